"""ELBO-likelihood policy gradient (Choi et al., arXiv 2602.04663): the final sample's ELBO as log pi_theta(x0).

A flow model's likelihood of a clean sample x0 is bounded from below by a weighted flow-matching error over the
forward (noising) process. At one re-noised point (t, eps), x_t = (1 - t) x0 + t eps, with target v = eps - x0 and
x0_hat = x_t - t v_theta (so x0_hat - x0 = -t (v_theta - v)), the one-point estimate is

    ELBO_theta(x0; t, eps) = - w(t, err) ||v_theta(x_t, t) - v||^2

with ||.||^2 the mean over the latent's elements (as everywhere in flowrl.core.objectives) and the weighting of the
paper's released code (jaemoo-choi/rethinking-diffusion-rl, `compute_elbo`):

    adaptive:  ||x0_hat - x0||^2 / sg(mean |x0_hat - x0|)   (floor 1e-5; = t ||v_theta - v||^2 / sg(mean |v_theta - v|))
    t:         ||x0_hat - x0||^2                              (= t^2 ||v_theta - v||^2)
    uniform:   ||v_theta - v||^2
    exact:     (1 - t) / (t + 1e-3) ||v_theta - v||^2

(`adaptive` is what its runs use.) Additive constants of the bound cancel in every loss below, which needs only
differences and gradients. The released code forms one estimate, one ratio and one loss per (sample, time): the
training times are Monte Carlo samples of the bound's time integral, and the loss is their mean.

With the old (sampling) policy's estimate at the SAME (t, eps), log rho = ELBO_theta - ELBO_old and the losses of a
sample with advantage A are (sg = stop-gradient; the released code's `compute_policy_loss`):

    epg:       -sg(rho) A ELBO_theta                                  (REINFORCE with the ELBO as log-likelihood)
    pepg:      -sg(rho) (A - sg(log rho)) ELBO_theta                  (proximal EPG: a KL(pi_theta || pi_old) pull)
    par:        1/2 sg(rho) (A - (ELBO_theta - ELBO_old))^2          (advantage regression on the log-ratio)
    ppo_clip:   max(-A rho, -A clip(rho, 1 - c, 1 + c))               (its "grpo" baseline, c = 1e-3)

At rho = 1 every one of them has the gradient -A grad ELBO_theta (the tests check it). The regulariser is the
released code's "girsanov" KL, kl_coef ||v_theta - v_ref||^2 toward the reference model.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .losses import clipped_surrogate
from .objectives import (
    OBJECTIVE_LOSSES,
    _dtype,
    _float,
    _mean,
    _per_sample,
    _per_sample_msq,
    _same_shape,
    forward_noising,
)

#: the ELBO's weightings (see the module docstring)
ELBO_WEIGHTINGS = ("adaptive", "uniform", "t", "exact")
#: the policy losses on the ELBO ratio (see the module docstring)
ELBO_LOSSES = ("epg", "pepg", "par", "ppo_clip")


def elbo_estimate(
    velocity: Tensor, x0: Tensor, noise: Tensor, t: Tensor, weighting: str = "adaptive", floor: float = 1e-5
) -> Tensor:
    """The one-point ELBO estimate of log pi(x0) up to a constant: -w ||v_hat - (eps - x0)||^2 at x_t = (1 - t) x0
    + t eps, with the weighting `weighting` (module docstring; `floor` bounds adaptive's detached denominator).

    velocity (the model's v_hat at x_t), x0, noise: [B, ...]; t: [B] flow time in [0, 1] (1 = noise) -> [B], float32
    (float64 stays), with the gradient of `velocity`."""
    if weighting not in ELBO_WEIGHTINGS:
        raise ValueError(f"unknown ELBO weighting {weighting!r}; valid: {', '.join(ELBO_WEIGHTINGS)}")
    _same_shape(velocity=velocity, x0=x0, noise=noise)
    dtype = _dtype(velocity, x0, noise)
    v = velocity.to(dtype)
    x_t, target = forward_noising(x0.to(dtype), noise.to(dtype), t)
    tt = _per_sample(_float(t), v, "t")
    err = v - target
    if weighting == "uniform":
        return -_per_sample_msq(err)
    if weighting == "exact":
        return -(1 - tt) / (tt + 1e-3) * _per_sample_msq(err)
    x0_err = x_t - tt.view(-1, *([1] * (v.ndim - 1))) * v - x0.to(dtype)  # x0_hat - x0 = -t err
    sq = _per_sample_msq(x0_err)
    if weighting == "t":
        return -sq
    with torch.no_grad():
        scale = x0_err.abs().flatten(1).mean(1).clamp(min=floor) if x0_err.ndim > 1 else x0_err.abs().clamp(min=floor)
    return -sq / scale


@OBJECTIVE_LOSSES.register("elbo")
def elbo_loss(
    velocity: Tensor,
    x0: Tensor,
    noise: Tensor,
    t: Tensor,
    advantages: Tensor,
    *,
    old_velocity: Tensor | None = None,
    loss: str = "pepg",
    weighting: str = "adaptive",
    clip_range: float = 1e-3,
    ref_velocity: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The ELBO-likelihood policy loss of each re-noised sample (module docstring): `loss` on the ratio
    rho = exp(ELBO_theta - ELBO_old) of `elbo_estimate`s at the same (t, eps), plus kl_coef ||v_theta - v_ref||^2
    when `ref_velocity` is given.

    velocity (v_theta, with grad), x0, noise, old_velocity (the sampling policy's, no grad), ref_velocity: [B, ...];
    t, advantages: [B]. old_velocity None: the sampling policy is the trained one (ELBO_old = sg(ELBO_theta), rho
    exactly 1). Returns (loss [B], stats: policy_loss, estimate = mean ELBO_theta, log_ratio, ratio_mean/min/max,
    and kl when ref_velocity is given), float32 (float64 stays)."""
    if loss not in ELBO_LOSSES:
        raise ValueError(f"unknown ELBO loss {loss!r}; valid: {', '.join(ELBO_LOSSES)}")
    _same_shape(velocity=velocity, x0=x0, noise=noise, old_velocity=old_velocity, ref_velocity=ref_velocity)
    elbo = elbo_estimate(velocity, x0, noise, t, weighting)
    if old_velocity is None:
        elbo_old = elbo.detach()
    else:
        with torch.no_grad():
            elbo_old = elbo_estimate(old_velocity.detach(), x0, noise, t, weighting)
    adv = _per_sample(advantages, elbo, "advantages")
    log_ratio = elbo.detach() - elbo_old
    ratio = log_ratio.exp()
    if loss == "epg":
        policy = -ratio * adv * elbo
    elif loss == "pepg":
        policy = -ratio * (adv - log_ratio) * elbo
    elif loss == "par":
        policy = 0.5 * ratio * (adv - (elbo - elbo_old)) ** 2
    else:
        policy, _ = clipped_surrogate(elbo - elbo_old, adv, clip_low=clip_range, clip_high=clip_range)
    out = policy
    stats = {
        "policy_loss": _mean(policy),
        "estimate": _mean(elbo),
        "log_ratio": _mean(log_ratio),
        "ratio_mean": _mean(ratio),
        "ratio_min": ratio.min() if ratio.numel() else ratio.new_ones(()),
        "ratio_max": ratio.max() if ratio.numel() else ratio.new_ones(()),
    }
    if ref_velocity is not None:
        kl = _per_sample_msq(velocity.to(elbo.dtype) - ref_velocity.detach().to(elbo.dtype))
        out = out + kl_coef * kl
        stats["kl"] = _mean(kl)
    return out, stats
