"""JPEG (in)compressibility (DDPO, Black et al. 2023, sec. 6.1): the size of the image saved as JPEG
at quality 95, in kB (1 kB = 1000 bytes). ``jpeg_incompressibility`` rewards large files,
``jpeg_compressibility`` is its negation and rewards small ones."""

from __future__ import annotations

import io

import torch

from rewards._common import check_images
from rewards.memory import NOTHING
from rewards.registry import IMAGE, register


def jpeg_size_kb(image, quality: int = 95) -> float:
    """Size in kB of ``image`` (PIL, RGB) encoded as JPEG at ``quality``."""
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000


class JpegSize:
    """``sign · size_kB``: sign +1 for incompressibility, -1 for compressibility."""

    kind = IMAGE
    per_sample = True  # each image scored on its own, on any thread (rollout.overlap_rewards)

    def __init__(self, sign: float, quality: int = 95):
        if not 1 <= quality <= 95:
            raise ValueError(f"JPEG quality must be in 1..95 (PIL's useful range), got {quality}")
        self.sign, self.quality = sign, quality
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, images, prompts, **metadata) -> torch.Tensor:
        images = check_images(images, prompts, "jpeg reward")
        size_kb = torch.tensor([jpeg_size_kb(x, self.quality) for x in images], dtype=torch.float32)  # [B]
        self.last_components = {"jpeg_kb": size_kb}
        return self.sign * size_kb


@register(
    "jpeg_incompressibility", kind=IMAGE, memory=NOTHING, summary="the image's JPEG size at quality 95, in kB (DDPO)"
)
def jpeg_incompressibility(quality: int = 95) -> JpegSize:
    """Reward = JPEG size in kB."""
    return JpegSize(+1.0, quality)


@register(
    "jpeg_compressibility",
    kind=IMAGE,
    memory=NOTHING,
    summary="minus the image's JPEG size at quality 95, in kB (DDPO)",
)
def jpeg_compressibility(quality: int = 95) -> JpegSize:
    """Reward = −(JPEG size in kB)."""
    return JpegSize(-1.0, quality)
