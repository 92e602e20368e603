"""What the planner's registries declare for `flowrl plan`: the types a model family and the text backend fill in.
A leaf module: it imports nothing of flowrl, so that the families import it without importing the planner's other
modules (or each other).

A family (flowrl/families/) declares, in its backend class, how the planner sees its denoiser class:

    plan_layout = Layout(blocks=r"transformer_blocks\\.\\d+", one=r"time_text_embed|norm1\\.linear",
                         txt=r"context_embedder")
    plan_calibration = Calibration(0.970, 0.61, 1.17, "calibrated on measured SD3s (benchmarks/memory.py)")

or borrows a measured class's factors (`Calibration.borrowed`), or says it was never measured (`NOT_CALIBRATED`).
"""

from __future__ import annotations

import dataclasses
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


#: the adaLN modulation Linears of diffusers' MMDiT blocks (SD3, FLUX.1): one vector per sample
MMDIT_ADALN = r"norm1(_context)?\.linear|norm\.linear|norm_out\.linear"

#: the layout of a denoiser class no family declares (a model of the user's own under a family's pipeline), from the
#: module names diffusers' transformers share
GENERIC_LAYOUT = Layout(
    blocks=r"(single_)?transformer_blocks\.\d+|layers\.\d+",
    one=r"time|modulation|adaLN|norm_out\.linear|norm1(_context)?\.linear|norm\.linear",
    txt=r"context|add_|txt|caption|cap_",
    joint=r"single_transformer_blocks",
)


@dataclass(frozen=True)
class Calibration:
    """The activation model's factors for one model class (see `activation_bytes`), and where they come from.
    `calibrated`: measured on this class (False: borrowed from a similar class, or a guess)."""

    alpha: float  # bytes kept for the backward pass per unit (tokens x fan) of a layer, in units of the dtype
    kappa: float  # with checkpointing: bytes kept per element of a block's input, in units of the dtype
    rho: float  # with checkpointing: the recomputed block's bytes (its activations and its backward's) per unit
    measured: str  # where the numbers come from
    head: float = 0.0  # a causal LM's output head: bytes per token x vocabulary entry, in units of the dtype
    chunk: float = 0.0  # a causal LM's log-prob: float32 [rows, vocabulary] buffers of its row chunks
    gamma: float = 1.0  # the rollout without gradients: a denoiser's bytes per unit of its largest block and the
    #                     layers outside the blocks; a causal LM's per token x vocabulary entry of its logits
    gamma_chunk: float = 0.0  # a causal LM's rollout: float32 [rows, vocabulary] buffers of the log-prob's chunks
    calibrated: bool = True

    def borrowed(self, source: str, borrower: str) -> Calibration:
        """These factors, measured on class `source`, lent to class `borrower` (not measured yet) whose blocks
        resemble the source's; `measured` says so and how to calibrate it."""
        return dataclasses.replace(
            self,
            calibrated=False,
            measured=f"not measured: {source}'s factors (similar blocks); run "
            f"benchmarks/memory.py on a {borrower} to calibrate it",
        )


#: the factors of a class never measured and like no measured one: a guess from the calibrated classes
NOT_CALIBRATED = Calibration(
    alpha=1.0,
    kappa=1.5,
    rho=1.5,
    head=4.0,
    chunk=3.0,
    calibrated=False,
    measured="not calibrated: the factors are a guess from the calibrated classes",
)


#: what a distributed strategy may split over the processes (`Strategy.shards`)
SHARDABLE = ("weights", "gradients", "optimizer")


@dataclass(frozen=True)
class StrategyTerms:
    """What a distributed strategy keeps on each GPU besides dividing what it shards by the process count, as it
    declares it (`Strategy.plan_terms`) for its column of `flowrl plan`."""

    gathered_blocks: int = 0  # whole blocks it gathers from the shards at once (FSDP2: the one running, the next)
    gradient_copy: bool = False  # its gradient all-reduce holds a copy of the gradients (DDP's buckets), > 1 process
    kept: tuple[tuple[str, float], ...] = ()  # (row label, bytes per GPU) of buffers of its own, held all along
    #: (row label, bytes per GPU) of buffers only its backward pass holds, beside the activations (ZeRO's gradient
    #: bucket): counted in the update, not in the rollout
    backward: tuple[tuple[str, float], ...] = ()
