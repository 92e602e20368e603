"""The shapes of an image run: the latent and token counts of a denoiser row at a size (a video's latent frames, an
editor's source images), the prompts and conditioning images of the data, and the VAE decoder's peak."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .models import Component


def _vae_factor_and_channels(vae: Mapping) -> tuple[int, int]:
    """(spatial downsampling factor, latent channels) of a VAE config."""
    cls = vae.get("_class_name", "AutoencoderKL")
    if cls in ("AutoencoderKLQwenImage", "AutoencoderKLWan"):
        return 2 ** len(vae.get("temperal_downsample", [False, True, True])), vae.get("z_dim", 16)
    if cls == "AutoencoderDC":
        return 2 ** (len(vae["encoder_block_out_channels"]) - 1), vae.get("latent_channels", 32)
    return 2 ** (len(vae.get("block_out_channels", [0, 0, 0, 0])) - 1), vae.get("latent_channels", 4)


def latent_frames(vae: Mapping, num_frames: int) -> int:
    """The latent frames of a clip of `num_frames` frames: a video VAE (AutoencoderKLWan) compresses time by
    2^(its temporal downsamplings) after the first frame, F' = (F - 1) / 2^k + 1; an image VAE keeps F."""
    if vae.get("_class_name") == "AutoencoderKLWan":
        return (num_frames - 1) // 2 ** sum(bool(d) for d in vae.get("temperal_downsample", [False, True, True])) + 1
    return num_frames


def config_dict(module) -> dict:
    return {"_class_name": type(module).__name__, **dict(module.config)} if module is not None else {}


@dataclass(frozen=True)
class ImageShape:
    """The update's shapes: tokens per model row, latent elements per sample, text-embedding size; with
    conditioning images (`ImageBackend.condition_tokens`) their tokens are among the image and text tokens, and
    `condition_elements` is what a sample keeps of them (their latents, or a condition in the latents' channels)."""

    image_tokens: int
    text_tokens: int
    levels: int
    latent_elements: int
    text_width: int
    frames: int = 1
    condition_elements: int = 0
    sources: int = 0


