"""SD1.5-style UNet backend (epsilon prediction), stepped with DDPO's DDIM step."""

from __future__ import annotations

import torch

from flowrl.backends.image import IMAGE_BACKENDS, ImageBackend, Schedule, SizeRule
from flowrl.sampling import ddim_step


@IMAGE_BACKENDS.register("sd15")
class SD15Backend(ImageBackend):
    """StableDiffusionPipeline with a DDIM scheduler (swapped in from the pipeline's config, as DDPO
    does), epsilon prediction. sde_type "ddim" samples with eta = noise_level (DDPO: 1.0); "ode" is
    eta = 0. CFG when guidance_scale > 1 (DDPO uses 5.0)."""

    family = "sd15"
    pipeline_classes = ("StableDiffusionPipeline",)
    denoiser_attr = "unet"
    sde_types = ("ddim", "ode")
    default_sde_type = "ddim"
    default_guidance_scale = 5.0
    uses_cfg_encodings = True

    def __init__(self, pipe, **kwargs):
        from diffusers import DDIMScheduler

        if not isinstance(pipe.scheduler, DDIMScheduler):
            pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
        config = pipe.scheduler.config
        if config.prediction_type != "epsilon":
            raise ValueError(
                f"SD15Backend's DDIM step takes epsilon predictions; this model predicts {config.prediction_type!r}"
            )
        if config.thresholding:
            raise ValueError("DDIM dynamic thresholding is not supported: set scheduler thresholding=False")
        if pipe.unet.config.time_cond_proj_dim is not None:
            raise ValueError("UNets with a guidance embedding (time_cond_proj_dim, e.g. LCM) are not supported")
        super().__init__(pipe, **kwargs)

    def _encode_text(self, prompts):
        prompt_embeds, _ = self.pipe.encode_prompt(prompts, self.device, 1, False)
        return {"prompt_embeds": prompt_embeds}, {}

    def _default_image_size(self) -> int:
        return self.denoiser_config.sample_size * self.pipe.vae_scale_factor

    @classmethod
    def size_rule(cls, denoiser_config, vae_scale_factor):
        """Sides divisible by the VAE factor (a UNet is convolutional: no bound)."""
        return SizeRule(cls.family, vae_scale_factor)

    def _latent_shape(self, settings):
        f = self.pipe.vae_scale_factor
        return (self.denoiser_config.in_channels, settings.height // f, settings.width // f)

    def _initial_noise(self, n, settings, generator):
        return super()._initial_noise(n, settings, generator) * self.pipe.scheduler.init_noise_sigma

    def _schedule(self, num_steps, settings):
        scheduler = self.pipe.scheduler
        scheduler.set_timesteps(num_steps, device=self.device)
        timesteps = scheduler.timesteps.clone()
        # DDIMScheduler.step's previous timestep: t - T // S, alpha-bar of it or the final one below 0.
        prev = timesteps - scheduler.config.num_train_timesteps // num_steps
        alphas = scheduler.alphas_cumprod.to(self.device, torch.float32)
        final = torch.as_tensor(scheduler.final_alpha_cumprod, dtype=torch.float32, device=self.device)
        alphas_prev = torch.where(prev >= 0, alphas[prev.clamp(min=0)], final)
        return Schedule(timesteps=timesteps, alphas_cumprod=alphas[timesteps], alphas_cumprod_prev=alphas_prev)

    def _predict(self, x, t, cond, encodings, settings):
        cfg = settings.guidance_scale > 1
        prompt_embeds = cond["prompt_embeds"]
        if cfg:
            negative = self._negative_like(encodings, x.shape[0])
            x, t = torch.cat([x, x]), torch.cat([t, t])
            prompt_embeds = torch.cat([negative["prompt_embeds"], prompt_embeds])
        out = self.denoiser(x, t, encoder_hidden_states=prompt_embeds, return_dict=False)[0]
        if cfg:
            uncond, text = out.chunk(2)
            out = uncond + settings.guidance_scale * (text - uncond)
        return out

    def _step(self, model_output, x, steps, schedule, settings, *, stochastic, prev_latents=None, generator=None):
        config = self.pipe.scheduler.config
        return ddim_step(
            model_output,
            x,
            schedule.alphas_cumprod[steps],
            schedule.alphas_cumprod_prev[steps],
            eta=settings.noise_level if stochastic else 0.0,
            prev_latents=prev_latents,
            generator=generator,
            logprob_reduce=settings.logprob_reduce,
            clip_sample_range=config.clip_sample_range if config.clip_sample else None,
        )

    def _to_vae_latents(self, latents, height, width):
        return latents / self.pipe.vae.config.scaling_factor
