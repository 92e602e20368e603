"""Centered Reward Distillation (CRD; Zhu, Wang, Lathuiliere, Kalogeiton, arXiv 2603.14128): the formulas.

CRD is KL-regularised reward maximisation on the forward process. Its optimal policy satisfies
r(x) = beta log(pi*(x) / pi_old(x)) + beta log Z(c): the intractable normaliser Z(c) depends only on the prompt c, so
it cancels when both sides are centred WITHIN a prompt's group. CRD therefore regresses the model's centred implicit
reward onto the centred external reward. With the flowrl convention of core.objectives (x_t = (1 - t) x0 + t eps,
target velocity v = eps - x0, ||a||^2 the mean of a^2 over a sample's elements):

    implicit reward     r_theta = -( ||v_theta - v||^2 / w_theta - ||v_old - v||^2 / w_old )
                        (w = sg(mean |v_. - v|) floored at 1e-5 when adaptive, else 1)
    external reward     r = 1/2 + 1/2 clip(A / c, -1, 1)  in [0, 1]        (core.optimality_probability)
    centring            R_c = r - sum_g p r,  R_theta_c = r_theta - sg(sum_g p r_theta)  over the sample's group g
    loss                c / beta * (beta R_theta_c - R_c)^2        (or BCE(logit beta R_theta_c, target sigmoid(R_c)))
    KL                  kl_beta (m + r (1 - m)) ||v_theta - v_ref||^2,  m = 1e-4 / kl_beta when reward-adaptive

with p uniform (or a softmax of +-r / T within the group: the two-direction variant, the loss then the mean of both
directions'), v_old a snapshot soft-updated after each epoch on the schedule `crd_decay`, and v_ref the base model
guided with classifier-free guidance. The formulas follow the released code (X-GenGroup/Flow-Factory
trainers/crd.py), except that flowrl centres over each prompt's group where that code centres over its micro-batch.

Every function computes in float32 whatever the input dtype (float64 stays float64, for exact tests).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .advantages import group_index, group_sums
from .objectives import OBJECTIVE_LOSSES, _dtype, _mean, _per_sample, _per_sample_msq, _same_shape

#: CRD's losses of the centred rewards
CRD_LOSSES = ("mse", "bce")
#: the smallest KL coefficient of the reward-adaptive KL (a sample with r = 0): the reference's base_beta
CRD_KL_FLOOR = 1e-4


def crd_implicit_reward(
    velocity: Tensor, old_velocity: Tensor, target: Tensor, *, adaptive: bool = True, floor: float = 1e-5
) -> Tensor:
    """CRD's implicit reward of each sample, a log-ratio estimate from flow-matching errors:

        r_theta = -( ||v_theta - v||^2 / w_theta - ||v_old - v||^2 / w_old ),

    v = `target` (eps - x0), w = sg(mean |v_. - v|) floored at `floor` when `adaptive` (else 1). Positive when the
    trained policy fits the sample better than the old one. Gradient through v_theta only.

    velocity (v_theta), old_velocity (v_old), target (v): [N, ...] -> [N].
    """
    _same_shape(velocity=velocity, old_velocity=old_velocity, target=target)
    dtype = _dtype(velocity, old_velocity, target)
    target = target.detach().to(dtype)
    err, err_old = velocity.to(dtype) - target, old_velocity.detach().to(dtype) - target
    fit, fit_old = _per_sample_msq(err), _per_sample_msq(err_old)
    if adaptive:
        fit = fit / _abs_mean(err.detach()).clamp(min=floor)
        fit_old = fit_old / _abs_mean(err_old).clamp(min=floor)
    return -(fit - fit_old)


def _abs_mean(x: Tensor) -> Tensor:
    """mean |x| per sample. [N, ...] -> [N]."""
    return x.abs().flatten(1).mean(1) if x.ndim > 1 else x.abs()


def group_softmax(x: Tensor, group_ids: Tensor | Sequence[Hashable], temperature: float) -> Tensor:
    """Centring weights p [N]: softmax(x / temperature) within each group (they sum to 1 over a group); a negative
    temperature (infinite) gives the uniform 1 / group size. x: [N]."""
    index, num_groups = group_index(group_ids, x.numel(), x.device)
    if temperature < 0:
        return 1.0 / group_sums(torch.ones_like(x), index, num_groups)[index]
    if temperature == 0:
        raise ValueError("temperature 0 (hard selection) is not supported; use a negative (uniform) or positive one")
    z = x / temperature
    top = torch.full((num_groups,), -torch.inf, dtype=x.dtype, device=x.device).scatter_reduce(0, index, z, "amax")
    e = torch.exp(z - top[index])
    return e / group_sums(e, index, num_groups)[index]


def group_mean(x: Tensor, group_ids: Tensor | Sequence[Hashable], weights: Tensor | None = None) -> Tensor:
    """sum_{j in g} p_j x_j of each sample's group g, per sample, with weights p [N] summing to 1 per group (None:
    the group's plain mean). x: [N] -> [N]."""
    index, num_groups = group_index(group_ids, x.numel(), x.device)
    if weights is None:
        weights = group_softmax(x.detach(), group_ids, -1.0)
    return group_sums(weights.to(x.dtype) * x, index, num_groups)[index]


