"""SD3 / SD3.5 (StableDiffusion3Pipeline): flow matching with CFG, three text encoders (two CLIP, one T5 that
`drop_t5` leaves out), an MMDiT transformer; sampled with flow_sde_step (Flow-GRPO's SDE by default)."""

from __future__ import annotations

import torch

from flowrl.plan.declarations import MMDIT_ADALN, Calibration, Layout

from . import _tiny as tiny
from ._base import SizeRule, register_family
from ._flow import FlowMatchingBackend

# the tiny test model's transformer (`tiny-sd3`)
TINY_TRANSFORMER = dict(
    sample_size=tiny.TINY_IMAGE_SIZE // 2,
    patch_size=2,
    in_channels=4,
    num_layers=1,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=64,
    caption_projection_dim=32,  # = heads x head_dim
    pooled_projection_dim=64,  # 2 CLIP projections of 32
    out_channels=4,
    pos_embed_max_size=16,  # latent side / patch size <= 16: images up to 64 px a side
)


@register_family
class SD3Backend(FlowMatchingBackend):
    """StableDiffusion3Pipeline. CFG when guidance_scale > 1; Flow-GRPO's SD3.5 recipe uses 4.5."""

    family = "sd3"
    pipeline_classes = ("StableDiffusion3Pipeline",)
    denoiser_attr = "transformer"
    denoiser_class = "SD3Transformer2DModel"
    repeated_blocks = ("transformer_blocks",)  # diffusers 0.42 declares no `_repeated_blocks` for it
    default_guidance_scale = 4.5
    # the attention projections of both streams (Flow-GRPO's choice for SD3)
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
    default_max_sequence_length = 256
    uses_cfg_encodings = True
    _t5_tokenizer_attr = "tokenizer_3"
    t5_components = ("text_encoder_3", "tokenizer_3")  # without them, T5's part of the prompt embedding is zeros
    plan_layout = Layout(
        blocks=r"transformer_blocks\.\d+",
        one=rf"time_text_embed|{MMDIT_ADALN}",
        txt=r"context_embedder|attn\.add_|to_add_out|ff_context",
    )
    # Measured by `python benchmarks/memory.py --fit` (CPU, bfloat16, LoRA r8 on lora_targets, beta 0.01 with CFG at
    # 256 px; activations in MiB on top of the static memory for micro-batch 1 / 4 / 16, without and with gradient
    # checkpointing): an SD3 of 8 blocks of 512 (dual attention in 4, qk RMS norm), 256 + 32 tokens: 133.4 / 527.6 /
    # 2104.4 and 27.2 / 103.1 / 406.4; of 24 blocks of 256 (dual attention in 13): 201.7 / 798.0 and 18.4 / 64.7
    # (micro 1 / 4). Within 0.3% without checkpointing, 0.2% with it. The rollout's denoiser (no gradients, 2 and 4
    # images with CFG): 15.7 / 31.4 MiB, gamma 0.513. Checked on models not used to fit them (estimate / measured,
    # micro-batch 1 and 2, checkpointing off and on): an SD3 of 12 blocks of 768 at 384 px (576 + 32 tokens)
    # 0.99-1.00, one of 4 blocks of 256 at 128 px 0.98-1.02 (tests/test_plan.py's).
    plan_calibration = Calibration(
        0.970,
        0.61,
        1.17,
        "calibrated on measured SD3s of 8 x 512 and 24 x 256 blocks (benchmarks/memory.py)",
        gamma=0.513,
    )

    def _encode_text(self, prompts):
        prompt_embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}, {}

    def _default_image_size(self) -> int:
        return self.pipe.default_sample_size * self.pipe.vae_scale_factor

    @classmethod
    def size_rule(cls, denoiser_config, vae_scale_factor):
        """Sides divisible by VAE factor x patch size, and the latent side / patch size at most the
        transformer's `pos_embed_max_size` (its PatchEmbed crops the positional embedding to the grid)."""
        patch = denoiser_config.get("patch_size", 2)
        multiple = vae_scale_factor * patch
        grid = denoiser_config.get("pos_embed_max_size")
        if grid is None:
            return SizeRule(cls.family, multiple)
        bound = f"pos_embed_max_size {grid} x patch size {patch} x VAE factor {vae_scale_factor}"
        return SizeRule(cls.family, multiple, grid * multiple, bound)

    def _latent_shape(self, settings):
        f = self.pipe.vae_scale_factor
        return (self.denoiser_config.in_channels, settings.height // f, settings.width // f)

    def _schedule(self, num_steps, settings):
        kwargs = {}
        config = self.pipe.scheduler.config
        if config.get("use_dynamic_shifting", False):  # as StableDiffusion3Pipeline does
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            patch, f = self.denoiser_config.patch_size, self.pipe.vae_scale_factor
            seq_len = (settings.height // f // patch) * (settings.width // f // patch)
            kwargs["mu"] = calculate_shift(
                seq_len,
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.16),
            )
        return self._set_scheduler(num_steps, num_inference_steps=num_steps, **kwargs)

    def _predict(self, x, t, cond, encodings, settings):
        cfg = settings.guidance_scale > 1
        prompt_embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if cfg:
            negative = self._negative_like(encodings, x.shape[0])
            x, t = torch.cat([x, x]), torch.cat([t, t])
            prompt_embeds = torch.cat([negative["prompt_embeds"], prompt_embeds])
            pooled = torch.cat([negative["pooled_prompt_embeds"], pooled])
        out = self.denoiser(
            hidden_states=x,
            timestep=t,
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        if cfg:
            uncond, text = out.chunk(2)
            out = uncond + settings.guidance_scale * (text - uncond)
        return out

    def _to_vae_latents(self, latents, height, width):
        return self._scale_shift(latents)

    def _from_vae_latents(self, latents, height, width):
        return self._unscale_shift(latents)

    @classmethod
    def tiny_pipeline(cls, seed: int = 0, *, drop_t5: bool = False):
        """A StableDiffusion3Pipeline: two CLIP-with-projection encoders, a T5, a 1-layer SD3 transformer.
        drop_t5: without the T5 encoder and tokenizer (the other weights are the same as with them)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
        from transformers import CLIPTextModelWithProjection

        tok, tok_3 = tiny.clip_tokenizer(), tiny.t5_tokenizer()
        with tiny.Seeded(seed) as build:
            text_encoder = build(CLIPTextModelWithProjection, tiny.clip_config(tok))
            text_encoder_2 = build(CLIPTextModelWithProjection, tiny.clip_config(tok))
            text_encoder_3 = build(tiny.t5_encoder, tok_3, d_model=64)  # = joint_attention_dim >= 2 x 32 CLIP dims
            transformer = build(SD3Transformer2DModel, **TINY_TRANSFORMER)
            vae = build(tiny.vae)
        if drop_t5:  # built all the same, so that the modules after it get the same seeds
            text_encoder_3 = tok_3 = None
        pipe = StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tok,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tiny.clip_tokenizer(),
            text_encoder_3=text_encoder_3,
            tokenizer_3=tok_3,
        )
        return tiny.finish(pipe)


def tiny_sd3_pipeline(seed: int = 0, *, drop_t5: bool = False):
    """The `tiny-sd3` pipeline (see SD3Backend.tiny_pipeline)."""
    return SD3Backend.tiny_pipeline(seed, drop_t5=drop_t5)
