"""Wan2.1 image-to-video (WanImageToVideoPipeline): Wan T2V's sampling (`wan.py`) with one first frame per prompt,
given to the transformer twice:
- CLIP vision features of the image (the encoder's second-to-last hidden states), attended to beside the text;
- the VAE latents of a clip whose first frame is the image and whose other frames are zeros, normalised like the
  sampled latents, behind a 4-channel mask marking the first frame's latent positions, concatenated to the sampled
  latents along the channels (16 + 4 + 16 = the transformer's 36 input channels).
Only the 16 sampled channels are the policy's latents. The image is resized to the video's height x width, as the
pipeline does. Wan2.2's I2V (two experts, or TI2V's per-token timesteps) is refused as in `wan.py`; a last frame
(`last_image`) is not driven."""

from __future__ import annotations

import torch

from . import _tiny as tiny
from ._base import register_family
from .wan import TINY_FLOW_SHIFT, TINY_TRANSFORMER, TINY_VAE, WanBackend, tiny_umt5

# the tiny test model's transformer (`tiny-wan_i2v`): Wan T2V's, with the concatenated channels and CLIP features
TINY_I2V_TRANSFORMER = dict(TINY_TRANSFORMER, in_channels=36, image_dim=4)
# the tiny CLIP vision encoder: 32 px in 4 px patches (64 tokens), width 4 (= image_dim)
TINY_IMAGE_ENCODER = dict(
    hidden_size=4,
    projection_dim=4,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    intermediate_size=16,
    patch_size=4,
)


@register_family
class WanImageToVideoBackend(WanBackend):
    """WanImageToVideoPipeline (Wan2.1 I2V 14B 480p / 720p): exactly one first frame per prompt."""

    family = "wan_i2v"
    pipeline_classes = ("WanImageToVideoPipeline",)
    condition_images = (1, 1)
    tiny_denoiser = TINY_I2V_TRANSFORMER

    def _latent_shape(self, settings):
        """[C, F', H', W'] with C the VAE's latent channels (the transformer takes more: the condition's)."""
        _, frames, h, w = super()._latent_shape(settings)
        return (self.pipe.vae.config.z_dim, frames, h, w)

    def _encode_conditions(self, images, settings, prompts=None):
        """P prompts' first frames -> {"image_embeds": [P, T, D] CLIP vision features, "first_frame": [P, 4 + C, F',
        H', W'] the mask and the normalised latents of the image-then-zeros clip}, each image resized to the video's
        size and encoded alone, as the pipeline encodes its one image."""
        pipe = self.pipe
        h, w, frames = settings.height, settings.width, settings.num_frames
        embeds, first = [], []
        for im in images:
            source = pipe.video_processor.resize(im[0], h, w)
            if pipe.image_encoder is not None and self.denoiser_config.image_dim is not None:
                embeds.append(pipe.encode_image(source, self.device))
            pixels = pipe.video_processor.preprocess(source, height=h, width=w).to(self.device, torch.float32)
            first.append(self._first_frame_condition(pixels, frames))
        out = {"first_frame": torch.cat(first)}
        if embeds:
            out["image_embeds"] = torch.cat(embeds).to(self.dtype)
        return out

    def _first_frame_condition(self, pixels, num_frames):
        """[1, 3, H, W] pixels in [-1, 1] -> [1, 4 + C, F', H', W']: the first-frame mask (its latent frame's 4
        sub-frames 1, the rest 0) and the VAE latents of the clip (the image, then num_frames - 1 zero frames),
        normalised by the VAE's per-channel mean and std."""
        pipe, vae = self.pipe, self.pipe.vae
        _, _, h, w = pixels.shape
        clip = torch.cat([pixels.unsqueeze(2), pixels.new_zeros(1, 3, num_frames - 1, h, w)], dim=2)
        latents = vae.encode(clip.to(vae.device, vae.dtype)).latent_dist.mode().to(self.device, torch.float32)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=self.device, dtype=torch.float32).view(shape)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std, device=self.device, dtype=torch.float32).view(shape)
        latents = (latents - mean) * inv_std
        t = pipe.vae_scale_factor_temporal
        lh, lw = latents.shape[-2:]
        mask = torch.zeros(1, 1, num_frames, lh, lw, device=self.device)
        mask[:, :, 0] = 1
        mask = torch.cat([mask[:, :, :1].repeat_interleave(t, dim=2), mask[:, :, 1:]], dim=2)  # [1, 1, F + t - 1, ..]
        mask = mask.view(1, -1, t, lh, lw).transpose(1, 2)  # [1, t, F', H', W']
        return torch.cat([mask, latents], dim=1)

    def _predict(self, x, t, cond, encodings, settings):
        """As WanImageToVideoPipeline's loop: the sampled latents with the first-frame condition on the channels, the
        CLIP features beside the text, CFG as two calls (the image features in both)."""
        x_in = torch.cat([x.float(), cond["first_frame"].float()], dim=1).to(self.dtype)
        image = cond.get("image_embeds")
        image = None if image is None else image.to(self.dtype)
        out = self.denoiser(
            hidden_states=x_in,
            timestep=t,
            encoder_hidden_states=cond["prompt_embeds"].to(self.dtype),
            encoder_hidden_states_image=image,
            return_dict=False,
        )[0]
        if settings.guidance_scale > 1:
            negative = self._negative_like(encodings, x.shape[0])["prompt_embeds"].to(self.dtype)
            uncond = self.denoiser(
                hidden_states=x_in,
                timestep=t,
                encoder_hidden_states=negative,
                encoder_hidden_states_image=image,
                return_dict=False,
            )[0]
            out = uncond + settings.guidance_scale * (out - uncond)
        return out

    def pipeline_batches(self, prompts, per_prompt):
        """Each prompt repeated, one video each: WanImageToVideoPipeline (diffusers 0.42) repeats the image features
        once per prompt, not per video, so `num_videos_per_prompt` > 1 fails in its transformer call."""
        return [{"prompt": [p for p in prompts for _ in range(per_prompt)], "num_videos_per_prompt": 1}]

    def pipeline_condition_kwargs(self, images, height, width):
        """The first frame, resized to the video's size as a rollout resizes it."""
        return {"image": self.pipe.video_processor.resize(images[0], height, width)}

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        """A WanImageToVideoPipeline: the tiny Wan T2V parts, a transformer taking 36 channels and 4-wide image
        features, a 2-layer CLIP vision encoder over 32 px in 4 px patches."""
        from diffusers import (
            AutoencoderKLWan,
            FlowMatchEulerDiscreteScheduler,
            WanImageToVideoPipeline,
            WanTransformer3DModel,
        )
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

        tok = tiny.t5_tokenizer()
        with tiny.Seeded(seed) as build:
            text_encoder = build(tiny_umt5, tok)
            transformer = build(WanTransformer3DModel, **TINY_I2V_TRANSFORMER)
            vae = build(AutoencoderKLWan, **TINY_VAE)
            image_encoder = build(CLIPVisionModelWithProjection, CLIPVisionConfig(**TINY_IMAGE_ENCODER))
        size = TINY_IMAGE_ENCODER["image_size"]
        pipe = WanImageToVideoPipeline(
            tokenizer=tok,
            text_encoder=text_encoder,
            vae=vae,
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=TINY_FLOW_SHIFT),
            image_encoder=image_encoder,
            image_processor=CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}),
        )
        return tiny.finish(pipe)


def tiny_wan_i2v_pipeline(seed: int = 0):
    """The `tiny-wan_i2v` pipeline (see WanImageToVideoBackend.tiny_pipeline)."""
    return WanImageToVideoBackend.tiny_pipeline(seed)
