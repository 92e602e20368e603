"""The shapes world's exact editing reward: was the instruction carried out, and was the rest of the scene kept?
(`flowrl.worlds.shapes.edit.check_edit`). The source image is the prompt record's conditioning image (its `image`
column, absolute paths from the data loader), the instruction its `edit` column, as in samples/shapes/edit/*.jsonl."""

from __future__ import annotations

import torch
from PIL import Image

from rewards.memory import NOTHING
from rewards.registry import IMAGE, register


@register(
    "shapes_edit",
    kind=IMAGE,
    memory=NOTHING,
    columns=("edit",),  # and the source image's (its option source_column, data.image_column)
    summary="the shapes world's edit check: the instruction carried out, the rest of the scene kept",
)
class ShapesEdit:
    """reward(images, prompts, edit=[...], image=[[source path], ...]) -> Tensor[B]: the fraction of the edit's
    clauses that hold (`score="strict"`: 1 iff all do); components `strict` and `fraction` [B].

    Args:
        score: "fraction" (the dense training reward) or "strict".
        tolerance: how far (a fraction of the image's side) a kept object's centre and size may move.
        source_column: the metadata column of the source image's path (data.image_column).
    """

    code_modules = (
        "flowrl.worlds.shapes.edit",
        "flowrl.worlds.shapes.detect",
        "flowrl.worlds.shapes.render",
    )  # its scorer (flowrl.eval.base_cache)

    kind = IMAGE

    def __init__(self, score: str = "fraction", tolerance: float = 0.06, source_column: str = "image"):
        if score not in ("fraction", "strict"):
            raise ValueError(f"score must be 'fraction' (the dense training reward) or 'strict', got {score!r}")
        if not 0 < tolerance < 0.5:
            raise ValueError(f"tolerance is a fraction of the image's side in (0, 0.5), got {tolerance}")
        self.score, self.tolerance, self.source_column = score, float(tolerance), source_column
        self.last_components: dict[str, torch.Tensor] = {}
        self.last_details: list[dict] = []

    def __call__(self, images, prompts, edit=None, **columns) -> torch.Tensor:
        from flowrl.worlds.shapes.edit import score_edits

        paths = columns.get(self.source_column)
        if edit is None or paths is None:
            raise ValueError(
                f"shapes_edit needs each prompt's `edit` column and its source image in the "
                f"{self.source_column!r} column, as in samples/shapes/edit/*.jsonl"
            )
        sources = [_open(p) for p in paths]
        strict, fraction, details = score_edits(list(images), sources, list(edit), self.tolerance)
        self.last_components = {"strict": torch.from_numpy(strict), "fraction": torch.from_numpy(fraction)}
        self.last_details = details
        return torch.from_numpy(fraction if self.score == "fraction" else strict).float()


def _open(value) -> Image.Image:
    """The source image of one sample: a path, or the first of a list of paths."""
    path = value if isinstance(value, str) else value[0]
    from flowrl.images import open_upright

    return open_upright(path)  # as the model was given it (flowrl.conditioning)
