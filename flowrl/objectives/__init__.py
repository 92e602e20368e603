"""Training objectives, one module each, registered by name (`train.objective`).

- ``grpo`` (the default): the policy loss on the sampler's own stochastic transitions (Flow-GRPO / DDPO for
  images, GRPO and its variants for text); its settings are `train.grpo`.
- ``nft``, ``awm``, ``dpo``, ``elbo``, ``crd``, ``dgpo``: DiffusionNFT, Advantage Weighted Matching, online
  Diffusion-DPO, the ELBO policy gradient, Centered Reward Distillation and DGPO, on the forward (noising) process of
  ODE samples' clean latents (`_forward.ForwardProcessObjective`); settings `train.nft`, ...

Adding an objective = one module here (a subclass of `Objective` decorated with `@register`, with its `Settings`)
and its formula in `flowrl.core`: every module of this package whose name does not start with ``_`` is imported on
the first lookup, and the config tree, its checks, the progress bar, checkpoints and `flowrl plan` ask the class.
"""

from __future__ import annotations

from flowrl.core.registry import Registry

from ._base import MemoryTerms, Objective

OBJECTIVES: Registry[type[Objective]] = Registry("training objective")


def register(cls: type[Objective]) -> type[Objective]:
    """Class decorator: register an objective under its `name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    return OBJECTIVES.register(cls.name)(cls)


def load_all() -> None:
    """Import every objective module of this package once, so that each registers itself."""
    OBJECTIVES.discover(__name__, __path__)


def objective_names() -> list[str]:
    """The registered objectives, `grpo` first (the default)."""
    load_all()
    return sorted(OBJECTIVES.names(), key=lambda n: (n != "grpo", n))


def get_objective(name: str) -> type[Objective]:
    """The objective class registered as `name` (ValueError listing the names if unknown)."""
    load_all()
    return OBJECTIVES.get(name)


def build_objective(cfg, policy, num_processes: int = 1) -> Objective:
    """The objective `cfg.train.objective` names, attached to `policy` (it adds what the objective keeps, e.g.
    NFT's "old" adapter; call before the policy is wrapped for DDP or sharded)."""
    return get_objective(cfg.train.objective)(cfg, policy, num_processes)


__all__ = [
    "OBJECTIVES",
    "MemoryTerms",
    "Objective",
    "build_objective",
    "get_objective",
    "load_all",
    "objective_names",
    "register",
]
