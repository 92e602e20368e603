"""Name -> function registries, with errors that list the valid names."""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Callable, Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")


def unknown_name_error(kind: str, name: object, valid: list[str]) -> ValueError:
    """A ValueError naming the bad `name`, the closest valid names and all valid names."""
    close = difflib.get_close_matches(str(name), valid, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(f"unknown {kind} {name!r}.{hint} Valid: {', '.join(sorted(valid))}.")


class Registry(Generic[T]):
    """A small name -> object map used as a decorator: ``@REG.register("grpo")``."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}
        self._discovered = False

    def discover(self, package: str, path: Iterable[str]) -> None:
        """Import, once, every module of `package` (found in its folders `path`) whose name does not start with "_",
        so that each registers its members here: adding a member is adding a module."""
        if self._discovered:
            return
        for info in pkgutil.iter_modules(list(path)):
            if not info.name.startswith("_"):
                importlib.import_module(f"{package}.{info.name}")
        self._discovered = True

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise unknown_name_error(self.kind, name, list(self._items)) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
