"""SANA (SanaPipeline): flow matching with CFG, a Gemma-2 text encoder (prompts prefixed by the pipeline's "complex
human instruction"), a linear-attention transformer on the latents of a deep-compression autoencoder (AutoencoderDC,
32x); sampled with flow_sde_step on FlowMatchEulerDiscreteScheduler sigmas with the checkpoint's flow shift."""

from __future__ import annotations

import inspect
import string
from collections.abc import Sequence

import torch

from flowrl.plan.declarations import NOT_CALIBRATED, Layout

from . import _tiny as tiny
from ._base import SizeRule, encode_prompt_per_prompt, register_family
from ._flow import FlowMatchingBackend, flow_euler_scheduler

# the tiny test model's transformer (`tiny-sana`)
TINY_TRANSFORMER = dict(
    in_channels=4,
    out_channels=4,
    num_layers=1,
    num_attention_heads=2,
    attention_head_dim=16,
    num_cross_attention_heads=2,
    cross_attention_head_dim=16,
    cross_attention_dim=32,  # = heads x head_dim
    caption_channels=32,  # = the tiny Gemma-2's hidden size
    sample_size=tiny.TINY_IMAGE_SIZE // 2,  # latent side at the default size (VAE factor 2)
    patch_size=1,
)
# the tiny AutoencoderDC (diffusers' own SanaPipeline test's): two blocks, one 2x downsampling, 4 latent channels
TINY_VAE = dict(
    in_channels=3,
    latent_channels=4,
    attention_head_dim=2,
    encoder_block_types=("ResBlock", "EfficientViTBlock"),
    decoder_block_types=("ResBlock", "EfficientViTBlock"),
    encoder_block_out_channels=(8, 8),
    decoder_block_out_channels=(8, 8),
    encoder_qkv_multiscales=((), (5,)),
    decoder_qkv_multiscales=((), (5,)),
    encoder_layers_per_block=(1, 1),
    decoder_layers_per_block=(1, 1),
    downsample_block_type="conv",
    upsample_block_type="interpolate",
    decoder_norm_types="rms_norm",
    decoder_act_fns="silu",
    scaling_factor=0.41407,
)
TINY_TEXT_HIDDEN = 32
_TINY_CHARS = string.ascii_letters + string.digits + string.punctuation + "\n"  # covers the instruction's text


def pipeline_complex_human_instruction() -> list[str]:
    """The instruction SanaPipeline prefixes prompts with by default (its `complex_human_instruction`)."""
    from diffusers import SanaPipeline

    return list(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default or [])


