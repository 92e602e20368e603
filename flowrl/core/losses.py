"""Policy losses and loss aggregation.

A "step" is a denoising step for images and a token for text; the functions here see only tensors of
per-step log-probs `[B, T]` (or `[B]`), advantages broadcastable to them, and an optional mask
(1 = the step counts). Every registered policy loss is called as

    loss_fn(log_prob, old_log_prob, advantages, *, mask=None, **options) -> (per_element_loss, stats)

and returns the unreduced loss (same shape as `log_prob`) and a dict of scalar tensors for logging;
`aggregate_loss` reduces it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .masked import masked_mean
from .registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss")

#: |log r| is clamped to this before exp() so a stale or diverged sample cannot overflow the ratio.
MAX_LOG_RATIO = 20.0


def get_policy_loss(name: str):
    """The policy loss registered as `name` (ValueError listing the names if unknown)."""
    return POLICY_LOSSES.get(name)


def _upcast(x: Tensor) -> Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    while advantages.ndim < like.ndim:
        advantages = advantages.unsqueeze(-1)
    return advantages.to(like.dtype)


def clipped_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The PPO clipped objective on a given log-ratio (shared by the token- and sequence-level losses).

    r = exp(log_ratio);  L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high));
    for A < 0 with `dual_clip = c` (Ye et al., arXiv 1912.09729): L = min(L, -A c).
    """
    if clip_low < 0 or (clip_high is not None and clip_high < 0):
        raise ValueError(f"clip ranges must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (a multiple of the advantage), got {dual_clip}")
    clip_high = clip_low if clip_high is None else clip_high
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = _broadcast_advantages(advantages, ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    if dual_clip is not None:
        dual_bound = -adv * dual_clip
        dual = (adv < 0) & (loss > dual_bound)
        loss = torch.where(adv < 0, torch.minimum(loss, dual_bound), loss)
    with torch.no_grad():
        m = torch.ones_like(ratio) if mask is None else mask.to(ratio.dtype).expand_as(ratio)
        lr = log_ratio.detach()
        stats = {
            "clipfrac": masked_mean(clipped.to(ratio.dtype), m),
            # k3 estimate of KL(old || new) from samples of the old policy: (r - 1) - log r.
            "approx_kl": masked_mean(torch.expm1(lr) - lr, m),
            "ratio_mean": masked_mean(ratio.detach(), m),
            "ratio_max": torch.where(m > 0, ratio.detach(), torch.full_like(ratio, -torch.inf)).max(),
            "ratio_min": torch.where(m > 0, ratio.detach(), torch.full_like(ratio, torch.inf)).min(),
        }
        if dual_clip is not None:
            stats["dual_clipfrac"] = masked_mean(dual.to(ratio.dtype), m)
    return loss, stats


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate with a per-step ratio (PPO arXiv 1707.06347; GRPO; DAPO clip-higher).

    ratio = exp(log_prob - old_log_prob)
    loss  = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
    and, for A < 0 with `dual_clip = c`, loss = min(loss, -A * c).
    `clip_high` defaults to `clip_low` (symmetric); DAPO's clip-higher sets it larger (e.g. 0.28).

    log_prob, old_log_prob: [B, T] or [B]; advantages: [B] or the same shape (broadcast over T);
    mask (optional, for the stats only): like log_prob.
    Returns (per-element loss like log_prob, stats with clipfrac, approx_kl, ratio_mean/min/max).
    """
    log_prob, old_log_prob = _upcast(log_prob), _upcast(old_log_prob)
    if log_prob.shape != old_log_prob.shape:
        raise ValueError(f"log_prob {tuple(log_prob.shape)} and old_log_prob {tuple(old_log_prob.shape)} differ")
    return clipped_surrogate(
        log_prob - old_log_prob, advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, mask=mask
    )


@POLICY_LOSSES.register("dppo")
def dppo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    step_kl: Tensor,
    kl_threshold: float = 1e-5,
    mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Flow-DPPO's trust-region mask in place of the ratio clip (arXiv 2606.11025).

    ratio = exp(log_prob - old_log_prob);  L = -A * ratio, except where the step has left the trust region and its
    ratio already moves the way its advantage pushes:
        masked  <=>  step_kl >= kl_threshold  and  ((ratio > 1 and A > 0) or (ratio < 1 and A < 0)),
    where L = 0 (no gradient). step_kl [like log_prob] is the exact KL between the current and the sampling policy's
    Gaussian transition of the step, KL(N(mu, s^2) || N(mu_old, s^2)) = mean over dims (mu - mu_old)^2 / (2 s^2)
    (core.gaussian_kl). Inside the trust region the update is the unclipped policy gradient; outside, a step may
    still move back toward the sampling policy.

    Returns (per-element loss like log_prob, stats: clipfrac = the masked fraction, step_kl_mean, approx_kl and the
    ratio's mean/min/max over `mask`).
    """
    if kl_threshold <= 0:
        raise ValueError(f"the trust region's KL threshold must be > 0, got {kl_threshold}")
    log_prob, old_log_prob = _upcast(log_prob), _upcast(old_log_prob)
    if step_kl.shape != log_prob.shape:
        raise ValueError(f"step_kl {tuple(step_kl.shape)} and log_prob {tuple(log_prob.shape)} differ")
    log_ratio = (log_prob - old_log_prob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = _broadcast_advantages(advantages, ratio).expand_as(ratio)
    outside = step_kl.detach().to(ratio.dtype) >= kl_threshold
    r = ratio.detach()
    masked = outside & (((r > 1) & (adv > 0)) | ((r < 1) & (adv < 0)))
    loss = torch.where(masked, torch.zeros_like(ratio), -adv * ratio)
    with torch.no_grad():
        m = torch.ones_like(ratio) if mask is None else mask.to(ratio.dtype).expand_as(ratio)
        lr = log_ratio.detach()
        stats = {
            "clipfrac": masked_mean(masked.to(ratio.dtype), m),
            "step_kl_mean": masked_mean(step_kl.detach().to(ratio.dtype), m),
            "approx_kl": masked_mean(torch.expm1(lr) - lr, m),
            "ratio_mean": masked_mean(r, m),
            "ratio_max": torch.where(m > 0, r, torch.full_like(r, -torch.inf)).max(),
            "ratio_min": torch.where(m > 0, r, torch.full_like(r, torch.inf)).min(),
        }
    return loss, stats


def sequence_log_ratio(log_prob: Tensor, old_log_prob: Tensor, mask: Tensor) -> Tensor:
    """GSPO's sequence-level log importance ratio, broadcast to tokens (arXiv 2507.18071).

    log s_i = (1/|y_i|) sum_t mask_it (log pi(y_it) - log pi_old(y_it)), and per token (GSPO-token)
    log s_it = sg[log s_i] + log pi(y_it) - sg[log pi(y_it)],
    whose value is log s_i at every token and whose gradient w.r.t. log pi(y_it) is 1.

    log_prob, old_log_prob, mask: [B, T] -> [B, T].
    """
    m = mask.to(log_prob.dtype)
    seq = ((log_prob - old_log_prob) * m).sum(-1) / m.sum(-1).clamp(min=1)  # [B]
    return seq.detach().unsqueeze(-1) + log_prob - log_prob.detach()


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    mask: Tensor | None = None,
    clip_low: float = 3e-4,
    clip_high: float | None = 4e-4,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (arXiv 2507.18071): the clipped surrogate on the sequence-level ratio of `sequence_log_ratio`.

    The paper's clip range is far tighter than PPO's (defaults 3e-4 / 4e-4); aggregate the result with
    ``seq-mean-token-mean`` to get the paper's objective. log_prob, old_log_prob, mask: [B, T].
    """
    log_prob, old_log_prob = _upcast(log_prob), _upcast(old_log_prob)
    if mask is None:
        mask = torch.ones_like(log_prob)
    return clipped_surrogate(
        sequence_log_ratio(log_prob, old_log_prob, mask),
        advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        mask=mask,
    )


AGGREGATION_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "seq-mean-token-sum-max-len",
)


def aggregate_loss(
    loss: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    horizon: int | None = None,
    *,
    normalizer: Tensor | float | None = None,
) -> Tensor:
    """Reduce a per-element loss [B, T] to a scalar over the positions where `mask` is 1.

    - ``token-mean``:              sum_bt m l / sum_bt m  (every token weighs the same; DAPO)
    - ``seq-mean-token-sum``:      mean_b sum_t m l
    - ``seq-mean-token-mean``:     mean_b (sum_t m l / sum_t m)  (GRPO's original)
    - ``seq-mean-token-sum-norm``: sum_bt m l / T  (verl's mode of this name: every masked element summed and
      divided by a constant T, `horizon` if given else the padded length; no division by the batch B)
    - ``seq-mean-token-sum-max-len``: mean_b (sum_t m l) / T  (Dr.GRPO's 1/G form: the same constant T, and the
      mean over the batch's sequences)
    The seq-mean modes average over the rows with at least one unmasked position: a fully masked row
    is not a sample and contributes nothing (never NaN); an all-masked batch gives 0.

    Every mode is `loss_numerator / loss_normalizer`. `normalizer` replaces the second: the normalizer of a whole
    minibatch makes the aggregates of its micro-batches add up to the minibatch's aggregate exactly.
    """
    if normalizer is None:
        normalizer = loss_normalizer(
            mask if loss.ndim > 1 else mask.unsqueeze(-1), mode, horizon, length=loss.shape[-1] if loss.ndim > 1 else 1
        )
    return loss_numerator(loss, mask, mode, horizon) / normalizer


def loss_numerator(loss: Tensor, mask: Tensor, mode: str = "token-mean", horizon: int | None = None) -> Tensor:
    """The sum `aggregate_loss` divides by `loss_normalizer`: additive over the rows of a batch. [B, T] -> scalar."""
    if loss.ndim == 1:
        loss, mask = loss.unsqueeze(-1), mask.unsqueeze(-1)
    m = mask.to(loss.dtype)
    row_sum = (loss * m).sum(-1)  # [B]
    if mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        return row_sum.sum()
    if mode == "seq-mean-token-mean":
        return (row_sum / m.sum(-1).clamp(min=1)).sum()
    if mode == "seq-mean-token-sum-max-len":
        return row_sum.sum() / float(horizon if horizon is not None else loss.shape[-1])
    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {', '.join(AGGREGATION_MODES)}")


def loss_normalizer(
    mask: Tensor, mode: str = "token-mean", horizon: int | None = None, *, length: int | None = None, clamp: bool = True
) -> Tensor:
    """What `aggregate_loss` divides the numerator by, from the mask [B, T] alone (so that it can be computed for a
    whole minibatch before its micro-batches run): the number of masked elements (token-mean), of non-empty rows
    (the seq-mean modes), or the constant T (seq-mean-token-sum-norm: `horizon`, else `length`, else T).
    Counts are clamped to at least 1 (an all-masked batch aggregates to 0, not NaN); `clamp=False` leaves them as
    they are, to be summed over processes first."""
    m = mask.to(torch.float64 if mask.dtype == torch.float64 else torch.float32)
    if m.ndim == 1:
        m = m.unsqueeze(-1)
    low = 1 if clamp else 0
    if mode == "token-mean":
        return m.sum().clamp(min=low)
    if mode == "seq-mean-token-sum-norm":
        return m.new_tensor(float(horizon if horizon is not None else (length or m.shape[-1])))
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-max-len"):
        return (m.sum(-1) > 0).sum().to(m.dtype).clamp(min=low)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {', '.join(AGGREGATION_MODES)}")
