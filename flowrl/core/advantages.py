"""Advantage estimators: outcome rewards per sample -> advantages per sample.

Every estimator registered here is called as ``fn(rewards[N], group_ids, **options) -> advantages[N]``,
where samples that share a group id were generated from the same prompt. ``group_ids`` may be a tensor or
any sequence of hashables (prompt strings, ints). Float32 or float64 in, the same dtype out.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Iterable, Sequence

import torch
from torch import Tensor

from .masked import masked_whiten
from .registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


def get_advantage_estimator(name: str):
    """The advantage estimator registered as `name` (ValueError listing the names if unknown)."""
    return ADVANTAGE_ESTIMATORS.get(name)


def _float(x: Tensor) -> Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def group_index(group_ids: Tensor | Sequence[Hashable], n: int, device=None) -> tuple[Tensor, int]:
    """Map group ids to contiguous ints.

    Returns (index[N] long, G): samples i, j are in the same group iff index[i] == index[j];
    groups are numbered in order of first appearance for sequences, sorted for tensors.
    """
    if isinstance(group_ids, Tensor):
        if group_ids.shape != (n,):
            raise ValueError(f"group_ids must have shape [{n}] like rewards, got {tuple(group_ids.shape)}")
        _, index = torch.unique(group_ids, return_inverse=True)
        index = index.to(device)
    else:
        ids = list(group_ids)
        if len(ids) != n:
            raise ValueError(f"group_ids has {len(ids)} entries but rewards has {n}")
        table: dict[Hashable, int] = {}
        index = torch.tensor([table.setdefault(g, len(table)) for g in ids], dtype=torch.long, device=device)
    num_groups = int(index.max().item()) + 1 if n else 0
    return index, num_groups


def group_sums(x: Tensor, index: Tensor, num_groups: int) -> Tensor:
    """The sum of x over each group: x [N], index [N] (`group_index`) -> [G], differentiable in x."""
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add(0, index, x)


def _group_stats(rewards: Tensor, index: Tensor, num_groups: int, unbiased: bool):
    """Per-sample (count, mean, std, range) of the sample's group, each [N]."""
    counts = group_sums(torch.ones_like(rewards), index, num_groups)
    mean = group_sums(rewards, index, num_groups) / counts
    dev = rewards - mean[index]
    sq = group_sums(dev * dev, index, num_groups)
    denom = counts - 1 if unbiased else counts
    var = torch.where(denom > 0, sq / denom.clamp(min=1), torch.zeros_like(sq))
    hi = torch.full_like(counts, -torch.inf).scatter_reduce(0, index, rewards, "amax")
    lo = torch.full_like(counts, torch.inf).scatter_reduce(0, index, rewards, "amin")
    return counts[index], mean[index], var.sqrt()[index], (hi - lo)[index]