def group_centred(x: Tensor, group_ids: Tensor | Sequence[Hashable], weights: Tensor | None = None) -> Tensor:
    """x - `group_mean`(x): each sample centred within its group. The gradient flows through the mean too: CRD
    centres its implicit reward with a detached mean instead (`crd_loss`). x: [N] -> [N]."""
    return x - group_mean(x, group_ids, weights)


def crd_decay(step: int, *, start: int = 0, initial: float = 0.0, rate: float = 0.001, cap: float = 0.5) -> float:
    """The decay lambda of a CRD snapshot's soft update (snapshot <- lambda snapshot + (1 - lambda) theta) after
    `step` optimizer steps:

        lambda = initial before `start`, else min(initial + rate (step - start), cap).

    The released code's schedule string "start-initial-rate-cap": the old snapshot 0-0.25-0.005-0.999, the sampling
    one 75-0.0-0.0075-0.999 (its OCR config, paper table 3). With initial = 0 it is core.soft_update_decay.
    """
    if step < start:
        return float(initial)
    return float(min(initial + rate * (step - start), cap))


@OBJECTIVE_LOSSES.register("crd")
def crd_loss(
    velocity: Tensor,
    old_velocity: Tensor,
    target: Tensor,
    r: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    *,
    beta: float = 1.0,
    loss_type: str = "mse",
    weight_temp: float = -1.0,
    adaptive_weight: bool = True,
    scale: float = 5.0,
    ref_velocity: Tensor | None = None,
    kl_beta: float = 0.0,
    adaptive_kl: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CRD's loss of each row (see the module docstring): the centred reward matching of the implicit reward
    r_theta (`crd_implicit_reward`) to the external r (`optimality_probability` of the advantage), plus the KL.

    Centring is within `group_ids` (flowrl passes one id per (prompt, training-time slot)): R_c = r - sum_g p r and
    R_theta_c = r_theta - sg(sum_g p r_theta), so a row's gradient comes only from its own r_theta. With
    weight_temp < 0, p is uniform and the policy term is scale / beta * (beta R_theta_c - R_c)^2 (`loss_type`
    "mse") or scale / beta * BCE_logits(beta R_theta_c, sigmoid(R_c)) ("bce"); with weight_temp > 0 it is the mean
    of that term under p+ = softmax(r / T) and p- = softmax(-r / T) (centred toward the group's best and worst).
    The KL term (only with ref_velocity) is kl_beta (m + r (1 - m)) ||v_theta - v_ref||^2 with m = 1e-4 / kl_beta
    when `adaptive_kl` (a weight running from 1e-4 at r = 0 to kl_beta at r = 1), else kl_beta ||v_theta - v_ref||^2.

    At the first step of an epoch whose old snapshot equals theta, r_theta = 0 and the MSE's gradient is
    -2 scale R_c grad r_theta: the error of a better-than-average sample is pushed down, a worse one's up.

    velocity, old_velocity, target, ref_velocity: [N, ...]; r: [N] in [0, 1]; group_ids: [N].
    Returns (loss [N], stats: policy_loss, r_theta_mean, old_deviation = ||v_theta - v_old||^2, and kl if computed).
    """
    if loss_type not in CRD_LOSSES:
        raise ValueError(f"unknown CRD loss {loss_type!r}; valid: {', '.join(CRD_LOSSES)}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    _same_shape(velocity=velocity, old_velocity=old_velocity, target=target, ref_velocity=ref_velocity)
    dtype = _dtype(velocity, old_velocity, target)
    v = velocity.to(dtype)
    r = _per_sample(r, v, "r").detach()
    if ((r < 0) | (r > 1)).any():
        raise ValueError("r must lie in [0, 1] (use optimality_probability to map advantages to r)")
    r_theta = crd_implicit_reward(v, old_velocity, target, adaptive=adaptive_weight)
    # uniform weights, or the two directions: toward the group's best (softmax(r / T)) and its worst (softmax(-r / T))
    signs = [1.0] if weight_temp < 0 else [1.0, -1.0]
    policy = v.new_zeros(v.shape[0])
    for sign in signs:
        p = group_softmax(sign * r, group_ids, weight_temp)
        r_c = group_centred(r, group_ids, p)
        r_theta_c = r_theta - group_mean(r_theta.detach(), group_ids, p)
        if loss_type == "mse":
            term = (beta * r_theta_c - r_c) ** 2
        else:
            term = F.binary_cross_entropy_with_logits(beta * r_theta_c, torch.sigmoid(r_c), reduction="none")
        policy = policy + term / len(signs)
    policy = policy * (scale / beta)
    loss = policy
    stats = {
        "policy_loss": _mean(policy),
        "r_theta_mean": _mean(r_theta),
        "old_deviation": _mean(_per_sample_msq(v.detach() - old_velocity.detach().to(dtype))),
    }
    if ref_velocity is not None:
        kl = _per_sample_msq(v - ref_velocity.detach().to(dtype))
        coef = kl_beta * torch.ones_like(r)
        if adaptive_kl and kl_beta > 0:
            floor = CRD_KL_FLOOR / kl_beta
            coef = kl_beta * (floor + r * (1 - floor))
        loss = loss + coef * kl
        stats["kl"] = _mean(kl)
    return loss, stats


__all__ = [
    "CRD_KL_FLOOR",
    "CRD_LOSSES",
    "crd_decay",
    "crd_implicit_reward",
    "crd_loss",
    "group_centred",
    "group_mean",
    "group_softmax",
]
