"""Distributed backends, one strategy per module, behind one small interface (`_base.Strategy`).

- ``single``: one process; ``ddp``: accelerate's DDP wrapper; ``fsdp``: flowrl's FSDP2 sharding (train.sharding=fsdp,
  or an accelerate FSDP config); ``deepspeed``: DeepSpeed ZeRO-1/2/3 (an accelerate DEEPSPEED config).

Which one runs follows from how the processes were launched (`detect`); adding a backend = one module here (a
`Strategy` subclass decorated with `@register`, found on the first lookup) and its accelerate config in
`configs/accelerate/`.
"""

from __future__ import annotations

import importlib
import os
import pkgutil

import torch

from flowrl.core.registry import Registry

from ._base import Strategy, like

STRATEGIES: Registry[type[Strategy]] = Registry("distributed strategy")



def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: register a strategy under its `name`."""
    return STRATEGIES.register(cls.name)(cls)


def load_all() -> None:
    """Import every strategy module of this package once, so that each registers itself."""
    STRATEGIES.discover(__name__, __path__)


def strategy_names() -> list[str]:
    load_all()
    return STRATEGIES.names()


def detect(cfg, num_processes: int, distributed_type) -> str:
    """Which strategy runs this launch: of the registered strategies that apply to it (`Strategy.applies`: DeepSpeed
    for an accelerate DEEPSPEED config; one process; FSDP for train.sharding=fsdp or an accelerate FSDP config, which
    flowrl shards with its own FSDP2 path, not accelerate's plugin; DDP otherwise), the one of highest priority."""
    load_all()
    launch = str(distributed_type).rpartition(".")[2]
    found = [STRATEGIES.get(n) for n in STRATEGIES.names() if STRATEGIES.get(n).applies(cfg, num_processes, launch)]
    if not found:
        raise ValueError(f"no distributed strategy runs {num_processes} process(es) of distributed_type {launch}; "
                         f"registered: {', '.join(STRATEGIES.names())}")
    return max(found, key=lambda cls: cls.priority).name


def make_accelerator(cfg):
    """The run's accelerate Accelerator: on the CPU when model.device=cpu; no buffer broadcast on every forward (the
    rollouts' forward passes run through the DDP wrapper too); TensorBoard / W&B trackers when asked for. Under
    `accelerate launch` with a DEEPSPEED config accelerate drops DeepSpeed when told cpu=True, and on the CPU it must
    be told gloo (else it counts one process); transformers' ZeRO-3 hook is unset, or it would partition every
    model it builds (text encoders, rewards)."""
    from accelerate import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs

    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    on_cpu = cfg.model.device == "cpu" or not torch.cuda.is_available()
    acc = Accelerator(
        cpu=cfg.model.device == "cpu" and not deepspeed,
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)] + (
            [InitProcessGroupKwargs(backend="gloo")] if deepspeed and on_cpu else []),
        log_with=(["tensorboard"] if cfg.log.tensorboard else []) + (["wandb"] if cfg.log.wandb else []) or None,
        project_dir=cfg.log.run_dir)
    if deepspeed:
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    return acc


def build_strategy(cfg, acc) -> Strategy:
    """The strategy of this launch (see `detect`) for accelerator `acc`."""
    load_all()
    return STRATEGIES.get(detect(cfg, acc.num_processes, acc.distributed_type))(cfg, acc)


__all__ = ["STRATEGIES", "Strategy", "build_strategy", "detect", "like", "load_all", "make_accelerator", "register",
           "strategy_names"]
