"""A config value checked (and gently converted) against its annotation: the one rule the config's loader and the
other registries' options (e.g. rollout.acceleration's knobs) share. A leaf: it imports no other part of flowrl but its
errors."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from flowrl.errors import ConfigError

#: per config key, values that are not among its choices but name one (a variant under another name): value ->
#: what to write instead; filled by the registries that define the choices (train.objective: the objectives)
CHOICE_ALIASES: dict[str, dict[str, str]] = {}


def convert_value(value: Any, tp, key: str, *, build: Callable | None = None) -> Any:
    """Check (and gently convert) `value` against the annotation `tp`; `key` names it in errors. `build(cls, data,
    key)` makes the dataclass items of a list (the config's sections, e.g. rewards)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return convert_value(value, inner[0], key, build=build)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            alias = CHOICE_ALIASES.get(key, {}).get(str(value).lower())
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
            hint = f" {value} is {alias}" if alias else f" Did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{key}: {value!r} is not a valid choice; valid: {', '.join(map(str, choices))}.{hint}")
        return value
    if origin is list:
        (arg,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if dataclasses.is_dataclass(arg):
            if build is None:
                raise ConfigError(f"{key}: a list of {arg.__name__} needs the config's builder")
            return [build(arg, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return [convert_value(v, arg, f"{key}[{i}]", build=build) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-4 without a dot as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if value is None:
            raise ConfigError(f"{key}: expected a string, got null (write {key}= for an empty string)")
        if key.endswith("].name") and isinstance(value, dict) and len(value) == 1 and None in value.values():
            # a reward's `r.py:` read as the mapping {r.py: null} (a template's `{prompt}` reads so too)
            (head,) = value
            raise ConfigError(
                f"{key}: expected a string, got {head!r} followed by a colon and nothing after it, which YAML reads as "
                "a mapping; a plug-in reward is FILE.py:FUNCTION (e.g. my_rewards.py:score), or quote the value"
            )
        if isinstance(value, (dict, list)):  # YAML reads an unquoted {prompt} or [a, b] as a mapping or a list
            what = "mapping" if isinstance(value, dict) else "list"
            raise ConfigError(
                f"{key}: expected a string, got {value!r}: YAML reads an unquoted {{...}} or [...] as a {what}; "
                f'quote the value, e.g. {key}: "{{prompt}}, a photo"'
            )
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if tp is Any:
        return value
    raise ConfigError(f"{key}: unsupported annotation {tp!r}")
