"""LAION improved aesthetic predictor (Schuhmann et al. 2022, "sac+logos+ava1-l14-linearMSE", as used by
DDPO): a purely linear MLP 768→1024→128→64→16→1 (dropout between, no activations) applied to the
L2-normalised CLIP ViT-L/14 image embedding. Scores are roughly on the 1-10 rating scale."""

from __future__ import annotations

import torch
from torch import nn

from rewards._common import (
    check_images,
    load_clip,
    load_state_dict,
    pooled,
    resolve_device,
    resolve_dtype,
    resolve_file,
)
from rewards.memory import hub_model
from rewards.registry import IMAGE, register


class AestheticMLP(nn.Module):
    """The head, laid out as the original so that its state dict (``layers.{0,2,4,6,7}.*``) loads.

    ``[B, input_size] -> [B, 1]``; purely linear: the dropouts are inactive in eval mode.
    """

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds)


@register(
    "aesthetic",
    kind=IMAGE,
    memory=hub_model("model", "CLIPModel"),
    summary="the LAION improved aesthetic predictor on CLIP ViT-L/14 (DDPO), roughly 1-10",
)  # + a 0.9M head
class Aesthetic:
    """``head(e / |e|)`` with ``e`` the projected CLIP image embedding.

    Args:
        model / processor: the CLIP ``CLIPModel`` (ViT-L/14) and its processor: hub ids or local dirs.
        head: the MLP weights: a ``.pth`` (read with ``weights_only=True``) or ``.safetensors`` file,
            a directory holding ``head_filename``, or a hub repository holding it. The original file is
            ``sac+logos+ava1-l14-linearMSE.pth`` of github.com/christophschuhmann/improved-aesthetic-predictor.
        device, dtype: of the CLIP backbone; the head runs in float32.
    """

    kind = IMAGE

    def __init__(
        self,
        model: str = "openai/clip-vit-large-patch14",
        processor: str | None = None,
        head: str = "camenduru/improved-aesthetic-predictor",
        head_filename: str = "sac+logos+ava1-l14-linearMSE.pth",
        device: str | None = None,
        dtype: str | torch.dtype = "float32",
    ):
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.model, self.processor = load_clip(model, processor, self.device, self.dtype)
        self.head = AestheticMLP(self.model.config.projection_dim)
        path = resolve_file(head, head_filename)
        try:
            self.head.load_state_dict(load_state_dict(path))
        except RuntimeError as e:
            raise ValueError(
                f"aesthetic head {path!r} does not fit the MLP {self.model.config.projection_dim}→1024→128→64→16→1: {e}"
            ) from e
        self.head.to(self.device).eval().requires_grad_(False)
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, images, prompts, **metadata) -> torch.Tensor:
        images = check_images(images, prompts, "aesthetic")
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"].to(self.device, self.dtype)
        with torch.no_grad():
            embeds = pooled(self.model.get_image_features(pixel_values=pixels)).float()  # [B, D]
            embeds = embeds / embeds.norm(dim=-1, keepdim=True)
            score = self.head(embeds).squeeze(-1).cpu()  # [B]
        self.last_components = {}
        return score
