"""FLUX.2 (Flux2Pipeline: FLUX.2 [dev]; Flux2KleinPipeline: the FLUX.2 [klein] sizes, base and step-distilled):
flow matching with one LLM text encoder, a Flux2 MMDiT on 2x2-patchified latents, a VAE with batch-norm latent
statistics; sampled with flow_sde_step.

What differs from FLUX.1, all mirrored from the pipelines' `__call__`:
- one text encoder, a chat model: FLUX.2 [dev] a Mistral-3 (Mistral3ForConditionalGeneration behind a
  PixtralProcessor's chat template, with BFL's system message), klein a Qwen3 (Qwen3ForCausalLM, its chat template
  with thinking off, one prompt at a time). The prompt embedding is three intermediate hidden states stacked on
  the feature axis (dev: layers 10, 20, 30; klein: 9, 18, 27), padded to max_sequence_length; `encode_prompt` does
  it all, and the text position ids (0, 0, 0, l) are the same for every prompt (kept once, `txt_ids`);
- latents are the VAE's latents patchified 2x2 (4x the channels, half the side), packed as tokens [B, (h/2)(w/2),
  4C] in row-major order, with position ids (0, row, col, 0); the noise is drawn patchified [B, 4C, h/2, w/2] in the
  latents' dtype, then packed, as `prepare_latents` does;
- before `vae.decode` the latents are un-normalised with the VAE's batch-norm running statistics (x * sqrt(var +
  eps) + mean, over the 4C patchified channels), then unpatchified: no scaling or shift factor;
- the sigmas are linspace(1, 1/S, S) and `mu` is BFL's empirical one (`compute_empirical_mu`), from the token
  count AND the number of steps;
- guidance: FLUX.2 [dev] is guidance-distilled, the scale goes into the guidance embedding (no CFG); klein passes
  no guidance embedding and does true CFG neg + g (pos - neg) against the empty prompt when g > 1 (two
  transformer calls in the pipeline, one batched call here), except a step-distilled klein (`is_distilled` in its
  model_index.json), which ignores the scale.
"""

from __future__ import annotations

import numpy as np
import torch

from flowrl.plan.declarations import Layout

from . import _tiny as tiny
from ._base import SizeRule, register_family
from ._flow import FlowMatchingBackend
from .flux import FluxBackend

# the tiny test models' transformer (`tiny-flux2`; klein's is the same without the guidance embedding)
TINY_TEXT_HIDDEN = 16  # the tiny text encoders' hidden size; the prompt embedding stacks three of their layers
TINY_TRANSFORMER = dict(
    patch_size=1,
    in_channels=16,  # 4 VAE latent channels x a 2x2 patch
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=3 * TINY_TEXT_HIDDEN,  # three hidden states of the text encoder
    timestep_guidance_channels=256,  # fixed in BFL's code
    axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim
    guidance_embeds=True,  # FLUX.2 [dev]
)
TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=tiny.VAE_BLOCK_OUT_CHANNELS,  # one 2x downsampling
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=tiny.TINY_IMAGE_SIZE,
)
TINY_MAX_LENGTH = 64  # the tiny tokenizers' model_max_length
# the pipelines read hidden states (10, 20, 30) (dev) and (9, 18, 27) (klein) of their text encoder: the tiny ones
# are that deep (and 16 wide), so that the pipelines' defaults run unchanged
TINY_MISTRAL_LAYERS, TINY_QWEN_LAYERS = 30, 27

# FLUX.2 [dev]'s scheduler config (black-forest-labs/FLUX.2-dev, scheduler/scheduler_config.json)
SCHEDULER = dict(
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    time_shift_type="exponential",
)

# Mistral-Small-3.1's chat template, reduced to what Flux2Pipeline renders: the system turn and one user turn, the
# contents given as lists of {"type": "text"} parts (format_input's form) or as strings.
TINY_MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST]' + text + '[/INST]' }}"
    "{% else %}{{ text + eos_token }}{% endif %}"
    "{% endfor %}"
)
_MISTRAL_SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
]

# Qwen3's chat template, reduced to what Flux2KleinPipeline renders: one user turn, the generation prompt, and the
# empty think block that `enable_thinking=False` adds.
TINY_QWEN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def _byte_level_bpe(specials: list[str], extra_tokens: tuple[str, ...] = ()):
    """A `tokenizers` byte-level BPE over the 256 byte symbols with no merges (one token per byte), the special
    tokens first (ids 0, 1, ...) and `extra_tokens` as whole-string added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(specials)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=specials[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
    return tokenizer


def tiny_mistral_processor():
    """A PixtralProcessor (FLUX.2 [dev]'s tokenizer class) over a byte-level tokenizer with Mistral's special tokens
    and a chat template. BFL's system message, which Flux2Pipeline puts before every prompt, is one added token, so
    that a prompt fits in the tests' 16 tokens after it."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_bpe(_MISTRAL_SPECIALS, (SYSTEM_MESSAGE,)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=TINY_MAX_LENGTH,
        chat_template=TINY_MISTRAL_TEMPLATE,
    )
    image_processor = PixtralImageProcessor(size={"longest_edge": 32}, patch_size={"height": 8, "width": 8})
    return PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        spatial_merge_size=2,
        chat_template=TINY_MISTRAL_TEMPLATE,
    )