def image_shape(
    components: Mapping[str, Component],
    denoiser_attr: str,
    height: int,
    width: int,
    max_sequence_length: int,
    num_frames: int = 1,
    family=None,
    max_sources: int | None = None,
) -> ImageShape:
    """The token counts of a denoiser row at height x width (x num_frames: a video's latent frames times its
    patches), from the denoiser's and the VAE's configs; the text tokens per denoiser class (SD3: CLIP's 77 then
    the T5 tokens; a UNet: the CLIP encoder's length; Wan image-to-video: its CLIP image tokens too; the others:
    `sample.max_sequence_length`, an upper bound where the pipeline drops the padding). `family` (an ImageBackend
    class) adds its conditioning images' tokens: `max_sources` of them (the most a prompt of the data holds), or
    when that is unknown (None) the most the family takes (`condition_images`)."""
    den = components[denoiser_attr].module
    config = config_dict(den)
    vae = config_dict(components["vae"].module) if "vae" in components else {}
    factor, latent_channels = _vae_factor_and_channels(vae) if vae else (8, config.get("in_channels", 4))
    in_channels = config.get("in_channels", latent_channels)
    patch = config.get("patch_size") or (config.get("all_patch_size") or [1])[0]
    pt, ph, pw = (
        tuple(patch)
        if isinstance(patch, (list, tuple)) and len(patch) == 3
        else (1, *(tuple(patch) if isinstance(patch, (list, tuple)) else (patch, patch)))
    )
    packed = in_channels == 4 * latent_channels  # latents packed 2x2 by the pipeline (FLUX, Qwen-Image, FLUX.2)
    if packed:
        ph = pw = 2
    frames = latent_frames(vae, num_frames)
    cls = type(den).__name__

    def tokens_at(height: int, width: int, frames: int = 1) -> int:
        return -(-frames // pt) * ((height // factor) // ph) * ((width // factor) // pw)

    h, w = height // factor, width // factor
    clip = next(
        (
            c.module.config.max_position_embeddings
            for n, c in components.items()
            if n.startswith("text_encoder") and c.module is not None and type(c.module).__name__.startswith("CLIPText")
        ),
        77,
    )
    if cls == "SD3Transformer2DModel":
        text_tokens = clip + max_sequence_length
    elif cls == "UNet2DConditionModel":
        text_tokens = clip
    else:
        text_tokens = max_sequence_length
    encoder = components.get("image_encoder")
    if cls == "WanTransformer3DModel" and config.get("image_dim") and encoder is not None and encoder.module:
        vision = encoder.module.config  # its penultimate hidden states: the patches and the class token
        text_tokens += (vision.image_size // vision.patch_size) ** 2 + 1
    text_width = (
        config.get("joint_attention_dim")
        or config.get("cross_attention_dim")
        or config.get("caption_channels")
        or config.get("cap_feat_dim")
        or config.get("text_dim")
        or 0
    )
    levels = len(config.get("block_out_channels", [0])) if cls == "UNet2DConditionModel" else 1
    image_tokens, elements = tokens_at(height, width, frames), latent_channels * frames * h * w
    if family is None:
        sources = 0
    else:
        low, high = family.condition_images
        sources = high if max_sources is None else min(high, max(low, max_sources))
    condition = 0
    if sources:
        source_image, source_text = family.condition_tokens(height, width, tokens_at)
        image_tokens += sources * source_image
        text_tokens += sources * source_text
        condition = sources * source_image * elements // max(1, tokens_at(height, width, frames))
    if in_channels > latent_channels and not packed:  # a condition concatenated to the latents' channels
        condition += (in_channels - latent_channels) * frames * h * w
    return ImageShape(image_tokens, text_tokens, levels, elements, int(text_width), frames, condition, sources)


def prompt_file(spec: str, column: str, prompt_column: str = "prompt") -> tuple[int | None, int | None]:
    """(prompts, the most conditioning images a prompt holds in `column`) of a local prompt file, read as training
    reads it (`flowrl.data.load_prompts`: a .txt, .jsonl, .json, .csv or .tsv file, its prompts in `prompt_column`;
    the images counted, not opened); None for what is not known (a `hf:` dataset, no such file, a .txt file's images,
    a file the prompt loader refuses: it names its problems when the run starts)."""
    if not spec or spec.startswith("hf:") or not os.path.isfile(spec):
        return None, None
    from flowrl.conditioning import image_count
    from flowrl.data import load_prompts

    try:  # (image_column "": the column is kept as the file gives it, a path or a list of paths)
        prompts = load_prompts(spec, column=prompt_column, image_column="")
    except (ValueError, OSError):  # (a PromptFileError): the run's own check names it
        return None, None
    if not column or spec.lower().endswith(".txt"):
        return len(prompts), None
    return len(prompts), max((image_count(meta, column) for meta in prompts.metadata), default=0)


#: the VAE decoder without gradients: bytes per image per element of its full-resolution feature map (height x
#: width x the channels of the decoder's last block), in units of the dtype. Measured (benchmarks/memory.py,
#: measure_vae_decode) on SD3.5's VAE in bfloat16: 24.0 / 48.0 MiB for 1 / 2 images of 128 px, 162.0 MiB for
#: 3 of 192 px, 96.0 and 384.0 MiB for one of 256 and 512 px: 6.0 everywhere. FLUX.1's, SD1.5's and SDXL's
#: decoders have the same blocks; the other VAE classes' factor is this one, not measured.
VAE_DECODE_FACTOR = 6.0


def vae_decode_bytes(vae: Mapping, height: int, width: int, b: int) -> float | None:
    """The VAE decoder's peak for one image (bytes): VAE_DECODE_FACTOR x b x height x width x the channels of
    its full-resolution block. None for a VAE class whose decoder this does not know."""
    channels = {
        "AutoencoderKL": lambda c: (c.get("decoder_block_out_channels") or c["block_out_channels"])[0],
        "AutoencoderKLFlux2": lambda c: (c.get("decoder_block_out_channels") or c["block_out_channels"])[0],
        "AutoencoderKLQwenImage": lambda c: c.get("base_dim", 96),
        "AutoencoderDC": lambda c: c["decoder_block_out_channels"][0],
    }.get(vae.get("_class_name"))
    return None if channels is None else VAE_DECODE_FACTOR * b * height * width * channels(vae)
