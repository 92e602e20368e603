"""The rollout recorder: which steps are stochastic (the SDE window), and the loop that records them.

The loop knows nothing of diffusers: a backend hands it `denoise(x, i)` (the model output at step i)
and `step(model_output, x, i, stochastic)` (a kernel from flow_sde.py / ddim.py) and gets back every
latent, log-prob and std. Steps outside the window are taken deterministically (ODE / eta = 0) and
are not trained.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from flowrl.sampling.step import StepOutput

WINDOW_KINDS = ("all", "fixed", "sliding")


@dataclass(frozen=True)
class SDEWindow:
    """Which of the S denoising steps are stochastic (and trained), possibly changing with the epoch.

    - all:     every step (Flow-GRPO, DanceGRPO, DDPO).
    - fixed:   steps [start, start + size) (Flow-GRPO-Fast); the rest are ODE steps.
    - sliding: a window of `size` steps whose start moves by `stride` every `every` epochs, from
               `start` up to `limit - size` (limit defaults to S), then rolls back to `start`
               (MixGRPO's progressive strategy, arXiv 2507.21802).
    """

    kind: str = "all"
    start: int = 0
    size: int | None = None
    stride: int = 1
    every: int = 1
    limit: int | None = None

    def __post_init__(self):
        if self.kind not in WINDOW_KINDS:
            raise ValueError(f"SDE window kind must be one of {WINDOW_KINDS}, got {self.kind!r}")
        if self.kind != "all" and (self.size is None or self.size < 1):
            raise ValueError(f"a {self.kind!r} SDE window needs size >= 1, got {self.size}")
        if self.start < 0 or self.stride < 1 or self.every < 1:
            raise ValueError(
                f"SDE window needs start >= 0, stride >= 1, every >= 1; got start={self.start}, "
                f"stride={self.stride}, every={self.every}"
            )

    @classmethod
    def all_steps(cls) -> SDEWindow:
        return cls("all")

    @classmethod
    def fixed(cls, start: int, size: int) -> SDEWindow:
        return cls("fixed", start=start, size=size)

    @classmethod
    def sliding(cls, size: int, *, stride: int = 1, every: int = 1, start: int = 0, limit: int | None = None):
        return cls("sliding", start=start, size=size, stride=stride, every=every, limit=limit)

    def steps(self, num_steps: int, epoch: int = 0) -> range:
        """The stochastic step indices at `epoch` for a rollout of `num_steps` steps."""
        if self.kind == "all":
            return range(num_steps)
        if self.kind == "fixed":
            if self.start + self.size > num_steps:
                raise ValueError(
                    f"SDE window [{self.start}, {self.start + self.size}) does not fit in {num_steps} steps"
                )
            return range(self.start, self.start + self.size)
        limit = num_steps if self.limit is None else min(self.limit, num_steps)
        last_start = limit - self.size
        if last_start < self.start:
            raise ValueError(
                f"a sliding SDE window of size {self.size} from step {self.start} does not fit below "
                f"step {limit} ({num_steps} steps)"
            )
        positions = (last_start - self.start) // self.stride + 1
        begin = self.start + ((epoch // self.every) % positions) * self.stride
        return range(begin, begin + self.size)

    def mask(self, num_steps: int, epoch: int = 0) -> Tensor:
        """[num_steps] bool, True on the stochastic steps."""
        mask = torch.zeros(num_steps, dtype=torch.bool)
        mask[list(self.steps(num_steps, epoch))] = True
        return mask


def as_sde_window(spec: SDEWindow | tuple[int, int] | str | None) -> SDEWindow:
    """None or "all" -> every step; (start, size) -> a fixed window; an SDEWindow as is."""
    if spec is None or spec == "all":
        return SDEWindow()
    if isinstance(spec, SDEWindow):
        return spec
    if isinstance(spec, (tuple, list)) and len(spec) == 2:
        return SDEWindow.fixed(int(spec[0]), int(spec[1]))
    raise ValueError(f"sde_window must be None, 'all', (start, size) or an SDEWindow, got {spec!r}")


class Chain(NamedTuple):
    latents: Tensor  # [B, S+1, ...] in the latents' dtype ([B, 1, ...], the final sample, without keep_steps)
    log_probs: Tensor | None  # [B, S] float32 (None without keep_steps)
    stds: Tensor | None  # [S] float32 (None without keep_steps)
    means: Tensor | None  # [B, S, ...] float32, if recorded


def record_chain(
    denoise: Callable[[Tensor, int], Tensor],
    step: Callable[[Tensor, Tensor, int, bool], StepOutput],
    latents: Tensor,
    sde_mask: Tensor,
    *,
    record_means: bool = False,
    keep_steps: bool = True,
) -> Chain:
    """Run S = len(sde_mask) steps from `latents` [B, ...] and record each one.

    denoise(x, i) -> model output at step i;  step(model_output, x, i, stochastic) -> StepOutput.
    The latents fed to step i + 1 are exactly the recorded latents[:, i + 1].
    keep_steps=False keeps only the final sample (latents [B, 1, ...], no log-probs, stds or means): what a
    forward-process objective trains on, without S copies of the latents in memory.
    """
    batch, num_steps = latents.shape[0], len(sde_mask)
    if not keep_steps:
        if record_means:
            raise ValueError("record_means needs keep_steps=True (the means of steps that are not kept)")
        x = latents
        for i, stochastic in enumerate(sde_mask.tolist()):
            x = step(denoise(x, i), x, i, stochastic).prev_latents
        return Chain(x.unsqueeze(1), None, None, None)
    all_latents = latents.new_empty((batch, num_steps + 1, *latents.shape[1:]))
    all_latents[:, 0] = latents
    log_probs = torch.zeros(batch, num_steps, dtype=torch.float32, device=latents.device)
    stds = torch.zeros(num_steps, dtype=torch.float32, device=latents.device)
    means = None
    if record_means:
        means = torch.empty((batch, num_steps, *latents.shape[1:]), dtype=torch.float32, device=latents.device)
    x = latents
    for i, stochastic in enumerate(sde_mask.tolist()):
        out = step(denoise(x, i), x, i, stochastic)
        all_latents[:, i + 1] = out.prev_latents
        log_probs[:, i] = out.log_prob
        stds[i] = out.std[0].reshape(())  # one schedule for the batch: every row has this std
        if means is not None:
            means[:, i] = out.mean
        x = out.prev_latents
    return Chain(all_latents, log_probs, stds, means)
