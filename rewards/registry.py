"""The reward registry: names -> factories, and the two kinds of reward.

How to add a reward (e.g. ``rewards/shapes_geneval.py``)::

    from rewards.registry import IMAGE, register

    @register("shapes_geneval", kind=IMAGE)
    class ShapesGenEval:
        kind = IMAGE
        def __init__(self, threshold: float = 0.5): ...
        def __call__(self, images, prompts, **metadata) -> torch.Tensor: ...  # [B] float32

Every module of the ``rewards`` package (except those whose name starts with ``_``) is imported on
the first ``rewards.get`` / ``rewards.available`` call, so a new file registers itself; nothing else to
edit. A factory is any callable (a class or a function) whose keyword arguments are the reward's
options and which returns the reward callable:

- ``kind="image"``: ``reward(images: list[PIL.Image], prompts: list[str], **metadata) -> Tensor[B]``
  (float32, one score per image); extra named values per image go in ``reward.last_components``
  (``dict[str, Tensor[B]]``), refreshed on each call.
- ``kind="text"``: the TRL signature ``reward(prompts, completions, **columns) -> list[float | None]``;
  completions are strings or chat messages (lists of ``{"role", "content"}`` dicts).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any, Callable

from flowrl.core.registry import Registry

IMAGE = "image"
TEXT = "text"
KINDS = (IMAGE, TEXT)

REWARDS: Registry[Callable[..., Any]] = Registry("reward")


def register(name: str, *, kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a reward factory under ``name``; ``kind`` is "image" or "text"."""
    if kind not in KINDS:
        raise ValueError(f"reward {name!r}: kind must be one of {KINDS}, got {kind!r}")

    def deco(factory: Callable[..., Any]) -> Callable[..., Any]:
        factory.reward_kind = kind  # type: ignore[attr-defined]
        return REWARDS.register(name)(factory)

    return deco


_loaded = False


def load_all() -> None:
    """Import every module of the ``rewards`` package once, so that each registers its rewards."""
    global _loaded
    if _loaded:
        return
    import rewards

    for info in pkgutil.iter_modules(rewards.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"rewards.{info.name}")
    _loaded = True


def available(kind: str | None = None) -> list[str]:
    """The registered reward names (sorted), optionally only those of one ``kind``."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} or None, got {kind!r}")
    load_all()
    return [n for n in REWARDS.names() if kind is None or getattr(REWARDS.get(n), "reward_kind", None) == kind]


def get(name: str, **kwargs: Any) -> Callable[..., Any]:
    """Build the reward registered as ``name`` with its options ``kwargs``.

    The result carries ``.kind`` ("image" or "text") and ``.__name__`` (TRL logs rewards by it).
    An unknown name or option is an error that lists the valid ones.
    """
    load_all()
    factory = REWARDS.get(name)
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in kwargs if k not in params and not takes_any]
    if unknown:
        valid = [k for k, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
        raise TypeError(
            f"reward {name!r} got unknown option(s) {', '.join(map(repr, unknown))}. "
            f"Valid options: {', '.join(valid) or '(none)'}."
        )
    reward = factory(**kwargs)
    if getattr(reward, "kind", None) is None:
        reward.kind = getattr(factory, "reward_kind", None)
    if reward.kind not in KINDS:
        raise ValueError(f"reward {name!r} built a callable of kind {reward.kind!r}; valid kinds: {KINDS}")
    if not hasattr(reward, "__name__"):
        reward.__name__ = name
    return reward


def kind_of(reward: Callable[..., Any], default: str | None = None) -> str:
    """The kind ("image"/"text") of a reward callable; ``default`` for unmarked ones (e.g. TRL's)."""
    kind = getattr(reward, "kind", default)
    if kind not in KINDS:
        raise ValueError(
            f"reward {getattr(reward, '__name__', reward)!r} has no kind (got {kind!r}); "
            f"set reward.kind to one of {KINDS} or build it with rewards.get(name)"
        )
    return kind
