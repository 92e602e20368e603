"""Wan2.1 text-to-video (WanPipeline): flow matching with CFG, one UMT5 text encoder, a 3-D transformer over
5-D latents [C, F', H', W'] (F' = (F - 1) / 4 + 1 latent frames for F video frames), the Wan VAE (a per-channel
mean and std instead of a scale and shift); sampled with flow_sde_step. A sample is a video, frames [F, H, W, C]
(`flowrl.video`).

The checkpoints' UniPC flow solver is swapped for FlowMatchEulerDiscreteScheduler with their flow shift (the SDE
kernels need Euler sigmas), as SANA's is. Wan2.2's two-expert pipelines (`transformer_2`, `boundary_ratio`) and
its TI2V `expand_timesteps` are refused with a message: one trained denoiser per pipeline here."""

from __future__ import annotations

import torch

from flowrl.plan.declarations import NOT_CALIBRATED, Layout

from . import _tiny as tiny
from ._base import ImageModelError, SizeRule, register_family
from ._flow import FlowMatchingBackend, flow_euler_scheduler

# the tiny test model's transformer (`tiny-wan`): 2 heads of 12 (RoPE splits a head over frames, rows, columns)
TINY_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=16,
    out_channels=16,
    text_dim=32,  # = the tiny UMT5's d_model
    freq_dim=32,
    ffn_dim=32,
    num_layers=1,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,  # latent frames and patch rows / columns up to 32: 512 px, 125 frames
)
TINY_VAE = dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
TINY_FLOW_SHIFT = 3.0  # Wan2.1's flow shift at 480p