def tiny_qwen_tokenizer():
    """A Qwen2TokenizerFast (klein's tokenizer class) over the byte-level symbols, with Qwen's special tokens and a
    chat template."""
    from transformers import Qwen2TokenizerFast

    return Qwen2TokenizerFast(
        tokenizer_object=_byte_level_bpe(_QWEN_SPECIALS),
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token=None,
        bos_token=None,
        model_max_length=TINY_MAX_LENGTH,
        chat_template=TINY_QWEN_TEMPLATE,
    )


def _tiny_mistral3(processor):
    """A Mistral3ForConditionalGeneration: a 30-layer, 16-wide Mistral and a 1-layer Pixtral vision tower."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tok = processor.tokenizer
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": tiny.vocab_size(tok),
            "hidden_size": TINY_TEXT_HIDDEN,
            "intermediate_size": 37,
            "num_hidden_layers": TINY_MISTRAL_LAYERS,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 4,
            "max_position_embeddings": 2 * TINY_MAX_LENGTH,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000000.0,
            "sliding_window": None,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "head_dim": 4,
            "intermediate_size": 37,
            "image_size": 32,
            "patch_size": 8,
            "num_channels": 3,
        },
        image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    return Mistral3ForConditionalGeneration(config)


def _tiny_qwen3(tokenizer):
    """A Qwen3ForCausalLM, 27 layers, 16 wide."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=tiny.vocab_size(tokenizer),
        hidden_size=TINY_TEXT_HIDDEN,
        intermediate_size=37,
        num_hidden_layers=TINY_QWEN_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        max_position_embeddings=2 * TINY_MAX_LENGTH,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config)


