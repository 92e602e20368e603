"""What a reward needs of each prompt's metadata, beyond the columns it declares (`rewards.declared_columns`),
checked before any model loads:

- a plug-in's required parameters: those of its signature without a default that are neither the batch nor an
  option in its `kwargs` (`required_columns`), which only a prompt's column can fill;
- a reward's check of a row (`row_check`): ``check_row(row) -> str`` on a plug-in function or a registered
  reward's factory, or given with ``@checks_rows(name)`` from another module; "" for a row it can score, else why
  not, in words (the shapes world's rewards name a shape, colour, count or relation outside the world).

Kept out of `rewards/registry.py`, whose source is part of the shipped base-model eval's fingerprint
(`flowrl.eval.base_cache`): checking prompts changes no image and no score."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable

from rewards._common import TRL_EXTRAS
from rewards.registry import _registered, is_plugin, load_plugin

ROW_CHECKS: dict[str, Callable[[dict], str]] = {}
"""The registered rewards' checks of a prompt's metadata given apart from their factories (``checks_rows``)."""


def checks_rows(name: str) -> Callable[[Callable[[dict], str]], Callable[[dict], str]]:
    """Decorator: ``check(row) -> str`` is the registered reward ``name``'s check of a prompt's metadata (as a
    ``check_row`` on its factory would be)."""

    def deco(check: Callable[[dict], str]) -> Callable[[dict], str]:
        ROW_CHECKS[name] = check
        return check

    return deco


def row_check(name: str) -> Callable[[dict], str] | None:
    """The reward ``name``'s check of one prompt's metadata, without building it (see the module docstring); None
    when it has none."""
    if is_plugin(name):
        check = getattr(load_plugin(name), "check_row", None)
    else:
        check = getattr(_registered(name), "check_row", None) or ROW_CHECKS.get(name)
    return check if callable(check) else None


def required_columns(name: str, kwargs: Mapping[str, Any]) -> tuple[tuple[str, ...], ...]:
    """The columns a plug-in's signature requires, in `declared_columns`' form (one name each): the parameters
    without a default past its two first positional ones (the batch) that no option in ``kwargs`` and no batch
    argument (images, prompts, completions, TRL's extras) gives; () for a registered reward."""
    if not is_plugin(name):
        return ()
    try:
        params = inspect.signature(load_plugin(name)).parameters
    except (TypeError, ValueError):  # a builtin or extension function: nothing to read
        return ()
    positional = [k for k, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    batch = {"images", "prompts", "completions", "completion_ids", *TRL_EXTRAS, *positional}
    return tuple(
        (k,)
        for k, p in params.items()
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and k not in batch
        and k not in kwargs
    )
