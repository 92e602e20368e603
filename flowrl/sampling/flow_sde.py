"""Stochastic steps for rectified-flow models (SD3, FLUX): Flow-GRPO's SDE, CPS, DanceGRPO's SDE, Euler.

Flow time `sigma` runs from 1 (noise) to 0 (data); `x_sigma = (1 - sigma) x0 + sigma x1` and the model
predicts the velocity `v = x1 - x0`. One step goes from `sigma` to `sigma_next < sigma`, `dt = sigma_next
- sigma < 0`. Every kernel here is a pure function `(v, x, sigma, sigma_next, noise_level) -> (mean, std)`
on float32 tensors (`sigma`, `sigma_next` as [B, 1, ..., 1] columns) registered by name in
`FLOW_KERNELS`; `flow_sde_step` draws and scores the sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from flowrl.core.registry import Registry
from flowrl.sampling.step import (
    Generator,
    StepOutput,
    batch_column,
    check_reduce,
    gaussian_log_density,
    sample_and_score,
)


class FlowKernel(NamedTuple):
    """transition: (v, x, sigma, sigma_next, noise_level) -> (mean, std), float32.
    log_density: (x_prev, mean, std) -> element-wise log-density, or None for a deterministic step."""

    transition: Callable[[Tensor, Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    log_density: Callable[[Tensor, Tensor, Tensor], Tensor] | None


FLOW_KERNELS: Registry[FlowKernel] = Registry("flow sde_type")

# What `noise_level` means differs by kernel (a, sin-angle, eta), and so does its usual value.
DEFAULT_NOISE_LEVEL = {"sde": 0.7, "cps": 0.7, "dance": 0.3, "ode": 0.0}


def flow_grpo_noise_scale(sigma: Tensor, sigma_next: Tensor, noise_level: float) -> Tensor:
    """Flow-GRPO's diffusion coefficient s_t = a sqrt(sigma / (1 - sigma)) (Flow-GRPO, arXiv 2505.05470),
    with sigma_next in the denominator where sigma == 1 (the first step of a shifted schedule)."""
    denominator_sigma = torch.where(sigma == 1, sigma_next, sigma)
    return noise_level * torch.sqrt(sigma / (1 - denominator_sigma))


def flow_grpo_transition(v: Tensor, x: Tensor, sigma: Tensor, sigma_next: Tensor, noise_level: float):
    """Flow-GRPO's Euler-Maruyama step of the marginal-preserving reverse SDE:
    mean = x (1 + s_t^2 dt / 2 sigma) + v (1 + s_t^2 (1 - sigma) / 2 sigma) dt,  std = s_t sqrt(-dt)."""
    dt = sigma_next - sigma
    s_t = flow_grpo_noise_scale(sigma, sigma_next, noise_level)
    mean = x * (1 + s_t**2 / (2 * sigma) * dt) + v * (1 + s_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = s_t * torch.sqrt(-dt)
    return mean, std


def cps_transition(v: Tensor, x: Tensor, sigma: Tensor, sigma_next: Tensor, noise_level: float):
    """Coefficients-preserving sampling (Wang & Yu, arXiv 2509.05952): predict x0 and x1, re-noise
    to sigma_next keeping the coefficients of x0 and of the total noise equal to the schedule's:
    std = sigma_next sin(a pi / 2), x0 = x - sigma v, x1 = x + (1 - sigma) v,
    mean = (1 - sigma_next) x0 + sqrt(sigma_next^2 - std^2) x1."""
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    x0 = x - sigma * v
    x1 = x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0 + torch.sqrt(sigma_next**2 - std**2) * x1
    return mean, std


def dance_transition(v: Tensor, x: Tensor, sigma: Tensor, sigma_next: Tensor, noise_level: float):
    """DanceGRPO's reverse SDE (arXiv 2505.07818), Euler-Maruyama with constant eta:
    dx = (v - eta^2 / 2 * score) dsigma + eta dw, where for rectified flow the score of x_sigma is
    score = -(x - (1 - sigma) x0_hat) / sigma^2 with x0_hat = x - sigma v.
    mean = x + (v - eta^2 / 2 * score) dt,  std = eta sqrt(-dt)."""
    dt = sigma_next - sigma
    x0_hat = x - sigma * v
    score = -(x - (1 - sigma) * x0_hat) / sigma**2
    mean = x + (v - noise_level**2 / 2 * score) * dt
    std = noise_level * torch.sqrt(-dt)
    return mean, std


def euler_transition(v: Tensor, x: Tensor, sigma: Tensor, sigma_next: Tensor, noise_level: float):
    """The probability-flow ODE's Euler step x + dt v (diffusers' FlowMatchEulerDiscreteScheduler)."""
    return x + (sigma_next - sigma) * v, torch.zeros_like(sigma)


def cps_log_density(x_prev: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """CPS's unnormalised log-density -(x' - mean)^2: the Gaussian's without 1 / (2 std^2) and the
    constants. Ratios of it are not Gaussian likelihood ratios; it is what the CPS paper trains with."""
    return -((x_prev - mean) ** 2)


FLOW_KERNELS.register("sde")(FlowKernel(flow_grpo_transition, gaussian_log_density))
FLOW_KERNELS.register("cps")(FlowKernel(cps_transition, cps_log_density))
FLOW_KERNELS.register("dance")(FlowKernel(dance_transition, gaussian_log_density))
FLOW_KERNELS.register("ode")(FlowKernel(euler_transition, None))


def flow_sde_step(
    velocity: Tensor,
    latents: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    noise_level: float = 0.7,
    sde_type: str = "sde",
    prev_latents: Tensor | None = None,
    generator: Generator = None,
    logprob_reduce: str = "mean",
) -> StepOutput:
    """One step x_sigma -> x_sigma_next of a flow-matching sampler, with the log-prob of the transition.

    velocity, latents: [B, ...] model output and current latents, any float dtype (math in float32).
    sigma, sigma_next: floats or [B] tensors (rows of a batch may sit at different steps).
    noise_level: `a` of Flow-GRPO ("sde"), the angle fraction of CPS ("cps"), `eta` of DanceGRPO ("dance").
    sde_type: "sde" | "cps" | "dance" | "ode" (see FLOW_KERNELS).
    prev_latents: [B, ...] if given, nothing is sampled: the log-prob of this transition is evaluated.
    generator: torch.Generator, one per sample, or None; used only when sampling.
    logprob_reduce: "mean" (default) or "sum" of the per-element log-density over non-batch dims.

    Returns StepOutput(prev_latents [B, ...] in latents.dtype, log_prob [B] float32,
    mean [B, ...] float32, std [B, 1, ..., 1] float32). "ode" is deterministic: log_prob and std are 0.
    """
    kernel = FLOW_KERNELS.get(sde_type)
    check_reduce(logprob_reduce)
    if kernel.log_density is not None and not noise_level > 0:
        raise ValueError(
            f"sde_type={sde_type!r} needs noise_level > 0 (got {noise_level}); use sde_type='ode' for a "
            "deterministic step"
        )
    if velocity.shape != latents.shape:
        raise ValueError(f"velocity {tuple(velocity.shape)} and latents {tuple(latents.shape)} must have one shape")
    batch, ndim, device = latents.shape[0], latents.ndim, latents.device
    sigma = batch_column(sigma, batch, ndim, device)
    sigma_next = batch_column(sigma_next, batch, ndim, device)
    mean, std = kernel.transition(velocity.float(), latents.float(), sigma, sigma_next, float(noise_level))
    std = torch.as_tensor(std, dtype=torch.float32, device=device).expand(batch, *([1] * (ndim - 1)))
    return sample_and_score(
        mean,
        std,
        latents,
        prev_latents=prev_latents,
        generator=generator,
        log_density=kernel.log_density,
        logprob_reduce=logprob_reduce,
    )
