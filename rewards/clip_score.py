"""CLIP score: the cosine similarity of the CLIP image and text embeddings (Radford et al. 2021;
Hessel et al. 2021 use ``2.5 · max(cos, 0)``, here ``scale · cos``), with transformers' ``CLIPModel``."""

from __future__ import annotations

import torch

from rewards._common import check_images, clip_embeddings, load_clip, resolve_device, resolve_dtype
from rewards.memory import hub_model
from rewards.registry import IMAGE, register


def clip_cosine(image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity of ``[B, D]`` image and text embeddings -> ``[B]``."""
    image_embeds = image_embeds / image_embeds.norm(dim=-1, keepdim=True)
    text_embeds = text_embeds / text_embeds.norm(dim=-1, keepdim=True)
    return (image_embeds * text_embeds).sum(-1)


@register(
    "clip_score",
    kind=IMAGE,
    memory=hub_model("model", "CLIPModel"),
    summary="`scale · cos` of the CLIP image and text embeddings",
)
class ClipScore:
    """``scale · cos(CLIP_image(x), CLIP_text(prompt))`` per image, one forward per tower and batch.

    Args:
        model: hub id or local directory of a ``CLIPModel``.
        processor: hub id or local directory of its ``CLIPProcessor`` (default: ``model``).
        scale: multiplies the cosine (1 keeps it in [-1, 1]; 100 is the common "CLIPScore ×100").
        device: default CUDA if available, else CPU. dtype: model dtype (the score is float32).
    """

    kind = IMAGE

    def __init__(
        self,
        model: str = "openai/clip-vit-large-patch14",
        processor: str | None = None,
        scale: float = 1.0,
        device: str | None = None,
        dtype: str | torch.dtype = "float32",
    ):
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.model, self.processor = load_clip(model, processor, self.device, self.dtype)
        self.scale = scale
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, images, prompts, **metadata) -> torch.Tensor:
        images = check_images(images, prompts, "clip_score")
        image_embeds, text_embeds = clip_embeddings(
            self.model, self.processor, images, prompts, self.device, self.dtype
        )  # [B, D] each
        cosine = clip_cosine(image_embeds, text_embeds).cpu()  # [B]
        self.last_components = {"cosine": cosine}
        return self.scale * cosine
