"""DDPO's stochastic DDIM step for epsilon-prediction diffusion models (SD1.5-style UNets).

DDIM (Song et al., arXiv 2010.02502) with `eta` > 0 is a Gaussian policy step, which is what DDPO
(Black et al., arXiv 2305.13301) trains. alpha_prod = alphas_cumprod ("alpha bar"), decreasing with t.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowrl.sampling.step import (
    Generator,
    StepOutput,
    batch_column,
    check_reduce,
    gaussian_log_density,
    sample_and_score,
)


def ddim_sigma(alpha_prod_t: Tensor, alpha_prod_t_prev: Tensor, eta: float) -> Tensor:
    """sigma_t(eta) = eta sqrt((1 - a_prev) / (1 - a_t)) sqrt(1 - a_t / a_prev)   (DDIM formula 16)."""
    variance = (1 - alpha_prod_t_prev) / (1 - alpha_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)
    return eta * torch.sqrt(variance)


def ddim_transition(
    noise_pred: Tensor,
    x: Tensor,
    alpha_prod_t: Tensor,
    alpha_prod_t_prev: Tensor,
    eta: float,
    clip_sample_range: float | None = None,
) -> tuple[Tensor, Tensor]:
    """DDIM formula 12 split into mean and std:
    x0_hat = (x - sqrt(1 - a_t) eps) / sqrt(a_t)              ("predicted x_0", optionally clamped)
    mean   = sqrt(a_prev) x0_hat + sqrt(1 - a_prev - sigma_t^2) eps,   std = sigma_t(eta)."""
    x0_hat = (x - torch.sqrt(1 - alpha_prod_t) * noise_pred) / torch.sqrt(alpha_prod_t)
    if clip_sample_range is not None:
        x0_hat = x0_hat.clamp(-clip_sample_range, clip_sample_range)
    std = ddim_sigma(alpha_prod_t, alpha_prod_t_prev, eta)
    mean = torch.sqrt(alpha_prod_t_prev) * x0_hat + torch.sqrt(1 - alpha_prod_t_prev - std**2) * noise_pred
    return mean, std


def ddim_step(
    noise_pred: Tensor,
    latents: Tensor,
    alpha_prod_t: float | Tensor,
    alpha_prod_t_prev: float | Tensor,
    *,
    eta: float = 1.0,
    prev_latents: Tensor | None = None,
    generator: Generator = None,
    logprob_reduce: str = "mean",
    clip_sample_range: float | None = None,
) -> StepOutput:
    """One DDIM step x_t -> x_{t_prev} with the Gaussian log-prob of the transition (DDPO).

    noise_pred, latents: [B, ...] epsilon prediction and current latents, any float dtype (math in float32).
    alpha_prod_t, alpha_prod_t_prev: alphas_cumprod at t and at the previous (less noisy) timestep;
        floats or [B] tensors.
    eta: DDIM's eta; 0 is the deterministic DDIM step (log_prob and std 0), 1 is DDPM-like.
    prev_latents: [B, ...] if given, nothing is sampled: the log-prob of this transition is evaluated.
    logprob_reduce: "mean" (default) or "sum" over non-batch dims.
    clip_sample_range: clamp x0_hat to [-r, r] (diffusers' `clip_sample`); None leaves it alone.

    Returns StepOutput(prev_latents [B, ...] in latents.dtype, log_prob [B] float32,
    mean [B, ...] float32, std [B, 1, ..., 1] float32).
    """
    check_reduce(logprob_reduce)
    if eta < 0:
        raise ValueError(f"eta must be >= 0 (0: deterministic DDIM, 1: DDPM-like), got {eta}")
    if noise_pred.shape != latents.shape:
        raise ValueError(f"noise_pred {tuple(noise_pred.shape)} and latents {tuple(latents.shape)} must have one shape")
    batch, ndim, device = latents.shape[0], latents.ndim, latents.device
    alpha_prod_t = batch_column(alpha_prod_t, batch, ndim, device)
    alpha_prod_t_prev = batch_column(alpha_prod_t_prev, batch, ndim, device)
    mean, std = ddim_transition(
        noise_pred.float(), latents.float(), alpha_prod_t, alpha_prod_t_prev, float(eta), clip_sample_range
    )
    return sample_and_score(
        mean,
        std,
        latents,
        prev_latents=prev_latents,
        generator=generator,
        log_density=gaussian_log_density if eta > 0 else None,
        logprob_reduce=logprob_reduce,
    )
