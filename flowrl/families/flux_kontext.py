"""FLUX.1-Kontext (FluxKontextPipeline): FLUX.1-dev's sampling with one source image per prompt. The source's VAE
latents are packed like the generated ones and appended to them along the token sequence, with position ids whose
first axis is 1 instead of 0; the transformer's output on the appended tokens is dropped. Only the generated tokens
are the policy's latents (what is sampled, recorded and scored).

The source image is resized to the sample's height x width before it is encoded, so that every sample of a batch has
as many source tokens (the pipeline keeps the source's own size, snapped to one of its preferred resolutions: pass
`pipe(image=..., **backend.pipeline_condition_kwargs(...))` to sample like a rollout). Kontext's optional true CFG
(`true_cfg_scale` with a negative prompt) is not driven: its guidance is the embedding, as FLUX.1-dev's."""

from __future__ import annotations

import torch

from . import _tiny as tiny
from ._base import register_family
from .flux import FluxBackend, tiny_flux1_parts


@register_family
class FluxKontextBackend(FluxBackend):
    """FluxKontextPipeline (FLUX.1-Kontext-dev): exactly one source image per prompt."""

    family = "flux_kontext"
    pipeline_classes = ("FluxKontextPipeline",)
    default_guidance_scale = 2.5  # FluxKontextPipeline's
    condition_images = (1, 1)
    parity_guidance = (2.5,)

    @classmethod
    def condition_tokens(cls, height, width, tokens_at):
        """The source, resized to the sample's size, appended to the sampled tokens: as many tokens again."""
        return tokens_at(height, width), 0

    def _encode_conditions(self, images, settings, prompts=None):
        """P prompts' source images -> {"image_latents": [P, (h/2)(w/2), 4C]}: each resized to the sample's size,
        VAE-encoded (the distribution's mode, shifted and scaled as the pipeline does) and packed in 2x2 patches."""
        pipe = self.pipe
        h, w = settings.height, settings.width
        sources = [pipe.image_processor.resize(im[0], h, w) for im in images]
        pixels = pipe.image_processor.preprocess(sources, h, w)  # [P, 3, H, W] in [-1, 1]
        vae = pipe.vae
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor  # [P, C, h, w]
        n, c, lh, lw = latents.shape
        return {"image_latents": pipe._pack_latents(latents, n, c, lh, lw).to(self.device, self.dtype)}

    def _predict(self, x, t, cond, encodings, settings):
        """The generated tokens x [N, L, 4C] and the source's [N, L, 4C] as one sequence; the velocity of the
        generated ones [N, L, 4C]."""
        h, w = self._latent_hw(settings.height, settings.width)
        latent_ids = self.pipe._prepare_latent_image_ids(None, h // 2, w // 2, self.device, x.dtype)
        source_ids = latent_ids.clone()
        source_ids[..., 0] = 1  # as the pipeline marks the source's tokens
        guidance = None
        if self.denoiser_config.guidance_embeds:
            guidance = torch.full((x.shape[0],), settings.guidance_scale, device=self.device, dtype=torch.float32)
        out = self.denoiser(
            hidden_states=torch.cat([x, cond["image_latents"].to(x.dtype)], dim=1),
            timestep=t.to(x.dtype) / 1000,
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"],
            encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=encodings.shared["txt_ids"].to(self.device),
            img_ids=torch.cat([latent_ids, source_ids], dim=0),
            return_dict=False,
        )[0]
        return out[:, : x.shape[1]]

    def pipeline_condition_kwargs(self, images, height, width):
        """The source image as a rollout encodes it (resized to height x width), and the output size kept as
        asked: no snapping to Kontext's preferred resolutions, `max_area` the sample's."""
        return {
            "image": self.pipe.image_processor.resize(images[0], height, width),
            "max_area": height * width,
            "_auto_resize": False,
        }

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        """A FluxKontextPipeline of the tiny FLUX.1-dev parts (flux.tiny_flux1_parts: Kontext's transformer is
        FLUX.1's class and config)."""
        from diffusers import FluxKontextPipeline

        pipe = FluxKontextPipeline(**tiny_flux1_parts(seed))
        pipe.default_sample_size = tiny.TINY_IMAGE_SIZE // pipe.vae_scale_factor  # Kontext's is 128 (1024 px)
        return tiny.finish(pipe)


def tiny_flux_kontext_pipeline(seed: int = 0):
    """The `tiny-flux_kontext` pipeline (see FluxKontextBackend.tiny_pipeline)."""
    return FluxKontextBackend.tiny_pipeline(seed)
