"""The shapes world's video task: one shape moving across the frame, and an exact check of the clip.

Prompts (`motion_prompts`): "a red circle moving left to right", "a square moving right to left", ... (each
shape, each colour or none, both directions: 30), records with the same `objects` as the image prompts (so the
GenEval-style reward scores their frames too) and a `motion` of "left to right" or "right to left". Split by
combination as the image prompts: test iff (shape index + 1, colour index + 1 if named, direction index + 1) sums
to 3 mod 4.

The check (`check_motion`), per clip of F frames, with the objects detected in each frame:
- presence: the share of frames that hold the asked object (its shape, its colour if named) and nothing else;
- monotonic: the share of the F - 1 consecutive pairs of frames, both holding it, in which its centre moves the
  asked way or back by at most `tolerance` of the width;
- travel: how far it went the asked way from its first to its last frame, over `min_travel` of the width (capped
  at 1; 0 when fewer than two frames hold it): a still object is monotonic but does not travel.
The score is their mean, in [0, 1]; a clip the renderer makes (`render_motion`) scores 1.
"""

from __future__ import annotations

import numpy as np

from .detect import detect_objects
from .render import COLORS, GRID, IMAGE_SIZE, SHAPES, SIDES, ShapeObject, _scaled_layout, draw

DIRECTIONS: tuple[str, ...] = ("left to right", "right to left")
TOLERANCE = 0.03  # of the width: backward jitter allowed between two frames
MIN_TRAVEL = 0.25  # of the width: the first-to-last move that counts as full travel


def motion_prompt(shape: str, color: str | None, direction: str) -> str:
    """'a red circle moving left to right', 'a square moving right to left'."""
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; expected one of {DIRECTIONS}")
    return "a " + (f"{color} " if color else "") + f"{shape} moving {direction}"


def motion_split(shape: str, color: str | None, direction: str) -> str:
    total = SHAPES.index(shape) + 1 + DIRECTIONS.index(direction) + 1
    if color:
        total += list(COLORS).index(color) + 1
    return "test" if total % 4 == 3 else "train"


def motion_prompts(split: str | None = None) -> list[dict]:
    """The task's prompt records in a fixed order (all 30, or those of split 'train' / 'test')."""
    if split not in (None, "train", "test"):
        raise ValueError(f"unknown split {split!r}; expected 'train', 'test' or None")
    records = []
    for shape in SHAPES:
        for color in (None, *COLORS):
            for direction in DIRECTIONS:
                record = {
                    "prompt": motion_prompt(shape, color, direction),
                    "objects": [{"shape": shape, "color": color, "count": 1}],
                    "relation": None,
                    "motion": direction,
                    "split": motion_split(shape, color, direction),
                }
                if split in (None, record["split"]):
                    records.append(record)
    return records


def render_motion(record: dict, rng: np.random.Generator, num_frames: int = 5, size: int = IMAGE_SIZE) -> np.ndarray:
    """A clip of the record: its object crossing from one side (the layout's gap from the border) to the other in
    equal steps at one height -> uint8[num_frames, size, size, 3]."""
    if num_frames < 2:
        raise ValueError(f"a motion clip needs at least 2 frames, got {num_frames}")
    obj = record["objects"][0]
    sides, grid, gap = _scaled_layout(size, SIDES, GRID)
    side = sides[int(rng.integers(len(sides)))]
    color = obj.get("color") or str(rng.choice(list(COLORS)))
    y = gap + grid * int(rng.integers(0, (size - side - 2 * gap) // grid + 1))
    xs = np.linspace(gap, size - side - gap, num_frames).round().astype(int)
    if record["motion"] == "right to left":
        xs = xs[::-1]
    return np.stack([draw([ShapeObject(obj["shape"], color, int(x), y, side)], size) for x in xs])


def check_motion(video, record: dict, tolerance: float = TOLERANCE, min_travel: float = MIN_TRAVEL) -> dict:
    """A clip [F, H, W, 3] against its record -> {"presence", "monotonic", "travel", "score"} (floats in [0, 1])
    and "xs": the object's centre x per frame (fraction of the width; None where the frame does not hold it)."""
    direction = record.get("motion")
    if direction not in DIRECTIONS:
        raise ValueError(f"a motion record needs `motion` in {DIRECTIONS}, got {direction!r}")
    wanted = record["objects"][0]
    width = np.asarray(video).shape[2]
    sign = 1.0 if direction == "left to right" else -1.0
    xs = []
    for objects in detect_objects(list(video)):
        alone = (
            len(objects) == 1
            and objects[0].shape == wanted["shape"]
            and (not wanted.get("color") or objects[0].color == wanted["color"])
        )
        xs.append(objects[0].center[0] / width if alone else None)
    pairs = list(zip(xs[:-1], xs[1:]))
    presence = sum(x is not None for x in xs) / len(xs)
    monotonic = sum(a is not None and b is not None and sign * (b - a) >= -tolerance for a, b in pairs) / len(pairs)
    found = [x for x in xs if x is not None]
    travel = min(1.0, max(0.0, sign * (found[-1] - found[0]) / min_travel)) if len(found) >= 2 else 0.0
    return {
        "presence": presence,
        "monotonic": monotonic,
        "travel": travel,
        "score": (presence + monotonic + travel) / 3,
        "xs": xs,
    }


def score_motions(
    videos, records: list[dict], tolerance: float = TOLERANCE, min_travel: float = MIN_TRAVEL
) -> dict[str, np.ndarray]:
    """`check_motion` of B clips -> {"score", "presence", "monotonic", "travel", "strict"}: float32[B] each
    (strict: 1 iff the score is 1)."""
    if len(videos) != len(records):
        raise ValueError(f"got {len(videos)} videos but {len(records)} records; need one each")
    checks = []
    for i, video in enumerate(videos):
        video = np.asarray(video)
        if video.ndim != 4 or video.shape[0] < 2:
            raise ValueError(f"video {i}: a clip of at least 2 frames [F, H, W, 3] is needed, got shape {video.shape}")
        checks.append(check_motion(video, records[i], tolerance, min_travel))
    out = {k: np.array([c[k] for c in checks], dtype=np.float32) for k in ("score", "presence", "monotonic", "travel")}
    out["strict"] = (out["score"] >= 1.0).astype(np.float32)
    return out
