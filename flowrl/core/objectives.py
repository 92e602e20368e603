"""Forward-process objectives: DiffusionNFT, Advantage Weighted Matching (AWM) and online Diffusion-DPO.

The policy losses of `losses.py` score the sampler's own stochastic transitions. The objectives here train on the
forward (noising) process instead: a rollout keeps only its final clean latents x0 (any sampler, deterministic
ones included); at update time each x0 is noised again at a fresh time t with fresh noise eps and the model's
velocity at x_t is regressed. The convention is flowrl's (and SD3's / FLUX's): flow time t in [0, 1], 1 = noise,

    x_t = (1 - t) x0 + t eps,      target velocity  v = eps - x0,      x0 = x_t - t v.

(The diffusers transformers take the timestep 1000 t.) Throughout, ||a||^2 is the MEAN of a^2 over the non-batch
elements of a sample, as the three reference implementations compute it, so no loss grows with the latent's size.

Every function computes in float32 whatever the input dtype (float64 stays float64, for exact tests) and every
objective returns ``(per-sample loss [B], stats)`` with stats a dict of detached scalar tensors, like the policy
losses. The objectives are registered in `OBJECTIVE_LOSSES` as "nft", "awm" and "dpo"; their arguments differ
(DPO takes winner/loser pairs), so a trainer dispatches on the name.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .advantages import group_index
from .losses import clipped_surrogate
from .registry import Registry

OBJECTIVE_LOSSES: Registry = Registry("objective loss")

#: AWM's weightings of the per-sample flow-matching error (see `awm_matching_loss`).
AWM_WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")
#: The small constant AWM's reference code adds inside the (generalised) Huber root.
AWM_HUBER_DELTA = 1e-10


def get_objective_loss(name: str):
    """The objective registered as `name` (ValueError listing the names if unknown)."""
    return OBJECTIVE_LOSSES.get(name)


def _float(x: Tensor) -> Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _dtype(*xs: Tensor) -> torch.dtype:
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def _per_sample_msq(x: Tensor) -> Tensor:
    """||x||^2 per sample: the mean of x^2 over every non-batch dim. [B, ...] -> [B]."""
    sq = x * x
    return sq.flatten(1).mean(1) if sq.ndim > 1 else sq


def _column(t: Tensor, like: Tensor) -> Tensor:
    """t [B] (or a scalar) as a [B, 1, ..., 1] column broadcastable to `like`."""
    t = t.to(like.dtype)
    if t.ndim == 0:
        t = t.expand(like.shape[0])
    if t.shape != (like.shape[0],):
        raise ValueError(f"t must be [B] = [{like.shape[0]}] (or a scalar), got {tuple(t.shape)}")
    return t.view(-1, *([1] * (like.ndim - 1)))


def _same_shape(**tensors: Tensor | None) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError("shapes differ: " + ", ".join(f"{k} {s}" for k, s in shapes.items()))


def _per_sample(x: Tensor | float, like: Tensor, name: str) -> Tensor:
    """A per-sample scalar ([B] tensor or a float) as a [B] tensor of `like`'s dtype."""
    x = torch.as_tensor(x, device=like.device).to(like.dtype)
    if x.ndim == 0:
        x = x.expand(like.shape[0])
    if x.shape != (like.shape[0],):
        raise ValueError(f"{name} must be [B] = [{like.shape[0]}] (or a scalar), got {tuple(x.shape)}")
    return x


def _mean(x: Tensor) -> Tensor:
    """Mean of a detached tensor; 0 (not NaN) if it is empty."""
    x = x.detach()
    return x.mean() if x.numel() else x.new_zeros(())


