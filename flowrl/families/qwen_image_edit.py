"""Qwen-Image-Edit-Plus (QwenImageEditPlusPipeline: Qwen-Image-Edit-2509 / -2511): Qwen-Image's sampling
(`qwen_image.py`) with one to three source images per prompt, given to the model twice:
- the instruction is encoded by Qwen2.5-VL together with the images ("Picture k: <|vision_start|><|image_pad|>...
  <|vision_end|>" before the prompt, in the editing template whose first 64 tokens are dropped), each image resized
  to about 384 x 384 pixels (`CONDITION_IMAGE_SIZE`) at its aspect ratio. The negative prompt of true CFG (" ") is
  encoded with the same images, so both encodings are per prompt and its images, kept with the samples
  (`traj.conditions`), not in the text cache;
- the VAE latents of each image resized to about 1024 x 1024 pixels (`VAE_IMAGE_SIZE`), packed like the sampled
  ones and appended to them along the token sequence, with their own grid in `img_shapes`; the transformer's output
  on the appended tokens is dropped. Only the sampled tokens are the policy's latents.

The pipeline samples one prompt per call (`pipeline_batches`). A rollout's rows may hold different numbers of source
images of different shapes: the encodings are padded to fixed lengths (the instruction to max_sequence_length plus a
budget per image; the source tokens to a budget per image) so that any batches stack, and `_predict` runs the rows
of each source layout together, cut back to their real tokens."""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from . import _tiny as tiny
from ._base import register_family
from .qwen_image import PACK, TINY_TRANSFORMER, QwenImageBackend, _tiny_text_encoder, tiny_qwen_tokenizer

#: the share by which an image's token count may exceed its nominal area's (the pipeline rounds each side to 32 px,
#: the Qwen2-VL processor to 28 px): the padding budget per image; a longer encoding is an error naming it
_SLACK = 1.25
_SOURCE_CACHE = 64  # source images whose VAE latents are kept (see _cached_source_latents)
_SOURCES: OrderedDict = OrderedDict()
_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
#: the tiny VAE: AutoencoderKLQwenImage compressing 16x (four downsamplings, two of them spatial-only), so that the
#: pipeline's ~1 megapixel sources are 32 x 32 packed tokens (the real 8x VAE makes 64 x 64) and cheap to attend to
TINY_EDIT_VAE = dict(
    base_dim=2,
    z_dim=4,
    dim_mult=[1, 1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, False, True, True],
    latents_mean=[0.1, -0.2, 0.3, 0.0],
    latents_std=[1.5, 0.8, 1.2, 2.0],
)
#: the tiny processor's largest image: 56 x 56 pixels, 4 x 4 patches of 14, merged 2 x 2 into 4 image tokens
TINY_MAX_PIXELS = 56 * 56


def _pipeline_module():
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    return pipeline_qwenimage_edit_plus


