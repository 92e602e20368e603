"""Detector and GenEval-style scorer of the shapes world (numpy only).

Detection, per image:
1. colour segmentation: each pixel goes to the nearest palette colour (background or one of `COLORS`) in
   RGB; pixels farther than `MAX_COLOR_DISTANCE` from every palette colour count as background;
2. connected components (4-connectivity) of same-colour pixels; components smaller than `MIN_AREA`
   (at 64x64, scaled with the image's area) are noise and dropped;
3. a shape classifier from geometry: the component's mask inside its bounding box is compared with the
   ideal circle, square and triangle drawn in that box, and the best intersection-over-union wins (a circle
   fills pi/4 of its box, a square all of it, a triangle half of it, with its widest row at the bottom).
   Boxes more elongated than `MAX_ASPECT` (e.g. two objects merged) or with a best IoU below `MIN_IOU`
   are objects of unknown shape (`None`): they count as objects, but as none of the shapes.

Clauses, per prompt (its metadata, see `flowrl.worlds.shapes.prompts`):
- for each object `o`: "exactly `o.count` `o.shape`(s)" among the detected objects;
- if `o.color` is named: "every `o.shape` is `o.color`" (and there is one);
- if there is a relation: the largest `objects[0]` shape and the largest `objects[1]` shape stand in it:
  their box centres are offset along the relation's axis, the right way, by at least `RELATION_MARGIN` times
  their mean side, and by at least as much as across it;
- "nothing else": the number of detected objects equals the number the prompt asks for.

`score_images` returns strict correctness (1 iff every clause holds, GenEval's headline metric) and the
fraction of clauses that hold (a denser training reward).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .render import BACKGROUND, COLORS, IMAGE_SIZE, RELATIONS, SHAPES

MAX_COLOR_DISTANCE = 100.0  # RGB (0-255) distance beyond which a pixel belongs to no palette colour
MIN_AREA = 24  # pixels, at 64x64; the smallest rendered object (a side-12 triangle) has 72
MAX_ASPECT = 1.5  # bounding boxes longer than this (either way) are not one of the shapes
MIN_IOU = 0.5  # below this IoU with every ideal shape, the shape is unknown
RELATION_MARGIN = 0.5  # fraction of the two objects' mean side the centres must be offset by

_PALETTE = np.array([BACKGROUND, *COLORS.values()], dtype=np.float32)  # [1 + C, 3]
_COLOR_NAMES = list(COLORS)


@dataclass(frozen=True)
class Detection:
    """One connected component: `shape` is None when it looks like none of the shapes."""

    shape: str | None
    color: str
    x0: int
    y0: int
    x1: int  # exclusive
    y1: int  # exclusive
    area: int
    ious: tuple[float, ...] = ()  # IoU with the ideal shape in its box, per shape of SHAPES (see shape_ious)

    @property
    def center(self) -> tuple[float, float]:
        return (self.x0 + self.x1) / 2, (self.y0 + self.y1) / 2

    @property
    def aspect(self) -> float:
        """Long side / short side of the bounding box (>= 1)."""
        w, h = self.x1 - self.x0, self.y1 - self.y0
        return max(w, h) / max(min(w, h), 1)

    @property
    def side(self) -> float:
        return ((self.x1 - self.x0) + (self.y1 - self.y0)) / 2


def to_uint8_batch(images) -> np.ndarray:
    """PIL images / uint8 arrays [H, W, 3] / float arrays in [0, 1] (a list, or one [B, H, W, 3] array)
    -> uint8[B, H, W, 3]. All images must have the same size."""
    arrays = []
    for im in images:
        a = np.asarray(im.convert("RGB")) if hasattr(im, "convert") else np.asarray(im)
        if a.ndim != 3 or a.shape[-1] != 3:
            raise ValueError(f"expected an RGB image [H, W, 3], got an array of shape {a.shape}")
        if a.dtype != np.uint8:
            a = np.clip(np.round(a.astype(np.float32) * 255.0), 0, 255).astype(np.uint8)
        arrays.append(a)
    if len({a.shape for a in arrays}) > 1:
        raise ValueError(f"all images must have one size, got {sorted({a.shape for a in arrays})}")
    return np.stack(arrays) if arrays else np.zeros((0, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)


def segment_colors(images: np.ndarray) -> np.ndarray:
    """uint8[B, H, W, 3] -> int64[B, H, W]: index into `COLORS` of each pixel's colour, -1 for background."""
    pixels = images.astype(np.float32)[..., None, :]  # [B, H, W, 1, 3]
    dist = np.sqrt(((pixels - _PALETTE) ** 2).sum(-1))  # [B, H, W, 1 + C]
    nearest = dist.argmin(-1)  # [B, H, W], 0 = background
    too_far = np.take_along_axis(dist, nearest[..., None], -1)[..., 0] > MAX_COLOR_DISTANCE
    return np.where(too_far, 0, nearest) - 1


