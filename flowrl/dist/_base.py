"""What the trainer asks of a distributed backend: one small interface, a subclass per backend.

A strategy prepares the trained module and the optimizer for its backend (wrap for DDP, shard for FSDP2, an engine
for DeepSpeed), runs a minibatch's passes with the gradient averaged only in the last (`gradient_sync`), clips and
steps, gives the optimizer's state as whole tensors for a checkpoint and takes it back, and gathers partitioned
weights where they must be whole. It also answers the few questions the loop has across processes (`any_process`,
`largest`, `gather`). The trainer never asks which backend runs.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ClassVar

import torch

from flowrl.plan.declarations import StrategyTerms
from flowrl.policies.base import full_tensor


def like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A whole tensor laid out as `param` is: this process's shard when `param` is a DTensor (FSDP2)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
    return value


class Strategy:
    """One process (the base of every backend). `acc` is the run's accelerate Accelerator."""

    #: the registered name
    name: ClassVar[str] = ""

    # ---- what it declares for `flowrl plan` (every strategy declares `shards` and `plan_column` in its own body)

    #: what it splits over the processes: any of "weights", "gradients", "optimizer" (flowrl.plan.declarations)
    shards: ClassVar[tuple[str, ...]]
    #: the title of its column in the plan's table (at most 10 characters), or None for a strategy the plan shows
    #: under another's column (one process: the DDP column at --gpus 1)
    plan_column: ClassVar[str | None]
    #: what the plan says under its table about the column ("": nothing)
    plan_note: ClassVar[str] = ""

    @classmethod
    def plan_terms(cls, trained: int, gpus: int) -> StrategyTerms:
        """What it keeps on each GPU besides its shards (gathered blocks, a copy of the gradients, buffers of its own)
        for a run that trains `trained` parameters on `gpus` processes."""
        return StrategyTerms()

    @classmethod
    def config_problem(cls, cfg) -> str:
        """What in `cfg` this backend cannot train, naming the fix ("": nothing), known from the config alone: the plan
        marks its column refused; `prepare` raises it."""
        return ""

    #: when several strategies apply to a launch (`applies`), the highest priority runs
    priority: ClassVar[int] = 0

    @classmethod
    def applies(cls, cfg, num_processes: int, launch: str) -> bool:
        """Whether this strategy can run a launch of `num_processes` processes whose accelerate distributed_type is
        `launch` ("NO", "MULTI_GPU", "MULTI_CPU", "FSDP", "DEEPSPEED", ...) with config `cfg`."""
        raise NotImplementedError

    def __init__(self, cfg, acc):
        self.cfg, self.acc = cfg, acc
        self.world = acc.num_processes
        self.rank = acc.process_index
        self.policy = None
        self.params: list[torch.nn.Parameter] = []
        self.opt = None

    # ---- setting up

    def prepare(self, policy, make_optimizer: Callable[[list, bool], object]):
        """Make `policy`'s trained module ready for this backend and build its optimizer with
        `make_optimizer(params, sharded)`; returns the optimizer (what `step` steps)."""
        self.policy = policy
        self.params = list(policy.trainable_parameters())
        self.opt = make_optimizer(self.params, False)
        return self.opt

    @property
    def sharded(self) -> bool:
        """Whether the trained weights are split over the processes (every forward pass is then a collective)."""
        return bool(self.policy is not None and self.policy.sharded)

    @property
    def equal_passes(self) -> bool:
        """Whether every process must run the same number of forward / backward passes in a minibatch (each one
        is a collective: sharded weights, or DeepSpeed's engine)."""
        return self.sharded

    # ---- a minibatch

    def gradient_sync(self, sync: bool):
        """A context for one forward/backward pass of a minibatch: the gradients are averaged over the processes
        only in the pass with `sync` (the minibatch's last)."""
        return contextlib.nullcontext()

    def backward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (DeepSpeed turns a non-finite one into NaN everywhere, so that every
        process skips the step)."""
        return loss

    def clip_gradients(self, max_norm: float) -> float:
        """Clip the (process-averaged) gradient by global norm (`max_norm` <= 0: no clipping); returns the norm."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm > 0 else float("inf"))
        return float(full_tensor(norm))

    def step(self) -> None:
        """The optimizer step."""
        self.opt.step()

    def skip_step(self) -> None:
        """A minibatch whose gradient is not finite: no step, and the gradient dropped."""
        self.opt.zero_grad(set_to_none=True)

    # ---- checkpoints

    def gathered(self, modifier_rank: int | None = None):
        """A context in which partitioned trained weights are whole (a collective; `modifier_rank`'s changes are
        kept); else nothing."""
        return contextlib.nullcontext()

    def optimizer_state(self) -> dict:
        """The optimizer's state_dict with whole tensors (a collective when they are partitioned)."""
        state = self.opt.state_dict()
        if not self.sharded:
            return state
        return {"state": {k: {s: full_tensor(v) if torch.is_tensor(v) else v for s, v in st.items()}
                          for k, st in state["state"].items()},
                "param_groups": state["param_groups"]}

    def load_trained(self, named: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor]) -> None:
        """Copy a checkpoint's whole trained tensors into the (possibly sharded) trained weights."""
        with torch.no_grad(), self.gathered(modifier_rank=0):
            for n, p in named.items():
                p.copy_(like(tensors[n].to(p.dtype), p))
        if hasattr(self.opt, "sync_masters"):  # float32 master copies (offload, bf16 weights): from the loaded ones
            self.opt.sync_masters()

    def load_optimizer_state(self, ck: dict) -> None:
        """A checkpoint's optimizer state (whole tensors) into the optimizer, laid out as the weights are."""
        if "optimizer" not in ck:
            return
        params = [p for group in self.opt.param_groups for p in group["params"]]
        state = {k: {s: like(v, params[int(k)]) if torch.is_tensor(v) and v.ndim else v for s, v in st.items()}
                 for k, st in ck["optimizer"]["state"].items()}
        self.opt.load_state_dict({"state": state, "param_groups": ck["optimizer"]["param_groups"]})

    # ---- questions across processes (collectives: every process must call them)

    def any_process(self, flag: bool) -> bool:
        """True when `flag` holds on some process."""
        if self.world == 1:
            return flag
        return bool(self.acc.reduce(torch.tensor([float(flag)]), reduction="sum").item() > 0)

    def largest(self, value: float) -> float:
        """The largest of the processes' `value`s."""
        if self.world == 1:
            return value
        return float(self.gather(torch.tensor([float(value)], dtype=torch.float64)).max())

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every process's `x` concatenated along dim 0, in process order, on the CPU."""
        if self.world == 1:
            return x
        return self.acc.gather(x.to(self.acc.device)).cpu()

    def sum_counts(self, count: torch.Tensor) -> torch.Tensor:
        """A count (a 0-dim tensor) summed over the processes."""
        if self.world == 1:
            return count
        return self.acc.reduce(count.reshape(1).to(self.acc.device), reduction="sum").cpu()[0]

    def replica_divergence(self) -> float | None:
        """Max |w_rank - w_rank0| over the trained weights (0 when the replicas are in sync); None where the weights
        are not replicas (one process, or shards that differ by design)."""
        if self.world == 1 or self.sharded:
            return None
        flat = torch.cat([p.detach().float().reshape(-1) for p in self.params]).to(self.acc.device)
        everyone = self.acc.gather(flat[None]).cpu()                                          # [world, P]
        return float((everyone - everyone[0:1]).abs().max())
