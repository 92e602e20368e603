"""The tiny `StableDiffusion3Pipeline` of the shapes world: configs, a tokenizer for the world's words, assembly.

The architecture is SD3's at toy scale (numbers for 64x64 images):

    vae            AutoencoderKL, 64x64x3 <-> 8x8x4 (4 levels, 16/32/32/32 channels, no attention)
    transformer    SD3Transformer2DModel, patch 1 -> 8x8 = 64 image tokens, 6 joint blocks of width 128
    text_encoder   CLIPTextModelWithProjection, 2 layers of width 64 (SD3 reads the penultimate layer)
    text_encoder_2 the same shape (SD3's second CLIP)
    tokenizer(_2)  CLIPTokenizer whose BPE merges spell every word of the world as one token, 16 tokens max
    text_encoder_3 T5EncoderModel, 1 layer of width 128 (= the transformer's joint_attention_dim)
    tokenizer_3    T5Tokenizer (Unigram) with one piece per word of the world

Load it as SD3.5 is loaded, `StableDiffusion3Pipeline.from_pretrained(path)`, and sample with
`max_sequence_length=MAX_SEQUENCE_LENGTH` (12): the transformer was trained on 12 T5 positions, and SD3's
default of 256 would add 244 padding tokens it has never seen (and triple the cost of every step).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from .prompts import vocabulary
from .render import IMAGE_SIZE

LATENT_CHANNELS = 4
VAE_CHANNELS = (16, 32, 32, 32)  # 2 ** (len - 1) = 8x downsampling: 256 latent numbers per image
LATENT_SIDE = IMAGE_SIZE // 2 ** (len(VAE_CHANNELS) - 1)  # 8
PATCH_SIZE = 1  # one image token per latent pixel: 64 tokens
TOKENIZER_MAX_LENGTH = 16  # the longest prompt is 12 tokens with start and end
MAX_SEQUENCE_LENGTH = 12  # T5 positions appended to the CLIP tokens (the longest prompt: 10 words + end)
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
T5_PAD, T5_EOS, T5_UNK = "<pad>", "</s>", "<unk>"

TRANSFORMER_CONFIG = dict(
    sample_size=LATENT_SIDE,
    patch_size=PATCH_SIZE,
    in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    num_layers=6,
    attention_head_dim=32,
    num_attention_heads=4,
    joint_attention_dim=128,  # two CLIPs of width 64, concatenated
    caption_projection_dim=128,
    pooled_projection_dim=128,  # two CLIP projections of 64, concatenated
    pos_embed_max_size=LATENT_SIDE // PATCH_SIZE,  # patches per side
    qk_norm="rms_norm",
)
CLIP_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    projection_dim=64,
    num_hidden_layers=2,  # SD3 uses hidden_states[-2]: at least 2 layers
    num_attention_heads=2,
    max_position_embeddings=TOKENIZER_MAX_LENGTH,
)
T5_CONFIG = dict(
    d_model=128,  # must equal the transformer's joint_attention_dim
    d_kv=32,
    d_ff=256,
    num_layers=1,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    dropout_rate=0.0,
)


def learn_bpe_merges(words: list[str]) -> list[tuple[str, str]]:
    """Byte-pair merges that make every word in `words` a single token `word</w>`.

    Greedy BPE on the word list (each word counted once): merge the most frequent adjacent pair
    (ties: the lexicographically smallest) until every word is one symbol. Encoding a listed word
    replays these merges in order, so it ends as one token.
    """
    spelled = {w: list(w[:-1]) + [w[-1] + "</w>"] for w in words}
    merges = []
    while True:
        pairs = Counter(p for s in spelled.values() for p in zip(s, s[1:]))
        if not pairs:
            return merges
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w, s in spelled.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            spelled[w] = out


def build_tokenizer(words: list[str] | None = None, max_length: int = TOKENIZER_MAX_LENGTH):
    """A `CLIPTokenizer` whose vocabulary is the world's words (one token each), their letters (so any other
    lower-case word still tokenizes) and the start/end tokens; end = pad = unknown, as in CLIP."""
    from transformers import CLIPTokenizer

    words = sorted(set(words or vocabulary()))
    merges = learn_bpe_merges(words)
    vocab = {BOS: 0, EOS: 1}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        model_max_length=max_length,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=EOS,
    )


def build_t5_tokenizer(words: list[str] | None = None):
    """A `T5Tokenizer` (Unigram) with a piece per word of the world, scored above the single letters that
    spell any other lower-case word; pad 0, end 1, unknown 2 (T5's layout), no sentinel tokens."""
    from transformers import T5Tokenizer

    words = sorted(set(words or vocabulary()))
    pieces = [(T5_PAD, 0.0), (T5_EOS, 0.0), (T5_UNK, 0.0), ("\u2581", -5.0)]
    pieces += [("\u2581" + w, -1.0) for w in words]
    pieces += [(ch, -10.0) for ch in "abcdefghijklmnopqrstuvwxyz"]
    return T5Tokenizer(vocab=pieces, eos_token=T5_EOS, unk_token=T5_UNK, pad_token=T5_PAD, extra_ids=0)


def build_pipeline(seed: int = 0, shift: float = 1.0):
    """A randomly initialised tiny `StableDiffusion3Pipeline` (float32, CPU), `torch.manual_seed(seed)` first.

    shift: the flow-matching scheduler's timestep shift (SD3 uses 3.0 at 1024 px; small images need less).
    The VAE's `shift_factor`/`scaling_factor` are 0/1 until `set_latent_stats` is called on trained weights.
    """
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    clip_config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **CLIP_CONFIG,
    )
    tokenizer_3 = build_t5_tokenizer()
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(VAE_CHANNELS),
        up_block_types=("UpDecoderBlock2D",) * len(VAE_CHANNELS),
        block_out_channels=VAE_CHANNELS,
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=IMAGE_SIZE,
        mid_block_add_attention=False,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0,
        scaling_factor=1.0,
    )
    return StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**TRANSFORMER_CONFIG),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift),
        vae=vae,
        text_encoder=CLIPTextModelWithProjection(clip_config),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(clip_config),
        tokenizer_2=build_tokenizer(),
        text_encoder_3=T5EncoderModel(
            T5Config(vocab_size=len(tokenizer_3), pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **T5_CONFIG)
        ),
        tokenizer_3=tokenizer_3,
    )


