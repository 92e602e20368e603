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


def ddpm_flow_time(alpha_prod: Tensor) -> Tensor:
    """The flow time of a DDPM noise level: with x = alpha x0 + sigma eps (alpha = sqrt(a), sigma = sqrt(1 - a),
    a = alphas_cumprod), x / (alpha + sigma) = (1 - t) x0 + t eps lies on the rectified-flow path at
    t = sigma / (alpha + sigma). Increasing in the DDPM timestep (a decreases). [...] -> [...] float32."""
    a = alpha_prod.float()
    alpha, sigma = a.sqrt(), (1 - a).sqrt()
    return sigma / (alpha + sigma)


def ddpm_velocity(
    model_output: Tensor, x: Tensor, alpha: Tensor, sigma: Tensor, prediction_type: str = "epsilon"
) -> Tensor:
    """A DDPM model's output at x = alpha x0 + sigma eps as a rectified-flow velocity v_hat = eps_hat - x0_hat
    (the flow path's target is v = eps - x0, so v_hat = v when the model predicts eps exactly).

    - epsilon:      eps_hat = output, x0_hat = (x - sigma eps_hat) / alpha;
    - v_prediction: (alpha^2 + sigma^2 = 1) eps_hat = sigma x + alpha output, x0_hat = alpha x - sigma output.

    Both are linear in the output. With t = sigma / (alpha + sigma), eps - eps_hat = (1 - t) (v - v_hat): a velocity
    error is the noise error divided by 1 - t.
    model_output, x: [N, ...] any float dtype; alpha, sigma: [N] -> v_hat [N, ...] float32.
    """
    out, x = model_output.float(), x.float()
    alpha = batch_column(alpha.float(), x.shape[0], x.ndim, x.device)
    sigma = batch_column(sigma.float(), x.shape[0], x.ndim, x.device)
    if prediction_type == "epsilon":
        eps_hat = out
        x0_hat = (x - sigma * eps_hat) / alpha
    elif prediction_type == "v_prediction":
        eps_hat = sigma * x + alpha * out
        x0_hat = alpha * x - sigma * out
    else:
        raise ValueError(f"prediction_type {prediction_type!r} has no velocity form here; valid: epsilon, v_prediction")
    return eps_hat - x0_hat
