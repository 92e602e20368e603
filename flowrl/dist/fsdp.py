"""FSDP2: torch's `fully_shard` on every block and on the model; weights, gradients and optimizer states sharded."""

from __future__ import annotations

import contextlib

from flowrl.plan.declarations import StrategyTerms

from . import register
from ._base import Strategy


@register
class FSDP(Strategy):
    """Fully sharded data parallel (train.sharding=fsdp, or an accelerate config of distributed_type FSDP): flowrl's
    own FSDP2 path (`policy.shard()`), not accelerate's plugin. Each block is gathered for its forward and its
    gradients reduce-scattered in the backward of the minibatch's last pass (`set_requires_gradient_sync`); the
    optimizer steps the shards (its states are sharded with them)."""

    name = "fsdp"
    shards = ("weights", "gradients", "optimizer")
    plan_column = "FSDP"

    @classmethod
    def plan_terms(cls, trained, gpus):
        """Two blocks whole at once: the one running and the next, prefetched."""
        return StrategyTerms(gathered_blocks=2)

    priority = 10

    @classmethod
    def applies(cls, cfg, num_processes, launch):
        return num_processes > 1 and (cfg.train.sharding == "fsdp" or launch == "FSDP")

    def prepare(self, policy, make_optimizer):
        self.policy = policy
        policy.shard()
        self.params = list(policy.trainable_parameters())
        self.opt = make_optimizer(self.params, True)
        return self.opt

    def gradient_sync(self, sync):
        self.policy.trained_module.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