def set_latent_stats(vae, shift_factor: float, scaling_factor: float) -> None:
    """Record the latent normalisation SD3 uses, `x0 = (z - shift_factor) * scaling_factor`, in the VAE config."""
    vae.register_to_config(shift_factor=float(shift_factor), scaling_factor=float(scaling_factor))


def ode_sample(pipe, prompts: list[str], *, steps: int, guidance: float, seed: int) -> np.ndarray:
    """The pipeline's own ODE sampler (Euler on the flow), as a user calls it -> uint8[B, 64, 64, 3]."""
    import torch

    out = pipe(
        prompts,
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=IMAGE_SIZE,
        width=IMAGE_SIZE,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    )
    return np.clip(np.round(out.images * 255.0), 0, 255).astype(np.uint8)


def ode_accuracy(
    pipe, records: list[dict], n_images: int, steps: int, guidance: float, seed: int, batch: int = 32
) -> dict:
    """Sample `n_images` (cycling through `records`, batch by batch with seeds `seed + start`) and score them.

    -> {"strict": mean, "fraction": mean, "by_family": {family: strict mean}, "n": n_images,
        "failures": {kind: share of the images with it}, "failures_by_family": {family: {kind: share}},
        "images": uint8[n, 64, 64, 3], "strict_per_image": [n]}; the kinds are `detect.FAILURE_KINDS`.
    """
    from .detect import FAILURE_KINDS, score_images

    chosen = [records[i % len(records)] for i in range(n_images)]
    strict, fraction, images, failures = [], [], [], []
    for start in range(0, n_images, batch):
        part = chosen[start : start + batch]
        imgs = ode_sample(pipe, [r["prompt"] for r in part], steps=steps, guidance=guidance, seed=seed + start)
        s, f, details = score_images(list(imgs), part)
        strict += s.tolist()
        fraction += f.tolist()
        failures += [d["failures"] for d in details]
        images.append(imgs)
    by_family: dict[str, list[float]] = {}
    failed_by_family: dict[str, list[list[str]]] = {}
    for r, s, fails in zip(chosen, strict, failures):
        by_family.setdefault(r["family"], []).append(s)
        failed_by_family.setdefault(r["family"], []).append(fails)

    def shares(per_image: list[list[str]]) -> dict[str, float]:
        return {k: sum(k in fails for fails in per_image) / len(per_image) for k in FAILURE_KINDS}

    return {
        "strict": float(np.mean(strict)),
        "fraction": float(np.mean(fraction)),
        "by_family": {k: float(np.mean(v)) for k, v in sorted(by_family.items())},
        "failures": shares(failures),
        "failures_by_family": {k: shares(v) for k, v in sorted(failed_by_family.items())},
        "n": n_images,
        "images": np.concatenate(images),
        "strict_per_image": strict,
    }
