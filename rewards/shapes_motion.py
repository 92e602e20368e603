"""The shapes world's exact video reward: the asked shape (and colour), alone in every frame, moving the asked way
(`flowrl.worlds.shapes.motion.check_motion`). Its metadata are the prompt record's `objects` and `motion` columns, as in
samples/shapes/motion/*.jsonl."""

from __future__ import annotations

import torch

from rewards.memory import NOTHING
from rewards.registry import IMAGE, register


@register(
    "shapes_motion",
    kind=IMAGE,
    accepts=("video",),
    memory=NOTHING,
    columns=("objects", "motion"),
    summary="the shapes world's motion check: the asked shape alone in every frame, moving the asked way",
)
class ShapesMotion:
    """reward(videos, prompts, objects=[...], motion=[...]) -> Tensor[B] in [0, 1]: the mean of presence (frames
    holding the object alone), monotonic (consecutive frames moving the asked way, up to `tolerance`) and travel
    (first-to-last move over `min_travel`); each is a component, with `strict` (all three are 1).

    Args:
        tolerance: backward move allowed between two frames, a fraction of the width.
        min_travel: the first-to-last move, a fraction of the width, that scores full travel.
    """

    code_modules = (
        "flowrl.worlds.shapes.motion",
        "flowrl.worlds.shapes.detect",
        "flowrl.worlds.shapes.render",
    )  # its scorer (flowrl.eval.base_cache)

    kind = IMAGE
    accepts = ("video",)

    def __init__(self, tolerance: float = 0.03, min_travel: float = 0.25):
        if not 0 <= tolerance < 1 or not 0 < min_travel <= 1:
            raise ValueError(
                f"tolerance must lie in [0, 1) and min_travel in (0, 1] (fractions of the width), got "
                f"{tolerance} and {min_travel}"
            )
        self.tolerance, self.min_travel = float(tolerance), float(min_travel)
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, videos, prompts, objects=None, motion=None, **_columns) -> torch.Tensor:
        from flowrl.worlds.shapes.motion import score_motions

        if objects is None or motion is None:
            raise ValueError(
                "shapes_motion needs each prompt's `objects` and `motion` columns, as in samples/shapes/motion/*.jsonl"
            )
        records = [{"objects": o, "motion": m} for o, m in zip(objects, motion)]
        scores = score_motions(list(videos), records, self.tolerance, self.min_travel)
        self.last_components = {k: torch.from_numpy(scores[k]) for k in ("presence", "monotonic", "travel", "strict")}
        return torch.from_numpy(scores["score"]).float()