def _tiny_vae():
    """An AutoencoderKLFlux2 with one 2x downsampling and random batch-norm statistics (a fresh one has mean 0 and
    variance 1, which would leave the latents' un-normalisation untested)."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(**TINY_VAE)
    channels = vae.bn.num_features
    vae.bn.running_mean.copy_(0.5 * torch.randn(channels))
    vae.bn.running_var.copy_(0.5 + 1.5 * torch.rand(channels))
    return vae


def _is_klein(pipe) -> bool:
    return any(c.__name__ == "Flux2KleinPipeline" for c in type(pipe).__mro__)


@register_family
class Flux2Backend(FlowMatchingBackend):
    """Flux2Pipeline (FLUX.2 [dev]: guidance embedding, no CFG) and Flux2KleinPipeline (klein base: true CFG when
    guidance_scale > 1; klein step-distilled: no guidance). Latents are packed 2x2-patchified tokens [B, (h/2)(w/2),
    4C] (h, w: the VAE latent's sides), the layout the transformer consumes."""

    family = "flux2"
    pipeline_classes = ("Flux2Pipeline", "Flux2KleinPipeline")
    denoiser_attr = "transformer"
    denoiser_class = "Flux2Transformer2DModel"
    # both pipelines' default; Flow-Factory samples FLUX.2 [dev] and klein base with 4 (and step-distilled klein
    # with 1, which it ignores anyway)
    default_guidance_scale = 4.0
    # the attention projections of both kinds of block, as Flow-Factory's FLUX.2 / klein "default" targets name
    # them (models/flux/flux2.py, flux2_klein.py): double-stream to_q/k/v, to_out.0 and the text stream's add_*
    # and to_add_out; single-stream to_qkv_mlp_proj (the fused q, k, v and MLP-in projection). Flow-Factory adds
    # the double-stream feed-forwards (ff.linear_in/out, ff_context.linear_in/out): the presets list them.
    lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_qkv_mlp_proj",
    )
    tiny_denoiser = TINY_TRANSFORMER
    plan_layout = Layout(
        blocks=r"(single_)?transformer_blocks\.\d+",
        one=r"time_guidance_embed|modulation|norm_out\.linear",
        txt=r"context_embedder|attn\.add_|to_add_out|ff_context",
        joint=r"single_transformer_blocks",
    )
    # not measured yet: FLUX.1's factors (double- then single-stream blocks, as FLUX.1's)
    plan_calibration = FluxBackend.plan_calibration.borrowed(FluxBackend.denoiser_class, denoiser_class)
    # dev: two values of the guidance embedding; klein base: without CFG (1) and with it (4)
    parity_guidance = (1.0, 4.0)
    default_max_sequence_length = 512  # both pipelines' default
    _t5_tokenizer_attr = "tokenizer"  # caps max_sequence_length at the tokenizer's model_max_length, if it has one

    def __init__(self, pipe, **kwargs):
        super().__init__(pipe, **kwargs)
        self.klein = _is_klein(pipe)
        self.distilled = bool(self.klein and pipe.config.get("is_distilled", False))
        # klein base does CFG against the empty prompt: encode it once
        self.uses_cfg_encodings = self.klein and not self.distilled
        self._ids: dict = {}

    # ---- prompts ---------------------------------------------------------------------------------

    def _encode_text(self, prompts):
        prompt_embeds, text_ids = self.pipe.encode_prompt(
            prompt=list(prompts),
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        # every prompt is padded to max_sequence_length: the text ids (0, 0, 0, l) are the same for all
        return {"prompt_embeds": prompt_embeds}, {"txt_ids": text_ids[:1]}

    # ---- sizes and noise -------------------------------------------------------------------------

    def _default_image_size(self) -> int:
        return self.pipe.default_sample_size * self.pipe.vae_scale_factor

    @classmethod
    def size_rule(cls, denoiser_config, vae_scale_factor):
        """Sides divisible by VAE factor x 2 (latents are patchified 2x2); the RoPE is computed from the positions,
        so no size bound."""
        return SizeRule(cls.family, vae_scale_factor * 2)

    def _grid(self, height: int, width: int) -> tuple[int, int]:
        """The patchified latent's sides (prepare_latents: 2 * (side // (f * 2)) // 2)."""
        f = self.pipe.vae_scale_factor
        return height // (f * 2), width // (f * 2)

    def _latent_shape(self, settings):
        h, w = self._grid(settings.height, settings.width)
        return (h * w, self.denoiser_config.in_channels)

    def _initial_noise(self, n, settings, generator):
        # prepare_latents: randn_tensor([n, 4C, h/2, w/2]) in the latents' dtype, then packed to tokens
        h, w = self._grid(settings.height, settings.width)
        device = generator.device if generator is not None else self.device
        noise = torch.randn(
            (n, self.denoiser_config.in_channels, h, w), generator=generator, device=device, dtype=self.dtype
        )
        return self.pipe._pack_latents(noise.to(self.device))

    def pipeline_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Initial latents [B, (h/2)(w/2), 4C] of a rollout as the pipelines' `latents=` argument takes them: the
        patchified grid [B, 4C, h/2, w/2] (`prepare_latents` packs it; the denoising loop and its callbacks see the
        packed tokens, this backend's layout)."""
        h, w = self._grid(height, width)
        ids = self._latent_ids(h, w).to(latents.device).expand(latents.shape[0], -1, -1)
        return self.pipe._unpack_latents_with_ids(latents, ids)

    def _latent_ids(self, h: int, w: int) -> torch.Tensor:
        """[1, h*w, 4] position ids (0, row, col, 0) of the packed latents, as `_prepare_latent_ids` makes them."""
        key = (h, w, self.device)
        if key not in self._ids:
            self._ids[key] = self.pipe._prepare_latent_ids(torch.empty(1, 0, h, w)).to(self.device)
        return self._ids[key]

    # ---- steps -----------------------------------------------------------------------------------

    def _schedule(self, num_steps, settings):
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)  # as both pipelines do
        if self.pipe.scheduler.config.get("use_flow_sigmas", False):
            sigmas = None
        h, w = self._grid(settings.height, settings.width)
        mu = compute_empirical_mu(image_seq_len=h * w, num_steps=num_steps)
        if sigmas is None:
            return self._set_scheduler(num_steps, num_inference_steps=num_steps, mu=mu)
        return self._set_scheduler(num_steps, sigmas=sigmas, mu=mu)

    def training_guidance_scale(self, guidance_scale):
        """FLUX.2 [dev]'s guidance is an embedding, kept at the rollout's value; klein's true CFG is off at 1."""
        return 1.0 if self.klein else guidance_scale

    def _predict(self, x, t, cond, encodings, settings):
        n, g = x.shape[0], settings.guidance_scale
        h, w = self._grid(settings.height, settings.width)
        latents = x.to(self.dtype)
        timestep = t.to(x.dtype) / 1000  # the pipelines: t.expand(B).to(latents.dtype) / 1000
        embeds = cond["prompt_embeds"]
        guidance = None
        if not self.klein:  # FLUX.2 [dev]: the guidance embedding, always passed
            guidance = torch.full((n,), g, device=self.device, dtype=torch.float32)
        cfg = self.uses_cfg_encodings and g > 1  # klein base: do_classifier_free_guidance
        if cfg:  # the pipeline's two calls (cond, uncond) as one batch
            latents, timestep = torch.cat([latents, latents]), torch.cat([timestep, timestep])
            embeds = torch.cat([embeds, self._negative_like(encodings, n)["prompt_embeds"]])
        out = self.denoiser(
            hidden_states=latents,
            timestep=timestep,
            guidance=guidance,
            encoder_hidden_states=embeds,
            txt_ids=encodings.shared["txt_ids"].to(self.device),
            img_ids=self._latent_ids(h, w),
            return_dict=False,
        )[0]
        out = out[:, : x.shape[1]]
        if cfg:
            pos, neg = out[:n], out[n:]
            out = neg + g * (pos - neg)
        return out

    def _to_vae_latents(self, latents, height, width):
        if height is None or width is None:
            side = int(round(latents.shape[1] ** 0.5))
            if side * side != latents.shape[1]:
                raise ValueError("FLUX.2 latents are packed: pass height and width to decode non-square images")
            h = w = side
        else:
            h, w = self._grid(height, width)
        ids = self._latent_ids(h, w).to(latents.device).expand(latents.shape[0], -1, -1)
        unpacked = self.pipe._unpack_latents_with_ids(latents, ids)  # [B, 4C, h, w]
        bn = self.pipe.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(unpacked.device, unpacked.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.pipe.vae.config.batch_norm_eps)
        unpacked = unpacked * std.to(unpacked.device, unpacked.dtype) + mean
        return self.pipe._unpatchify_latents(unpacked)

    def _from_vae_latents(self, latents, height, width):
        """Patchified 2x2, normalised by the VAE's batch-norm statistics (the pipelines' `_encode_vae_image`), then
        packed to tokens."""
        latents = self.pipe._patchify_latents(latents)
        bn = self.pipe.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.pipe.vae.config.batch_norm_eps)
        return self.pipe._pack_latents((latents - mean) / std.to(latents.device, latents.dtype))

    # ---- the tiny model --------------------------------------------------------------------------

    @classmethod
    def tiny_config_files(cls) -> dict[str, dict]:
        return {
            "model_index.json": {
                "_class_name": cls.pipeline_classes[0],
                cls.denoiser_attr: ["diffusers", cls.denoiser_class],
                "vae": ["diffusers", "AutoencoderKLFlux2"],
            },
            f"{cls.denoiser_attr}/config.json": {"_class_name": cls.denoiser_class, **cls.tiny_denoiser},
            "vae/config.json": {
                "_class_name": "AutoencoderKLFlux2",
                "block_out_channels": list(TINY_VAE["block_out_channels"]),
            },
        }

    @classmethod
    def tiny_pipeline(cls, seed: int = 0, *, klein: bool = False, distilled: bool = False):
        """A Flux2Pipeline (FLUX.2 [dev] style: a Mistral-3 text encoder behind a PixtralProcessor, guidance
        embedding), or with klein=True a Flux2KleinPipeline (a Qwen3 text encoder, no guidance embedding; CFG unless
        distilled=True). Both: a transformer with one double and one single block, a 4-channel AutoencoderKLFlux2,
        FLUX.2's dynamically shifted scheduler."""
        from diffusers import (
            FlowMatchEulerDiscreteScheduler,
            Flux2KleinPipeline,
            Flux2Pipeline,
            Flux2Transformer2DModel,
        )

        if distilled and not klein:
            raise ValueError("distilled=True is a klein option (Flux2KleinPipeline's is_distilled)")
        tokenizer = tiny_qwen_tokenizer() if klein else tiny_mistral_processor()
        with tiny.Seeded(seed) as build:
            text_encoder = build(_tiny_qwen3 if klein else _tiny_mistral3, tokenizer)
            transformer = build(Flux2Transformer2DModel, **{**TINY_TRANSFORMER, "guidance_embeds": not klein})
            vae = build(_tiny_vae)
        components = dict(
            scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=transformer,
        )
        if klein:
            pipe = Flux2KleinPipeline(**components, is_distilled=distilled)
        else:
            pipe = Flux2Pipeline(**components)
        pipe.default_sample_size = tiny.TINY_IMAGE_SIZE // pipe.vae_scale_factor  # the pipelines: 128 (1024 px)
        return tiny.finish(pipe)


def tiny_flux2_pipeline(seed: int = 0, *, klein: bool = False, distilled: bool = False):
    """The `tiny-flux2` pipeline (see Flux2Backend.tiny_pipeline); klein=True: a tiny Flux2KleinPipeline."""
    return Flux2Backend.tiny_pipeline(seed, klein=klein, distilled=distilled)