@register_family
class SanaBackend(FlowMatchingBackend):
    """SanaPipeline. CFG when guidance_scale > 1 (the pipeline's default 4.5), the negative prompt "" encoded as the
    pipeline does (without the instruction). Prompts are encoded with the pipeline's complex human instruction
    unless the backend is made with `complex_human_instruction=()`; `pipeline_call_kwargs` passes the same to
    `pipe(...)`. The checkpoint's flow DPM-Solver is swapped for FlowMatchEulerDiscreteScheduler with its flow shift
    (the SDE kernels need Euler sigmas), and its encode_prompt is made to repeat attention masks per prompt as it
    repeats the embeddings (see `encode_prompt_per_prompt`)."""

    family = "sana"
    pipeline_classes = ("SanaPipeline",)
    denoiser_attr = "transformer"
    denoiser_class = "SanaTransformer2DModel"
    repeated_blocks = ("transformer_blocks",)  # diffusers 0.42 declares no `_repeated_blocks` for it
    default_guidance_scale = 4.5
    default_max_sequence_length = 300  # SanaPipeline's: Gemma tokens kept after the instruction
    # q/k/v of the linear self-attention (attn1) and of the cross-attention (attn2), as diffusers'
    # train_dreambooth_lora_sana.py targets them, and their output projections, as Flow-GRPO does for SD3's
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    tiny_denoiser = TINY_TRANSFORMER
    plan_layout = Layout(
        blocks=r"transformer_blocks\.\d+", one=r"time_embed", txt=r"caption_projection|attn2\.to_[kv]$"
    )
    # never measured, and its linear-attention blocks resemble no measured class's: a guess
    plan_calibration = NOT_CALIBRATED
    parity_guidance = (1.0, 4.5)
    uses_cfg_encodings = True
    _t5_tokenizer_attr = "tokenizer"  # bounds max_sequence_length by the Gemma tokenizer's model_max_length

    def __init__(self, pipe, *, complex_human_instruction: Sequence[str] | None = None, **kwargs):
        """complex_human_instruction: the lines prefixed to every prompt (None: the pipeline's default; () for
        none). The pipeline's scheduler is replaced by a FlowMatchEulerDiscreteScheduler with its flow shift."""
        pipe.scheduler = flow_euler_scheduler(pipe.scheduler, self.family)
        if pipe.scheduler.config.get("use_dynamic_shifting", False):
            raise ValueError("SanaPipeline passes no `mu`: a scheduler with use_dynamic_shifting cannot sample it")
        encode_prompt_per_prompt(pipe)
        if complex_human_instruction is None:
            complex_human_instruction = pipeline_complex_human_instruction()
        self.complex_human_instruction = list(complex_human_instruction) or None
        super().__init__(pipe, **kwargs)

    def pipeline_call_kwargs(self, guidance_scale: float) -> dict:
        return {
            "guidance_scale": guidance_scale,
            "max_sequence_length": self.max_sequence_length,
            "complex_human_instruction": self.complex_human_instruction,
            "use_resolution_binning": False,  # the size asked for, not the nearest of the model's aspect-ratio bins
        }

    # ---- prompts ---------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts):
        if self.uses_cfg_encodings and self._negative is None:
            self._negative = self._encode_negative()
        return super().encode_prompts(prompts)

    def _encode_text(self, prompts):
        prompt_embeds, attention_mask, _, _ = self.pipe.encode_prompt(
            prompts,
            do_classifier_free_guidance=False,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
            complex_human_instruction=self.complex_human_instruction,
        )
        return {"prompt_embeds": prompt_embeds, "prompt_attention_mask": attention_mask}, {}

    def _encode_negative(self) -> dict[str, torch.Tensor]:
        """The unconditional encodings as SanaPipeline makes them: "" without the instruction (not what
        `_encode_text([""])` gives). A placeholder positive embedding lets encode_prompt skip encoding one."""
        placeholder = torch.zeros(1, 1, 1, device=self.device)
        _, _, negative, negative_mask = self.pipe.encode_prompt(
            None,
            do_classifier_free_guidance=True,
            negative_prompt="",
            device=self.device,
            prompt_embeds=placeholder,
            prompt_attention_mask=torch.ones(1, 1, dtype=torch.long, device=self.device),
            max_sequence_length=self.max_sequence_length,
            complex_human_instruction=self.complex_human_instruction,
        )
        return {"prompt_embeds": negative, "prompt_attention_mask": negative_mask}

    # ---- sampling --------------------------------------------------------------------------------

    def _default_image_size(self) -> int:
        return self.denoiser_config.sample_size * self.pipe.vae_scale_factor

    @classmethod
    def size_rule(cls, denoiser_config, vae_scale_factor):
        """Sides divisible by VAE factor x patch size; no bound (no positional embedding, or a sin-cos one
        computed for any grid)."""
        return SizeRule(cls.family, vae_scale_factor * denoiser_config.get("patch_size", 1))

    def _latent_shape(self, settings):
        f = self.pipe.vae_scale_factor
        return (self.denoiser_config.in_channels, settings.height // f, settings.width // f)

    def _schedule(self, num_steps, settings):
        return self._set_scheduler(num_steps, num_inference_steps=num_steps)  # SanaPipeline: no sigmas, no mu

    def _predict(self, x, t, cond, encodings, settings):
        # as SanaPipeline's loop: [uncond, cond] in one call, timestep x timestep_scale, output in float32
        cfg = settings.guidance_scale > 1
        prompt_embeds, mask = cond["prompt_embeds"], cond["prompt_attention_mask"]
        if cfg:
            negative = self._negative_like(encodings, x.shape[0])
            x, t = torch.cat([x, x]), torch.cat([t, t])
            prompt_embeds = torch.cat([negative["prompt_embeds"], prompt_embeds])
            mask = torch.cat([negative["prompt_attention_mask"], mask])
        config, dtype = self.denoiser_config, self.dtype
        out = self.denoiser(
            x.to(dtype),
            encoder_hidden_states=prompt_embeds.to(dtype),
            encoder_attention_mask=mask,
            timestep=t * config.timestep_scale,
            return_dict=False,
        )[0].float()
        if cfg:
            uncond, text = out.chunk(2)
            out = uncond + settings.guidance_scale * (text - uncond)
        if config.out_channels // 2 == config.in_channels:  # learned sigma: keep the prediction
            out = out.chunk(2, dim=1)[0]
        return out

    def _to_vae_latents(self, latents, height, width):
        return latents / self.pipe.vae.config.scaling_factor  # SanaPipeline: no shift

    def _from_vae_latents(self, latents, height, width):
        return latents * self.pipe.vae.config.scaling_factor

    # ---- the tiny model --------------------------------------------------------------------------

    @classmethod
    def tiny_config_files(cls):
        return {
            "model_index.json": {
                "_class_name": "SanaPipeline",
                "transformer": ["diffusers", cls.denoiser_class],
                "vae": ["diffusers", "AutoencoderDC"],
            },
            "transformer/config.json": {"_class_name": cls.denoiser_class, **TINY_TRANSFORMER},
            "vae/config.json": {
                "_class_name": "AutoencoderDC",
                "encoder_block_out_channels": list(TINY_VAE["encoder_block_out_channels"]),
            },
        }

    @staticmethod
    def tiny_tokenizer():
        """A Gemma BPE tokenizer over single characters (no merges), adding <bos> as Gemma's does."""
        from transformers import GemmaTokenizer

        vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "▁": 5}
        for c in _TINY_CHARS:
            vocab.setdefault(c, len(vocab))
        return GemmaTokenizer(vocab=vocab, merges=[], add_bos_token=True, add_eos_token=False)

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        """A SanaPipeline: a 1-layer Gemma-2, a 1-layer SANA transformer, diffusers' test AutoencoderDC, and the
        flow-matching Euler scheduler (shift 3, as SANA's 512/1024 px checkpoints)."""
        from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel
        from transformers import Gemma2Config, Gemma2Model

        tok = cls.tiny_tokenizer()
        text_config = Gemma2Config(
            vocab_size=tiny.vocab_size(tok),
            hidden_size=TINY_TEXT_HIDDEN,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=2048,  # the instruction is ~1,060 characters, one token each
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            attn_implementation="eager",
        )
        with tiny.Seeded(seed) as build:
            text_encoder = build(Gemma2Model, text_config)
            transformer = build(SanaTransformer2DModel, **TINY_TRANSFORMER)
            vae = build(AutoencoderDC, **TINY_VAE)
        pipe = SanaPipeline(
            tokenizer=tok,
            text_encoder=text_encoder,
            vae=vae,
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        )
        return tiny.finish(pipe)


def tiny_sana_pipeline(seed: int = 0):
    """The `tiny-sana` pipeline (see SanaBackend.tiny_pipeline)."""
    return SanaBackend.tiny_pipeline(seed)
