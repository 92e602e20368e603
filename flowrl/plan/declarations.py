"""What the planner's registries declare for `flowrl plan`: the types a model family, the text backend and a
distributed strategy fill in. A leaf module: it imports nothing of flowrl, so that the families and the strategies
import it without importing the planner's other modules (or each other)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Which tokens each Linear/Conv layer of a denoiser class sees, by the layer's name (regexes, searched in
    this order): `one`: one vector per sample (timestep and pooled-text embeddings, adaLN modulation);
    `joint`: image and text tokens together (single-stream blocks); `txt`: the text tokens; anything else:
    the image tokens (for a UNet, those of the resolution level its name says). `blocks`: the modules that
    gradient checkpointing recomputes (diffusers checkpoints them one by one)."""

    blocks: str
    one: str
    txt: str
    joint: str = r"(?!)"
    unet: bool = False


@dataclass(frozen=True)
class Calibration:
    """The activation model's factors for one model class (see `activation_bytes`), and where they come from."""

    alpha: float  # bytes kept for the backward pass per unit (tokens x fan) of a layer, in units of the dtype
    kappa: float  # with checkpointing: bytes kept per element of a block's input, in units of the dtype
    rho: float  # with checkpointing: the recomputed block's bytes (its activations and its backward's) per unit
    measured: str  # where the numbers come from
    head: float = 0.0  # a causal LM's output head: bytes per token x vocabulary entry, in units of the dtype
    chunk: float = 0.0  # a causal LM's log-prob: float32 [rows, vocabulary] buffers of its row chunks
    gamma: float = 1.0  # the rollout without gradients: a denoiser's bytes per unit of its largest block and the
    #                     layers outside the blocks; a causal LM's per token x vocabulary entry of its logits
    gamma_chunk: float = 0.0  # a causal LM's rollout: float32 [rows, vocabulary] buffers of the log-prob's chunks
