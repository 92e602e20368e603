"""The activation model: the Linear/Conv layers of a denoiser with the tokens each sees in one model row (from its
family's `Layout`), the shape terms they add up to, and the bytes the update keeps for the backward pass with and
without gradient checkpointing (the `Calibration` factors, measured by benchmarks/memory.py)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .declarations import Calibration, Layout
from .models import DTYPE_BYTES

_ADALN = r"norm1(_context)?\.linear|norm\.linear|norm_out\.linear"
LAYOUTS: dict[str, Layout] = {
    "SD3Transformer2DModel": Layout(
        blocks=r"transformer_blocks\.\d+", one=rf"time_text_embed|{_ADALN}",
        txt=r"context_embedder|attn\.add_|to_add_out|ff_context"),
    "FluxTransformer2DModel": Layout(
        blocks=r"(single_)?transformer_blocks\.\d+", one=rf"time_text_embed|{_ADALN}",
        txt=r"context_embedder|attn\.add_|to_add_out|ff_context", joint=r"single_transformer_blocks"),
    "Flux2Transformer2DModel": Layout(
        blocks=r"(single_)?transformer_blocks\.\d+", one=r"time_guidance_embed|modulation|norm_out\.linear",
        txt=r"context_embedder|attn\.add_|to_add_out|ff_context", joint=r"single_transformer_blocks"),
    "QwenImageTransformer2DModel": Layout(
        blocks=r"transformer_blocks\.\d+", one=r"time_text_embed|_mod\.|norm_out\.linear",
        txt=r"txt_|attn\.add_|to_add_out"),
    "ZImageTransformer2DModel": Layout(
        blocks=r"(layers|noise_refiner|context_refiner)\.\d+", one=r"t_embedder|adaLN_modulation",
        txt=r"cap_embedder|context_refiner", joint=r"^layers\."),
    "SanaTransformer2DModel": Layout(
        blocks=r"transformer_blocks\.\d+", one=r"time_embed", txt=r"caption_projection|attn2\.to_[kv]$"),
    "UNet2DConditionModel": Layout(  # diffusers checkpoints the resnets and the attentions' transformer blocks
        blocks=(r"(down_blocks\.\d+\.|up_blocks\.\d+\.|mid_block\.)"
                r"(resnets\.\d+|attentions\.\d+\.transformer_blocks\.\d+)"),
        one=r"time_embedding|time_emb_proj|add_embedding", txt=r"attn2\.to_[kv]$", unet=True),
}
#: the layout of a denoiser class not in LAYOUTS, from the names diffusers' transformers share
GENERIC_LAYOUT = Layout(blocks=r"(single_)?transformer_blocks\.\d+|layers\.\d+",
                        one=r"time|modulation|adaLN|norm_out\.linear|norm1(_context)?\.linear|norm\.linear",
                        txt=r"context|add_|txt|caption|cap_", joint=r"single_transformer_blocks")


@dataclass(frozen=True)
class Layer:
    """A Linear or Conv layer of the denoiser, for one model row: the tokens it sees (in and out; they differ
    for a UNet's down/up-samplers), its fan-in and fan-out, the block it belongs to (None: outside every
    checkpointed block) and its LoRA rank (0: not adapted)."""

    name: str
    stream: str  # "one", "joint", "txt", "img" or, in a UNet, "img<level>"
    tokens_in: int
    tokens_out: int
    fan_in: int
    fan_out: int
    block: str | None
    lora_rank: int = 0

    @property
    def units(self) -> int:
        """tokens x (fan-in + fan-out): the elements of this layer's input and output."""
        return self.tokens_in * self.fan_in + self.tokens_out * self.fan_out


