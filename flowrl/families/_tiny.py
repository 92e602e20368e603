"""Parts the families' tiny random-weight pipelines share: tokenizers made in code from a character vocabulary
(no files, no hub), small CLIP / T5 text encoders, a VAE with one downsampling, seeded building.

Each family's `tiny_pipeline` builds real pipeline and model classes, one or two layers each, offline in a
fraction of a second; the images are noise, the code paths are the real ones. Sizes: 32x32 images, 16x16
latents of 4 channels, 16 text tokens.
"""

from __future__ import annotations

import string

import torch

TINY_IMAGE_SIZE = 32
TINY_MAX_TOKENS = 16  # CLIP's model_max_length and the T5 sequence length the backends use
_CHARS = string.ascii_lowercase + string.digits + ",.!?'-:;"
VAE_BLOCK_OUT_CHANNELS = (8, 16)  # two blocks: one 2x downsampling
# a FlowMatchEulerDiscreteScheduler shifting with the image's token count (FLUX.1-dev's settings): the tiny flow
# models that sample with a `mu` use it, so that the parity test checks how they compute it
DYNAMIC_SHIFT_SCHEDULER = dict(
    shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
)


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


def vocab_size(tokenizer) -> int:
    return len(tokenizer) + 4  # a little headroom, as real checkpoints have


def clip_config(tokenizer, hidden: int = 32, projection: int = 32):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size(tokenizer),
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


def t5_encoder(tokenizer, d_model: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size(tokenizer),
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


def vae(latent_channels: int = 4, *, flow: bool = True):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=VAE_BLOCK_OUT_CHANNELS,
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


class Seeded:
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


def finish(pipe):
    # Modules built from a config start in train mode (T5 has dropout 0.1); from_pretrained gives eval mode.
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
