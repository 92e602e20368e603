"""Procedural renderer of the shapes world: flat-coloured circles, squares and triangles on a plain background.

A scene is a list of `ShapeObject`s (shape, colour, top-left corner, side); `draw` paints it without
anti-aliasing, so every pixel of a ground-truth image is exactly the background or one palette colour.
`sample_scene` lays out the objects a prompt asks for (see `flowrl.worlds.shapes.prompts` for the metadata):
sizes (12 or 16 px) and positions at random, on a 4-pixel grid (half the shipped VAE's 8-pixel stride, so
an object takes one of few latent patterns: this keeps the world learnable by a tiny model), colours at random
where the prompt names none, objects never touching, and for a relation ("a circle left of a square") a
clear offset along the relation's axis.

Pure numpy; an image is `uint8[H, W, 3]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 200, 30),
}
BACKGROUND: tuple[int, int, int] = (240, 240, 240)
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")

IMAGE_SIZE = 64
SIDES = (12, 16)  # sides of an object's bounding box, pixels (at IMAGE_SIZE)
GRID = 4  # corners lie on this pixel grid (at IMAGE_SIZE)
GAP = 4  # empty pixels at least between two objects' bounding boxes, and between an object and the border


@dataclass(frozen=True)
class ShapeObject:
    """One object of a scene: its bounding box is `[x, x + side) x [y, y + side)` in pixels."""

    shape: str
    color: str
    x: int
    y: int
    side: int

    @property
    def center(self) -> tuple[float, float]:
        """(cx, cy) in pixels, the centre of the bounding box."""
        return self.x + self.side / 2, self.y + self.side / 2


def shape_mask(shape: str, side: int) -> np.ndarray:
    """The shape filling a `side x side` box, sampled at pixel centres -> bool[side, side].

    circle: the inscribed disc; square: the whole box; triangle: apex up, base the bottom edge,
    as wide as it is high (fills ~1/2 of its box, a disc ~pi/4, a square 1).
    """
    if side < 1:
        raise ValueError(f"side must be >= 1 pixel, got {side}")
    c = (np.arange(side) + 0.5) / side  # pixel centres in [0, 1]
    yy, xx = np.meshgrid(c, c, indexing="ij")
    if shape == "circle":
        return (xx - 0.5) ** 2 + (yy - 0.5) ** 2 <= 0.25
    if shape == "square":
        return np.ones((side, side), dtype=bool)
    if shape == "triangle":
        return np.abs(xx - 0.5) <= yy / 2
    raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def draw(objects: list[ShapeObject], size: int = IMAGE_SIZE) -> np.ndarray:
    """Paint `objects` (in order) on the background -> uint8[size, size, 3]."""
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    for obj in objects:
        if obj.color not in COLORS:
            raise ValueError(f"unknown colour {obj.color!r}; expected one of {tuple(COLORS)}")
        if obj.x < 0 or obj.y < 0 or obj.x + obj.side > size or obj.y + obj.side > size:
            raise ValueError(f"{obj} does not fit in a {size}x{size} image")
        window = image[obj.y : obj.y + obj.side, obj.x : obj.x + obj.side]
        window[shape_mask(obj.shape, obj.side)] = COLORS[obj.color]
    return image


def _apart(a: ShapeObject, b: ShapeObject, gap: int) -> bool:
    """True when the bounding boxes are at least `gap` pixels apart along x or along y."""
    return (
        a.x + a.side + gap <= b.x or b.x + b.side + gap <= a.x or a.y + a.side + gap <= b.y or b.y + b.side + gap <= a.y
    )


def relation_is_clear(a: ShapeObject, b: ShapeObject, relation: str) -> bool:
    """Whether the renderer accepts `a <relation> b` as an unambiguous layout.

    The two boxes must not overlap along the relation's axis (a fully left of b, ...), and the offset along
    that axis must be at least twice the offset across it, so the picture reads the way the prompt does.
    """
    (ax, ay), (bx, by) = a.center, b.center
    if relation == "left of":
        along, across, apart = bx - ax, by - ay, a.x + a.side <= b.x
    elif relation == "right of":
        along, across, apart = ax - bx, by - ay, b.x + b.side <= a.x
    elif relation == "above":
        along, across, apart = by - ay, bx - ax, a.y + a.side <= b.y
    elif relation == "below":
        along, across, apart = ay - by, bx - ax, b.y + b.side <= a.y
    else:
        raise ValueError(f"unknown relation {relation!r}; expected one of {RELATIONS}")
    return apart and along >= 2 * abs(across)


def _scaled_layout(size: int, sides: tuple[int, ...], grid: int) -> tuple[list[int], int, int]:
    """Object sides, corner grid and gap given at IMAGE_SIZE -> (sides, grid, gap) in pixels at `size`."""
    scale = size / IMAGE_SIZE
    return [max(3, round(s * scale)) for s in sides], max(1, round(grid * scale)), max(1, round(GAP * scale))


def _random_box(rng: np.random.Generator, sides: list[int], size: int, grid: int, gap: int) -> tuple[int, int, int]:
    """-> (x, y, side): a side uniform in `sides`, then a corner `gap + grid * k` uniform where the box fits."""
    side = sides[int(rng.integers(len(sides)))]
    cells = (size - side - 2 * gap) // grid + 1  # corners gap, gap + grid, ... still fitting
    x, y = (gap + grid * int(v) for v in rng.integers(0, cells, size=2))
    return x, y, side


def sample_scene(
    objects: list[dict],
    relation: str | None,
    rng: np.random.Generator,
    size: int = IMAGE_SIZE,
    max_tries: int = 1000,
    sides: tuple[int, ...] = SIDES,
    grid: int = GRID,
) -> list[ShapeObject]:
    """Lay out what a prompt asks for -> the scene's objects.

    objects: the prompt's metadata objects, `[{"shape": str, "color": str | None, "count": int}, ...]`;
      each entry becomes `count` objects; a `None` colour is drawn uniformly from `COLORS`, per object.
    relation: `None`, or one of `RELATIONS`, read as `objects[0] <relation> objects[1]` (both count 1).
    Sides uniform in `sides`, corners `GAP + grid * k` uniform where the object fits (all scaled by size/64).
    """
    sides, grid, gap = _scaled_layout(size, sides, grid)
    wanted = [(o["shape"], o.get("color")) for o in objects for _ in range(int(o["count"]))]
    if relation is not None and (len(objects) != 2 or any(int(o["count"]) != 1 for o in objects)):
        raise ValueError(f"a relation needs exactly two objects of count 1, got {objects}")
    color_names = list(COLORS)
    for _ in range(max_tries):
        scene: list[ShapeObject] = []
        for shape, color in wanted:
            for _ in range(100):
                x, y, side = _random_box(rng, sides, size, grid, gap)
                name = color if color is not None else color_names[int(rng.integers(len(color_names)))]
                obj = ShapeObject(shape, name, x, y, side)
                if all(_apart(obj, other, gap) for other in scene):
                    scene.append(obj)
                    break
            else:
                break
        if len(scene) != len(wanted):
            continue
        if relation is not None and not relation_is_clear(scene[0], scene[1], relation):
            continue
        return scene
    raise RuntimeError(f"could not lay out {objects} (relation {relation!r}) in {max_tries} tries")


def add_distractor(
    scene: list[ShapeObject],
    rng: np.random.Generator,
    size: int = IMAGE_SIZE,
    sides: tuple[int, ...] = SIDES,
    grid: int = GRID,
    max_tries: int = 200,
) -> list[ShapeObject]:
    """`scene` plus one object its prompt does not mention -> a new list (the same objects if none fits).

    The extra object's shape and colour are uniform over `SHAPES` and `COLORS`, its side is uniform in
    `sides` (at IMAGE_SIZE; pass smaller sides than the scene's for small background objects, the kind a
    caption leaves out), its corner is drawn as `sample_scene` draws it, and it keeps the same gap to every
    object of `scene`. An image of it under the scene's prompt is a caption that leaves something out, as
    web captions often do.
    """
    sides, grid, gap = _scaled_layout(size, sides, grid)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    color = list(COLORS)[int(rng.integers(len(COLORS)))]
    for _ in range(max_tries):
        obj = ShapeObject(shape, color, *_random_box(rng, sides, size, grid, gap))
        if all(_apart(obj, other, gap) for other in scene):
            return [*scene, obj]
    return list(scene)


def render(
    metadata: dict,
    rng: np.random.Generator,
    size: int = IMAGE_SIZE,
    sides: tuple[int, ...] = SIDES,
    grid: int = GRID,
    distractor_prob: float = 0.0,
    distractor_sides: tuple[int, ...] | None = None,
) -> tuple[np.ndarray, list[ShapeObject]]:
    """A ground-truth image of one prompt -> (uint8[size, size, 3], scene).

    metadata: a prompt record (`{"objects": [...], "relation": ...}`, see `flowrl.worlds.shapes.prompts`).
    sides, grid: the layout's object sides and corner grid (see `sample_scene`).
    distractor_prob: the chance that the image also holds one object the prompt does not mention
      (`add_distractor`), i.e. that the prompt is an incomplete caption of it. At 0 (the default) no random
      number is drawn for it, so the images of a seed do not change.
    distractor_sides: the sides of that object (at IMAGE_SIZE); None = `sides`, as the prompt's objects.
    """
    if not 0.0 <= distractor_prob <= 1.0:
        raise ValueError(f"distractor_prob must lie in [0, 1], got {distractor_prob}")
    scene = sample_scene(metadata["objects"], metadata.get("relation"), rng, size, sides=sides, grid=grid)
    if distractor_prob > 0 and rng.random() < distractor_prob:
        scene = add_distractor(scene, rng, size, sides=distractor_sides or sides, grid=grid)
    return draw(scene, size), scene
