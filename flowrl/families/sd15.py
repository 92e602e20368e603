"""SD1.5-style UNet (StableDiffusionPipeline): epsilon prediction, CFG, one CLIP text encoder; sampled with DDPO's
DDIM step."""

from __future__ import annotations

import torch

from flowrl.plan.declarations import Calibration, Layout
from flowrl.sampling import ddim_step, ddpm_flow_time, ddpm_velocity

from . import _tiny as tiny
from ._base import ImageBackend, Schedule, SizeRule, register_family

# the tiny test model's UNet (`tiny-sd15`)
TINY_UNET = dict(
    sample_size=tiny.TINY_IMAGE_SIZE // 2,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=(8, 16),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=2,
    norm_num_groups=4,
)


def ddim_scheduler(scheduler):
    """The DDIM scheduler the backend samples with, made from the directory's scheduler (DDPO swaps DDIM in from the
    pipeline's config): its betas, prediction type, timestep spacing and steps offset as the source says, and the
    DDIM-only settings as SD1.5 / SDXL base have them when the source does not say (an Euler or DPM-Solver config
    has no `clip_sample`: DDIM's default True would clamp x0 to [-1, 1]). `set_alpha_to_one` is False whatever the
    source says: True puts alpha-bar 1 below the last step, whose DDIM variance is then 0 and its log-prob not
    finite, so no run could train it."""
    from diffusers import DDIMScheduler

    config = scheduler.config
    if isinstance(scheduler, DDIMScheduler) and not config.set_alpha_to_one:
        return scheduler
    return DDIMScheduler.from_config(config, set_alpha_to_one=False, clip_sample=bool(config.get("clip_sample", False)))


@register_family
class SD15Backend(ImageBackend):
    """StableDiffusionPipeline with a DDIM scheduler (swapped in from the pipeline's config, as DDPO
    does), epsilon prediction. sde_type "ddim" samples with eta = noise_level (DDPO: 1.0); "ode" is
    eta = 0. CFG when guidance_scale > 1 (DDPO uses 5.0)."""

    family = "sd15"
    pipeline_classes = ("StableDiffusionPipeline",)
    denoiser_attr = "unet"
    denoiser_class = "UNet2DConditionModel"
    sde_types = ("ddim", "ode")
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    tiny_denoiser = TINY_UNET
    # diffusers checkpoints the resnets and the attentions' transformer blocks
    plan_layout = Layout(
        blocks=(
            r"(down_blocks\.\d+\.|up_blocks\.\d+\.|mid_block\.)"
            r"(resnets\.\d+|attentions\.\d+\.transformer_blocks\.\d+)"
        ),
        one=r"time_embedding|time_emb_proj|add_embedding",
        txt=r"attn2\.to_[kv]$",
        unet=True,
    )
    # Measured by `python benchmarks/memory.py --fit` (as SD3's, see sd3.py): SD1.5's UNet at a fifth of its width
    # (64 / 128 / 256 / 256 channels, 2 layers per block), 1024 latent pixels + 16 tokens: 109.1 / 432.9 / 1728.5 and
    # 26.1 / 101.2 / 401.6 MiB; with 1 layer per block: 68.6 / 272.2 and 20.9 / 81.4 (micro 1 / 4). Within 1.1%
    # without checkpointing, 0.1% with it. The rollout's denoiser (2 and 4 images with CFG): 13.1 / 26.2 MiB, gamma
    # 0.364. Checked on a UNet of 96 / 192 / 384 / 384 channels at 384 px, not used to fit them: 1.00-1.01.
    plan_calibration = Calibration(
        0.941,
        0.59,
        1.00,
        "calibrated on measured SD1.5-style UNets of 1 and 2 layers per block (benchmarks/memory.py)",
        gamma=0.364,
    )
    default_sde_type = "ddim"
    other_schedulers = (("EulerDiscreteScheduler", {}), ("DPMSolverMultistepScheduler", {}))
    default_guidance_scale = 5.0
    uses_cfg_encodings = True

    def __init__(self, pipe, **kwargs):
        pipe.scheduler = ddim_scheduler(pipe.scheduler)
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

    def flow_times(self, traj) -> torch.Tensor:
        """The flow time of step i: sigma / (alpha + sigma) at its timestep's alpha-bar (`ddpm_flow_time`)."""
        return ddpm_flow_time(traj.alphas_cumprod)

    def _flow_input(self, x0, noise, t):
        """The training timestep tau whose flow time is nearest t: x = alpha x0 + sigma eps (alpha = sqrt(a_tau),
        sigma = sqrt(1 - a_tau)); the UNet's epsilon (or v) becomes a velocity by `ddpm_velocity`."""
        alphas = self.pipe.scheduler.alphas_cumprod.to(self.device, torch.float32)  # [T]
        times = ddpm_flow_time(alphas)  # [T] increasing
        tau = (times[None, :] - t[:, None]).abs().argmin(1)  # [N]
        alpha, sigma = alphas[tau].sqrt(), (1 - alphas[tau]).sqrt()
        shape = (-1, *([1] * (x0.ndim - 1)))
        x = alpha.view(shape) * x0 + sigma.view(shape) * noise
        kind = self.pipe.scheduler.config.prediction_type

        def to_velocity(out):
            return ddpm_velocity(out, x, alpha, sigma, kind)

        return times[tau], x, tau, to_velocity

    def _to_vae_latents(self, latents, height, width):
        return latents / self.pipe.vae.config.scaling_factor

    def _from_vae_latents(self, latents, height, width):
        return latents * self.pipe.vae.config.scaling_factor

    parity_guidance = (1.0, 5.0)

    def pipeline_call_kwargs(self, guidance_scale: float) -> dict:
        return {"guidance_scale": guidance_scale, "eta": 0.0}  # the deterministic DDIM step

    @classmethod
    def export_lora(cls, pipeline_class, directory, state, metadata):
        """The UNet's LoRA in the diffusers key format the SD pipelines' `load_lora_weights` reads."""
        from diffusers.utils import convert_state_dict_to_diffusers

        pipeline_class.save_lora_weights(
            directory,
            unet_lora_layers=convert_state_dict_to_diffusers(state),
            unet_lora_adapter_metadata=metadata,
            safe_serialization=True,
        )

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        """A StableDiffusionPipeline with a 2-block UNet and SD1.5's DDIM schedule (scaled-linear betas)."""
        from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
        from transformers import CLIPTextModel

        tok = tiny.clip_tokenizer()
        with tiny.Seeded(seed) as build:
            text_encoder = build(CLIPTextModel, tiny.clip_config(tok))
            unet = build(UNet2DConditionModel, **TINY_UNET)
            vae = build(tiny.vae, flow=False)
        scheduler = DDIMScheduler(
            num_train_timesteps=1000,
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            clip_sample=False,
            set_alpha_to_one=False,
            steps_offset=1,
        )
        pipe = StableDiffusionPipeline(
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tok,
            unet=unet,
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
        return tiny.finish(pipe)


def tiny_sd15_pipeline(seed: int = 0):
    """The `tiny-sd15` pipeline (see SD15Backend.tiny_pipeline)."""
    return SD15Backend.tiny_pipeline(seed)
