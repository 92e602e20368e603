"""Tiny SD3 / FLUX / SD1.5 diffusers pipelines with random weights, built offline in a fraction of a second.

Real pipeline classes, real model classes, one or two layers each; tokenizers are made in code from a
character vocabulary (no files, no hub). Weights depend only on `seed`. For tests, the tiny CPU
config and benchmarks: the images are noise, the code paths are the real ones.

Sizes: 32x32 images, a VAE with one downsampling (16x16 latents, 4 channels), 16 text tokens.
"""

from __future__ import annotations

import string

import torch

TINY_IMAGE_SIZE = 32
TINY_MAX_TOKENS = 16  # CLIP's model_max_length and the T5 sequence length the backends use
_CHARS = string.ascii_lowercase + string.digits + ",.!?'-:;"
_VAE_BLOCK_OUT_CHANNELS = (8, 16)  # two blocks: one 2x downsampling

# the denoisers' configs (each builder's and tiny_config_files' source)
_SD3_TRANSFORMER = dict(
    sample_size=TINY_IMAGE_SIZE // 2,
    patch_size=2,
    in_channels=4,
    num_layers=1,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=64,
    caption_projection_dim=32,  # = heads x head_dim
    pooled_projection_dim=64,  # 2 CLIP projections of 32
    out_channels=4,
    pos_embed_max_size=16,  # latent side / patch size <= 16: images up to 64 px a side
)
_FLUX_TRANSFORMER = dict(
    patch_size=1,
    in_channels=16,  # 4 latent channels x a 2x2 patch
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
)
_SD15_UNET = dict(
    sample_size=TINY_IMAGE_SIZE // 2,
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
# name -> (pipeline class, denoiser component, denoiser class, denoiser config)
_TINY_MODELS = {
    "tiny-sd3": ("StableDiffusion3Pipeline", "transformer", "SD3Transformer2DModel", _SD3_TRANSFORMER),
    "tiny-flux": ("FluxPipeline", "transformer", "FluxTransformer2DModel", _FLUX_TRANSFORMER),
    "tiny-sd15": ("StableDiffusionPipeline", "unet", "UNet2DConditionModel", _SD15_UNET),
}


def tiny_config_files(name: str) -> dict[str, dict]:
    """What a check before loading reads of the tiny model `name`, without building it: its
    model_index.json, its denoiser's config.json and its VAE's, keyed by their paths in a saved
    pipeline (the entries that matter, not every key save_pretrained writes)."""
    pipeline_class, denoiser, denoiser_class, denoiser_config = _TINY_MODELS[name]
    return {
        "model_index.json": {
            "_class_name": pipeline_class,
            denoiser: ["diffusers", denoiser_class],
            "vae": ["diffusers", "AutoencoderKL"],
        },
        f"{denoiser}/config.json": {"_class_name": denoiser_class, **denoiser_config},
        "vae/config.json": {"_class_name": "AutoencoderKL", "block_out_channels": list(_VAE_BLOCK_OUT_CHANNELS)},
    }


def clip_tokenizer():
    """A CLIP BPE tokenizer over single characters: '<|startoftext|>' = 0, '<|endoftext|>' = 1 (eos,
    pad and unk, as in CLIP), then each character and its word-final form 'c</w>'."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for c in _CHARS:
            vocab[c + suffix] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=TINY_MAX_TOKENS)


def t5_tokenizer():
    """A T5 unigram tokenizer over single characters ('▁c' starts a word): <pad> 0, </s> 1, <unk> 2."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + c, -3.0) for c in _CHARS] + [(c, -3.5) for c in _CHARS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=TINY_MAX_TOKENS)


def _vocab_size(tokenizer) -> int:
    return len(tokenizer) + 4  # a little headroom, as real checkpoints have


def _clip_config(tokenizer, hidden: int = 32, projection: int = 32):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=_vocab_size(tokenizer),
        hidden_size=hidden,
        intermediate_size=37,
        num_hidden_layers=2,  # SD3 reads hidden_states[-2]
        num_attention_heads=4,
        max_position_embeddings=TINY_MAX_TOKENS,
        projection_dim=projection,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,  # must be the tokenizer's end token: CLIP pools there
        pad_token_id=tokenizer.pad_token_id,
        hidden_act="gelu",
    )


