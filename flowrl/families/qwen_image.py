"""Qwen-Image (QwenImagePipeline: Qwen-Image, Qwen-Image-2512): flow matching with true CFG and a norm rescale, a
Qwen2.5-VL text encoder behind a fixed prompt template, an MMDiT transformer on packed 2x2 latents, a video-style
VAE; sampled with flow_sde_step.

What differs from SD3 / FLUX, all mirrored from `QwenImagePipeline.__call__`:
- the prompt embedding is Qwen2.5-VL's last hidden state of the templated prompt ("<|im_start|>system\\nDescribe
  the image by ...<|im_end|>\\n<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n") with its real
  tokens only and the template's first 34 tokens dropped (`prompt_template_encode_start_idx`); a batch is padded
  to its longest prompt, with a mask. Kept here as `prompt_embeds` [P, max_sequence_length, D] (zero past each
  prompt's length) and `prompt_embeds_mask` [P, max_sequence_length], and cut back before the transformer to the
  longest prompt of the rows it runs on; the mask is left out (None) when those rows are all full, as
  `encode_prompt` does. Its encode_prompt pairs each prompt's embeddings with another prompt's mask when
  num_images_per_prompt > 1: the backend makes it repeat the masks per prompt (see `encode_prompt_per_prompt`);
- true CFG: a second forward with the negative prompt's encoding (Flow-GRPO's and the model card's " "), then
  `neg + g (cond - neg)` rescaled per token to the norm of the conditional prediction (over the packed channels),
  on when g > 1. The guidance scale here is the pipeline's `true_cfg_scale` (its `guidance_scale` is for
  guidance-distilled transformers, which Qwen-Image is not). `pipe(prompts, ...)` needs the negative prompt once
  per prompt (a single string is not repeated over a list of prompts): `pipeline_call_kwargs` gives that list;
- latents are packed 2x2 patches [B, (h/2)(w/2), 4C], drawn as [B, 1, C, h, w] (a frame axis) then packed; the
  transformer takes `img_shapes` [(1, h/2, w/2)] per sample and the timestep t / 1000;
- the sigmas are linspace(1, 1/S, S) shifted with `mu` from the packed sequence length (and the scheduler's
  `shift_terminal`, Qwen-Image's 0.02);
- the VAE (AutoencoderKLQwenImage) decodes [B, C, 1, h, w] latents un-normalised by its per-channel
  `latents_mean` / `latents_std`, and returns a frame axis the images drop.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from flowrl.plan.declarations import Layout

from . import _tiny as tiny
from ._base import SizeRule, encode_prompt_per_prompt, register_family
from ._flow import FlowMatchingBackend
from .flux import FluxBackend

# QwenImagePipeline packs the latents in 2x2 patches whatever the transformer's patch_size says
PACK = 2
# QwenEmbedRope's table has 4096 positions; the text's run from max(grid height, grid width) / 2 on, and a prompt
# has at most QwenImagePipeline.tokenizer_max_length = 1024 tokens (after the dropped template tokens)
_ROPE_POSITIONS = 4096
_MAX_PROMPT_TOKENS = 1024

# the tiny test model's transformer (`tiny-qwen_image`)
TINY_TRANSFORMER = dict(
    patch_size=2,
    in_channels=16,  # 4 latent channels x a 2x2 patch
    out_channels=4,
    num_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,  # = the tiny Qwen2.5-VL's hidden size
    guidance_embeds=False,
    axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
)
# its VAE: one 2x spatial downsampling (no temporal one), 4 latent channels with a per-channel mean and std
TINY_VAE = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2],
    num_res_blocks=1,
    temperal_downsample=[False],
    latents_mean=[0.1, -0.2, 0.3, 0.0],
    latents_std=[1.5, 0.8, 1.2, 2.0],
)
TINY_TEXT_HIDDEN = TINY_TRANSFORMER["joint_attention_dim"]

# QwenImagePipeline's prompt template up to the prompt: the tiny tokenizer makes it the same 34 tokens as Qwen's
# (the pipeline drops that many), one per word, space-led word and punctuation mark
_TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
_TEMPLATE_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def tiny_qwen_tokenizer(
    template: str = _TEMPLATE_PREFIX + _TEMPLATE_SUFFIX, special_tokens: tuple[str, ...] = _SPECIAL_TOKENS
):
    """A byte-level Qwen2Tokenizer (Qwen2.5-VL's class) over the 256 byte symbols, with merges that make each
    word of a pipeline's prompt `template` one token (QwenImagePipeline's by default, so that its 34 dropped
    template tokens are the template's, as with Qwen's own vocabulary); other words are split into pieces.
    `special_tokens` (the first, <|endoftext|>, pads) are single tokens."""
    import re

    from tokenizers import AddedToken, pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {token: i for i, token in enumerate(special_tokens)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    splitter = Qwen2Tokenizer(vocab=dict(vocab), merges=[])._tokenizer.pre_tokenizer
    special = "|".join(re.escape(t) for t in special_tokens)
    pieces = [piece for text in re.split(special, template) for piece, _ in splitter.pre_tokenize_str(text)]
    merges = []
    for piece in sorted(dict.fromkeys(pieces), key=len, reverse=True):  # longer words first: their merges win
        for i in range(1, len(piece)):
            head, merged = piece[:i], piece[: i + 1]
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((head, piece[i]))
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_tokens([AddedToken(token, special=True) for token in special_tokens[1:]])
    return tokenizer


def _tiny_text_encoder(tokenizer, **token_ids):
    """A Qwen2_5_VLForConditionalGeneration with one decoder layer (the pipeline reads the last hidden state) and
    a one-block vision tower (run by the editing pipelines only, whose `token_ids` say where the image tokens
    are: image_token_id, video_token_id, vision_start_token_id)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab_size = tiny.vocab_size(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": TINY_TEXT_HIDDEN,
            "intermediate_size": 37,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": vocab_size,
            "max_position_embeddings": 2048,
            "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},  # head dim 16
            "rope_theta": 1000000.0,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": None,
            "eos_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": TINY_TEXT_HIDDEN,
        },
        vocab_size=vocab_size,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.pad_token_id,
        **token_ids,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