def forward_noising(x0: Tensor, noise: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """The rectified-flow forward process: x_t = (1 - t) x0 + t eps and its target velocity v = eps - x0.

    x0, noise: [B, ...]; t: [B] in [0, 1] (1 = noise) -> (x_t, v), both [B, ...] in float32 (cast x_t to the model's
    dtype before the forward pass).
    """
    _same_shape(x0=x0, noise=noise)
    dtype = _dtype(x0, noise)
    x0, noise = x0.to(dtype), noise.to(dtype)
    tc = _column(_float(t), x0)
    return (1 - tc) * x0 + tc * noise, noise - x0


def stratified_times(times: Tensor, steps: Tensor, u: Tensor) -> Tensor:
    """Continuous training times in the intervals of a rollout's schedule: step k of the schedule integrates from
    t_k down to t_{k+1} (t_S = 0 after the last step), and its training time is t_k - u (t_k - t_{k+1}), uniform
    in (t_{k+1}, t_k] for u uniform in [0, 1) (u = 0: the step's own time t_k). Every step's interval is drawn as
    often as the step itself, so the times keep the schedule's emphasis and fill the gaps a finer schedule of the
    same spacing visits.

    times: [S] the schedule's flow times, strictly decreasing in (0, 1]; steps: [...] long indices into them;
    u: [...] in [0, 1), the shape of steps -> [...] flow times (float32, or float64 for a float64 schedule).
    """
    times = _float(times)
    if times.ndim != 1 or times.numel() == 0:
        raise ValueError(f"times must be a non-empty 1-D schedule [S], got shape {tuple(times.shape)}")
    if (times[1:] >= times[:-1]).any() or times[-1] <= 0 or times[0] > 1:
        raise ValueError(
            f"times must decrease strictly within (0, 1] (a flow schedule from noise to data), got "
            f"{[round(float(x), 4) for x in times]}"
        )
    if steps.shape != u.shape:
        raise ValueError(f"steps and u must have one shape, got {tuple(steps.shape)} and {tuple(u.shape)}")
    u = u.to(times.dtype)
    if ((u < 0) | (u >= 1)).any():
        raise ValueError("u must lie in [0, 1)")
    ends = torch.cat([times[1:], times.new_zeros(1)])  # where each step's interval ends: the next time, or 0
    start, end = times[steps], ends[steps]
    return start - u.to(start.device) * (start - end)


# ----------------------------------------------------------------------------------------------- DiffusionNFT


def optimality_probability(advantages: Tensor, clip: float = 5.0) -> Tensor:
    """DiffusionNFT's optimality probability r in [0, 1] of each sample (Zheng et al., arXiv 2509.16117):

        r = 1/2 + 1/2 clip((r_raw - E_{pi_old(.|c)} r_raw) / Z_c, -1, 1).

    Given group-normalised advantages A = (r_raw - mean_c) / std this is r = 1/2 + 1/2 clip(A / clip, -1, 1),
    i.e. Z_c = clip * std. The reference code (NVlabs/DiffusionNFT) takes A with the per-prompt mean and the
    *global* std of the batch's rewards (population std, + 1e-4) -- flowrl's
    ``group_advantages(r, ids, scale="batch", unbiased=False, eps=1e-4)`` -- and clip = 5 (its `adv_clip_max`).
    A = 0 (average, or a group whose rewards all tie) gives r = 1/2: both halves of the NFT loss weigh the same.

    advantages: [B] (any shape) -> r, same shape, float32 (float64 stays).
    """
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    a = _float(advantages)
    return 0.5 + 0.5 * torch.clamp(a / clip, -1.0, 1.0)


def _self_normalised_x0_error(x0_hat: Tensor, x0: Tensor, floor: float) -> Tensor:
    """||x0_hat - x0||^2 / sg(mean |x0_hat - x0|) per sample, the denominator floored at `floor`. -> [B]"""
    err = x0_hat - x0
    with torch.no_grad():
        scale = (err.abs().flatten(1).mean(1) if err.ndim > 1 else err.abs()).clamp(min=floor)
    return _per_sample_msq(err) / scale


@OBJECTIVE_LOSSES.register("nft")
def nft_loss(
    velocity: Tensor,
    old_velocity: Tensor,
    x0: Tensor,
    noise: Tensor,
    t: Tensor,
    r: Tensor,
    *,
    beta: float = 1.0,
    adaptive_weight: bool = True,
    ref_velocity: Tensor | None = None,
    kl_coef: float = 0.0,
    policy_scale: float = 1.0,
    weight_floor: float = 1e-5,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DiffusionNFT's negative-aware fine-tuning loss on the forward process (Zheng et al., arXiv 2509.16117).

    With v_theta = `velocity` (the trained policy at x_t), v_old = `old_velocity` (the sampling policy at the same
    x_t, no gradient) and beta > 0, the implicit positive and negative policies are

        v+ = (1 - beta) v_old + beta v_theta,        v- = (1 + beta) v_old - beta v_theta,

    and the loss of a sample with optimality probability r (`optimality_probability`) and target v = eps - x0 is

        L = policy_scale / beta * [ r ||v+ - v||^2 + (1 - r) ||v- - v||^2 ]  +  kl_coef ||v_theta - v_ref||^2.

    Given x_t, if v_old = E[v | x_t] (the old policy fits its own samples) the minimiser is
    v* = v_old + (2 / beta) (E[r v] - E[r] E[v]) = v_old + (2 / beta) alpha (v_pos - v_old) with alpha = E[r | x_t]
    and v_pos = E[r v] / E[r]: the paper's optimum, v_old moved toward the well-rewarded samples' velocity (the
    tests re-derive it). With beta = 1, v+ = v_theta. r = 1 pulls v_theta toward the target; r = 0 pushes it away
    from the target through v_old (v_theta -> v_old + (v_old - v) / beta).

    - ``adaptive_weight`` (on in the reference code; its form is the released code's, the paper's text could not
      be read here): each squared error is taken in x0-space and divided by its own detached mean absolute value,
      ||x0+ - x0||^2 / sg(mean |x0+ - x0|) with x0+ = x_t - t v+ (likewise for v-), the denominator floored at
      `weight_floor`. Since x0+ - x0 = -t (v+ - v) this equals t ||v+ - v||^2 / sg(mean |v+ - v|): a weight
      that adapts to the error's size and to t. ``adaptive_weight=False`` is the unweighted velocity loss above.
    - The division by beta (reference code) keeps the gradient's size independent of beta (dv+/dv_theta = beta).
    - ``policy_scale``: the reference multiplies the policy term by its advantage clip constant (5) before adding
      the KL term; ``kl_coef``: its KL coefficient (1e-4 in its SD3.5-M configs), a velocity-space penalty toward
      the reference (pretrained) model, computed only if ``ref_velocity`` is given.

    velocity, old_velocity, x0, noise, ref_velocity: [B, ...]; t: [B] flow time in [0, 1]; r: [B] in [0, 1].
    Returns (loss [B], stats: policy_loss, positive_loss, negative_loss, old_deviation = ||v_theta - v_old||^2,
    r_mean, and kl if ref_velocity is given).
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    _same_shape(velocity=velocity, old_velocity=old_velocity, x0=x0, noise=noise, ref_velocity=ref_velocity)
    dtype = _dtype(velocity, old_velocity, x0, noise)
    v = velocity.to(dtype)
    v_old = old_velocity.detach().to(dtype)
    x_t, target = forward_noising(x0.to(dtype), noise.to(dtype), t)
    r = _per_sample(r, v, "r")
    if ((r < 0) | (r > 1)).any():
        raise ValueError("r must lie in [0, 1] (use optimality_probability to map advantages to r)")
    v_pos = (1 - beta) * v_old + beta * v
    v_neg = (1 + beta) * v_old - beta * v
    if adaptive_weight:
        tc = _column(_float(t), v)
        x0 = x0.to(dtype)
        pos = _self_normalised_x0_error(x_t - tc * v_pos, x0, weight_floor)
        neg = _self_normalised_x0_error(x_t - tc * v_neg, x0, weight_floor)
    else:
        pos = _per_sample_msq(v_pos - target)
        neg = _per_sample_msq(v_neg - target)
    policy = policy_scale * (r * pos + (1 - r) * neg) / beta
    loss = policy
    stats = {
        "policy_loss": _mean(policy),
        "positive_loss": _mean(pos),
        "negative_loss": _mean(neg),
        "old_deviation": _mean(_per_sample_msq(v.detach() - v_old)),
        "r_mean": _mean(r),
    }
    if ref_velocity is not None:
        kl = _per_sample_msq(v - ref_velocity.detach().to(dtype))
        loss = loss + kl_coef * kl
        stats["kl"] = _mean(kl)
    return loss, stats


def soft_update_decay(step: int, *, rate: float = 0.001, cap: float = 0.5, start: int = 0) -> float:
    """The decay lambda of DiffusionNFT's soft update of the sampling policy after `step` optimizer steps:

        lambda = 0 before `start`, else min(rate * (step - start), cap).

    lambda = 0 copies theta into theta_old (fully on-policy); it grows as training stabilises. Reference presets
    (NVlabs/DiffusionNFT `return_decay`): the default (rate 1e-3, cap 0.5, start 0) is its decay_type 1, used by
    every SD3.5-M config but OCR; OCR uses decay_type 2 (start 75, rate 7.5e-3, cap 0.999). AWM's EMA policy for
    its KL term follows the same form with rate 1e-3, cap 0.3 (scxue/advantage_weighted_matching, "linear").
    """
    if step < start:
        return 0.0
    return float(min(rate * (step - start), cap))


def soft_update_(old_params: Iterable[Tensor], params: Iterable[Tensor], decay: float) -> None:
    """theta_old <- lambda theta_old + (1 - lambda) theta, in place and without gradient: DiffusionNFT's soft update
    of the sampling policy (also any EMA). The blend is computed in float32 and written back in the old dtype.

    old_params, params: matching iterables of tensors (e.g. a LoRA's "old" and trained adapter weights);
    decay = lambda in [0, 1] (`soft_update_decay`).
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must lie in [0, 1], got {decay}")
    old_params, params = list(old_params), list(params)
    if len(old_params) != len(params):
        raise ValueError(f"{len(old_params)} old tensors but {len(params)} current ones")
    with torch.no_grad():
        for old, new in zip(old_params, params):
            if old.shape != new.shape:
                raise ValueError(f"shapes differ: old {tuple(old.shape)}, current {tuple(new.shape)}")
            if old is new:
                raise ValueError("an old tensor is the current tensor itself: the old policy needs its own copy")
            dtype = _dtype(old, new)
            old.copy_(old.to(dtype) * decay + new.to(dtype) * (1.0 - decay))


# ------------------------------------------------------------------------------ Advantage Weighted Matching


def awm_matching_loss(fm_error: Tensor, t: Tensor, weighting: str = "uniform", ghuber_power: float = 0.25) -> Tensor:
    """AWM's weighted matching loss m(l, t) of a per-sample flow-matching error l = ||v_theta - v||^2:

        uniform: l          t: t l          t2: t^2 l
        huber:   t (sqrt(l + d) - sqrt(d))
        ghuber:  t / p ((l + d)^p - d^p)          (p = ghuber_power, d = 1e-10)

    (scxue/advantage_weighted_matching; its configs use ghuber with p = 0.25). The Huber forms grow sub-linearly in
    l, so a sample with a large error does not dominate: dm/dl = t (l + d)^(p - 1). huber = ghuber(p = 1/2) / 2.

    fm_error: [B] >= 0; t: [B] flow time -> [B].
    """
    if weighting not in AWM_WEIGHTINGS:
        raise ValueError(f"unknown AWM weighting {weighting!r}; valid: {', '.join(AWM_WEIGHTINGS)}")
    t = t.to(fm_error.dtype)
    d = AWM_HUBER_DELTA
    if weighting == "uniform":
        return fm_error
    if weighting == "t":
        return t * fm_error
    if weighting == "t2":
        return t * t * fm_error
    if weighting == "huber":
        return t * (torch.sqrt(fm_error + d) - d**0.5)
    if not ghuber_power > 0:
        raise ValueError(f"ghuber_power must be > 0, got {ghuber_power}")
    p = ghuber_power
    return t / p * ((fm_error + d) ** p - d**p)


@OBJECTIVE_LOSSES.register("awm")
def awm_loss(
    velocity: Tensor,
    x0: Tensor,
    noise: Tensor,
    t: Tensor,
    advantages: Tensor,
    *,
    old_velocity: Tensor | None = None,
    weighting: str = "ghuber",
    ghuber_power: float = 0.25,
    advantage_clip: float | None = 5.0,
    clip_range: float = 1.0,
    ref_velocity: Tensor | None = None,
    kl_coef: float = 0.0,
    ema_velocity: Tensor | None = None,
    ema_kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Advantage Weighted Matching (Xue et al., arXiv 2509.25050): policy gradient with the pretraining loss.

    AWM treats a whole image x0 as one action and uses minus the (weighted) flow-matching loss at a random (t, eps)
    as the surrogate of log pi_theta(x0):  log pi_theta(x0) ~ -m(||v_theta(x_t, t) - (eps - x0)||^2, t)  with m
    from `awm_matching_loss`. The policy term is PPO's clipped surrogate on the ratio of those surrogates,

        rho = exp(m_old - m_theta),   L_pg = max(-A rho, -A clip(rho, 1 - clip_range, 1 + clip_range)),

    where m_old is the same loss of the sampling policy at the SAME x_t (`old_velocity`); without it the update is
    on-policy (m_old = sg(m_theta), rho = 1) and the gradient is exactly A * grad m_theta: advantage-weighted flow
    matching (lower the error of good samples, raise it for bad ones). Regularisers, each computed only if its
    velocity is given: kl_coef ||v_theta - v_ref||^2 toward the frozen reference model and ema_kl_coef
    ||v_theta - v_ema||^2 toward an EMA of the policy (the reference's "KL-EMA", updated with `soft_update_`).

    Reference defaults (scxue/advantage_weighted_matching, SD3.5-M): weighting ghuber p = 0.25; advantages clipped
    to +-5 then divided by 5 (``advantage_clip=5``: A <- clip(A, -c, c) / c; None leaves A as given); clip_range 1
    (never binds: its runs are on-policy); kl_coef 1e-3 (GenEval), 3e-3 (OCR), 1e-4 (PickScore); ema_kl_coef 1
    with the EMA decay min(1e-3 step, 0.3). The paper's own equations could not be read here; these facts are the
    released code's.

    velocity, x0, noise, old/ref/ema_velocity: [B, ...]; t: [B] flow time; advantages: [B].
    Returns (loss [B], stats: policy_loss, matching_loss, fm_error, clipfrac, approx_kl, ratio_mean/min/max, and
    kl / ema_kl when computed).
    """
    if clip_range < 0:
        raise ValueError(f"clip_range must be >= 0, got {clip_range}")
    if advantage_clip is not None and not advantage_clip > 0:
        raise ValueError(f"advantage_clip must be > 0 or None, got {advantage_clip}")
    _same_shape(
        velocity=velocity,
        x0=x0,
        noise=noise,
        old_velocity=old_velocity,
        ref_velocity=ref_velocity,
        ema_velocity=ema_velocity,
    )
    dtype = _dtype(velocity, x0, noise)
    v = velocity.to(dtype)
    _, target = forward_noising(x0.to(dtype), noise.to(dtype), t)
    tt = _per_sample(t, v, "t")
    adv = _per_sample(advantages, v, "advantages")
    if advantage_clip is not None:
        adv = adv.clamp(-advantage_clip, advantage_clip) / advantage_clip
    fm = _per_sample_msq(v - target)
    m = awm_matching_loss(fm, tt, weighting, ghuber_power)
    if old_velocity is None:
        m_old = m.detach()
    else:
        with torch.no_grad():
            m_old = awm_matching_loss(_per_sample_msq(old_velocity.to(dtype) - target), tt, weighting, ghuber_power)
    policy, stats = clipped_surrogate(m_old - m, adv, clip_low=clip_range, clip_high=clip_range)
    loss = policy
    stats = {"policy_loss": _mean(policy), "matching_loss": _mean(m), "fm_error": _mean(fm), **stats}
    if ref_velocity is not None:
        kl = _per_sample_msq(v - ref_velocity.detach().to(dtype))
        loss = loss + kl_coef * kl
        stats["kl"] = _mean(kl)
    if ema_velocity is not None:
        ema_kl = _per_sample_msq(v - ema_velocity.detach().to(dtype))
        loss = loss + ema_kl_coef * ema_kl
        stats["ema_kl"] = _mean(ema_kl)
    return loss, stats


# ------------------------------------------------------------------------------------------ online Diffusion-DPO


def _pair_inputs(rewards: Tensor, group_ids) -> tuple[Tensor, Tensor, int]:
    """The checks and group numbering of the pairings: (rewards as float [N], group index [N], number of groups)."""
    rewards = _float(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if torch.isnan(rewards).any():
        raise ValueError("rewards contain NaN")
    index, num_groups = group_index(group_ids, rewards.numel(), rewards.device)
    return rewards, index, num_groups


def best_worst_pairs(rewards: Tensor, group_ids: Tensor | Sequence[Hashable]) -> tuple[Tensor, Tensor]:
    """Online DPO's preference pairs: in each group (samples of one prompt) the best sample wins over the worst.

    Ties go to the lowest index (the first best and the first worst). A group of one sample, or one whose rewards
    are all equal, gives no pair; NaN rewards are not allowed.

    rewards: [N]; group_ids: [N] tensor or sequence of hashables -> (winners [P], losers [P]) long indices into
    the N samples, one pair per group that has one, in order of the groups (`group_index`'s numbering).
    """
    rewards, index, num_groups = _pair_inputs(rewards, group_ids)
    n = rewards.numel()
    if n == 0:
        empty = torch.zeros(0, dtype=torch.long, device=rewards.device)
        return empty, empty.clone()
    hi = torch.full((num_groups,), -torch.inf, dtype=rewards.dtype, device=rewards.device)
    hi = hi.scatter_reduce(0, index, rewards, "amax")
    lo = torch.full_like(hi, torch.inf).scatter_reduce(0, index, rewards, "amin")
    pos = torch.arange(n, device=rewards.device)
    never = torch.full((num_groups,), n, dtype=torch.long, device=rewards.device)
    first_hi = never.scatter_reduce(0, index, torch.where(rewards == hi[index], pos, n), "amin")
    first_lo = never.clone().scatter_reduce(0, index, torch.where(rewards == lo[index], pos, n), "amin")
    has_pair = hi > lo  # >= 2 samples and not all equal
    return first_hi[has_pair], first_lo[has_pair]


def ranked_pairs(rewards: Tensor, group_ids: Tensor | Sequence[Hashable]) -> tuple[Tensor, Tensor]:
    """Online DPO's preference pairs, several per group: a group of n samples ranked from best to worst (ties by
    index) and from worst to best (ties by index), the k-th best wins over the k-th worst for k < n // 2 while it is
    strictly better. The pairs of a group are disjoint (no sample in two), and its first pair is
    `best_worst_pairs`'s. With 0/1 rewards a group of c correct samples gives min(c, n - c) pairs.

    rewards: [N]; group_ids: [N] -> (winners [P], losers [P]) long indices into the N samples, the groups in
    `group_index`'s order and each group's pairs in order of k.
    """
    rewards, index, num_groups = _pair_inputs(rewards, group_ids)
    winners, losers = [], []
    for g in range(num_groups):
        members = (index == g).nonzero().flatten()  # ascending sample index: a stable sort breaks ties by it
        r = rewards[members]
        best = members[torch.sort(r, descending=True, stable=True).indices]
        worst = members[torch.sort(r, stable=True).indices]
        for k in range(len(members) // 2):
            if not rewards[best[k]] > rewards[worst[k]]:
                break  # the k-th best is non-increasing and the k-th worst non-decreasing: no later pair is strict
            winners.append(best[k])
            losers.append(worst[k])
    if not winners:
        empty = torch.zeros(0, dtype=torch.long, device=rewards.device)
        return empty, empty.clone()
    return torch.stack(winners), torch.stack(losers)


def attribute_shift(reference: Tensor, current: Tensor, attributes: Sequence[Hashable]) -> Tensor:
    """d = q_ref - q_cur [F]: how far each value of a free attribute is drawn less often now than in the reference.

    reference, current: [F] counts (column j counts one value of attribute attributes[j], e.g. the colours of the
    objects a prompt left free); q_ref and q_cur normalise each attribute's columns to sum 1 (an attribute with no
    count on a side gives that side 0 on its columns, so d is 0 there when neither has one). For one attribute,
    1/2 ||d||_1 is the total variation distance TV(q_cur, q_ref) the eval reports against the base model.
    """
    reference, current = _float(torch.as_tensor(reference)), _float(torch.as_tensor(current))
    if reference.ndim != 1 or reference.shape != current.shape or len(attributes) != reference.numel():
        raise ValueError(
            f"reference and current must be [F] counts with one attribute each, got shapes {tuple(reference.shape)}, "
            f"{tuple(current.shape)} and {len(attributes)} attributes"
        )
    if (
        not (torch.isfinite(reference).all() and torch.isfinite(current).all())
        or (reference < 0).any()
        or (current < 0).any()
    ):
        raise ValueError("counts must be finite and non-negative")
    index, groups = group_index(list(attributes), reference.numel(), reference.device)

    def distribution(x: Tensor) -> Tensor:
        total = torch.zeros(groups, dtype=x.dtype, device=x.device).index_add(0, index, x)[index]
        return torch.where(total > 0, x / total.clamp_min(torch.finfo(x.dtype).tiny), torch.zeros_like(x))

    return distribution(reference) - distribution(current)


def matched_pairs(
    rewards: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    features: Tensor,
    shift: Tensor | None = None,
    anchor: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Online DPO's pairs as many as `ranked_pairs` gives in each group, chosen so that a pair's two samples agree
    on `features` (e.g. the counts of the colours the prompt left free): a preference then carries as little as
    it can of what the reward does not judge, and the trained model is not pushed along it.

    Per group, greedily: among the strictly ordered pairs (r_w > r_l) of samples not yet paired, the one of the
    smallest L1 distance ||f_w - f_l||_1, ties to the larger reward gap, then the lower winner and loser index;
    until the group has ranked_pairs' count. With 0/1 rewards every correct sample meets an incorrect one, so
    the count is always reached; where a graded reward's greedy choice falls short of it, the group keeps
    ranked_pairs' own pairs.

    With `anchor` > 0 and a `shift` d [F] (attribute_shift: what the sampled model draws less often than a reference
    does), a pair's cost is ||f_w - f_l||_1 - anchor (f_w - f_l) . d instead of its distance: what a chosen pair's
    two samples still differ in then leans toward the winner holding the values drawn too rarely and the loser
    those drawn too often, so that DPO's push on the difference points back to the reference's distribution. With
    |d| summing to 2 TV per attribute, the term moves a cost by at most anchor x 2 TV per unit of distance.

    rewards: [N]; group_ids: [N]; features: [N, F]; shift: [F] or None -> (winners [P], losers [P]) long indices
    into the N samples, the groups in `group_index`'s order and each group's pairs in the order chosen.
    """
    rewards, index, num_groups = _pair_inputs(rewards, group_ids)
    features = torch.as_tensor(features)
    if features.ndim != 2 or features.shape[0] != rewards.numel():
        raise ValueError(
            f"features must be [N, F] with N = {rewards.numel()} samples (as rewards), got shape "
            f"{tuple(features.shape)}"
        )
    if not torch.isfinite(features).all():
        raise ValueError("features contain NaN or inf")
    if anchor < 0 or (anchor > 0 and shift is None):
        raise ValueError(f"anchor must be >= 0, with a shift [F] when > 0; got anchor={anchor} and shift={shift}")
    features = features.to(torch.float64)
    cost = torch.cdist(features, features, p=1)  # [N, N]
    if anchor > 0:
        shift = torch.as_tensor(shift, dtype=torch.float64, device=features.device)
        if shift.shape != (features.shape[1],):
            raise ValueError(f"shift must be [F] with F = {features.shape[1]} features, got {tuple(shift.shape)}")
        along = features @ shift  # [N]: (f_a - f_b) . d = along[a] - along[b]
        cost = cost - anchor * (along[:, None] - along[None, :])
    distance = cost.tolist()
    ranked_w, ranked_l = ranked_pairs(rewards, index)
    r = rewards.tolist()
    winners, losers = [], []
    for g in range(num_groups):
        in_group = index[ranked_w] == g
        wanted = int(in_group.sum())
        if not wanted:
            continue
        members = (index == g).nonzero().flatten().tolist()
        candidates = sorted((distance[a][b], -(r[a] - r[b]), a, b) for a in members for b in members if r[a] > r[b])
        used: set[int] = set()
        chosen: list[tuple[int, int]] = []
        for _, _, a, b in candidates:
            if a not in used and b not in used:
                chosen.append((a, b))
                used.update((a, b))
                if len(chosen) == wanted:
                    break
        if len(chosen) < wanted:
            chosen = list(zip(ranked_w[in_group].tolist(), ranked_l[in_group].tolist()))
        winners += [a for a, _ in chosen]
        losers += [b for _, b in chosen]
    device = rewards.device
    if not winners:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty.clone()
    return torch.tensor(winners, dtype=torch.long, device=device), torch.tensor(losers, dtype=torch.long, device=device)


#: A pair whose DPO inside is above this is met: its loss's gradient, sigmoid(-inside), is below 1e-13 of a live
#: pair's (sigmoid(-30) = 9.4e-14), under float32's resolution of any sum with one. Left in, it is no help and it is
#: slow: past 87 it is subnormal, and so is everything its backward pass multiplies it into, and subnormal float32
#: arithmetic runs several times slower on x86 CPUs (offline DPO's epochs took twice as long once most of its pairs
#: were met: 3.2 CPU-seconds against 1.5 with this cut-off, docs/race.md).
SATURATED_INSIDE = 30.0


def _saturating(loss: Tensor, inside: Tensor) -> Tensor:
    """`loss` [P] as it is, with no gradient from the pairs whose `inside` [P] exceeds SATURATED_INSIDE (exact zeros
    in their backward pass, where their true gradient, below 1e-13 of a live pair's, would be subnormal soon)."""
    live = inside.detach() <= SATURATED_INSIDE
    return torch.where(live, loss, loss.detach())


@OBJECTIVE_LOSSES.register("dpo")
def dpo_loss(
    velocity_w: Tensor,
    velocity_l: Tensor,
    ref_velocity_w: Tensor,
    ref_velocity_l: Tensor,
    x0_w: Tensor,
    x0_l: Tensor,
    noise: Tensor,
    t: Tensor,
    *,
    beta: float = 5000.0,
    weight: Tensor | float | None = None,
    kl_coef: float = 0.0,
    sft_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Diffusion-DPO (Wallace et al., arXiv 2311.12908) on a flow-matching model, one loss per winner/loser pair.

    The paper's loss, for a pair (x_w preferred to x_l) noised with the SAME eps and t, is
    -log sigmoid(-beta T omega(lambda_t) [(||eps - eps_theta(x_t^w)||^2 - ||eps - eps_ref(x_t^w)||^2)
    - (||eps - eps_theta(x_t^l)||^2 - ||eps - eps_ref(x_t^l)||^2)]); the released code draws t uniformly from the
    T = 1000 training steps and weights none of them (constant omega). The flow-matching adaptation puts velocity
    errors in place of noise errors, with x_t = (1 - t) x0 + t eps and each image's own target v = eps - x0:

        D = (||v_w - v_theta(x_t^w)||^2 - ||v_w - v_ref(x_t^w)||^2)
            - (||v_l - v_theta(x_t^l)||^2 - ||v_l - v_ref(x_t^l)||^2)
        L = -log sigmoid(-beta / 2 * w(t) * D)

    Constants, as in the released code (SalesforceAIResearch/DiffusionDPO): ||.||^2 is the per-element mean, the
    inside is -0.5 * beta_dpo * D (the 1/2 of the Gaussian log-density; T and omega are folded into beta), and
    beta_dpo = 5000 in its SD1.5 and SDXL launchers (lr 1e-8 scaled by the batch of 2048 pairs). w(t) = `weight`
    (default 1: the paper's constant omega). Since eps - eps_hat = (1 - t)(v - v_hat) for rectified flow, the
    paper's noise-error loss is this one with w(t) = (1 - t)^2; the field uses velocity errors with w = 1. A
    gradient step lowers the winner's error relative to the reference and raises the loser's.

    D constrains only the difference of the two images' deviations from the reference, so nothing in L holds back
    a change both images share. `kl_coef` adds the velocity-space penalty toward the reference that the other
    forward-process objectives here carry (NFT, AWM, DGPO), on both images of the pair:

        L += kl_coef * (||v_theta(x_t^w) - v_ref(x_t^w)||^2 + ||v_theta(x_t^l) - v_ref(x_t^l)||^2)

    (not in the paper; 0, the default, leaves its loss as it is). `sft_coef` adds the winner's own denoising loss,
    weighted as the inside is:

        L += sft_coef * w(t) * ||v_w - v_theta(x_t^w)||^2

    the diffusion form of the winner's negative log-likelihood that RPO (Pang et al., arXiv 2404.19733) adds to DPO:
    D's gradient on the winner fades with sigmoid(-inside) once the pair is ranked (also when that came from the
    loser's error rising), this term's does not, so the winner's likelihood is held up; at a time of weight 0 it is
    0, as the DPO term's gradient is. dL/d err_w is beta / 2 * w * sigmoid(-inside) from D (beta / 4 * w at the
    reference) and sft_coef * w from this term. A pair whose inside exceeds SATURATED_INSIDE (30)
    keeps its loss's value and gives no gradient (its own is below 1e-13 of a live pair's, and slow as a subnormal).

    velocity_w/l (trained model at x_t^w / x_t^l), ref_velocity_w/l (reference model, no gradient), x0_w, x0_l,
    noise: [P, ...]; t: [P] flow time; weight: [P], a float, or None.
    Returns (loss [P], stats: implicit_acc = share of pairs with a positive inside, margin = mean inside,
    model_error_w/l, ref_error_w/l, kl = the mean over both images of ||v_theta - v_ref||^2 (whatever kl_coef),
    num_pairs); zero pairs give an empty loss and zero stats.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if not sft_coef >= 0:
        raise ValueError(f"sft_coef must be >= 0, got {sft_coef}")
    _same_shape(
        velocity_w=velocity_w,
        velocity_l=velocity_l,
        ref_velocity_w=ref_velocity_w,
        ref_velocity_l=ref_velocity_l,
        x0_w=x0_w,
        x0_l=x0_l,
        noise=noise,
    )
    dtype = _dtype(velocity_w, velocity_l, x0_w, x0_l, noise)
    _, target_w = forward_noising(x0_w.to(dtype), noise.to(dtype), t)
    _, target_l = forward_noising(x0_l.to(dtype), noise.to(dtype), t)
    err_w = _per_sample_msq(velocity_w.to(dtype) - target_w)
    err_l = _per_sample_msq(velocity_l.to(dtype) - target_l)
    with torch.no_grad():
        ref_w = _per_sample_msq(ref_velocity_w.to(dtype) - target_w)
        ref_l = _per_sample_msq(ref_velocity_l.to(dtype) - target_l)
    w = _per_sample(1.0 if weight is None else weight, err_w, "weight")
    inside = -0.5 * beta * w * ((err_w - ref_w) - (err_l - ref_l))
    loss = _saturating(-F.logsigmoid(inside), inside)
    kl = _per_sample_msq(velocity_w.to(dtype) - ref_velocity_w.detach().to(dtype)) + _per_sample_msq(
        velocity_l.to(dtype) - ref_velocity_l.detach().to(dtype)
    )
    if kl_coef > 0:
        loss = loss + kl_coef * kl
    if sft_coef > 0:
        loss = loss + sft_coef * w * err_w
    stats = {
        "implicit_acc": _mean((inside > 0).to(dtype)),
        "margin": _mean(inside),
        "model_error_w": _mean(err_w),
        "model_error_l": _mean(err_l),
        "ref_error_w": _mean(ref_w),
        "ref_error_l": _mean(ref_l),
        "kl": _mean(kl.detach()) / 2,
        "num_pairs": torch.tensor(float(loss.shape[0]), dtype=dtype),
    }
    return loss, stats
