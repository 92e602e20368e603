"""One process: the trained module as it is, the optimizer's step, nothing to synchronise."""

from __future__ import annotations

from . import register
from ._base import Strategy


@register
class Single(Strategy):
    """One process (`flowrl train` without a launcher)."""

    name = "single"
    shards = ()
    plan_column = None  # one process: the plan's DDP column at --gpus 1
    priority = 20  # one process: nothing to share, whatever the sharding key says (DeepSpeed's config aside)

    @classmethod
    def applies(cls, cfg, num_processes, launch):
        return num_processes == 1
