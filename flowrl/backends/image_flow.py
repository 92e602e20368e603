"""Flow-matching image backends: SD3 / SD3.5 and FLUX.1, stepped with flow_sde_step (sde, cps, dance, ode)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from flowrl.backends.image import IMAGE_BACKENDS, ImageBackend, Schedule, SizeRule
from flowrl.sampling import flow_sde_step


class _FlowMatchingBackend(ImageBackend):
    """Shared by SD3 and FLUX: FlowMatchEulerDiscreteScheduler sigmas, flow_sde_step."""

    sde_types = ("sde", "cps", "dance", "ode")
    default_sde_type = "sde"

    def _set_scheduler(self, num_steps: int, **kwargs) -> Schedule:
        scheduler = self.pipe.scheduler
        scheduler.set_timesteps(device=self.device, **kwargs)
        timesteps, sigmas = scheduler.timesteps.clone(), scheduler.sigmas.clone()
        if len(timesteps) != num_steps or len(sigmas) != num_steps + 1:
            raise RuntimeError(f"scheduler gave {len(timesteps)} timesteps for {num_steps} steps")
        return Schedule(timesteps=timesteps.float(), sigmas=sigmas.float())

    def _step(self, model_output, x, steps, schedule, settings, *, stochastic, prev_latents=None, generator=None):
        return flow_sde_step(
            model_output,
            x,
            schedule.sigmas[steps],
            schedule.sigmas[steps + 1],
            noise_level=settings.noise_level,
            sde_type=settings.sde_type if stochastic else "ode",
            prev_latents=prev_latents,
            generator=generator,
            logprob_reduce=settings.logprob_reduce,
        )

    def _scale_shift(self, latents: Tensor) -> Tensor:
        config = self.pipe.vae.config
        return latents / config.scaling_factor + (config.shift_factor or 0.0)


@IMAGE_BACKENDS.register("sd3")
class SD3Backend(_FlowMatchingBackend):
    """StableDiffusion3Pipeline. CFG when guidance_scale > 1; Flow-GRPO's SD3.5 recipe uses 4.5."""

    family = "sd3"
    pipeline_classes = ("StableDiffusion3Pipeline",)
    denoiser_attr = "transformer"
    default_guidance_scale = 4.5
    default_max_sequence_length = 256
    uses_cfg_encodings = True
    _t5_tokenizer_attr = "tokenizer_3"
    t5_components = ("text_encoder_3", "tokenizer_3")  # without them, T5's part of the prompt embedding is zeros

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


@IMAGE_BACKENDS.register("flux")
class FluxBackend(_FlowMatchingBackend):
    """FluxPipeline (FLUX.1-dev: guidance embedding; FLUX.1-schnell: none). No CFG. Latents are packed
    2x2 patches [B, (h/2)(w/2), 4C], the layout the transformer consumes."""

    family = "flux"
    pipeline_classes = ("FluxPipeline",)
    denoiser_attr = "transformer"
    default_guidance_scale = 3.5
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
