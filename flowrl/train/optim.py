"""The optimizer side of training: the EMA of the trained weights, the optimizers (AdamW, 8-bit AdamW, float32
master weights), and the learning-rate schedule."""

from __future__ import annotations

import contextlib
import math
from typing import Iterable

import torch


class EMA:
    """Exponential moving average of parameters: shadow <- decay * shadow + (1 - decay) * param, in float32,
    on the parameters' device or on `device` (train.offload: the CPU)."""

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
        decay: float,
        device: str | torch.device | None = None,
    ):
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.device = device
        self.params = dict(named_params)
        self.shadow = {n: p.detach().to(device or p.device, torch.float32, copy=True) for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        for n, p in self.params.items():
            shadow = self.shadow[n]
            shadow.mul_(self.decay).add_(p.detach().to(shadow.device, torch.float32), alpha=1 - self.decay)

    @contextlib.contextmanager
    def applied(self):
        """Swap the EMA weights into the parameters for the duration of the block."""
        backup = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.shadow[n].to(p.device, p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(backup[n])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.shadow) - set(state)
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:3]}...")
        self.shadow = {n: state[n].to(self.shadow[n].device, torch.float32, copy=True) for n in self.shadow}


def optimizer_factory(kind: str, *, lr: float, betas, eps: float, weight_decay: float):
    """params -> the optimizer `kind` names (`adamw`: torch's; `adamw_8bit`: bitsandbytes' AdamW8bit)."""
    hyper = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    if kind == "adamw":
        return lambda params: torch.optim.AdamW(params, **hyper)
    if kind == "adamw_8bit":
        bnb = import_bitsandbytes()
        return lambda params: bnb.optim.AdamW8bit(params, **hyper)
    raise ValueError(f"unknown optimizer {kind!r}; valid: adamw, adamw_8bit")


def import_bitsandbytes():
    """bitsandbytes, or an error that says how to install it."""
    try:
        import bitsandbytes
    except Exception as e:  # ImportError, or a library that fails to load on this platform
        from flowrl.errors import FlowrlError

        raise FlowrlError(
            f"train.optimizer=adamw_8bit needs bitsandbytes, which does not import here ({e}); "
            "install it with `pip install 'flowrl[bnb]'`, or use train.optimizer=adamw"
        ) from None
    return bitsandbytes


class MasterWeightsOptimizer:
    """An optimizer that steps float32 master copies of the trained parameters kept on `device` (the CPU for
    train.offload), not the parameters themselves. `step()` copies each gradient to its master (as float32),
    steps the inner optimizer there, and copies the updated masters back into the parameters (in their dtype).
    So the optimizer's states live where the masters do, and bf16/fp16 weights are stepped in float32.

    Exposes what the trainer uses of a torch optimizer: param_groups, state, step, zero_grad, state_dict and
    load_state_dict (the inner optimizer's, whose parameter order is the parameters')."""

    def __init__(self, params, make, device: str | torch.device):
        self.params = list(params)
        self.masters = [p.detach().to(device, torch.float32, copy=True) for p in self.params]
        self.inner = make(self.masters)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.detach().to(m.device, torch.float32)
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m.to(p.device, p.dtype))
            m.grad = None

    @torch.no_grad()
    def sync_masters(self) -> None:
        """Masters <- the parameters (after the parameters were loaded from a checkpoint)."""
        for p, m in zip(self.params, self.masters):
            m.copy_(p.detach().to(m.device, torch.float32))

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def build_optimizer(params: list[torch.nn.Parameter], train_cfg, *, sharded: bool = False):
    """The optimizer of train_cfg (`optimizer`, lr, betas, eps, weight decay) over `params`. Its states are
    float32: parameters that are not float32, and every parameter with train.offload, are stepped through
    float32 master copies (on the CPU with offload; see MasterWeightsOptimizer). Sharded parameters (FSDP2) are
    stepped in place: FSDP's own offload moves them."""
    t = train_cfg
    make = optimizer_factory(t.optimizer, lr=t.lr, betas=t.adam_betas, eps=t.adam_eps, weight_decay=t.weight_decay)
    if sharded or not params:
        return make(params)
    if t.offload:
        return MasterWeightsOptimizer(params, make, "cpu")
    if any(p.dtype != torch.float32 for p in params):
        return MasterWeightsOptimizer(params, make, params[0].device)
    return make(params)


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str, decay_frac: float = 1.0):
    """Multiplier of the base lr at optimizer-step slot k (0-based): linear warm-up over `warmup_steps`, then
    constant, or cosine to 0. With `decay_frac` f < 1 the cosine holds the lr constant first and decays over
    the last f of the steps after warm-up only (warm-up-stable-decay):
        m(k) = 1                                   for k < K - f (K - W)
        m(k) = (1 + cos(pi p)) / 2,  p = (k - (K - f (K - W))) / (f (K - W))   after,
    with K = total_steps, W = warmup_steps; m = 0 from k = K on.

    The returned fn(k, budget_fraction=0) also takes the fraction b of a time budget spent (train.schedule_over=
    budget): the cosine's position is then the further along of the two, p = max(p_steps, (b - (1 - f)) / f)
    (clamped to [0, 1]), so the lr reaches 0 at whichever end of the run comes first."""
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"unknown lr schedule {schedule!r}; valid: constant, cosine")
    if not 0 < decay_frac <= 1:
        raise ValueError(f"lr decay fraction must be in (0, 1], got {decay_frac}")

    def fn(step: int, budget_fraction: float = 0.0) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(1.0, decay_frac * (total_steps - warmup_steps))
        progress = max((step - (total_steps - span)) / span, (budget_fraction - (1 - decay_frac)) / decay_frac)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))

    return fn