@register_family
class QwenImageEditPlusBackend(QwenImageBackend):
    """QwenImageEditPlusPipeline (Qwen/Qwen-Image-Edit-2509, -2511): one to three source images per prompt (the
    model card's range), true CFG as Qwen-Image's."""

    family = "qwen_image_edit"
    pipeline_classes = ("QwenImageEditPlusPipeline",)
    condition_images = (1, 3)
    tiny_denoiser = TINY_TRANSFORMER
    parity_guidance = (4.0,)  # with true CFG: its conditional pass is the CFG-free one (each source costs a VAE pass)

    @classmethod
    def condition_tokens(cls, height, width, tokens_at):
        """Each source at about VAE_IMAGE_SIZE pixels appended to the sampled tokens, and at about
        CONDITION_IMAGE_SIZE pixels in the instruction's encoding (Qwen2-VL's 28 x 28 pixels per merged token, its
        "Picture k: <|vision_start|>...<|vision_end|>" words), whatever the sample's size."""
        module = _pipeline_module()
        side = int(math.sqrt(module.VAE_IMAGE_SIZE))
        return tokens_at(side, side), math.ceil(module.CONDITION_IMAGE_SIZE / 28**2) + 8

    # ---- budgets -------------------------------------------------------------------------------

    def _vision_budget(self) -> int:
        """Instruction tokens one image may add: its image tokens at the processor's patch and merge sizes for an
        image of CONDITION_IMAGE_SIZE pixels (or the processor's max_pixels, if less), with slack, and its
        "Picture k: <|vision_start|>...<|vision_end|>" words."""
        ip = self.pipe.processor.image_processor
        limit = getattr(ip, "max_pixels", None) or getattr(getattr(ip, "size", None), "longest_edge", None)
        pixels = min(_pipeline_module().CONDITION_IMAGE_SIZE, limit or math.inf)
        per_token = (ip.patch_size * ip.merge_size) ** 2
        return math.ceil(_SLACK * pixels / per_token) + 8

    def _text_length(self) -> int:
        """The instruction encodings' padded length: max_sequence_length for the prompt, a budget per image."""
        return self.max_sequence_length + self.condition_images[1] * self._vision_budget()

    def _source_budget(self) -> int:
        """Source tokens one image may add: VAE_IMAGE_SIZE pixels in packed 2x2 latent patches, with slack."""
        f = self.pipe.vae_scale_factor * PACK
        return math.ceil(_SLACK * _pipeline_module().VAE_IMAGE_SIZE / f**2)

    # ---- prompts and images ----------------------------------------------------------------------

    def _encode_text(self, prompts):
        """Nothing per prompt alone: the instruction is encoded with its images (`_encode_conditions`)."""
        return {}, {}

    def _encode_conditions(self, images, settings, prompts=None):
        """P prompts' texts and source images -> {"edit_embeds" [P, T, D], "edit_mask" [P, T] (and, for true CFG,
        "edit_negative_embeds" / "edit_negative_mask": the negative prompt with the same images), "source_latents"
        [P, S, 4C] (zero past the real tokens), "source_shapes" [P, 3, 2] (each image's packed grid, 0 0 for
        none)}, T and S the fixed budgets."""
        if prompts is None or len(prompts) != len(images):
            raise ValueError(f"{self.family} encodes each prompt with its images: give rollout the prompts' texts")
        rows = [self._encode_one(p, list(ims), settings.guidance_scale > 1) for p, ims in zip(prompts, images)]
        return {name: torch.cat([r[name] for r in rows]) for name in rows[0]}

    def _encode_one(self, prompt: str, images: list, negative: bool) -> dict[str, torch.Tensor]:
        """One prompt's conditions (see `_encode_conditions`), as QwenImageEditPlusPipeline computes them."""
        module, pipe = _pipeline_module(), self.pipe
        vl_images, sources, shapes = [], [], torch.zeros(self.condition_images[1], 2, dtype=torch.long)
        for k, im in enumerate(images):
            width, height = im.size
            w, h = module.calculate_dimensions(module.CONDITION_IMAGE_SIZE, width / height)
            vl_images.append(pipe.image_processor.resize(im, h, w))
            w, h = module.calculate_dimensions(module.VAE_IMAGE_SIZE, width / height)
            sources.append(self._cached_source_latents(im, h, w))
            f = pipe.vae_scale_factor * PACK
            shapes[k] = torch.tensor([h // f, w // f])
        out = self._instruction(prompt, vl_images, "edit")
        if negative:
            out.update(self._instruction(self.negative_prompt, vl_images, "edit_negative"))
        source = torch.cat(sources, dim=1)  # [1, S_real, 4C]
        budget = self.condition_images[1] * self._source_budget()
        if source.shape[1] > budget:
            raise ValueError(
                f"{self.family}: the source images make {source.shape[1]} latent tokens, more than the "
                f"budget of {budget}; use images of a less extreme aspect ratio"
            )
        padded = source.new_zeros((1, budget, source.shape[2]))
        padded[:, : source.shape[1]] = source
        out.update(source_latents=padded, source_shapes=shapes[None].to(self.device))
        return out

    def _instruction(self, text: str, vl_images: list, name: str) -> dict[str, torch.Tensor]:
        """The VL encoding of `text` with the images: {name_embeds [1, T, D], name_mask [1, T]}, zero-padded to T."""
        embeds, mask = self.pipe.encode_prompt(
            prompt=[text], image=vl_images, device=self.device, num_images_per_prompt=1
        )
        _, length, dim = embeds.shape
        if mask is None:
            mask = torch.ones((1, length), dtype=torch.long, device=embeds.device)
        size = self._text_length()
        if length > size:
            raise ValueError(
                f"{self.family}: the instruction {text!r} with its images is {length} tokens, more than "
                f"{size} (sample.max_sequence_length={self.max_sequence_length} for the prompt and "
                f"{self._vision_budget()} per image): raise sample.max_sequence_length"
            )
        padded = embeds.new_zeros((1, size, dim))
        padded[:, :length] = embeds
        padded_mask = mask.new_zeros((1, size))
        padded_mask[:, :length] = mask
        return {f"{name}_embeds": padded, f"{name}_mask": padded_mask}

    def _cached_source_latents(self, image, height: int, width: int) -> torch.Tensor:
        """`_source_latents` of a PIL image resized to height x width, kept (per process, for the last _SOURCE_CACHE
        images) by the image's pixels and the VAE's weights: a prompt's sources are encoded at ~1 megapixel each
        time it is drawn otherwise."""
        import hashlib

        key = (
            self._vae_fingerprint(),
            hashlib.sha1(image.tobytes()).hexdigest(),
            image.size,
            image.mode,
            height,
            width,
            str(self.device),
            self.dtype,
        )
        if key not in _SOURCES:
            pixels = self.pipe.image_processor.preprocess(image, height, width).unsqueeze(2)
            _SOURCES[key] = self._source_latents(pixels)
            while len(_SOURCES) > _SOURCE_CACHE:
                _SOURCES.popitem(last=False)
        _SOURCES.move_to_end(key)
        return _SOURCES[key]

    def _vae_fingerprint(self) -> str:
        """A hash of the VAE's weights (computed once per backend: they are never trained)."""
        import hashlib

        if getattr(self, "_vae_hash", None) is None:
            digest = hashlib.sha1()
            for name, tensor in sorted(self.pipe.vae.state_dict().items()):
                digest.update(name.encode())
                digest.update(tensor.detach().float().cpu().numpy().tobytes())
            self._vae_hash = digest.hexdigest()
        return self._vae_hash

    def _source_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, 3, 1, H, W] pixels in [-1, 1] -> [1, (h/2)(w/2), 4C]: the VAE's mode, normalised per channel, packed."""
        vae = self.pipe.vae
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()  # [1, C, 1, h, w]
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = ((latents - mean) / std).to(self.device, self.dtype)
        _, c, _, h, w = latents.shape
        return self.pipe._pack_latents(latents, 1, c, h, w)

    # ---- the denoiser ----------------------------------------------------------------------------

    def _predict(self, x, t, cond, encodings, settings):
        """Rows with one source layout at a time: the sampled tokens [n, L, 4C] and the sources' real tokens as one
        sequence, `img_shapes` the generated grid then each source's; true CFG with the negative instruction (the
        same images), rescaled as Qwen-Image's. Returns [N, L, 4C]."""
        out = torch.empty_like(x)
        shapes = cond["source_shapes"]
        layouts = {}
        for i, row in enumerate(shapes.tolist()):
            layouts.setdefault(tuple(map(tuple, row)), []).append(i)
        for layout, rows in layouts.items():
            idx = torch.tensor(rows, device=x.device)
            out[idx] = self._predict_layout(x[idx], t[idx], {k: v[idx] for k, v in cond.items()}, layout, settings)
        return out

    def _predict_layout(self, x, t, cond, layout, settings):
        """`_predict` for n rows sharing one source layout (each image's packed grid, (0, 0) for none): x [n, L, 4C],
        t [n] -> [n, L, 4C]."""
        n, length = x.shape[0], x.shape[1]
        h, w = self._latent_hw(settings.height, settings.width)
        sources = [(1, a, b) for a, b in layout if a]
        img_shapes = [[(1, h // PACK, w // PACK), *sources]] * n
        real = sum(a * b for _, a, b in sources)
        hidden = torch.cat([x, cond["source_latents"][:, :real].to(x.dtype)], dim=1)
        timestep = t.to(x.dtype) / 1000
        text = self._text({"prompt_embeds": cond["edit_embeds"], "prompt_embeds_mask": cond["edit_mask"]})
        pred = self._forward(hidden, timestep, *text, img_shapes)[:, :length]
        if settings.guidance_scale > 1:
            if "edit_negative_embeds" not in cond:
                raise ValueError(
                    f"{self.family}: true CFG needs the negative instruction, encoded when the rollout's "
                    f"guidance_scale is > 1"
                )
            negative = self._text(
                {"prompt_embeds": cond["edit_negative_embeds"], "prompt_embeds_mask": cond["edit_negative_mask"]}
            )
            neg = self._forward(hidden, timestep, *negative, img_shapes)[:, :length]
            combined = neg + settings.guidance_scale * (pred - neg)
            pred = combined * (torch.norm(pred, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
        return pred

    # ---- sampling with diffusers -----------------------------------------------------------------

    def pipeline_batches(self, prompts, per_prompt):
        """One call per prompt: QwenImageEditPlusPipeline takes one prompt at a time."""
        return [{"prompt": [p], "num_images_per_prompt": per_prompt} for p in prompts]

    def pipeline_call_kwargs(self, guidance_scale, num_prompts=None):
        """Qwen-Image's, for the pipeline's one prompt per call."""
        return super().pipeline_call_kwargs(guidance_scale, num_prompts=1)

    def pipeline_condition_kwargs(self, images, height, width):
        """The source images as they are: the pipeline resizes them as a rollout does."""
        return {"image": list(images)}

    # ---- the tiny model --------------------------------------------------------------------------

    @classmethod
    def tiny_config_files(cls):
        files = super().tiny_config_files()
        files["vae/config.json"] = {"_class_name": "AutoencoderKLQwenImage", **TINY_EDIT_VAE}
        return files

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        """A QwenImageEditPlusPipeline: the tiny Qwen-Image parts with a tokenizer whose editing-template words are
        single tokens (its 64 dropped tokens are the template's) plus the vision tokens, a Qwen2-VL processor
        shrinking every image to at most 56 x 56 pixels (a few image tokens), and a 16x VAE."""
        from diffusers import (
            AutoencoderKLQwenImage,
            FlowMatchEulerDiscreteScheduler,
            QwenImageEditPlusPipeline,
            QwenImageTransformer2DModel,
        )
        from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

        prefix, suffix = _edit_template()
        words = "".join(f"Picture {k}: " for k in range(1, 4))
        tokenizer = tiny_qwen_tokenizer(
            prefix + words + suffix, ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *_VISION_TOKENS)
        )
        ids = {
            name: tokenizer.convert_tokens_to_ids(token)
            for name, token in [
                ("image_token_id", "<|image_pad|>"),
                ("video_token_id", "<|video_pad|>"),
                ("vision_start_token_id", "<|vision_start|>"),
            ]
        }
        with tiny.Seeded(seed) as build:
            text_encoder = build(_tiny_text_encoder, tokenizer, **ids)
            transformer = build(QwenImageTransformer2DModel, **TINY_TRANSFORMER)
            vae = build(AutoencoderKLQwenImage, **TINY_EDIT_VAE)
        pixels = dict(min_pixels=28 * 28, max_pixels=TINY_MAX_PIXELS)
        processor = Qwen2VLProcessor(
            image_processor=Qwen2VLImageProcessor(**pixels),
            tokenizer=tokenizer,
            video_processor=Qwen2VLVideoProcessor(**pixels),
        )  # videos: never given
        scheduler = FlowMatchEulerDiscreteScheduler(
            base_image_seq_len=256,
            base_shift=0.5,
            max_image_seq_len=8192,
            max_shift=0.9,
            num_train_timesteps=1000,
            shift=1.0,
            shift_terminal=0.02,
            time_shift_type="exponential",
            use_dynamic_shifting=True,
        )
        pipe = QwenImageEditPlusPipeline(
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            processor=processor,
            transformer=transformer,
        )
        dropped = len(tokenizer(prefix).input_ids)
        if dropped != pipe.prompt_template_encode_start_idx or not pipe.prompt_template_encode.startswith(prefix):
            raise RuntimeError(
                f"QwenImageEditPlusPipeline's template changed: it drops "
                f"{pipe.prompt_template_encode_start_idx} tokens, the tiny tokenizer makes {dropped}"
            )
        pipe.default_sample_size = tiny.TINY_IMAGE_SIZE // pipe.vae_scale_factor
        return tiny.finish(pipe)


def _edit_template() -> tuple[str, str]:
    """QwenImageEditPlusPipeline's prompt template, split around the instruction: read from a pipeline built without
    components (its __init__ sets the template), so that the tiny tokenizer follows it."""
    from diffusers import QwenImageEditPlusPipeline

    bare = QwenImageEditPlusPipeline(None, None, None, None, None, None)
    prefix, suffix = bare.prompt_template_encode.split("{}")
    return prefix, suffix


def tiny_qwen_image_edit_pipeline(seed: int = 0):
    """The `tiny-qwen_image_edit` pipeline (see QwenImageEditPlusBackend.tiny_pipeline)."""
    return QwenImageEditPlusBackend.tiny_pipeline(seed)
