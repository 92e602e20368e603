"""Temporal consistency of a video: the mean cosine similarity of the backbone features (DINOv2 by default, or
CLIP; see ``rewards.features``) of consecutive frames. A clip that holds together (the same scene and subject from
frame to frame) scores near 1; flicker, cuts and frames of noise score lower. A still clip scores 1: pair it with
a reward for motion or for the prompt, not alone."""

from __future__ import annotations

import torch

from rewards._common import resolve_device, resolve_dtype
from rewards.features import ARCHITECTURES, ImageEncoder
from rewards.memory import hub_model
from rewards.registry import IMAGE, register


@register(
    "temporal_consistency",
    kind=IMAGE,
    accepts=("video",),
    memory=hub_model("model", ARCHITECTURES),
    summary="the similarity of a video's consecutive frames' features (DINOv2 or CLIP)",
)
class TemporalConsistency:
    """reward(videos, prompts) -> Tensor[B]: per video, ``scale · mean_t cos(f(frame_t), f(frame_t+stride))`` over
    its frames 0, stride, 2·stride, ...; component ``min`` [B]: the least similar consecutive pair (the worst jump).

    Args:
        model, processor: a DINOv2 or CLIP checkpoint (hub id or directory) and its image processor.
        stride: compare every stride-th frame (1 = every frame with the next).
        scale, device, dtype, batch_size: as for the other backbone rewards.
    """

    kind = IMAGE
    accepts = ("video",)

    def __init__(
        self,
        model: str = "facebook/dinov2-small",
        processor: str | None = None,
        stride: int = 1,
        scale: float = 1.0,
        device: str | None = None,
        dtype: str | torch.dtype = "float32",
        batch_size: int = 64,
    ):
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        self.encoder = ImageEncoder(model, processor, resolve_device(device), resolve_dtype(dtype), batch_size)
        self.stride, self.scale = int(stride), scale
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, videos, prompts, **_metadata) -> torch.Tensor:
        from flowrl.video import as_video, frame_image

        if len(videos) != len(prompts):
            raise ValueError(f"temporal_consistency: {len(videos)} videos but {len(prompts)} prompts")
        frames, counts = [], []
        for i, video in enumerate(videos):
            video = as_video(video)
            picked = range(0, len(video), self.stride)
            if len(picked) < 2:
                raise ValueError(
                    f"temporal_consistency: video {i} has {len(video)} frame(s), fewer than 2 at stride "
                    f"{self.stride}; it compares consecutive frames (lower the stride or make more)"
                )
            frames.extend(frame_image(video, t) for t in picked)
            counts.append(len(picked))
        features = self.encoder(frames)  # [sum(counts), D], unit norm
        means, worst = [], []
        for chunk in torch.split(features, counts):
            pairs = (chunk[1:] * chunk[:-1]).sum(-1)  # [F - 1]
            means.append(pairs.mean())
            worst.append(pairs.min())
        self.last_components = {"min": torch.stack(worst)}
        return self.scale * torch.stack(means)
