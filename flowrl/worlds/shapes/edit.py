"""The shapes world's editing task: a rendered source scene, an instruction, and an exact check of the edit.

Instructions (an `edit` record, its text by `instruction`):

    {"op": "recolor", "shape": "circle", "color": "blue"}   "make the circle blue"
    {"op": "add", "shape": "square", "color": null}          "add a square"   (or "add a red square")
    {"op": "remove", "shape": "triangle", "color": null}     "remove the triangle"

A source scene holds 1 to 3 objects of distinct shapes, so "the circle" names one object; for "add" the scene has
no object of the added shape, for "recolor" the object has another colour than the asked one.

The check (`check_edit`), on the objects detected in the source image and in the edited one (positions compared
in fractions of each image's size, so an edited image may have another resolution than its source):
- the instruction: recolor - an object of the shape, of the asked colour, where the source's was; add - exactly
  one object of the shape that is not one of the source's, of the asked colour if one is named; remove - no object
  of the shape left;
- each object the instruction does not mention is kept: one of the same shape and colour at the same place and
  size, within `tolerance` (a fraction of the image's side);
- nothing else: as many objects as the source's, one more after "add", one fewer after "remove".
The reward is the fraction of these clauses that hold (strict: all of them).

Splits: an instruction's combination (op/shape/colour) goes wholly to one split, test iff its checksum (shape index
+ 1, colour index + 1 if named, op index + 1) is 3 mod 4: a test instruction is one never trained on.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict

import numpy as np

from .detect import Detection, detect_objects, to_uint8_batch
from .render import COLORS, GAP, GRID, IMAGE_SIZE, SHAPES, SIDES, ShapeObject, _apart, _random_box, _scaled_layout

OPS: tuple[str, ...] = ("recolor", "add", "remove")
TOLERANCE = 0.06  # of the image's side: 3.8 px at 64, less than the 4-px layout grid


def instruction(edit: dict) -> str:
    """The instruction's text: "make the circle blue", "add a square", "add a red square", "remove the triangle"."""
    op, shape, color = edit["op"], edit["shape"], edit.get("color")
    if op == "recolor":
        return f"make the {shape} {color}"
    if op == "add":
        return "add a " + (f"{color} " if color else "") + shape
    if op == "remove":
        return f"remove the {shape}"
    raise ValueError(f"unknown edit op {op!r}; expected one of {OPS}")


def all_edits() -> list[dict]:
    """Every instruction of the task (30): recolor each shape to each colour, add each shape (each colour or
    none), remove each shape."""
    edits = [{"op": "recolor", "shape": s, "color": c} for s in SHAPES for c in COLORS]
    edits += [{"op": "add", "shape": s, "color": c} for s in SHAPES for c in (None, *COLORS)]
    edits += [{"op": "remove", "shape": s, "color": None} for s in SHAPES]
    return edits


def split_of_edit(edit: dict) -> str:
    """'test' iff the combination's checksum is 3 mod 4 (see the module docstring), else 'train'."""
    total = SHAPES.index(edit["shape"]) + 1 + OPS.index(edit["op"]) + 1
    if edit.get("color"):
        total += list(COLORS).index(edit["color"]) + 1
    return "test" if total % 4 == 3 else "train"


def sample_source(edit: dict, rng: np.random.Generator, size: int = IMAGE_SIZE) -> list[ShapeObject]:
    """A source scene the instruction applies to: 1-3 objects of distinct shapes, random colours and places; it
    holds the instruction's shape (with another colour than a recolor's) unless the op is "add"."""
    others = [s for s in SHAPES if s != edit["shape"]]
    extra = [others[i] for i in sorted(rng.choice(len(others), size=int(rng.integers(0, 3)), replace=False))]
    shapes = extra if edit["op"] == "add" else [edit["shape"], *extra]
    if not shapes:  # "add" to an empty scene: give it one object
        shapes = [others[int(rng.integers(len(others)))]]
    sides, grid, gap = _scaled_layout(size, SIDES, GRID)
    names = list(COLORS)
    while True:
        scene: list[ShapeObject] = []
        for shape in shapes:
            banned = edit["color"] if edit["op"] == "recolor" and shape == edit["shape"] else None
            color = rng.choice([c for c in names if c != banned])
            obj = ShapeObject(shape, str(color), *_random_box(rng, sides, size, grid, gap))
            if not all(_apart(obj, other, gap) for other in scene):
                break
            scene.append(obj)
        if len(scene) == len(shapes):
            return scene


def apply_edit(
    scene: list[ShapeObject], edit: dict, rng: np.random.Generator, size: int = IMAGE_SIZE
) -> list[ShapeObject]:
    """The scene after a correct edit: the object recoloured or removed in place, or a new object added where it
    keeps the layout's gap to the others (a random colour when the instruction names none)."""
    op, shape = edit["op"], edit["shape"]
    if op == "recolor":
        return [ShapeObject(o.shape, edit["color"], o.x, o.y, o.side) if o.shape == shape else o for o in scene]
    if op == "remove":
        return [o for o in scene if o.shape != shape]
    sides, grid, gap = _scaled_layout(size, SIDES, GRID)
    color = edit.get("color") or str(rng.choice(list(COLORS)))
    for _ in range(1000):
        obj = ShapeObject(shape, color, *_random_box(rng, sides, size, grid, gap))
        if all(_apart(obj, other, gap) for other in scene):
            return [*scene, obj]
    raise RuntimeError(f"no room to add a {shape} to {scene}")