def label_components(classes: np.ndarray) -> np.ndarray:
    """Connected components (4-connectivity) of equal non-negative classes.

    classes: int[B, H, W], -1 = background. Returns int64[B, H, W]: background -1; every pixel of a
    component holds the flat index (within its image) of the component's first pixel in raster order.
    Min-label propagation with pointer jumping, vectorised over the batch.
    """
    b, h, w = classes.shape
    fg = classes >= 0
    big = h * w
    labels = np.where(fg, np.arange(big).reshape(1, h, w), big)  # [B, H, W]
    same_down = fg[:, 1:] & (classes[:, 1:] == classes[:, :-1])  # pixel (y, x) joins (y-1, x)
    same_right = fg[:, :, 1:] & (classes[:, :, 1:] == classes[:, :, :-1])
    flat_idx = np.arange(b)[:, None] * (big + 1)
    while True:
        new = labels.copy()
        np.minimum(new[:, 1:], np.where(same_down, labels[:, :-1], big), out=new[:, 1:])
        np.minimum(new[:, :-1], np.where(same_down, labels[:, 1:], big), out=new[:, :-1])
        np.minimum(new[:, :, 1:], np.where(same_right, labels[:, :, :-1], big), out=new[:, :, 1:])
        np.minimum(new[:, :, :-1], np.where(same_right, labels[:, :, 1:], big), out=new[:, :, :-1])
        # pointer jumping: a label is a pixel of the same component; take that pixel's label
        padded = np.concatenate([new.reshape(b, big), np.full((b, 1), big)], axis=1)  # [B, HW + 1]
        new = padded.reshape(-1)[flat_idx + new.reshape(b, big)].reshape(b, h, w)
        if np.array_equal(new, labels):
            break
        labels = new
    return np.where(fg, labels, -1)


def ideal_mask(shape: str, h: int, w: int) -> np.ndarray:
    """The shape drawn to fill an `h x w` box (pixel centres) -> bool[h, w]; matches `shape_mask` when h == w."""
    yy, xx = np.meshgrid((np.arange(h) + 0.5) / h, (np.arange(w) + 0.5) / w, indexing="ij")
    if shape == "circle":
        return (xx - 0.5) ** 2 + (yy - 0.5) ** 2 <= 0.25
    if shape == "square":
        return np.ones((h, w), dtype=bool)
    if shape == "triangle":
        return np.abs(xx - 0.5) <= yy / 2
    raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def shape_ious(mask: np.ndarray) -> tuple[float, ...]:
    """bool[h, w] (a component cropped to its bounding box) -> its IoU with the ideal shape drawn in that box,
    one per shape of `SHAPES`, in that order."""
    h, w = mask.shape
    ious = []
    for shape in SHAPES:
        ideal = ideal_mask(shape, h, w)
        ious.append(float((mask & ideal).sum() / (mask | ideal).sum()))
    return tuple(ious)


def classify_shape(mask: np.ndarray, ious: tuple[float, ...] | None = None) -> str | None:
    """bool[h, w] (a component cropped to its bounding box) -> the shape with the best IoU, or None."""
    h, w = mask.shape
    if max(h, w) > MAX_ASPECT * min(h, w):
        return None
    best, best_iou = None, MIN_IOU
    for shape, iou in zip(SHAPES, ious if ious is not None else shape_ious(mask)):
        if iou >= best_iou:
            best, best_iou = shape, iou
    return best


