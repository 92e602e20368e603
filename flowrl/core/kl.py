"""KL penalties: sample-based estimators on log-probs and the closed form for Gaussian steps."""

from __future__ import annotations

import torch
from torch import Tensor

KL_KINDS = ("k1", "k2", "k3", "abs")
#: The exponent's input in k3 is clamped to [-K3_CLAMP, K3_CLAMP] so exp() cannot overflow.
K3_CLAMP = 20.0


def kl_estimate(log_prob: Tensor, ref_log_prob: Tensor, kind: str = "k3") -> Tensor:
    """Per-element estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence").

    With d = log_prob - ref_log_prob:
      k1 = d,  k2 = d^2 / 2,  k3 = exp(-d) + d - 1 (unbiased and >= 0),  abs = |d|.
    For k3, -d is clamped to [-20, 20] before exp (the gradient is 0 outside that range).
    Any shape in, the same shape out (float32 at least).
    """
    if log_prob.dtype not in (torch.float32, torch.float64):
        log_prob = log_prob.float()
    d = log_prob - ref_log_prob.to(log_prob.dtype)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        u = (-d).clamp(-K3_CLAMP, K3_CLAMP)  # u = log(pi_ref / pi)
        return torch.expm1(u) - u
    if kind == "abs":
        return d.abs()
    raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_KINDS)}")


def gaussian_kl(mean: Tensor, ref_mean: Tensor, std: Tensor | float) -> Tensor:
    """KL between two Gaussian transitions that share the std: N(mean, std^2) || N(ref_mean, std^2).

    Per element (mean - ref_mean)^2 / (2 std^2), averaged over every non-batch dim, computed in float32
    (float64 stays float64).
    mean, ref_mean: [B, ...]; std: a float, [B], or broadcastable to mean -> [B].
    """
    dtype = torch.float64 if mean.dtype == torch.float64 else torch.float32
    mean, ref_mean = mean.to(dtype), ref_mean.to(dtype)
    std = torch.as_tensor(std, dtype=dtype, device=mean.device)
    if std.ndim == 1 and mean.ndim > 1 and std.shape[0] == mean.shape[0]:
        std = std.view(-1, *([1] * (mean.ndim - 1)))
    kl = (mean - ref_mean) ** 2 / (2 * std**2)
    return kl.reshape(kl.shape[0], -1).mean(1) if kl.ndim > 1 else kl