def edit_region(scene: list[ShapeObject], edit: dict, size: int = IMAGE_SIZE) -> list[float] | None:
    """Where the edit may change the image, as [x0, y0, x1, y1] in fractions (the edited object's box grown by the
    layout gap), for `edit_consistency`; None for "add" (the new object may go anywhere)."""
    if edit["op"] == "add":
        return None
    obj = next(o for o in scene if o.shape == edit["shape"])
    x0, y0 = max(0, obj.x - GAP), max(0, obj.y - GAP)
    x1, y1 = min(size, obj.x + obj.side + GAP), min(size, obj.y + obj.side + GAP)
    return [x0 / size, y0 / size, x1 / size, y1 / size]


def edit_records(split: str, per_instruction: int, seed: int = 0) -> list[tuple[dict, list[ShapeObject]]]:
    """(record, source scene) pairs of one split: `per_instruction` source scenes per instruction of the split, in a
    fixed order (`draw` makes the 64x64 source image). Records: prompt, edit, edit_region, split (the writer adds
    the image path)."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
    rng = np.random.default_rng(seed)
    out = []
    for edit, _ in itertools.product(all_edits(), range(per_instruction)):
        scene = sample_source(edit, rng)  # drawn for every instruction, so a split does not shift the other's
        if split_of_edit(edit) != split:
            continue
        record = {"prompt": instruction(edit), "edit": edit, "edit_region": edit_region(scene, edit), "split": split}
        out.append((record, scene))
    return out


# ---------------------------------------------------------------------------- the check


def _place(d: Detection, width: int, height: int) -> tuple[float, float, float]:
    """A detection's centre x, centre y and side, in fractions of its image's width / height."""
    cx, cy = d.center
    return cx / width, cy / height, d.side / ((width + height) / 2)


def _same_place(a: tuple, b: tuple, tolerance: float) -> bool:
    return all(abs(u - v) <= tolerance for u, v in zip(a, b))


def check_edit(
    source: list[Detection],
    edited: list[Detection],
    edit: dict,
    source_size: tuple[int, int],
    edited_size: tuple[int, int],
    tolerance: float = TOLERANCE,
) -> list[tuple[str, bool]]:
    """The clauses of an edit (see the module docstring) -> [(description, holds), ...]. Sizes are (width, height)."""
    op, shape, color = edit["op"], edit["shape"], edit.get("color")
    if op not in OPS:
        raise ValueError(f"unknown edit op {op!r}; expected one of {OPS}")
    src = [(d, _place(d, *source_size)) for d in source]
    out = [(d, _place(d, *edited_size)) for d in edited]
    used: set[int] = set()

    def take(want_shape: str, want_color: str | None, place: tuple) -> bool:
        """Use up an unused edited object of that shape (and colour) at `place`; whether there was one."""
        for i, (d, p) in enumerate(out):
            if (
                i not in used
                and d.shape == want_shape
                and (want_color is None or d.color == want_color)
                and _same_place(p, place, tolerance)
            ):
                used.add(i)
                return True
        return False

    targets = [(d, p) for d, p in src if d.shape == shape]
    if op == "recolor":
        done = bool(targets) and all(take(shape, color, p) for _, p in targets)
    elif op == "remove":
        done = not any(d.shape == shape for d, _ in out)
    else:
        kept = [take(shape, None, p) for _, p in targets]  # the source's own objects of that shape are not new
        new = [i for i, (d, _) in enumerate(out) if d.shape == shape and i not in used]
        done = all(kept) and len(new) == 1 and (color is None or out[new[0]][0].color == color)
        used.update(new)
    clauses = [(instruction(edit), done)]
    for d, p in src:
        if d.shape != shape:
            clauses.append((f"kept the {d.color} {d.shape}", take(d.shape, d.color, p)))
    expected = len(source) + {"add": 1, "remove": -len(targets), "recolor": 0}[op]
    clauses.append((f"nothing but {expected} object(s)", len(edited) == expected))
    return clauses


def score_edits(
    images, sources, edits: list[dict], tolerance: float = TOLERANCE
) -> tuple[np.ndarray, np.ndarray, list[dict]]:
    """Score edited images against their source images and instructions.

    images, sources: B edited and B source images (PIL or uint8 [H, W, 3]; each set of one size);
    edits: B instructions. Returns (strict float32[B], fraction float32[B], details: B dicts with "clauses").
    """
    if not len(images) == len(sources) == len(edits):
        raise ValueError(
            f"got {len(images)} edited images, {len(sources)} sources and {len(edits)} instructions; "
            f"need one of each per sample"
        )
    edited_batch, source_batch = to_uint8_batch(images), to_uint8_batch(sources)
    edited_size = (edited_batch.shape[2], edited_batch.shape[1])
    source_size = (source_batch.shape[2], source_batch.shape[1])
    strict = np.zeros(len(edits), dtype=np.float32)
    fraction = np.zeros(len(edits), dtype=np.float32)
    details = []
    for i, (found, before, edit) in enumerate(zip(detect_objects(edited_batch), detect_objects(source_batch), edits)):
        clauses = check_edit(before, found, edit, source_size, edited_size, tolerance)
        oks = [ok for _, ok in clauses]
        strict[i], fraction[i] = float(all(oks)), sum(oks) / len(oks)
        details.append(
            {"clauses": [{"clause": c, "ok": ok} for c, ok in clauses], "objects": [asdict(d) for d in found]}
        )
    return strict, fraction, details
