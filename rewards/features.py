"""Image features: a vision backbone loaded by hub id or local directory through transformers, one embedding per
image. Public: the similarity rewards (edit consistency, temporal consistency) and flowrl's eval.diversity_features
embed with ``ImageEncoder``; the memory planner asks ``encoder_memory`` what it holds.

    from rewards.features import ImageEncoder
    encoder = ImageEncoder("facebook/dinov2-small", None, torch.device("cuda"), torch.float32)
    features = encoder(images)                                           # [B, D] float32, L2-normalised

Backbones (read from the checkpoint's config, `model_type`):
- ``dinov2`` (``Dinov2Model``, e.g. ``facebook/dinov2-small``): the [CLS] token after the final layer norm
  (``pooler_output``). DINO features are the usual choice for "is this the same image / subject" (they keep layout
  and appearance, not just what a caption would say);
- ``clip`` (``CLIPModel``) or ``clip_vision_model`` (``CLIPVisionModelWithProjection``, e.g.
  ``openai/clip-vit-large-patch14``): the projected image embedding (CLIP-I).
The image processor comes from the same hub id or directory (or ``processor``).
"""

from __future__ import annotations

import torch

from rewards._common import pooled
from rewards.memory import HubModel

#: a checkpoint's config.json ``model_type`` -> the transformers class ``ImageEncoder`` builds it as
ARCHITECTURES = {"dinov2": "Dinov2Model", "clip": "CLIPModel", "clip_vision_model": "CLIPVisionModelWithProjection"}
BACKBONES = tuple(ARCHITECTURES)  # the model types ImageEncoder embeds with


def encoder_memory(model: str, dtype: str = "float32") -> HubModel:
    """What an ``ImageEncoder`` of ``model`` (hub id or local directory) keeps on its device, for the memory
    planner: the backbone's transformers class, picked by its config's ``model_type``, in ``dtype``."""
    return HubModel(model, ARCHITECTURES, dtype)


class ImageEncoder:
    """``encoder(images) -> Tensor[B, D]``: L2-normalised float32 features of PIL images, ``batch_size`` at a time."""

    def __init__(
        self, model: str, processor: str | None, device: torch.device, dtype: torch.dtype, batch_size: int = 64
    ):
        from transformers import AutoConfig, AutoImageProcessor

        from flowrl import hub

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        hub.settle_for(model, processor or model)  # (offline at once when the hub cannot be reached)
        try:
            self.model_type = AutoConfig.from_pretrained(model).model_type
        except OSError as e:
            raise OSError(
                f"backbone {model!r} is neither a local directory nor a hub id that could be loaded here "
                f"(offline: is it in the Hugging Face cache?): {str(e).splitlines()[0]}"
            ) from e
        if self.model_type not in BACKBONES:
            raise ValueError(
                f"{model!r} is a {self.model_type!r} checkpoint; the similarity rewards take one of "
                f"{', '.join(BACKBONES)} (e.g. facebook/dinov2-small or openai/clip-vit-large-patch14)"
            )
        import transformers

        backbone = getattr(transformers, ARCHITECTURES[self.model_type])
        self.model = backbone.from_pretrained(model).to(device=device, dtype=dtype)
        self.model.eval().requires_grad_(False)
        self.processor = AutoImageProcessor.from_pretrained(processor or model)
        self.device, self.dtype, self.batch_size = device, dtype, int(batch_size)

    def __call__(self, images: list) -> torch.Tensor:
        chunks = [self._embed(images[i : i + self.batch_size]) for i in range(0, len(images), self.batch_size)]
        features = torch.cat(chunks) if chunks else torch.zeros(0, 1)
        return features / features.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def _embed(self, images: list) -> torch.Tensor:
        pixels = self.processor(images=[im.convert("RGB") for im in images], return_tensors="pt")["pixel_values"]
        pixels = pixels.to(self.device, self.dtype)
        if self.model_type == "clip":
            return pooled(self.model.get_image_features(pixel_values=pixels)).float().cpu()
        if self.model_type == "clip_vision_model":
            return self.model(pixel_values=pixels).image_embeds.float().cpu()
        return self.model(pixel_values=pixels).pooler_output.float().cpu()  # DINOv2: normed [CLS]
