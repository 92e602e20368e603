"""SDXL (StableDiffusionXLPipeline): an epsilon-prediction UNet with two CLIP text encoders, the pooled text
embedding and the size "time ids" as added conditions, CFG; sampled with DDPO's DDIM step, as SD1.5.

What differs from SD1.5, all mirrored from `StableDiffusionXLPipeline.__call__`:
- the prompt embedding is both encoders' penultimate hidden states side by side, plus the second encoder's pooled
  projection (`text_embeds`), and `time_ids` = (original size, crop top-left, target size) = (H, W, 0, 0, H, W);
- the unconditional embeddings are zeros when the pipeline's `force_zeros_for_empty_prompt` is set (SDXL base),
  else the encoding of "" (what `encode_prompt` gives with CFG and no negative prompt);
- the UNet takes them as `added_cond_kwargs={"text_embeds", "time_ids"}`.
"""

from __future__ import annotations

import torch

from . import _tiny as tiny
from ._base import register_family
from .sd15 import SD15Backend

# the tiny test model's UNet (`tiny-sdxl`): diffusers' own SDXL test sizes, smaller
TINY_UNET = dict(
    sample_size=tiny.TINY_IMAGE_SIZE // 2,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=(8, 16),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    transformer_layers_per_block=(1, 1),
    projection_class_embeddings_input_dim=32 + 6 * 8,  # pooled projection 32 + 6 time ids x 8
    cross_attention_dim=64,  # the two CLIP encoders' 32 + 32 hidden dims
    norm_num_groups=4,
)


# SDXL base's scheduler_config.json (an Euler scheduler; the backend swaps in DDIM from this config, as DDPO does)
SDXL_SCHEDULER = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    prediction_type="epsilon",
    timestep_spacing="leading",
    steps_offset=1,
    clip_sample=False,
    set_alpha_to_one=False,
    interpolation_type="linear",
    use_karras_sigmas=False,
)


