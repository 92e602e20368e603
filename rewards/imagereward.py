"""ImageReward (Xu et al. 2023): a BLIP text encoder cross-attending to the image, an MLP on its [CLS]
feature, then standardised: ``(mlp(f) - mean) / std``, with the package's own mean/std. Runs through the
optional package ``image-reward`` (module ``ImageReward``), imported when the reward is built."""

from __future__ import annotations

import torch

from rewards._common import check_images, require, resolve_device, resolve_dtype
from rewards.memory import Parameters, dtype_name
from rewards.registry import IMAGE, register

MAX_PROMPT_TOKENS = 35  # ImageReward's tokenizer max_length
#: ImageReward-v1.0's parameters: BLIP's ViT-L/16 at 224 px (303,301,632); its BERT-base text encoder, vocabulary
#: 30,524, cross-attending to the 1024-wide image tokens, without token-type embeddings or pooler (141,977,088); the
#: two 256-d projections (459,264); the MLP head 768→1024→128→64→16→1 (927,969). In float32 that is 1.79 GB, the
#: size of its ImageReward.pt.
PARAMETERS = 303_301_632 + 141_977_088 + 459_264 + 927_969


def blip_memory(options: dict) -> Parameters:
    """ImageReward's BLIP model and head (not a transformers model: a known size), in the ``dtype`` option."""
    return Parameters(PARAMETERS, "ImageReward BLIP ViT-L + BERT-base", dtype_name(options["dtype"]))


@register(
    "imagereward",
    kind=IMAGE,
    memory=blip_memory,
    summary='ImageReward (the optional package `image-reward`: `pip install -e ".[imagereward]"`)',
)
class ImageRewardScore:
    """ImageReward per image, the whole batch in one forward (the package's ``score`` loops per image).

    Args:
        model: a name known to ``ImageReward.load`` ("ImageReward-v1.0") or a local checkpoint path.
        download_root: where the package caches its checkpoint (its default when None).
        device, dtype: as for every reward backbone.
    """

    kind = IMAGE

    def __init__(
        self,
        model: str = "ImageReward-v1.0",
        download_root: str | None = None,
        device: str | None = None,
        dtype: str | torch.dtype = "float32",
    ):
        image_reward = require(
            "ImageReward", extra="imagereward", package="image-reward", purpose="the imagereward reward"
        )
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.model = image_reward.load(model, device=str(self.device), download_root=download_root)
        self.model.to(self.device, self.dtype).eval().requires_grad_(False)
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, images, prompts, **metadata) -> torch.Tensor:
        images = check_images(images, prompts, "imagereward")
        blip = self.model.blip
        text = blip.tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=MAX_PROMPT_TOKENS, return_tensors="pt"
        ).to(self.device)
        pixels = torch.stack([self.model.preprocess(x) for x in images]).to(self.device, self.dtype)  # [B,3,H,W]
        with torch.no_grad():
            image_embeds = blip.visual_encoder(pixels)  # [B, N, D]
            image_mask = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)  # [B, N]
            text_out = blip.text_encoder(
                text.input_ids,
                attention_mask=text.attention_mask,
                encoder_hidden_states=image_embeds,
                encoder_attention_mask=image_mask,
                return_dict=True,
            )
            cls_features = text_out.last_hidden_state[:, 0, :]  # [B, D]
            raw = self.model.mlp(cls_features).squeeze(-1).float()  # [B]
        score = ((raw - self.model.mean) / self.model.std).cpu()
        self.last_components = {"raw": raw.cpu()}
        return score
