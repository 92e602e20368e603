"""DDP: every process holds the whole model; the backward of a minibatch's last pass averages the gradients."""

from __future__ import annotations

import contextlib

from flowrl.plan.declarations import StrategyTerms

from . import register
from ._base import Strategy


@register
class DDP(Strategy):
    """Data parallel through accelerate (`accelerate launch` of a MULTI_GPU / multi-CPU config): the trained module is
    wrapped by `accelerator.prepare`; the passes of a minibatch run inside accelerate's `no_sync` but the last, whose
    backward averages the accumulated gradients over the processes."""

    name = "ddp"
    shards = ()  # every process holds the whole model, its gradients and optimizer states
    plan_column = "DDP"

    @classmethod
    def plan_terms(cls, trained, gpus):
        """The all-reduce's buckets: a copy of the gradients."""
        return StrategyTerms(gradient_copy=True)

    @classmethod
    def applies(cls, cfg, num_processes, launch):
        return True  # the default of several processes

    def prepare(self, policy, make_optimizer):
        self.policy = policy
        policy.wrap_trained(self.acc.prepare)
        self.params = list(policy.trainable_parameters())
        self.opt = make_optimizer(self.params, False)
        return self.opt

    def gradient_sync(self, sync):
        return contextlib.nullcontext() if sync else self.acc.no_sync(self.policy.trained_module)
