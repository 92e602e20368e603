"""Edit consistency: how much of the source image an edit kept, as the cosine similarity of backbone features
(DINOv2 by default, or CLIP; see ``rewards.features``) of the edited image and the source image.

Where it compares: the whole image by default, outside the edited region when the prompt record gives that region.
A prompt record of an editing set names its source image (``image``, the conditioning image, which the data loader
hands to the rewards as absolute paths) but in general not where the edit should happen; finding the region from
the two images' pixel differences would exclude exactly the changes the reward should punish, so without a region
the comparison is global: the features still change little for a local edit (a recoloured object, an added one)
and a lot when the scene is redrawn. When the record has an ``edit_region`` (a box ``[x0, y0, x1, y1]`` in
fractions of the image's width and height, or a list of boxes), the boxes are painted over in both images with the
processor's mean colour before embedding, so only what lies outside them counts, and an edit confined to them
scores 1 whatever it does inside.

Doing nothing scores 1 too: train this with a reward for the instruction (a ``weighted`` sum), not alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from PIL import Image, ImageDraw

from rewards._common import check_images, resolve_device, resolve_dtype
from rewards.features import ARCHITECTURES, ImageEncoder
from rewards.memory import hub_model
from rewards.registry import IMAGE, register


@register(
    "edit_consistency",
    kind=IMAGE,
    memory=hub_model("model", ARCHITECTURES),
    summary="the similarity of an edited image's features to its source image's (DINOv2 or CLIP)",
)
class EditConsistency:
    """reward(images, prompts, image=[[source path, ...], ...], edit_region=[box or boxes or None, ...])
    -> Tensor[B]: ``scale · cos(f(edited), f(source))``; component ``masked`` [B] (1 where a region was left out).

    Args:
        model: hub id or local directory of a DINOv2 or CLIP checkpoint (``facebook/dinov2-small``,
            ``facebook/dinov2-base``, ``openai/clip-vit-large-patch14``, ...).
        processor: its image processor (default: ``model``).
        source_column: the metadata column holding the source image's path (the data loader's
            ``data.image_column``); a list of paths is read at ``source_index`` (multi-image editing).
        region_column: the metadata column of the region the edit may change ("" = always global).
        scale, device, dtype, batch_size: as for the other backbone rewards.
    """

    kind = IMAGE

    def __init__(
        self,
        model: str = "facebook/dinov2-small",
        processor: str | None = None,
        source_column: str = "image",
        source_index: int = 0,
        region_column: str = "edit_region",
        scale: float = 1.0,
        device: str | None = None,
        dtype: str | torch.dtype = "float32",
        batch_size: int = 64,
    ):
        self.encoder = ImageEncoder(model, processor, resolve_device(device), resolve_dtype(dtype), batch_size)
        self.source_column, self.source_index, self.region_column = source_column, int(source_index), region_column
        self.scale = scale
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, images, prompts, **columns) -> torch.Tensor:
        images = check_images(images, prompts, "edit_consistency")
        sources = [self._source(columns, i) for i in range(len(images))]
        regions = columns.get(self.region_column) if self.region_column else None
        regions = [parse_boxes(r, i) for i, r in enumerate(regions)] if regions is not None else [[]] * len(images)
        fill = mean_colour(self.encoder.processor)
        edited = [paint_boxes(im, boxes, fill) for im, boxes in zip(images, regions)]
        kept = [paint_boxes(im, boxes, fill) for im, boxes in zip(sources, regions)]
        features = self.encoder(edited + kept)  # [2B, D], unit norm
        cosine = (features[: len(images)] * features[len(images) :]).sum(-1)  # [B]
        self.last_components = {"masked": torch.tensor([float(bool(b)) for b in regions])}
        return self.scale * cosine

    def _source(self, columns: dict, i: int) -> Image.Image:
        """Sample i's source image, read from its path in the source column."""
        values = columns.get(self.source_column)
        if values is None:
            raise ValueError(
                f"edit_consistency needs each prompt's source image: a {self.source_column!r} column of "
                f"image paths in the prompt file (data.image_column), or set source_column"
            )
        value = values[i]
        paths = [value] if isinstance(value, str) else list(value or [])
        if not -len(paths) <= self.source_index < len(paths):
            raise ValueError(
                f"edit_consistency: sample {i} has {len(paths)} image(s) in {self.source_column!r}, "
                f"no index {self.source_index} (source_index)"
            )
        from flowrl.images import open_upright

        return open_upright(paths[self.source_index])  # as the model was given it (flowrl.conditioning)


Box = tuple[float, float, float, float]


def parse_boxes(value, index: int = 0) -> list[Box]:
    """A record's edit region -> boxes (x0, y0, x1, y1) in fractions of the image: None (no region), one box
    [x0, y0, x1, y1], or a list of boxes; each with 0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1."""
    if value is None:
        return []
    boxes = [value] if _is_box(value) else list(value)
    for box in boxes:
        if not _is_box(box) or not (0 <= box[0] < box[2] <= 1 and 0 <= box[1] < box[3] <= 1):
            raise ValueError(
                f"edit region of sample {index}: expected [x0, y0, x1, y1] in fractions of the image "
                f"(0 <= x0 < x1 <= 1, 0 <= y0 < y1 <= 1), or a list of such boxes; got {value!r}"
            )
    return [tuple(float(v) for v in box) for box in boxes]


def _is_box(value) -> bool:
    return isinstance(value, Sequence) and len(value) == 4 and all(isinstance(v, (int, float)) for v in value)


def paint_boxes(image: Image.Image, boxes: list[Box], fill: tuple[int, int, int]) -> Image.Image:
    """A copy of `image` with each box (fractions of its size, rounded outwards to whole pixels) filled with
    `fill`; `image` itself when there is no box."""
    if not boxes:
        return image
    out = image.copy()
    draw = ImageDraw.Draw(out)
    w, h = out.size
    for x0, y0, x1, y1 in boxes:
        left, top = int(x0 * w), int(y0 * h)
        right, bottom = -int(-x1 * w), -int(-y1 * h)  # ceil
        draw.rectangle([left, top, right - 1, bottom - 1], fill=fill)
    return out


def mean_colour(processor) -> tuple[int, int, int]:
    """The colour the processor normalises to zero (its image_mean), as RGB 0-255; mid grey without one."""
    mean = getattr(processor, "image_mean", None) or (0.5, 0.5, 0.5)
    return tuple(int(round(255 * m)) for m in mean[:3])
