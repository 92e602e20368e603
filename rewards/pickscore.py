"""PickScore (Kirstain et al. 2023, "Pick-a-Pic"): a CLIP-H fine-tuned on human preferences; the score
is ``exp(logit_scale) · cos(image, text)``. Flow-GRPO divides it by 26 (``scale=1/26``)."""

from __future__ import annotations

import torch

from rewards._common import check_images, clip_embeddings, load_clip, resolve_device, resolve_dtype
from rewards.memory import hub_model
from rewards.registry import IMAGE, register


def pickscore(image_embeds: torch.Tensor, text_embeds: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """``exp(logit_scale) · <img/|img|, txt/|txt|>`` row-wise: ``[B, D], [B, D], [] -> [B]``."""
    image_embeds = image_embeds / image_embeds.norm(dim=-1, keepdim=True)
    text_embeds = text_embeds / text_embeds.norm(dim=-1, keepdim=True)
    return logit_scale.exp() * (image_embeds * text_embeds).sum(-1)


@register(
    "pickscore",
    kind=IMAGE,
    memory=hub_model("model", "CLIPModel"),
    summary="PickScore, a CLIP-H fine-tuned on human preferences (Flow-GRPO divides it by 26)",
)
class PickScore:
    """PickScore per image, ``scale · exp(logit_scale) · cos``.

    Args:
        model: hub id or local directory of the PickScore ``CLIPModel``.
        processor: the processor of the CLIP it was fine-tuned from (its preprocessing constants).
        scale: multiplies the score (PickScore is ~20-23 for real images; Flow-GRPO uses 1/26).
        device, dtype: as for every reward backbone.
    """

    kind = IMAGE

    def __init__(
        self,
        model: str = "yuvalkirstain/PickScore_v1",
        processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        scale: float = 1.0,
        device: str | None = None,
        dtype: str | torch.dtype = "float32",
    ):
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.model, self.processor = load_clip(model, processor, self.device, self.dtype)
        self.scale = scale
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, images, prompts, **metadata) -> torch.Tensor:
        images = check_images(images, prompts, "pickscore")
        image_embeds, text_embeds = clip_embeddings(
            self.model, self.processor, images, prompts, self.device, self.dtype
        )  # [B, D] each
        score = pickscore(image_embeds, text_embeds, self.model.logit_scale.float()).cpu()  # [B]
        self.last_components = {"cosine": (image_embeds * text_embeds).sum(-1).cpu()}
        return self.scale * score