@register_family
class SDXLBackend(SD15Backend):
    """StableDiffusionXLPipeline with a DDIM scheduler (swapped in from the pipeline's config, as DDPO does),
    epsilon prediction, CFG when guidance_scale > 1. Images at the requested size with no crop (the time ids of
    `pipe(prompt, height=H, width=W)`)."""

    family = "sdxl"
    pipeline_classes = ("StableDiffusionXLPipeline",)
    denoiser_attr = "unet"
    denoiser_class = "UNet2DConditionModel"
    # the UNet's attention projections, as diffusers' train_text_to_image_lora_sdxl.py targets them
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    tiny_denoiser = TINY_UNET
    # SD1.5's UNet2DConditionModel class (its add_embedding is among the layout's per-sample layers): the same
    # layout and the factors measured on SD1.5-style UNets
    plan_layout = SD15Backend.plan_layout
    plan_calibration = SD15Backend.plan_calibration
    default_guidance_scale = 5.0
    parity_guidance = (1.0, 5.0)

    # ---- prompts ---------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts):
        if self._negative is None:
            self._negative = self._encode_negative()
        return super().encode_prompts(prompts)

    def _encode_text(self, prompts):
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompts, device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=False
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}, {}

    def _encode_negative(self) -> dict[str, torch.Tensor]:
        """The unconditional encodings as the pipeline makes them with CFG and no negative prompt: zeros under
        `force_zeros_for_empty_prompt`, else the encoding of ""."""
        _, negative, _, negative_pooled = self.pipe.encode_prompt(
            [""], device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=True
        )
        return {"prompt_embeds": negative, "pooled_prompt_embeds": negative_pooled}

    # ---- steps -----------------------------------------------------------------------------------

    def _time_ids(self, n: int, settings, dtype) -> torch.Tensor:
        """[n, 6] (original size, crop top-left, target size) for images of the rollout's size, no crop."""
        size = (settings.height, settings.width)
        encoder_2 = self.pipe.text_encoder_2
        projection = encoder_2.config.projection_dim if encoder_2 is not None else None
        ids = self.pipe._get_add_time_ids(size, (0, 0), size, dtype=dtype, text_encoder_projection_dim=projection)
        return ids.to(self.device).repeat(n, 1)

    def _predict(self, x, t, cond, encodings, settings):
        cfg = settings.guidance_scale > 1
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if cfg:
            negative = self._negative_like(encodings, x.shape[0])
            x, t = torch.cat([x, x]), torch.cat([t, t])
            embeds = torch.cat([negative["prompt_embeds"], embeds])
            pooled = torch.cat([negative["pooled_prompt_embeds"], pooled])
        added = {"text_embeds": pooled, "time_ids": self._time_ids(x.shape[0], settings, embeds.dtype)}
        out = self.denoiser(x, t, encoder_hidden_states=embeds, added_cond_kwargs=added, return_dict=False)[0]
        if cfg:
            uncond, text = out.chunk(2)
            out = uncond + settings.guidance_scale * (text - uncond)
        return out

    # ---- decoding --------------------------------------------------------------------------------

    def _to_vae_latents(self, latents, height, width):
        """As the pipeline does before vae.decode: x * std / scaling_factor + mean when the VAE's config has
        latents_mean and latents_std, else x / scaling_factor (SDXL base)."""
        config = self.pipe.vae.config
        mean, std = config.get("latents_mean"), config.get("latents_std")
        if mean is None or std is None:
            return latents / config.scaling_factor
        shape = (1, len(mean), 1, 1)
        mean = torch.tensor(mean, device=latents.device, dtype=latents.dtype).view(shape)
        std = torch.tensor(std, device=latents.device, dtype=latents.dtype).view(shape)
        return latents * std / config.scaling_factor + mean

    def _from_vae_latents(self, latents, height, width):
        """`_to_vae_latents`' inverse: (z - mean) x scaling_factor / std, or z x scaling_factor."""
        config = self.pipe.vae.config
        mean, std = config.get("latents_mean"), config.get("latents_std")
        if mean is None or std is None:
            return latents * config.scaling_factor
        shape = (1, len(mean), 1, 1)
        mean = torch.tensor(mean, device=latents.device, dtype=latents.dtype).view(shape)
        std = torch.tensor(std, device=latents.device, dtype=latents.dtype).view(shape)
        return (latents - mean) * config.scaling_factor / std

    @torch.no_grad()
    def decode(self, latents, *, height=None, width=None):
        """As the base class does; a float16 VAE with `force_upcast` (SDXL's overflows in float16) decodes in
        float32 and is cast back, as the pipeline does."""
        vae = self.pipe.vae
        if not (vae.dtype == torch.float16 and vae.config.get("force_upcast", False)):
            return super().decode(latents, height=height, width=width)
        vae.to(torch.float32)
        try:
            return super().decode(latents, height=height, width=width)
        finally:
            vae.to(torch.float16)

    # ---- the tiny model --------------------------------------------------------------------------

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        """A StableDiffusionXLPipeline: CLIPTextModel + CLIPTextModelWithProjection (32 dims each), a 2-block UNet
        with SDXL's text-time conditioning, SDXL base's Euler scheduler config (the backend swaps in DDIM from it,
        as on the real model); no watermarker."""
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection

        tok, tok_2 = tiny.clip_tokenizer(), tiny.clip_tokenizer()
        with tiny.Seeded(seed) as build:
            text_encoder = build(CLIPTextModel, tiny.clip_config(tok))
            text_encoder_2 = build(CLIPTextModelWithProjection, tiny.clip_config(tok_2))
            unet = build(UNet2DConditionModel, **TINY_UNET)
            vae = build(tiny.vae, flow=False)
        scheduler = EulerDiscreteScheduler.from_config(SDXL_SCHEDULER)
        pipe = StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=text_encoder,
            text_encoder_2=text_encoder_2,
            tokenizer=tok,
            tokenizer_2=tok_2,
            unet=unet,
            scheduler=scheduler,
            force_zeros_for_empty_prompt=True,  # SDXL base's setting
            add_watermarker=False,
        )
        return tiny.finish(pipe)


def tiny_sdxl_pipeline(seed: int = 0):
    """The `tiny-sdxl` pipeline (see SDXLBackend.tiny_pipeline)."""
    return SDXLBackend.tiny_pipeline(seed)
