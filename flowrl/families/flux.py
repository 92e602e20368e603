"""FLUX.1 (FluxPipeline): flow matching with a guidance embedding (dev) or none (schnell), no CFG, CLIP + T5 text
encoders, packed 2x2 latents; sampled with flow_sde_step."""

from __future__ import annotations

import numpy as np
import torch

from flowrl.plan.declarations import MMDIT_ADALN, Calibration, Layout

from . import _tiny as tiny
from ._base import SizeRule, register_family
from ._flow import FlowMatchingBackend

# the tiny test model's transformer (`tiny-flux`)
TINY_TRANSFORMER = dict(
    patch_size=1,
    in_channels=16,  # 4 latent channels x a 2x2 patch
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
)


@register_family
class FluxBackend(FlowMatchingBackend):
    """FluxPipeline (FLUX.1-dev: guidance embedding; FLUX.1-schnell: none). No CFG. Latents are packed
    2x2 patches [B, (h/2)(w/2), 4C], the layout the transformer consumes."""

    family = "flux"
    pipeline_classes = ("FluxPipeline",)
    denoiser_attr = "transformer"
    denoiser_class = "FluxTransformer2DModel"
    default_guidance_scale = 3.5
    lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
    )
    tiny_denoiser = TINY_TRANSFORMER
    parity_guidance = (3.5,)  # the guidance embedding; FLUX.1 has no CFG
    plan_layout = Layout(
        blocks=r"(single_)?transformer_blocks\.\d+",
        one=rf"time_text_embed|{MMDIT_ADALN}",
        txt=r"context_embedder|attn\.add_|to_add_out|ff_context",
        joint=r"single_transformer_blocks",
    )
    # Measured by `python benchmarks/memory.py --fit` (as SD3's, see sd3.py): a FLUX.1 of 3 double + 6 single blocks
    # of 512, 256 + 16 tokens: 54.7 / 213.9 / 850.8 and 12.6 / 46.2 / 180.5 MiB; of 6 + 12 blocks of 256: 52.7 /
    # 205.9 and 8.2 / 28.7. Within 2.5% without checkpointing, 0.8% with it. The rollout's denoiser (2 and 4 images):
    # 9.4 / 18.7 MiB, gamma 0.873. Checked on a FLUX.1 of 4 + 8 blocks of 768 at 384 px, not used to fit them:
    # estimate / measured 1.00-1.01.
    plan_calibration = Calibration(
        0.860,
        1.00,
        1.25,
        "calibrated on measured FLUX.1s of 3 + 6 x 512 and 6 + 12 x 256 blocks (benchmarks/memory.py)",
        gamma=0.873,
    )
    default_max_sequence_length = 512
    _t5_tokenizer_attr = "tokenizer_2"

    def _encode_text(self, prompts):
        prompt_embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}, {"txt_ids": text_ids}

    def _default_image_size(self) -> int:
        return self.pipe.default_sample_size * self.pipe.vae_scale_factor

    @classmethod
    def size_rule(cls, denoiser_config, vae_scale_factor):
        """Sides divisible by VAE factor x 2 (latents are packed in 2x2 patches); RoPE bounds no size."""
        return SizeRule(cls.family, vae_scale_factor * 2)

    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        f = self.pipe.vae_scale_factor
        return 2 * (height // (f * 2)), 2 * (width // (f * 2))

    def _latent_shape(self, settings):
        h, w = self._latent_hw(settings.height, settings.width)
        return ((h // 2) * (w // 2), self.denoiser_config.in_channels)

    def _initial_noise(self, n, settings, generator):
        # Drawn unpacked [n, C, h, w] then packed, as FluxPipeline.prepare_latents does.
        h, w = self._latent_hw(settings.height, settings.width)
        channels = self.denoiser_config.in_channels // 4
        device = generator.device if generator is not None else self.device
        noise = torch.randn((n, channels, h, w), generator=generator, device=device, dtype=torch.float32)
        noise = self.pipe._pack_latents(noise, n, channels, h, w)
        return noise.to(device=self.device, dtype=self.dtype)

    def _schedule(self, num_steps, settings):
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.pipe.scheduler.config
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)  # as FluxPipeline does
        if config.get("use_flow_sigmas", False):
            sigmas = None
        h, w = self._latent_hw(settings.height, settings.width)
        mu = calculate_shift(
            (h // 2) * (w // 2),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        if sigmas is None:
            return self._set_scheduler(num_steps, num_inference_steps=num_steps, mu=mu)
        return self._set_scheduler(num_steps, sigmas=sigmas, mu=mu)

    def training_guidance_scale(self, guidance_scale):
        """FLUX.1 has no CFG: dev's guidance is an embedding, kept at the rollout's value."""
        return guidance_scale if self.denoiser_config.guidance_embeds else 1.0

    def _predict(self, x, t, cond, encodings, settings):
        h, w = self._latent_hw(settings.height, settings.width)
        img_ids = self.pipe._prepare_latent_image_ids(None, h // 2, w // 2, self.device, x.dtype)
        guidance = None
        if self.denoiser_config.guidance_embeds:
            guidance = torch.full((x.shape[0],), settings.guidance_scale, device=self.device, dtype=torch.float32)
        return self.denoiser(
            hidden_states=x,
            timestep=t.to(x.dtype) / 1000,  # FluxPipeline: t.expand(B).to(latents.dtype) / 1000
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"],
            encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=encodings.shared["txt_ids"].to(self.device),
            img_ids=img_ids,
            return_dict=False,
        )[0]

    def _to_vae_latents(self, latents, height, width):
        if height is None or width is None:
            side = int(round(latents.shape[1] ** 0.5)) * 2 * self.pipe.vae_scale_factor
            if (side // (2 * self.pipe.vae_scale_factor)) ** 2 != latents.shape[1]:
                raise ValueError("FLUX latents are packed: pass height and width to decode non-square images")
            height, width = height or side, width or side
        unpacked = self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor)
        return self._scale_shift(unpacked)

    def _from_vae_latents(self, latents, height, width):
        """Shifted and scaled, then packed in 2x2 patches (as Kontext's source images are)."""
        latents = self._unscale_shift(latents)
        n, c, h, w = latents.shape
        return self.pipe._pack_latents(latents, n, c, h, w)

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        """A FluxPipeline (FLUX.1-dev style: guidance embedding, dynamic shift) of `tiny_flux1_parts`."""
        from diffusers import FluxPipeline

        pipe = FluxPipeline(**tiny_flux1_parts(seed))
        pipe.default_sample_size = tiny.TINY_IMAGE_SIZE // pipe.vae_scale_factor  # FLUX hard-codes 128 (1024 px)
        return tiny.finish(pipe)


def tiny_flux1_parts(seed: int = 0) -> dict:
    """The tiny FLUX.1-dev components as pipeline keyword arguments (FluxPipeline's, FluxKontextPipeline's): CLIP +
    T5 + a transformer with one double and one single block, the tiny VAE, a dynamic-shift scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel

    tok, tok_2 = tiny.clip_tokenizer(), tiny.t5_tokenizer()
    with tiny.Seeded(seed) as build:
        text_encoder = build(CLIPTextModel, tiny.clip_config(tok))
        text_encoder_2 = build(tiny.t5_encoder, tok_2, d_model=32)
        transformer = build(FluxTransformer2DModel, **TINY_TRANSFORMER)
        vae = build(tiny.vae)
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(**tiny.DYNAMIC_SHIFT_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tok_2,
        transformer=transformer,
    )


def tiny_flux_pipeline(seed: int = 0):
    """The `tiny-flux` pipeline (see FluxBackend.tiny_pipeline)."""
    return FluxBackend.tiny_pipeline(seed)