def detect_objects(images) -> list[list[Detection]]:
    """Images (see `to_uint8_batch`) -> the objects found in each, in raster order of their first pixel."""
    batch = to_uint8_batch(images)
    if len(batch) == 0:
        return []
    classes = segment_colors(batch)
    labels = label_components(classes)
    _, h, w = labels.shape
    min_area = MIN_AREA * (h * w) / IMAGE_SIZE**2
    found = []
    for lab, cls in zip(labels, classes):
        objects = []
        for root in np.unique(lab[lab >= 0]):
            ys, xs = np.nonzero(lab == root)
            if len(ys) < min_area:
                continue
            y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
            crop = lab[y0:y1, x0:x1] == root
            color = _COLOR_NAMES[cls.flat[root]]
            ious = shape_ious(crop)
            objects.append(
                Detection(classify_shape(crop, ious), color, int(x0), int(y0), int(x1), int(y1), len(ys), ious)
            )
        found.append(objects)
    return found


def relation_holds(a: Detection, b: Detection, relation: str) -> bool:
    """`a <relation> b`: box centres offset the right way along the axis by >= RELATION_MARGIN x mean side,
    and at least as much along the axis as across it."""
    (ax, ay), (bx, by) = a.center, b.center
    along, across = {
        "left of": (bx - ax, by - ay),
        "right of": (ax - bx, by - ay),
        "above": (by - ay, bx - ax),
        "below": (ay - by, bx - ax),
    }.get(relation, (None, None))
    if along is None:
        raise ValueError(f"unknown relation {relation!r}; expected one of {RELATIONS}")
    return along >= RELATION_MARGIN * (a.side + b.side) / 2 and along >= abs(across)


def _relation_pair(objects: list[Detection], wanted: list[dict]) -> tuple[Detection, Detection] | None:
    """The objects a relation is checked on: the largest of the first asked shape and of the second, or None
    when either shape is missing."""
    a = [d for d in objects if d.shape == wanted[0]["shape"]]
    b = [d for d in objects if d.shape == wanted[1]["shape"]]
    if not (a and b):
        return None
    return max(a, key=lambda d: d.area), max(b, key=lambda d: d.area)


def check_clauses(objects: list[Detection], metadata: dict) -> list[tuple[str, bool]]:
    """The prompt's clauses (see the module docstring) -> [(description, holds), ...]."""
    wanted = metadata["objects"]
    clauses = []
    for o in wanted:
        of_shape = [d for d in objects if d.shape == o["shape"]]
        clauses.append((f"exactly {o['count']} {o['shape']}", len(of_shape) == o["count"]))
        if o.get("color"):
            ok = bool(of_shape) and all(d.color == o["color"] for d in of_shape)
            clauses.append((f"every {o['shape']} is {o['color']}", ok))
    relation = metadata.get("relation")
    if relation is not None:
        pair = _relation_pair(objects, wanted)
        ok = pair is not None and relation_holds(*pair, relation)
        clauses.append((f"{wanted[0]['shape']} {relation} {wanted[1]['shape']}", ok))
    total = sum(int(o["count"]) for o in wanted)
    clauses.append((f"nothing but {total} object(s)", len(objects) == total))
    return clauses


FAILURE_KINDS: tuple[str, ...] = (
    "shape missing",  # no object of a shape the prompt asks for
    "count wrong",  # some of that shape, but not the number asked
    "colour swapped",  # a shape wears another colour the prompt asks for (attribute binding)
    "colour unasked",  # a shape wears a colour the prompt does not name
    "relation wrong",  # both shapes there, but not in the asked relation
    "extra objects",  # more objects than the prompt asks for
)