@register_family
class QwenImageBackend(FlowMatchingBackend):
    """QwenImagePipeline (Qwen/Qwen-Image, Qwen/Qwen-Image-2512). True CFG with the pipeline's norm rescale when
    guidance_scale > 1 (the pipeline's `true_cfg_scale`; a second forward with the negative prompt " "). Latents
    are packed 2x2 patches [B, (h/2)(w/2), 4C], the layout the transformer consumes."""

    family = "qwen_image"
    pipeline_classes = ("QwenImagePipeline",)
    denoiser_attr = "transformer"
    denoiser_class = "QwenImageTransformer2DModel"
    # Flow-GRPO's Qwen-Image recipe (config/grpo.py: pickscore_qwenimage) and Flow-Factory's
    # (examples/grpo/lora/qwen_image/default.yaml) sample with true_cfg_scale 4, the pipeline's own default
    default_guidance_scale = 4.0
    # the attention projections of both streams: diffusers' train_dreambooth_lora_qwen_image.py default, and the
    # attention part of Flow-GRPO's and Flow-Factory's lists (which add the MLPs: the preset lists them)
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
    plan_layout = Layout(
        blocks=r"transformer_blocks\.\d+",
        one=r"time_text_embed|_mod\.|norm_out\.linear",
        txt=r"txt_|attn\.add_|to_add_out",
    )
    # not measured yet: FLUX.1's factors (double-stream blocks with RoPE, as FLUX.1's)
    plan_calibration = FluxBackend.plan_calibration.borrowed(FluxBackend.denoiser_class, denoiser_class)
    parity_guidance = (1.0, 4.0)  # without true CFG and with it (the recipes' 4)
    default_max_sequence_length = 512  # QwenImagePipeline.__call__'s default
    uses_cfg_encodings = True
    #: the negative prompt of true CFG: Flow-GRPO's (train_qwenimage.py: `negative_prompt=[" "] * len(prompts)`)
    #: and the model card's
    negative_prompt: ClassVar[str] = " "

    def __init__(self, pipe, **kwargs):
        if pipe.transformer.config.get("guidance_embeds", False):
            raise ValueError(
                "guidance-distilled Qwen-Image transformers (guidance_embeds=True) are not supported: "
                "this backend's guidance_scale is the pipeline's true_cfg_scale"
            )
        encode_prompt_per_prompt(pipe)
        super().__init__(pipe, **kwargs)
        self._num_prompts = 1  # the prompts of the last rollout (see pipeline_call_kwargs)

    # ---- prompts ---------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts):
        # the unconditional encoding is the negative prompt's, not the base class's ""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self._num_prompts = len(prompts)
        if self._negative is None:
            self._negative, _ = self._encode([self.negative_prompt])
        return super().encode_prompts(prompts)

    def _encode_text(self, prompts):
        embeds, mask = self.pipe.encode_prompt(
            list(prompts), device=self.device, num_images_per_prompt=1, max_sequence_length=self.max_sequence_length
        )
        n, length, dim = embeds.shape
        if mask is None:  # encode_prompt drops an all-ones mask
            mask = torch.ones((n, length), dtype=torch.long, device=embeds.device)
        # every prompt padded to max_sequence_length (zeros, mask 0), so that encodings of any calls stack
        size = max(self.max_sequence_length, length)
        padded = embeds.new_zeros((n, size, dim))
        padded[:, :length] = embeds
        padded_mask = mask.new_zeros((n, size))
        padded_mask[:, :length] = mask
        return {"prompt_embeds": padded, "prompt_embeds_mask": padded_mask}, {}

    @staticmethod
    def _text(cond: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows' embeddings and mask cut to their longest prompt, as encode_prompt pads a batch; the mask
        None when every row is full (encode_prompt's `if prompt_embeds_mask.all(): None`)."""
        mask = cond["prompt_embeds_mask"]
        length = max(int(mask.sum(dim=1).max()), 1)
        embeds, mask = cond["prompt_embeds"][:, :length], mask[:, :length]
        return embeds, (None if bool(mask.all()) else mask)

    # ---- sizes and noise -------------------------------------------------------------------------

    def _default_image_size(self) -> int:
        return self.pipe.default_sample_size * self.pipe.vae_scale_factor  # QwenImagePipeline: 128 x 8 = 1024

    @classmethod
    def size_rule(cls, denoiser_config, vae_scale_factor):
        """Sides divisible by VAE factor x 2 (the pipeline packs 2x2 latent patches), and at most what the
        transformer's RoPE table (4096 positions) holds: the text's positions follow half the longer grid side,
        for prompts of up to 1024 tokens."""
        multiple = vae_scale_factor * PACK
        grid = 2 * (_ROPE_POSITIONS - _MAX_PROMPT_TOKENS)
        bound = (
            f"RoPE table of {_ROPE_POSITIONS} positions: {grid} packed patches a side for "
            f"{_MAX_PROMPT_TOKENS} prompt tokens, x 2 x VAE factor {vae_scale_factor}"
        )
        return SizeRule(cls.family, multiple, grid * multiple, bound)

    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        f = self.pipe.vae_scale_factor
        return PACK * (height // (f * PACK)), PACK * (width // (f * PACK))

    def _latent_shape(self, settings):
        h, w = self._latent_hw(settings.height, settings.width)
        return ((h // PACK) * (w // PACK), self.denoiser_config.in_channels)

    def _initial_noise(self, n, settings, generator):
        # prepare_latents: randn_tensor([n, 1, C, h, w]) in the prompt embeddings' dtype, then packed
        from diffusers.utils.torch_utils import randn_tensor

        h, w = self._latent_hw(settings.height, settings.width)
        channels = self.denoiser_config.in_channels // (PACK * PACK)
        dtype = self.pipe.text_encoder.dtype if self.pipe.text_encoder is not None else self.dtype
        noise = randn_tensor((n, 1, channels, h, w), generator=generator, device=self.device, dtype=dtype)
        noise = self.pipe._pack_latents(noise, n, channels, h, w)
        return noise.to(device=self.device, dtype=self.dtype)

    # ---- steps -----------------------------------------------------------------------------------

    def _schedule(self, num_steps, settings):
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        config = self.pipe.scheduler.config
        h, w = self._latent_hw(settings.height, settings.width)
        mu = calculate_shift(
            (h // PACK) * (w // PACK),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)  # as QwenImagePipeline does
        return self._set_scheduler(num_steps, sigmas=sigmas, mu=mu)

    def _forward(self, x, timestep, embeds, mask, img_shapes):
        return self.denoiser(
            hidden_states=x,
            timestep=timestep,
            guidance=None,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=embeds,
            img_shapes=img_shapes,
            return_dict=False,
        )[0]

    def _predict(self, x, t, cond, encodings, settings):
        n = x.shape[0]
        h, w = self._latent_hw(settings.height, settings.width)
        img_shapes = [[(1, h // PACK, w // PACK)]] * n
        timestep = t.to(x.dtype) / 1000  # QwenImagePipeline: t.expand(B).to(latents.dtype) / 1000
        out = self._forward(x, timestep, *self._text(cond), img_shapes)
        if settings.guidance_scale > 1:  # true CFG: a second forward, then the norm rescale
            negative = self._text(self._negative_like(encodings, n))
            neg = self._forward(x, timestep, *negative, img_shapes)
            combined = neg + settings.guidance_scale * (out - neg)
            cond_norm = torch.norm(out, dim=-1, keepdim=True)
            noise_norm = torch.norm(combined, dim=-1, keepdim=True)
            out = combined * (cond_norm / noise_norm)
        return out

    # ---- decoding --------------------------------------------------------------------------------

    def _to_vae_latents(self, latents, height, width):
        f = self.pipe.vae_scale_factor
        if height is None or width is None:
            side = int(round(latents.shape[1] ** 0.5)) * PACK * f
            if (side // (PACK * f)) ** 2 != latents.shape[1]:
                raise ValueError("Qwen-Image latents are packed: pass height and width to decode non-square images")
            height, width = height or side, width or side
        vae = self.pipe.vae
        latents = self.pipe._unpack_latents(latents, height, width, f).to(vae.dtype)  # [B, C, 1, h, w]
        config = vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        return latents / std + mean

    def _vae_encode(self, pixels):
        """The video VAE takes one frame: [B, 3, 1, H, W] -> [B, C, 1, h, w]."""
        return super()._vae_encode(pixels[:, :, None])

    def _from_vae_latents(self, latents, height, width):
        """Normalised per channel (latents_mean, latents_std) and packed in 2x2 patches, as Qwen-Image-Edit's
        source images are (`_source_latents`)."""
        config = self.pipe.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = (latents - mean) / std
        n, c, _, h, w = latents.shape
        return self.pipe._pack_latents(latents, n, c, h, w)

    @torch.no_grad()
    def decode(self, latents, *, height=None, width=None):
        vae = self.pipe.vae
        image = vae.decode(self._to_vae_latents(latents, height, width).to(vae.device, vae.dtype), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image[:, :, 0], output_type="pil")  # the frame axis dropped

    # ---- sampling with diffusers -----------------------------------------------------------------

    def pipeline_call_kwargs(self, guidance_scale: float, num_prompts: int | None = None) -> dict:
        """`pipe(prompts, ...)`'s true CFG: `true_cfg_scale` and, when it is > 1, the negative prompt once per
        prompt (QwenImagePipeline does not repeat a single negative prompt over a list of prompts).
        num_prompts: how many prompts `pipe` gets; default: as many as this backend's last rollout had."""
        kwargs = {
            "true_cfg_scale": guidance_scale,
            "guidance_scale": None,
            "max_sequence_length": self.max_sequence_length,
        }
        if guidance_scale > 1:
            kwargs["negative_prompt"] = [self.negative_prompt] * (num_prompts or self._num_prompts)
        return kwargs

    # ---- the tiny model --------------------------------------------------------------------------

    @classmethod
    def tiny_config_files(cls) -> dict[str, dict]:
        return {
            "model_index.json": {
                "_class_name": cls.pipeline_classes[0],
                "transformer": ["diffusers", cls.denoiser_class],
                "vae": ["diffusers", "AutoencoderKLQwenImage"],
            },
            "transformer/config.json": {"_class_name": cls.denoiser_class, **TINY_TRANSFORMER},
            "vae/config.json": {"_class_name": "AutoencoderKLQwenImage", **TINY_VAE},
        }

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        """A QwenImagePipeline: a one-layer Qwen2.5-VL behind a byte-level Qwen2Tokenizer whose template tokens
        are Qwen's, a one-block transformer, a 4-channel AutoencoderKLQwenImage with one downsampling, and
        Qwen-Image's scheduler settings (dynamic exponential shift, shift_terminal 0.02)."""
        from diffusers import (
            AutoencoderKLQwenImage,
            FlowMatchEulerDiscreteScheduler,
            QwenImagePipeline,
            QwenImageTransformer2DModel,
        )

        tokenizer = tiny_qwen_tokenizer()
        with tiny.Seeded(seed) as build:
            text_encoder = build(_tiny_text_encoder, tokenizer)
            transformer = build(QwenImageTransformer2DModel, **TINY_TRANSFORMER)
            vae = build(AutoencoderKLQwenImage, **TINY_VAE)
        scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image's scheduler_config.json
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
        pipe = QwenImagePipeline(
            scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
        )
        dropped = len(tokenizer(_TEMPLATE_PREFIX).input_ids)
        if dropped != pipe.prompt_template_encode_start_idx or not pipe.prompt_template_encode.startswith(
            _TEMPLATE_PREFIX
        ):
            raise RuntimeError(
                f"QwenImagePipeline's prompt template changed (it drops {pipe.prompt_template_encode_start_idx} "
                f"tokens; the tiny tokenizer makes {dropped} of the template it knows): update _TEMPLATE_PREFIX"
            )
        pipe.default_sample_size = tiny.TINY_IMAGE_SIZE // pipe.vae_scale_factor  # QwenImagePipeline: 1024 px
        return tiny.finish(pipe)


def tiny_qwen_image_pipeline(seed: int = 0):
    """The `tiny-qwen_image` pipeline (see QwenImageBackend.tiny_pipeline)."""
    return QwenImageBackend.tiny_pipeline(seed)
