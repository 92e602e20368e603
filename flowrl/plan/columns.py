"""The columns of a plan: one per distributed strategy that declares one (flowrl/dist/: what it shards over the GPUs,
what it keeps besides, what it refuses), and `offload`, the memory lever flowrl adds on top of DDP (train.offload:
the text encoders, the VAE and the rewards off the GPU between their uses, the optimizer's states, float32 master
weights and EMA in CPU memory). The planner keeps no list of the strategies: it asks their registry."""

from __future__ import annotations

from dataclasses import dataclass

from .declarations import SHARDABLE, StrategyTerms
from .models import PlanError


@dataclass(frozen=True)
class Column:
    """A way to run the update over the GPUs, as a column of the plan: what it divides by the GPU count (any of
    "weights", "gradients", "optimizer"), what it keeps besides (`terms`), whether the offload lever is on, what the
    plan says about it, and what in the config it refuses ("": nothing). `base`: the title of the column it is built
    on (offload: DDP's), whose terms are its own."""

    title: str
    shards: frozenset[str]
    terms: StrategyTerms
    offload: bool = False
    base: str | None = None
    note: str = ""
    problem: str = ""

    def holds(self, nbytes: float, gpus: int, kind: str | None = None, offloaded: bool = False) -> float | None:
        """What one GPU holds of `nbytes` of `kind` (None: something no strategy shards): a GPU's share where this
        column shards that kind; None (not on the GPU) under offload for what offload moves (`offloaded`)."""
        if offloaded and self.offload:
            return None
        return nbytes / gpus if kind in self.shards else nbytes


def spread(
    cols: list[Column], nbytes: float, gpus: int, kind: str | None = None, offloaded: bool = False
) -> dict[str, float | None]:
    """A row's bytes per GPU under each column (`Column.holds`)."""
    return {c.title: c.holds(nbytes, gpus, kind, offloaded) for c in cols}


def columns(cfg, trained: int, gpus: int) -> list[Column]:
    """The plan's columns for `cfg` training `trained` parameters on `gpus` GPUs: every registered strategy that
    declares a `plan_column`, from the one that shards least to the one that shards most, then offload (DDP's
    declarations, with the lever on). A strategy that declares no `shards` or `plan_column`, or shards something
    else, is a PlanError naming it."""
    from flowrl.dist import STRATEGIES, strategy_names

    found = []
    for name in strategy_names():
        cls = STRATEGIES.get(name)
        missing = [attr for attr in ("shards", "plan_column") if not hasattr(cls, attr)]
        if missing or not set(cls.shards) <= set(SHARDABLE):
            said = "no " + " and no ".join(missing) if missing else f"shards={cls.shards!r}"
            raise PlanError(
                f"distributed strategy {name!r} declares {said} for flowrl plan: every strategy declares "
                f"shards (a tuple of {', '.join(SHARDABLE)}) and plan_column (flowrl/dist/_base.py)"
            )
        if cls.plan_column:
            found.append(
                Column(
                    cls.plan_column,
                    frozenset(cls.shards),
                    cls.plan_terms(trained, gpus),
                    note=cls.plan_note,
                    problem=cls.config_problem(cfg),
                )
            )
    found.sort(key=lambda c: (len(c.shards), c.title))
    ddp = STRATEGIES.get("ddp")
    return found + [
        Column(
            "offload",
            frozenset(ddp.shards),
            ddp.plan_terms(trained, gpus),
            offload=True,
            base=ddp.plan_column,
            problem=ddp.config_problem(cfg),
        )
    ]


def replicated(cols: list[Column]) -> Column:
    """The column that shards nothing and keeps everything on the GPU (DDP)."""
    return next(c for c in cols if not c.shards and not c.offload)