def diagnose(objects: list[Detection], metadata: dict) -> list[str]:
    """Why an image fails its prompt: the `FAILURE_KINDS` that apply, each once, in that order.

    Empty exactly when every clause of `check_clauses` holds (strict correctness). A shape that is missing also
    fails its relation and, if fewer objects than asked were drawn, the object count: those clauses are put
    down to "shape missing". A failed colour clause is "colour swapped" when every wrong colour on that shape is
    one the prompt names for another object, else "colour unasked".
    """
    wanted = metadata["objects"]
    asked_colors = {o["color"] for o in wanted if o.get("color")}
    kinds: set[str] = set()
    for o in wanted:
        of_shape = [d for d in objects if d.shape == o["shape"]]
        if not of_shape:
            kinds.add("shape missing")
            continue
        if len(of_shape) != o["count"]:
            kinds.add("count wrong")
        wrong = {d.color for d in of_shape if o.get("color") and d.color != o["color"]}
        if wrong:
            kinds.add("colour swapped" if wrong <= asked_colors - {o["color"]} else "colour unasked")
    relation = metadata.get("relation")
    pair = _relation_pair(objects, wanted) if relation is not None else None
    if pair is not None and not relation_holds(*pair, relation):
        kinds.add("relation wrong")
    total = sum(int(o["count"]) for o in wanted)
    if len(objects) > total:
        kinds.add("extra objects")
    # fewer objects than asked needs no kind of its own: a prompt's shapes are distinct, so one of them is short
    return [k for k in FAILURE_KINDS if k in kinds]


def score_images(images, metadata: list[dict]) -> tuple[np.ndarray, np.ndarray, list[dict]]:
    """Score generated images against their prompts' metadata.

    images: B images (PIL, uint8 [H, W, 3], or float [H, W, 3] in [0, 1]; one size).
    metadata: B prompt records (at least "objects" and "relation").
    Returns (strict float32[B]: 1 iff every clause holds, fraction float32[B]: share of clauses that hold,
    details: B dicts {"objects": [detections as dicts], "clauses": [{"clause": str, "ok": bool}],
    "failures": the image's `diagnose` kinds}).
    """
    if len(images) != len(metadata):
        raise ValueError(f"got {len(images)} images but {len(metadata)} metadata records; need one each")
    detections = detect_objects(images)
    strict = np.zeros(len(metadata), dtype=np.float32)
    fraction = np.zeros(len(metadata), dtype=np.float32)
    details = []
    for i, (objects, meta) in enumerate(zip(detections, metadata)):
        clauses = check_clauses(objects, meta)
        oks = [ok for _, ok in clauses]
        strict[i] = float(all(oks))
        fraction[i] = sum(oks) / len(oks)
        details.append(
            {
                "objects": [asdict(d) for d in objects],
                "clauses": [{"clause": c, "ok": ok} for c, ok in clauses],
                "failures": diagnose(objects, meta),
            }
        )
    return strict, fraction, details


def soft_score(objects: list[Detection], metadata: dict) -> float:
    """A graded version of the clauses, for training: how well the detected objects match the prompt's.

    Every object instance the prompt asks for (`count` copies of each of its objects, in prompt order) takes,
    greedily, the unused detected object that matches it best, with match = IoU with the wanted shape (of
    `Detection.ious`; divided by the box's aspect ratio when that exceeds MAX_ASPECT), halved when the prompt
    names a colour and the object has another. With n instances and d detected objects:
        soft = sum(match) / n - 0.5 * max(0, d - n) / n,
    an unmatched instance counting 0. A rendered ground truth scores about 0.97 (a pixelated circle's IoU
    with the ideal one is below 1); relations are not scored.
    """
    # each object's fit to each shape, computed once: IoU, divided by the aspect ratio past MAX_ASPECT
    fits = [[iou / (d.aspect if d.aspect > MAX_ASPECT else 1.0) for iou in d.ious] for d in objects]
    wanted = [o for o in metadata["objects"] for _ in range(int(o["count"]))]
    used: set[int] = set()
    matches = []
    for o in wanted:
        k = SHAPES.index(o["shape"])
        best, best_i = 0.0, None
        for i, d in enumerate(objects):
            if i in used:
                continue
            match = fits[i][k] * (0.5 if o.get("color") and d.color != o["color"] else 1.0)
            if match > best:
                best, best_i = match, i
        if best_i is not None:
            used.add(best_i)
        matches.append(best)
    n = len(wanted)
    return sum(matches) / n - 0.5 * max(0, len(objects) - n) / n


def soft_scores(images, metadata: list[dict]) -> np.ndarray:
    """`soft_score` of each image against its prompt's metadata -> float32[B]."""
    if len(images) != len(metadata):
        raise ValueError(f"got {len(images)} images but {len(metadata)} metadata records; need one each")
    return np.array([soft_score(objs, m) for objs, m in zip(detect_objects(images), metadata)], dtype=np.float32)
