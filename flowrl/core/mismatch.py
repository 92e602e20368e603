"""The rollout engine / trainer mismatch of text rollouts: an inference engine (vLLM) samples token y_t from its
own numerics mu, while the update's ratio is taken against the trainer's forward pi_old of the same weights. The
two differ by kernels and precision; truncated importance sampling (TIS: Yao et al., 2025, "Your efficient RL
framework secretly brings you off-policy RL training"; TRL's `vllm_importance_sampling_correction`) reweights
each token's loss by the capped ratio pi_old / mu so that the gradient is, up to the cap, the on-policy one."""

from __future__ import annotations

import torch
from torch import Tensor

from .masked import masked_mean

IS_LEVELS = ("token", "sequence")


def truncated_is_weights(trainer_lp: Tensor, engine_lp: Tensor, mask: Tensor, level: str, cap: float) -> Tensor:
    """Detached per-token weights [B, T] of truncated importance sampling.

    trainer_lp: log pi_old(y_t) [B, T], the trainer's forward of the sampling weights; engine_lp: log mu(y_t)
    [B, T], the engine's log-prob of the token it sampled; mask [B, T] (1 = a completion token).
      token:    w_t = min(exp(log pi_old(y_t) - log mu(y_t)), cap)
      sequence: w   = min(exp(sum_t mask_t (log pi_old(y_t) - log mu(y_t))), cap), the same for every token
    Masked positions get 1 (they carry no loss)."""
    if level not in IS_LEVELS:
        raise ValueError(f"importance-sampling level {level!r}: one of {', '.join(IS_LEVELS)}")
    if cap <= 0:
        raise ValueError(f"the importance-sampling cap must be > 0, got {cap}")
    m = mask.to(torch.float32)
    diff = (trainer_lp.detach().float() - engine_lp.detach().float()) * m
    if level == "token":
        w = diff.exp().clamp(max=cap)
    else:
        w = diff.sum(-1, keepdim=True).exp().clamp(max=cap).expand_as(diff)
    return torch.where(m > 0, w, torch.ones_like(w))


def mismatch_metrics(
    trainer_lp: Tensor, engine_lp: Tensor, mask: Tensor, level: str | None = None, cap: float | None = None
) -> dict:
    """How far the engine's sampling distribution is from the trainer's, over the completion tokens [B, T]:
    `kl` the k3 estimate of KL(mu || pi_old) from the sampled tokens (mean of exp(r) - 1 - r, r = log pi_old -
    log mu), `max_abs` the largest |r|; with `level` and `cap` also the truncated_is_weights' mean over the tokens
    and the fraction the cap truncated (of tokens, or of sequences)."""
    m = mask.to(torch.float32)
    r = (trainer_lp.float() - engine_lp.float()) * m
    out = {"kl": masked_mean(r.exp() - 1 - r, m).item(), "max_abs": r.abs().max().item() if r.numel() else 0.0}
    if level is not None:
        w = truncated_is_weights(trainer_lp, engine_lp, mask, level, cap)
        out["is_weight_mean"] = masked_mean(w, m).item()
        if level == "token":
            out["is_truncated_fraction"] = masked_mean((r.exp() > cap).float(), m).item()
        else:
            rows = m.sum(-1) > 0
            over = r.sum(-1).exp() > cap
            out["is_truncated_fraction"] = (over & rows).float().sum().item() / max(int(rows.sum()), 1)
    return out
