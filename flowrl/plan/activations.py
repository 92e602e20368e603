"""The activation model: the Linear/Conv layers of a denoiser with the tokens each sees in one model row (from its
family's `Layout`), the shape terms they add up to, and the bytes the update keeps for the backward pass with and
without gradient checkpointing (the `Calibration` factors, measured by benchmarks/memory.py)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .declarations import Calibration, Layout
from .models import DTYPE_BYTES


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


def denoiser_layers(
    module: torch.nn.Module,
    layout: Layout,
    *,
    image_tokens: int,
    text_tokens: int,
    levels: int = 1,
    lora_targets: Mapping[str, int] | None = None,
) -> list[Layer]:
    """The Linear/Conv layers of a denoiser with the tokens each sees in one model row, read with `layout` (its
    family's `plan_layout`).

    image_tokens: the image tokens at the denoiser's input (for a UNet: latent height x width, level 0).
    text_tokens: the prompt embedding's tokens. levels: a UNet's resolution levels (len(block_out_channels)).
    lora_targets: name -> LoRA rank of the adapted layers."""
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
    return ActivationTerms(
        units(layers), units(largest) + units(outside), kept, lora(layers), lora(largest) + lora(outside)
    )


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


def activation_bytes(terms: ActivationTerms, cal: Calibration, dtype: str, head_units: int = 0) -> Activations:
    """The activations one model row keeps for the backward pass (b: the dtype's size):

        plain        = alpha x b x units + LoRA + head
        checkpointed = kappa x b x kept + max(rho x b x units_checkpointed + LoRA_checkpointed, head)

    units: sum over the layers of tokens x (fan-in + fan-out); kept: the blocks' inputs, which checkpointing
    keeps while it recomputes one block at a time and runs its backward (rho: that block's activations and
    its backward's temporaries, with the layers outside the blocks; see ActivationTerms); head = head_factor
    x b x head_units, a causal LM's output head (tokens x vocabulary: the logits the log-probs keep and their
    gradients), done with before the first block is recomputed. The factors are the model class's `cal`: its
    family's `plan_calibration`, or the text planner's LM_CALIBRATION."""
    b = DTYPE_BYTES[dtype]
    head = cal.head * b * head_units
    return Activations(
        plain=cal.alpha * b * terms.units + terms.lora + head,
        kept=cal.kappa * b * terms.kept,
        recompute=cal.rho * b * terms.units_checkpointed + terms.lora_checkpointed,
        head=head,
        calibrated=cal.calibrated,
    )


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
