"""Direct Group Preference Optimization (DGPO; Luo et al., arXiv 2510.08425, ICLR 2026): group-level DPO on the
forward process of ODE samples.

A rollout keeps each sample's clean latents x0; at update time x0 is noised again at a flow time t with noise eps
(every sample of a group at the same t and eps), x_t = (1 - t) x0 + t eps, and the flow-matching (denoising score
matching, DSM) error of the trained policy and of a reference at that point are

    l_i = ||v_theta(x_t^i, t) - (eps - x0^i)||^2,        l_i^ref = ||v_ref(x_t^i, t) - (eps - x0^i)||^2

(||.||^2 the mean over the latent's elements, as flowrl.core.objectives). DGPO's group preference logit of a group g
of G samples (the configured group size) with advantages A_i is

    s_g = sum_{i in g} A_i * beta * (l_i - l_i^ref) / G                                       (no gradient)

and its weight w_g = sigmoid(s_g) (no gradient). The loss of sample i of group g is

    L_i = w_g * A_i * l_i   (+ kl_coef ||v_theta - v_kl||^2),

whose mean over the samples is the loss: its gradient w_g A_i grad l_i / N lowers the error of the samples with a
positive advantage and raises it for the negative ones, each group weighted by how far its preference still is from
being met (s_g < 0: the policy already prefers the group's good samples more than the reference does, w_g < 1/2).

Optional PPO-style DSM clipping against an "old" policy (an EMA of the trained one): with the ratio
rho_i = exp(l_i^old - l_i), a sample with A_i > 0 and rho_i > 1 + clip_high, or A_i < 0 and rho_i < 1 - clip_low,
has its DSM term detached (it still counts in the loss's value, with no gradient).

The formulas follow Flow-Factory's DGPO trainer (X-GenGroup/Flow-Factory, src/flow_factory/trainers/dgpo.py); its
constants are the arguments' defaults of flowrl.objectives.dgpo. Everything computes in float32 (float64 stays).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from .advantages import group_index, group_sums
from .objectives import OBJECTIVE_LOSSES, _dtype, _mean, _per_sample, _per_sample_msq, _same_shape, forward_noising


def dsm_error(velocity: Tensor, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
    """The flow-matching (DSM) error l = ||v - (eps - x0)||^2 of each sample (the mean over its elements).

    velocity, x0, noise: [N, ...]; t: [N] flow time (1 = noise) -> [N] float32 (float64 stays), with the gradient
    of `velocity`."""
    _same_shape(velocity=velocity, x0=x0, noise=noise)
    dtype = _dtype(velocity, x0, noise)
    _, target = forward_noising(x0.to(dtype), noise.to(dtype), t)
    return _per_sample_msq(velocity.to(dtype) - target)


def group_preference_weights(
    errors: Tensor,
    ref_errors: Tensor,
    advantages: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    *,
    beta: float,
    group_size: int,
) -> tuple[Tensor, Tensor]:
    """DGPO's group weights: s_g = sum_{i in g} A_i beta (l_i - l_i^ref) / G and w_g = sigmoid(s_g), both detached.

    errors (l), ref_errors (l^ref), advantages (A): [N]; group_ids: [N] (samples i, j are in one group iff their ids
    are equal; a group may hold fewer than G of its samples, e.g. those without a finite reward left out);
    group_size: G, the configured group size -> (w [N], s [N]): each sample's group weight and group logit."""
    if not group_size >= 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    dtype = _dtype(errors, ref_errors)
    errors = errors.detach().to(dtype)
    adv = _per_sample(advantages, errors, "advantages")
    ref = _per_sample(ref_errors.detach(), errors, "ref_errors")
    index, num_groups = group_index(group_ids, errors.shape[0], errors.device)
    per_sample = adv * beta * (errors - ref) / group_size
    s = group_sums(per_sample, index, num_groups)[index]
    return torch.sigmoid(s), s


def dsm_clip_mask(
    errors: Tensor, old_errors: Tensor, advantages: Tensor, *, clip_low: float, clip_high: float
) -> Tensor:
    """Which samples' DSM terms the PPO-style clip detaches: with rho = exp(l^old - l) (the likelihood ratio of the
    trained to the old policy that the DSM errors stand for), A > 0 and rho > 1 + clip_high (the good sample's
    likelihood already rose enough), or A < 0 and rho < 1 - clip_low (the bad one's already fell enough).

    errors (l), old_errors (l^old), advantages: [N] -> [N] bool. (Flow-Factory applies the low rule to A = 0 too; a
    sample with A = 0 has no DSM term to detach, so only the clip fraction differs.)"""
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    dtype = _dtype(errors, old_errors)
    l = errors.detach().to(dtype)
    ratio = torch.exp(old_errors.detach().to(dtype) - l)
    adv = _per_sample(advantages, l, "advantages")
    return ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))


@OBJECTIVE_LOSSES.register("dgpo")
def dgpo_loss(
    velocity: Tensor,
    ref_velocity: Tensor,
    x0: Tensor,
    noise: Tensor,
    t: Tensor,
    advantages: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    *,
    beta: float = 100.0,
    group_size: int,
    old_velocity: Tensor | None = None,
    clip_low: float = 0.05,
    clip_high: float = 0.05,
    kl_velocity: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DGPO's loss of each sample (see the module docstring): L_i = w_g A_i l_i + kl_coef ||v_theta - v_kl||^2.

    velocity: v_theta [N, ...] (with grad); ref_velocity: the DGPO term's reference v_ref at the same x_t (the frozen
    base, or the EMA old policy; no grad); x0, noise: [N, ...]; t: [N] flow times; advantages: [N] (clipped as the
    caller wants); group_ids: [N], the group of each row (rows of one group at one time and noise: the group sum is
    over them); old_velocity: the old policy's velocity, which switches the DSM clip on (None: off); kl_velocity:
    the KL term's target (None: no KL term). Returns (loss [N], stats: dsm_error, ref_error, weight_mean (of w over
    the rows), logit_mean (of s), clipfrac (when clipping), kl (when a KL term is computed)).
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    _same_shape(velocity=velocity, ref_velocity=ref_velocity, old_velocity=old_velocity, kl_velocity=kl_velocity)
    l = dsm_error(velocity, x0, noise, t)
    with torch.no_grad():
        ref = dsm_error(ref_velocity.detach(), x0, noise, t)
    adv = _per_sample(advantages, l, "advantages")
    w, s = group_preference_weights(l, ref, adv, group_ids, beta=beta, group_size=group_size)
    stats = {"dsm_error": _mean(l), "ref_error": _mean(ref), "weight_mean": _mean(w), "logit_mean": _mean(s)}
    if old_velocity is not None:
        with torch.no_grad():
            old = dsm_error(old_velocity.detach(), x0, noise, t)
        clipped = dsm_clip_mask(l, old, adv, clip_low=clip_low, clip_high=clip_high)
        l = torch.where(clipped, l.detach(), l)
        stats["clipfrac"] = _mean(clipped.to(l.dtype))
    loss = w * adv * l
    if kl_velocity is not None:
        kl = _per_sample_msq(velocity.to(l.dtype) - kl_velocity.detach().to(l.dtype))
        loss = loss + kl_coef * kl
        stats["kl"] = _mean(kl)
    return loss, stats