def _t5_encoder(tokenizer, d_model: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=_vocab_size(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=37,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return T5EncoderModel(config)


def _vae(latent_channels: int = 4, *, flow: bool = True):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=_VAE_BLOCK_OUT_CHANNELS,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=TINY_IMAGE_SIZE,
        # SD3 / FLUX VAEs have a shift and no quant convs; SD1.5's has quant convs and no shift.
        scaling_factor=1.5035 if flow else 0.18215,
        shift_factor=0.0609 if flow else None,
        use_quant_conv=not flow,
        use_post_quant_conv=not flow,
    )


class _Seeded:
    """Each module is built right after `torch.manual_seed(seed + k)`, without touching the caller's RNG."""

    def __init__(self, seed: int):
        self.seed, self.k = seed, 0
        self._fork = torch.random.fork_rng(devices=[])

    def __enter__(self):
        self._fork.__enter__()
        return self

    def __exit__(self, *exc):
        return self._fork.__exit__(*exc)

    def __call__(self, build, *args, **kwargs):
        torch.manual_seed(self.seed * 1000 + self.k)
        self.k += 1
        return build(*args, **kwargs)


def _finish(pipe):
    # Modules built from a config start in train mode (T5 has dropout 0.1); from_pretrained gives eval mode.
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_sd3_pipeline(seed: int = 0, *, drop_t5: bool = False):
    """A StableDiffusion3Pipeline: two CLIP-with-projection encoders, a T5, a 1-layer SD3 transformer.
    drop_t5: without the T5 encoder and tokenizer (the other weights are the same as with them)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    tok, tok_3 = clip_tokenizer(), t5_tokenizer()
    with _Seeded(seed) as build:
        text_encoder = build(CLIPTextModelWithProjection, _clip_config(tok))
        text_encoder_2 = build(CLIPTextModelWithProjection, _clip_config(tok))
        text_encoder_3 = build(_t5_encoder, tok_3, d_model=64)  # = joint_attention_dim >= 2 x 32 CLIP dims
        transformer = build(SD3Transformer2DModel, **_SD3_TRANSFORMER)
        vae = build(_vae)
    if drop_t5:  # built all the same, so that the modules after it get the same seeds
        text_encoder_3 = tok_3 = None
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tok_3,
    )
    return _finish(pipe)


def tiny_flux_pipeline(seed: int = 0):
    """A FluxPipeline (FLUX.1-dev style: guidance embedding, dynamic shift): CLIP + T5 + a transformer
    with one double and one single block."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    tok, tok_2 = clip_tokenizer(), t5_tokenizer()
    with _Seeded(seed) as build:
        text_encoder = build(CLIPTextModel, _clip_config(tok))
        text_encoder_2 = build(_t5_encoder, tok_2, d_model=32)
        transformer = build(FluxTransformer2DModel, **_FLUX_TRANSFORMER)
        vae = build(_vae)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tok_2,
        transformer=transformer,
    )
    pipe.default_sample_size = TINY_IMAGE_SIZE // pipe.vae_scale_factor  # FLUX hard-codes 128 (1024 px)
    return _finish(pipe)


def tiny_sd15_pipeline(seed: int = 0):
    """A StableDiffusionPipeline with a 2-block UNet and SD1.5's DDIM schedule (scaled-linear betas)."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    tok = clip_tokenizer()
    with _Seeded(seed) as build:
        text_encoder = build(CLIPTextModel, _clip_config(tok))
        unet = build(UNet2DConditionModel, **_SD15_UNET)
        vae = build(_vae, flow=False)
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
    return _finish(pipe)


TINY_PIPELINES = {"tiny-sd3": tiny_sd3_pipeline, "tiny-flux": tiny_flux_pipeline, "tiny-sd15": tiny_sd15_pipeline}
