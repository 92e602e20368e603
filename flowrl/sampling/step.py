"""What every sampler step returns, and the pieces the step kernels share.

A step kernel maps the model output at `x_t` to the Gaussian transition `x_{t-1} ~ N(mean, std^2 I)`,
draws `x_{t-1}` (or takes the one it is given) and scores it. All step math runs in float32 whatever
the model dtype; the drawn sample is rounded to the latents' dtype *before* it is scored, so that
the log-prob recorded at rollout is exactly the one recomputed later from the stored latents.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

LOGPROB_REDUCTIONS = ("mean", "sum")

Generator = torch.Generator | Sequence[torch.Generator] | None


class StepOutput(NamedTuple):
    """One denoising step.

    prev_latents: [B, ...] the next latents x_{t-1}, in the dtype of the input latents (the sampled
        ones, or the `prev_latents` given to the step).
    log_prob:     [B] float32 log-density of `prev_latents` under the transition, reduced over all
        non-batch dims ("mean" by default, or "sum"). Zeros for a deterministic step.
    mean:         [B, ...] float32 mean of the transition (`prev_sample_mean` in Flow-GRPO / DDPO).
    std:          [B, 1, ..., 1] float32 standard deviation of the transition itself, broadcastable
        to the latents (one value per sample: rows of a stacked batch may sit at different steps).
        Zeros for a deterministic step.
    """

    prev_latents: Tensor
    log_prob: Tensor
    mean: Tensor
    std: Tensor


def check_reduce(logprob_reduce: str) -> None:
    if logprob_reduce not in LOGPROB_REDUCTIONS:
        raise ValueError(
            f"logprob_reduce must be one of {LOGPROB_REDUCTIONS} (how the per-element log-density is "
            f"reduced over the non-batch dims), got {logprob_reduce!r}"
        )


def reduce_sample_dims(x: Tensor, logprob_reduce: str = "mean") -> Tensor:
    """[B, ...] -> [B]: mean (or sum) over every dim but the first."""
    dims = tuple(range(1, x.ndim))
    if not dims:
        return x
    return x.mean(dim=dims) if logprob_reduce == "mean" else x.sum(dim=dims)


def gaussian_log_density(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Element-wise log N(x; mean, std^2) = -(x - mean)^2 / (2 std^2) - log std - log sqrt(2 pi)."""
    return -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)


def batch_column(value: float | Tensor, batch: int, ndim: int, device: torch.device) -> Tensor:
    """A float, a 0-d tensor or a [B] tensor -> float32 [B, 1, ..., 1] with `ndim` dims in all."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    if t.ndim == 0:
        t = t.expand(batch)
    elif t.ndim != 1 or t.shape[0] != batch:
        raise ValueError(
            f"a per-sample schedule value must be a float, a 0-d tensor or a [B]={batch} tensor, "
            f"got shape {tuple(t.shape)}"
        )
    return t.reshape(batch, *([1] * (ndim - 1)))


def standard_normal(shape: Sequence[int], generator: Generator, device: torch.device) -> Tensor:
    """float32 N(0, I) noise of `shape` on `device`.

    `generator` is None (torch's global RNG), one torch.Generator (drawn on its own device, then
    moved), or one generator per sample (row i drawn from generator i, as diffusers' `randn_tensor`).
    """
    if generator is None:
        return torch.randn(tuple(shape), device=device, dtype=torch.float32)
    if isinstance(generator, torch.Generator):
        return torch.randn(tuple(shape), generator=generator, device=generator.device, dtype=torch.float32).to(device)
    if len(generator) != shape[0]:
        raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}: pass one per sample, or one")
    rows = [torch.randn((1, *shape[1:]), generator=g, device=g.device, dtype=torch.float32) for g in generator]
    return torch.cat([r.to(device) for r in rows])


def sample_and_score(
    mean: Tensor,
    std: Tensor,
    latents: Tensor,
    *,
    prev_latents: Tensor | None,
    generator: Generator,
    log_density,
    logprob_reduce: str,
) -> StepOutput:
    """Draw x_{t-1} = mean + std * eps (unless given), round it to `latents.dtype`, score it.

    `log_density(x_prev, mean, std) -> [B, ...]` is the kernel's element-wise log-density, or None for
    a deterministic step (then x_{t-1} = mean and log_prob = 0).
    """
    if prev_latents is None:
        if log_density is None:
            prev_latents = mean.to(latents.dtype)
        else:
            noise = standard_normal(mean.shape, generator, mean.device)
            prev_latents = (mean + std * noise).to(latents.dtype)
    elif prev_latents.shape != latents.shape:
        raise ValueError(
            f"prev_latents has shape {tuple(prev_latents.shape)}, the latents {tuple(latents.shape)}: "
            "they must match (the transition x_t -> x_(t-1) keeps the shape)"
        )
    if log_density is None:
        log_prob = torch.zeros(mean.shape[0], dtype=torch.float32, device=mean.device)
    else:
        log_prob = reduce_sample_dims(log_density(prev_latents.detach().float(), mean, std), logprob_reduce)
    return StepOutput(prev_latents, log_prob, mean, std)
