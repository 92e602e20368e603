"""The smallest real GRPO run: a tabular token policy learns a target string with the core alone.

Used by `flowrl demo` until the embedded image default exists. Every piece of the update is the
core's: `token_log_probs`, `group_advantages`, `ppo_clip_loss`, `kl_estimate`, `aggregate_loss`.
"""

from __future__ import annotations

import torch

from flowrl.core import aggregate_loss, group_advantages, kl_estimate, ppo_clip_loss, token_log_probs


def run_toy_grpo(
    target: str = "flowrl",
    vocab: str = "abcdefghijklmnopqrstuvwxyz",
    prompts_per_step: int = 4,
    group_size: int = 8,
    steps: int = 60,
    inner_epochs: int = 2,
    lr: float = 0.3,
    beta: float = 0.01,
    seed: int = 0,
    log_every: int = 10,
    print_fn=print,
) -> list[float]:
    """Train per-position logits [T, V] so that sampled strings match `target`; returns mean reward per step.

    Reward: the fraction of positions that match the target. The reference policy is the initial
    (uniform) one.
    """
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    T, V = len(target), len(vocab)
    goal = torch.tensor([vocab.index(c) for c in target])
    logits = torch.zeros(T, V, requires_grad=True)
    ref_logits = torch.zeros(T, V)
    opt = torch.optim.Adam([logits], lr=lr)
    n = prompts_per_step * group_size
    group_ids = torch.arange(prompts_per_step).repeat_interleave(group_size)
    mask = torch.ones(n, T)
    history = []
    for step in range(steps):
        with torch.no_grad():
            probs = torch.softmax(logits, -1).expand(n, T, V).reshape(-1, V)
            tokens = torch.multinomial(probs, 1, generator=gen).view(n, T)  # [N, T]
            old_logp = token_log_probs(logits.expand(n, T, V), tokens)  # [N, T]
            ref_logp = token_log_probs(ref_logits.expand(n, T, V), tokens)
            reward = (tokens == goal).float().mean(1)  # [N]
            adv = group_advantages(reward, group_ids)  # [N]
        for _ in range(inner_epochs):
            logp = token_log_probs(logits.expand(n, T, V), tokens)
            loss, stats = ppo_clip_loss(logp, old_logp, adv, clip_low=0.2, mask=mask)
            loss = loss + beta * kl_estimate(logp, ref_logp, "k3")
            opt.zero_grad()
            aggregate_loss(loss, mask, "token-mean").backward()
            opt.step()
        history.append(reward.mean().item())
        if print_fn and (step % log_every == 0 or step == steps - 1):
            best = "".join(vocab[i] for i in logits.argmax(-1).tolist())
            print_fn(f"step {step:3d}  reward {history[-1]:.3f}  clipfrac {stats['clipfrac']:.2f}  greedy {best!r}")
    return history
