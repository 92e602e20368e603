"""Per-denoising-step pieces of the image GRPO update: step weights and GRPO-Guard's ratio normalisation.

Pure torch. "Steps" are the trained (stochastic) denoising steps of a trajectory.
"""

from __future__ import annotations

import torch
from torch import Tensor

STEP_WEIGHTINGS = ("none", "noise", "ratio_norm")


def noise_step_weights(stds: Tensor) -> Tensor:
    """TempFlow-GRPO's noise-aware weighting: w_t proportional to the step's transition std
    (sigma_t sqrt(dt) for Flow-GRPO's SDE), normalised to mean 1 over the trained steps, so the
    overall loss scale (and the learning rate that suits it) is unchanged.

    stds: [S] transition std of each trained step (> 0) -> [S]; float32 at least.
    """
    stds = stds if stds.dtype == torch.float64 else stds.float()
    if (stds <= 0).any():
        raise ValueError("noise step weights need the trained steps' stds > 0 (deterministic steps are not trained)")
    return stds / stds.mean()


def inverse_dt_step_weights(dts: Tensor) -> Tensor:
    """GRPO-Guard's gradient re-weighting: w_t proportional to 1 / |dt_t| = 1 / (sqrt(-dt))^2, normalised to
    mean 1 over the trained steps. dts: [S] (any sign; |dt| > 0) -> [S]."""
    dts = dts if dts.dtype == torch.float64 else dts.float()
    inv = 1.0 / dts.abs()
    return inv / inv.mean()


def ratio_norm_log_ratio(log_prob: Tensor, old_log_prob: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor) -> Tensor:
    """GRPO-Guard's RatioNorm (arXiv 2510.22319): a per-step log-ratio recentred and rescaled,

        b_t = mean_dims (mu_theta - mu_old)^2 / (2 std_t^2)
        log rho_t = (log p_theta - log p_old + b_t) * std_t

    where std_t = sigma_t sqrt(-dt) is the transition std and the log-probs are averaged over the latent's
    dims (Flow-GRPO's convention). Adding b_t removes the drift that makes the mean ratio fall below 1;
    the factor std_t makes the ratio's spread comparable across steps.

    log_prob, old_log_prob: [B] (or [B, K]); mean, old_mean: [B, ...] (or [B, K, ...]);
    std: broadcastable to log_prob (e.g. [B] or [B, K]) -> log rho [like log_prob].
    """
    nd = log_prob.ndim
    dtype = torch.float64 if log_prob.dtype == torch.float64 else torch.float32
    diff = (mean.to(dtype) - old_mean.to(dtype)) ** 2
    msd = diff.reshape(*diff.shape[:nd], -1).mean(-1)
    std = std.to(dtype)
    std = std.reshape(*std.shape[:nd]) if std.ndim > nd else std
    b = msd / (2 * std**2)
    return (log_prob - old_log_prob + b) * std