def denoiser_layers(module: torch.nn.Module, class_name: str, *, image_tokens: int, text_tokens: int,
                    levels: int = 1, lora_targets: Mapping[str, int] | None = None) -> list[Layer]:
    """The Linear/Conv layers of a denoiser with the tokens each sees in one model row.

    image_tokens: the image tokens at the denoiser's input (for a UNet: latent height x width, level 0).
    text_tokens: the prompt embedding's tokens. levels: a UNet's resolution levels (len(block_out_channels)).
    lora_targets: name -> LoRA rank of the adapted layers."""
    layout = LAYOUTS.get(class_name, GENERIC_LAYOUT)
    lora_targets = lora_targets or {}
    layers = []
    for name, mod in module.named_modules():
        if ".lora_" in name:  # an adapter's own layers (counted by lora_cast_bytes)
            continue
        name = name.removesuffix(".base_layer")  # the layer a LoRA wraps
        if isinstance(mod, torch.nn.Linear):
            fan_in, fan_out = mod.in_features, mod.out_features
        elif isinstance(mod, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
            fan_in, fan_out = mod.in_channels, mod.out_channels
        else:
            continue
        block = re.match(rf"({layout.blocks})(\.|$)", name)
        block = block.group(1) if block else None
        if re.search(layout.one, name):
            stream, t_in, t_out = "one", 1, 1
        elif re.search(layout.joint, name):
            stream, t_in, t_out = "joint", image_tokens + text_tokens, image_tokens + text_tokens
        elif re.search(layout.txt, name):
            stream, t_in, t_out = "txt", text_tokens, text_tokens
        elif layout.unet:
            stream, t_in, t_out = _unet_tokens(name, image_tokens, levels)
        else:
            stream, t_in, t_out = "img", image_tokens, image_tokens
        layers.append(Layer(name, stream, t_in, t_out, fan_in, fan_out, block, lora_targets.get(name, 0)))
    return layers


def _unet_tokens(name: str, image_tokens: int, levels: int) -> tuple[str, int, int]:
    """(stream, tokens in, tokens out) of a UNet layer: level i of the down path has image_tokens / 4^i; up
    block i runs at level levels-1-i; a downsampler halves each side, an upsampler's conv runs after the
    doubling."""
    level = 0
    if m := re.match(r"down_blocks\.(\d+)", name):
        level = int(m.group(1))
    elif m := re.match(r"up_blocks\.(\d+)", name):
        level = levels - 1 - int(m.group(1))
    elif name.startswith("mid_block"):
        level = levels - 1
    tokens = max(1, image_tokens // 4**level)
    if ".downsamplers." in name:
        return f"img{level}", tokens, max(1, tokens // 4)
    if ".upsamplers." in name:
        return f"img{level - 1}", tokens * 4, tokens * 4
    return f"img{level}", tokens, tokens




CALIBRATION: dict[str, Calibration] = {
    # SD3 of 8 blocks of 512 (dual attention in 4, qk RMS norm), 256 + 32 tokens: 133.4 / 527.6 / 2104.4 and
    # 27.2 / 103.1 / 406.4; of 24 blocks of 256 (dual attention in 13): 201.7 / 798.0 and 18.4 / 64.7 (micro 1 / 4).
    # Within 0.3% without checkpointing, 0.2% with it.
    # The rollout's denoiser (no gradients, 2 and 4 images with CFG): 15.7 / 31.4 MiB, gamma 0.513.
    "SD3Transformer2DModel": Calibration(0.970, 0.61, 1.17, "calibrated on measured SD3s of 8 x 512 and 24 x 256 "
                                                            "blocks (benchmarks/memory.py)", gamma=0.513),
    # FLUX.1 of 3 double + 6 single blocks of 512, 256 + 16 tokens: 54.7 / 213.9 / 850.8 and 12.6 / 46.2 / 180.5;
    # of 6 + 12 blocks of 256: 52.7 / 205.9 and 8.2 / 28.7. Within 2.5% without checkpointing, 0.8% with it.
    # The rollout's denoiser (2 and 4 images): 9.4 / 18.7 MiB, gamma 0.873.
    "FluxTransformer2DModel": Calibration(0.860, 1.00, 1.25, "calibrated on measured FLUX.1s of 3 + 6 x 512 and "
                                                             "6 + 12 x 256 blocks (benchmarks/memory.py)", gamma=0.873),
    # SD1.5's UNet at a fifth of its width (64 / 128 / 256 / 256 channels, 2 layers per block), 1024 latent pixels +
    # 16 tokens: 109.1 / 432.9 / 1728.5 and 26.1 / 101.2 / 401.6; with 1 layer per block: 68.6 / 272.2 and
    # 20.9 / 81.4 (micro 1 / 4). Within 1.1% without checkpointing, 0.1% with it.
    # The rollout's denoiser (2 and 4 images with CFG): 13.1 / 26.2 MiB, gamma 0.364.
    "UNet2DConditionModel": Calibration(0.941, 0.59, 1.00, "calibrated on measured SD1.5-style UNets of 1 and 2 "
                                                           "layers per block (benchmarks/memory.py)", gamma=0.364),
    # causal LMs (Qwen2, ~69 tokens): 4 layers of 256 with a 151,936 vocabulary: 313.1 / 498.7 / 742.4 and
    # 307.1 / 486.6 / 718.2; 8 layers of 512, vocabulary 1,024: 27.7 / 55.4 / 110.9 and 6.1 / 12.2 / 24.4; 24 layers
    # of 256: 41.1 / 82.2 / 164.3 and 4.2 / 8.4 / 16.9 (micro 2 / 4 / 8). Over micro-batch 1 to 16 (the benchmark's
    # default run) within 14% without checkpointing (at micro-batch 1 the logits' slice is contiguous and the
    # log-prob makes one copy fewer) and 19% with it.
    # The rollout (generate, then the old log-probs of 2 / 4 / 8 completions in one forward), vocabulary 151,936:
    # 205.8 / 284.0 / 440.5 MiB: 39.1 MiB per completion = 1.95 x its bf16 logits (they and the copy the log-prob
    # makes of their slice) and 128 MiB once = 2 float32 row chunks of 2^24 elements; within 2% up to 16
    # completions. With a 1,024 vocabulary the hidden states, left out, matter: 32% under.
    "causal LM": Calibration(0.849, 0.52, 1.42, "calibrated on measured Qwen2s of 4 x 256 (vocabulary 151,936), "
                                                "8 x 512 and 24 x 256 layers (benchmarks/memory.py)",
                             head=3.437, chunk=2.714, gamma=1.95, gamma_chunk=2.0),
}
DEFAULT_CALIBRATION = Calibration(alpha=1.0, kappa=1.5, rho=1.5, head=4.0, chunk=3.0,
                                  measured="not calibrated: the factors are a guess from the calibrated classes")
#: denoiser classes not measured yet, and the measured class whose blocks theirs resemble most
BORROWED = {
    "QwenImageTransformer2DModel": "FluxTransformer2DModel",  # double-stream blocks with RoPE, as FLUX.1's
    "Flux2Transformer2DModel": "FluxTransformer2DModel",  # double- then single-stream blocks
    "ZImageTransformer2DModel": "FluxTransformer2DModel",  # single-stream blocks over image and text tokens
}


def calibration(class_name: str) -> Calibration:
    """The activation factors of a model class: its own (CALIBRATION), a similar class's (BORROWED), or the
    DEFAULT_CALIBRATION guess; `measured` says which."""
    if class_name in CALIBRATION:
        return CALIBRATION[class_name]
    if class_name in BORROWED:
        return dataclasses.replace(CALIBRATION[BORROWED[class_name]],
                                   measured=f"not measured: {BORROWED[class_name]}'s factors (similar blocks); run "
                                            f"benchmarks/memory.py on a {class_name} to calibrate it")
    return DEFAULT_CALIBRATION


class ActivationTerms(NamedTuple):
    """The shape terms of the activation model for one model row (see `activation_bytes`)."""

    units: int  # sum over the layers of tokens x (fan-in + fan-out)
    units_checkpointed: int  # the same over the largest block and the layers outside every block
    kept: int  # sum over the blocks of their input's elements (what checkpointing keeps)
    lora: float  # bytes LoRA adds (lora_cast_bytes) over all layers
    lora_checkpointed: float  # the same over the largest block and the layers outside every block


def lora_cast_bytes(layer: Layer, dtype: str) -> float:
    """What a LoRA adapter adds to the saved activations of its layer: peft casts the layer's input to the
    adapter's float32 (a copy, kept for lora_A's backward, when the model is not float32) and keeps lora_A's
    float32 output for lora_B's backward."""
    if not layer.lora_rank:
        return 0.0
    cast = layer.tokens_in * layer.fan_in * 4 if dtype != "float32" else 0
    return cast + layer.tokens_in * layer.lora_rank * 4


def activation_terms(layers: list[Layer], dtype: str) -> ActivationTerms:
    """The shape terms of `layers` (one model row). A block's input is, per token stream it holds, the input
    of the stream's first layer: the hidden states diffusers' checkpointing keeps."""
    blocks: dict[str | None, list[Layer]] = {}
    for layer in layers:
        blocks.setdefault(layer.block, []).append(layer)
    outside = blocks.pop(None, [])
    units = lambda group: sum(layer.units for layer in group)  # noqa: E731
    lora = lambda group: sum(lora_cast_bytes(layer, dtype) for layer in group)  # noqa: E731
    kept = 0
    for group in blocks.values():
        first: dict[str, int] = {}
        for layer in group:
            if layer.stream != "one":
                first.setdefault(layer.stream, layer.tokens_in * layer.fan_in)
        kept += sum(first.values())
    largest = max(blocks.values(), key=units, default=[])
    return ActivationTerms(units(layers), units(largest) + units(outside), kept, lora(layers),
                           lora(largest) + lora(outside))


@dataclass(frozen=True)
class Activations:
    """The update's activation memory (bytes) of one model row, in the pieces the peak is made of. plain: what
    the backward pass needs without checkpointing; with it, the blocks' inputs (`kept`) stay while one block
    at a time is recomputed (`recompute`, with the layers outside the blocks), and a causal LM's output head
    (`head`) is done with before the first block is recomputed."""

    plain: float
    kept: float
    recompute: float
    head: float = 0.0
    calibrated: bool = True

    @property
    def checkpointed(self) -> float:
        return min(self.plain, self.kept + max(self.recompute, self.head))


def activation_bytes(terms: ActivationTerms, class_name: str, dtype: str, head_units: int = 0) -> Activations:
    """The activations one model row keeps for the backward pass (b: the dtype's size):

        plain        = alpha x b x units + LoRA + head
        checkpointed = kappa x b x kept + max(rho x b x units_checkpointed + LoRA_checkpointed, head)

    units: sum over the layers of tokens x (fan-in + fan-out); kept: the blocks' inputs, which checkpointing
    keeps while it recomputes one block at a time and runs its backward (rho: that block's activations and
    its backward's temporaries, with the layers outside the blocks; see ActivationTerms); head = head_factor
    x b x head_units, a causal LM's output head (tokens x vocabulary: the logits the log-probs keep and their
    gradients), done with before the first block is recomputed. The factors are per model class (CALIBRATION)."""
    cal = calibration(class_name)
    b = DTYPE_BYTES[dtype]
    head = cal.head * b * head_units
    return Activations(plain=cal.alpha * b * terms.units + terms.lora + head, kept=cal.kappa * b * terms.kept,
                       recompute=cal.rho * b * terms.units_checkpointed + terms.lora_checkpointed, head=head,
                       calibrated=class_name in CALIBRATION)




def block_params(module: torch.nn.Module, blocks: str) -> int:
    """The parameters of the largest checkpointed block (what FSDP gathers at once)."""
    sizes: dict[str, int] = {}
    for name, p in module.named_parameters():
        if ".lora_" in name:
            continue
        m = re.match(rf"({blocks})\.", name)
        if m:
            sizes[m.group(1)] = sizes.get(m.group(1), 0) + p.numel()
    return max(sizes.values(), default=0)