@ADVANTAGE_ESTIMATORS.register("grpo")
def group_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    scale: str = "group",
    eps: float = 1e-6,
    unbiased: bool = True,
) -> Tensor:
    """GRPO group-relative advantages (DeepSeekMath, arXiv 2402.03300).

    A_i = (r_i - mean_{g(i)}) / (std + eps), where std is
      - ``"group"``: the std of sample i's group (GRPO);
      - ``"batch"``: the std of all N rewards (Flow-GRPO's ``global_std``);
      - ``"none"``:  no division, A_i = r_i - mean_{g(i)} (Dr.GRPO, arXiv 2503.20783).
    ``unbiased`` selects the N-1 (Bessel) denominator for the std.
    A group of one sample gets advantage 0, and so does a group whose rewards are all equal
    (exactly 0, never NaN).

    rewards: [N]; group_ids: [N] (tensor or hashables) -> advantages [N], dtype of rewards.
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"unknown scale {scale!r}; valid: 'group', 'batch', 'none'")
    rewards = _float(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    index, num_groups = group_index(group_ids, rewards.numel(), rewards.device)
    if rewards.numel() == 0:
        return rewards.clone()
    count, mean, std, spread = _group_stats(rewards, index, num_groups, unbiased)
    centred = rewards - mean
    if scale == "group":
        adv = centred / (std + eps)
    elif scale == "batch":
        batch_std = rewards.std(unbiased=unbiased) if rewards.numel() > 1 else rewards.new_zeros(())
        adv = centred / (batch_std + eps)
    else:
        adv = centred
    return torch.where((count > 1) & (spread > 0), adv, torch.zeros_like(adv))


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantages(rewards: Tensor, group_ids, **_ignored) -> Tensor:
    """Dr.GRPO: the group mean subtracted, no std division (`group_advantages(scale="none")`)."""
    return group_advantages(rewards, group_ids, scale="none")


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(rewards: Tensor, group_ids: Tensor | Sequence[Hashable]) -> Tensor:
    """REINFORCE leave-one-out (Ahmadian et al., arXiv 2402.14740).

    A_i = r_i - mean_{j in g(i), j != i} r_j  =  n_g / (n_g - 1) * (r_i - mean_g).
    A group of one gets 0.  rewards: [N] -> [N].
    """
    rewards = _float(rewards)
    index, num_groups = group_index(group_ids, rewards.numel(), rewards.device)
    if rewards.numel() == 0:
        return rewards.clone()
    count, mean, _, _ = _group_stats(rewards, index, num_groups, unbiased=False)
    adv = count / (count - 1).clamp(min=1) * (rewards - mean)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp_advantages(rewards: Tensor, group_ids: Tensor | Sequence[Hashable], eps: float = 1e-8) -> Tensor:
    """REINFORCE++ with a group baseline (arXiv 2501.03262).

    First the group mean is subtracted, x_i = r_i - mean_{g(i)}; then x is whitened over the batch,
    A_i = (x_i - mean(x)) / sqrt(var(x) + eps) with the unbiased variance.
    Samples in groups of one have no baseline: they get 0 and stay out of the batch statistics.
    rewards: [N] -> [N].
    """
    rewards = _float(rewards)
    index, num_groups = group_index(group_ids, rewards.numel(), rewards.device)
    if rewards.numel() == 0:
        return rewards.clone()
    count, mean, _, _ = _group_stats(rewards, index, num_groups, unbiased=False)
    valid = (count > 1).to(rewards.dtype)
    centred = (rewards - mean) * valid
    if valid.sum() < 2:
        return torch.zeros_like(rewards)
    return masked_whiten(centred, valid, eps=eps) * valid


def gdpo_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    weights: Sequence[float] | Tensor | None = None,
    eps: float = 1e-6,
    unbiased: bool = True,
    batch_eps: float = 1e-8,
) -> Tensor:
    """GDPO: group reward-decoupled normalisation for several rewards (arXiv 2601.05242).

    Each reward k is normalised within its group on its own, A^k = group_advantages(r[:, k]);
    the weighted sum S_i = sum_k w_k A^k_i is then whitened over the batch so its scale does not grow
    with the number of rewards. (GRPO on the summed reward instead is `group_advantages(r @ w)`.)

    rewards: [N, K]; weights: [K] (default all ones) -> advantages [N].
    """
    rewards = _float(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [N, K] (one column per reward), got {tuple(rewards.shape)}")
    k = rewards.shape[1]
    w = (
        torch.ones(k, dtype=rewards.dtype, device=rewards.device)
        if weights is None
        else torch.as_tensor(weights, dtype=rewards.dtype, device=rewards.device)
    )
    if w.shape != (k,):
        raise ValueError(f"weights must have {k} entries (one per reward column), got {tuple(w.shape)}")
    per_reward = torch.stack(
        [group_advantages(rewards[:, j], group_ids, eps=eps, unbiased=unbiased) for j in range(k)], dim=1
    )
    summed = per_reward @ w
    if summed.numel() < 2:
        return torch.zeros_like(summed)
    return masked_whiten(summed, torch.ones_like(summed), eps=batch_eps)


def gae_advantages(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al., arXiv 1506.02438) over masked sequences.

    delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},
    where t+1 means the next position whose mask is 1 (masked positions are skipped, not ends of episodes)
    and V, A after the last valid position are 0. Returns (advantages, returns) with returns = A + V
    (before whitening); advantages are whitened over the masked positions when `whiten`. Both are 0 where
    the mask is 0.

    rewards, values, mask: [B, T] -> (advantages [B, T], returns [B, T]).
    """
    rewards, values = _float(rewards), _float(values)
    if not (rewards.shape == values.shape == mask.shape) or rewards.ndim != 2:
        raise ValueError(
            f"rewards, values and mask must all be [B, T]; got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(mask.shape)}"
        )
    m = mask.to(rewards.dtype)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        # Masked positions pass the running value and advantage through unchanged.
        next_value = torch.where(m[:, t] > 0, values[:, t], next_value)
        next_adv = torch.where(m[:, t] > 0, adv_t, next_adv)
        out[:, t] = adv_t
    returns = (out + values) * m
    adv = masked_whiten(out, m) if whiten else out
    return adv * m, returns


class PerPromptStatTracker:
    """DDPO's per-prompt reward normaliser (Black et al., arXiv 2305.13301).

    For each prompt it keeps the last `buffer_size` rewards (all of them when None). A sample's advantage is
    (r - mean) / (std + eps) with mean and (population) std of its prompt's history, including this batch;
    while a prompt has fewer than `min_count` rewards in its history, the whole batch's statistics are used.
    """

    def __init__(self, buffer_size: int | None = 16, min_count: int = 16, eps: float = 1e-6):
        if buffer_size is not None and buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1 or None (unbounded), got {buffer_size}")
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        self.buffer_size, self.min_count, self.eps = buffer_size, min_count, eps
        self.history: dict[str, deque] = {}

    def update(self, prompts: Iterable[str], rewards: Tensor) -> Tensor:
        """Add this batch to the histories and return advantages [N] (dtype of rewards)."""
        prompts = list(prompts)
        rewards = _float(rewards)
        if len(prompts) != rewards.numel():
            raise ValueError(f"{len(prompts)} prompts but {rewards.numel()} rewards")
        batch_mean, batch_std = rewards.mean(), rewards.std(unbiased=False)
        adv = torch.empty_like(rewards)
        by_prompt: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            by_prompt.setdefault(p, []).append(i)
        for p, idx in by_prompt.items():
            hist = self.history.setdefault(p, deque(maxlen=self.buffer_size))
            hist.extend(rewards[idx].tolist())
            if len(hist) < self.min_count:
                mean, std = batch_mean, batch_std
            else:
                h = torch.tensor(list(hist), dtype=rewards.dtype)
                mean, std = h.mean(), h.std(unbiased=False)
            adv[idx] = (rewards[idx] - mean) / (std + self.eps)
        return adv

    def clear(self) -> None:
        self.history.clear()

    def state_dict(self) -> dict:
        return {
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "history": {p: list(h) for p, h in self.history.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.buffer_size, self.min_count = state["buffer_size"], state["min_count"]
        self.history = {p: deque(h, maxlen=self.buffer_size) for p, h in state["history"].items()}