@register_family
class WanBackend(FlowMatchingBackend):
    """WanPipeline (Wan2.1 T2V 1.3B / 14B). CFG when guidance_scale > 1 (the pipeline's default 5.0) against the
    empty negative prompt, as two denoiser calls (cond, uncond) like the pipeline's loop."""

    family = "wan"
    pipeline_classes = ("WanPipeline",)
    denoiser_attr = "transformer"
    denoiser_class = "WanTransformer3DModel"
    default_guidance_scale = 5.0
    default_max_sequence_length = 512  # WanPipeline's
    # self- and cross-attention projections of every block (attn1, attn2), as diffusers' Wan LoRA trainers target
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    tiny_denoiser = TINY_TRANSFORMER
    # WanTransformer3DModel: `blocks` (checkpointed one by one), each self-attention over the video's tokens (attn1),
    # cross-attention to the text (attn2: its keys and values from the text; image-to-video's added keys and values
    # from the CLIP image tokens, which the planner counts among the text tokens), a feed-forward; the time embedding
    # and its projection give one vector per sample.
    plan_layout = Layout(
        blocks=r"blocks\.\d+",
        one=r"condition_embedder\.time_",
        txt=r"condition_embedder\.(text|image)_embedder|attn2\.(to_[kv]|add_[kv]_proj)$",
    )
    # never measured, and no measured class has its cross-attention blocks: a guess
    plan_calibration = NOT_CALIBRATED
    parity_guidance = (1.0, 5.0)
    uses_cfg_encodings = True
    _t5_tokenizer_attr = "tokenizer"
    video = True
    other_schedulers = (
        *FlowMatchingBackend.other_schedulers,
        ("UniPCMultistepScheduler", {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0}),
    )
    default_num_frames = 81  # WanPipeline's: 5 s at 16 fps
    tiny_num_frames = 5  # two latent frames

    def __init__(self, pipe, **kwargs):
        """The pipeline's scheduler is replaced by a FlowMatchEulerDiscreteScheduler with its flow shift."""
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.get("boundary_ratio") is not None:
            raise ImageModelError(
                "WanBackend trains one denoiser: this pipeline has Wan2.2's two experts "
                "(transformer_2 / boundary_ratio); build it with transformer_2=None and "
                "boundary_ratio=None to train its first expert alone"
            )
        if pipe.config.get("expand_timesteps", False):
            raise ImageModelError("WanBackend does not drive Wan2.2 TI2V's per-token timesteps (expand_timesteps)")
        pipe.scheduler = flow_euler_scheduler(pipe.scheduler, self.family)
        if pipe.scheduler.config.get("use_dynamic_shifting", False):
            raise ImageModelError("WanPipeline passes no `mu`: a scheduler with use_dynamic_shifting cannot sample it")
        super().__init__(pipe, **kwargs)

    @classmethod
    def check_model_index(cls, source: str, model_index) -> None:
        """Before any weight is read (preflight and `flowrl plan`): a Wan2.2 pipeline's two experts (transformer_2,
        boundary_ratio) or TI2V's per-token timesteps (expand_timesteps), which this family does not drive."""
        second = model_index.get("transformer_2")
        experts = [f"transformer_2 {second[-1]}"] if isinstance(second, (list, tuple)) and second[0] is not None else []
        if model_index.get("boundary_ratio") is not None:
            experts.append(f"boundary_ratio {model_index['boundary_ratio']}")
        if experts:
            raise ImageModelError(
                f"{source}: model_index.json has Wan2.2's two denoising experts ({', '.join(experts)}); flowrl's "
                f"{cls.family} family trains one transformer: use a one-transformer Wan2.1 {cls.pipeline_classes[0]} "
                "(e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers)"
            )
        if model_index.get("expand_timesteps"):
            raise ImageModelError(
                f"{source}: model_index.json sets expand_timesteps (Wan2.2 TI2V's per-token timesteps), which flowrl's "
                f"{cls.family} family does not drive: use a Wan2.1 {cls.pipeline_classes[0]}"
            )

    @classmethod
    def check_num_frames(cls, num_frames):
        """Wan's VAE compresses time 4x: F = 4k + 1 frames (WanPipeline rounds others; here they are an error)."""
        frames = super().check_num_frames(num_frames)
        if (frames - 1) % 4:
            near = sorted({max(1, (frames - 1) // 4 * 4 + 1), (frames - 1) // 4 * 4 + 5})
            raise ImageModelError(
                f"wan makes 4k + 1 frames (its VAE compresses time 4x), got sample.num_frames="
                f"{frames}; nearest valid: {', '.join(map(str, near))}"
            )
        return frames

    @classmethod
    def tiny_config_files(cls) -> dict[str, dict]:
        files = super().tiny_config_files()
        files["model_index.json"]["vae"] = ["diffusers", "AutoencoderKLWan"]
        files["vae/config.json"] = {"_class_name": "AutoencoderKLWan", "scale_factor_spatial": 8, **TINY_VAE}
        return files

    def pipeline_call_kwargs(self, guidance_scale: float) -> dict:
        return {"guidance_scale": guidance_scale, "max_sequence_length": self.max_sequence_length}

    # ---- prompts ---------------------------------------------------------------------------------

    def _encode_text(self, prompts):
        prompt_embeds, _ = self.pipe.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            num_videos_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return {"prompt_embeds": prompt_embeds}, {}

    # ---- sampling --------------------------------------------------------------------------------

    def _default_image_size(self) -> int:
        return 480  # WanPipeline's default height (its width is 832)

    @classmethod
    def size_rule(cls, denoiser_config, vae_scale_factor):
        """Sides divisible by the VAE's spatial factor x the patch's; latent rows and columns per patch at most the
        transformer's `rope_max_seq_len` (its rotary embedding is precomputed for that many positions)."""
        patch = denoiser_config.get("patch_size", (1, 2, 2))
        multiple = vae_scale_factor * max(patch[1], patch[2])
        rope = denoiser_config.get("rope_max_seq_len")
        if rope is None:
            return SizeRule(cls.family, multiple)
        bound = f"rope_max_seq_len {rope} x patch {patch[1]} x VAE factor {vae_scale_factor}"
        return SizeRule(cls.family, multiple, rope * multiple, bound)

    def _latent_frames(self, num_frames: int) -> int:
        return (num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1

    def _latent_shape(self, settings):
        f = self.pipe.vae_scale_factor_spatial
        return (
            self.denoiser_config.in_channels,
            self._latent_frames(settings.num_frames),
            settings.height // f,
            settings.width // f,
        )

    def _schedule(self, num_steps, settings):
        return self._set_scheduler(num_steps, num_inference_steps=num_steps)  # WanPipeline: no sigmas, no mu

    def _predict(self, x, t, cond, encodings, settings):
        """As WanPipeline's loop: the conditional call, then with CFG the unconditional one (two calls, not one
        batch), mixed as uncond + g (cond - uncond)."""
        x = x.to(self.dtype)
        out = self.denoiser(
            hidden_states=x, timestep=t, encoder_hidden_states=cond["prompt_embeds"].to(self.dtype), return_dict=False
        )[0]
        if settings.guidance_scale > 1:
            negative = self._negative_like(encodings, x.shape[0])["prompt_embeds"].to(self.dtype)
            uncond = self.denoiser(hidden_states=x, timestep=t, encoder_hidden_states=negative, return_dict=False)[0]
            out = uncond + settings.guidance_scale * (out - uncond)
        return out

    def _to_vae_latents(self, latents, height, width):
        """[B, C, F', H', W'] -> what the VAE decodes: latents x std + mean per channel."""
        config = self.pipe.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean, device=latents.device, dtype=torch.float32).view(shape)
        std = torch.tensor(config.latents_std, device=latents.device, dtype=torch.float32).view(shape)
        return latents.float() * std + mean

    @torch.no_grad()
    def decode(self, latents, *, height=None, width=None) -> list:
        """[B, C, F', H', W'] final latents -> B videos, uint8 arrays [F, H, W, 3]."""
        from flowrl.video import as_video

        vae = self.pipe.vae
        video = vae.decode(self._to_vae_latents(latents, height, width).to(vae.device, vae.dtype), return_dict=False)[0]
        frames = self.pipe.video_processor.postprocess_video(video, output_type="np")  # [B, F, H, W, 3] in [0, 1]
        return [as_video(v) for v in frames]

    # ---- the tiny test model ---------------------------------------------------------------------

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        """A WanPipeline: a 1-layer UMT5 encoder over the character tokenizer, a 1-block Wan transformer, the Wan
        VAE of diffusers' own tests (8x space, 4x time), Euler flow matching with Wan2.1's shift."""
        from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

        tok = tiny.t5_tokenizer()
        with tiny.Seeded(seed) as build:
            text_encoder = build(tiny_umt5, tok)
            transformer = build(WanTransformer3DModel, **TINY_TRANSFORMER)
            vae = build(AutoencoderKLWan, **TINY_VAE)
        pipe = WanPipeline(
            tokenizer=tok,
            text_encoder=text_encoder,
            transformer=transformer,
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=TINY_FLOW_SHIFT),
        )
        return tiny.finish(pipe)


def tiny_umt5(tokenizer):
    """The tiny Wan pipelines' text encoder: a 1-layer UMT5 encoder of width 32 over `tokenizer`."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        vocab_size=tiny.vocab_size(tokenizer),
        d_model=32,
        d_kv=8,
        d_ff=37,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return UMT5EncoderModel(config)


def tiny_wan_pipeline(seed: int = 0):
    """The `tiny-wan` pipeline (see WanBackend.tiny_pipeline)."""
    return WanBackend.tiny_pipeline(seed)
