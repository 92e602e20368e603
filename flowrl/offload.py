"""train.offload: modules that live in CPU memory and visit the accelerator only while they run.

The text encoders run once per new prompt (their encodings are cached), the VAE once per rollout (the decode),
a reward model once per batch: between those, they hold accelerator memory the update could use. `Parked`
keeps a set of such modules on the CPU and brings them to their device for the span of a `with visit():`.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch

PARKING = torch.device("cpu")


def module_device(module: torch.nn.Module) -> torch.device | None:
    """The device of a module's first parameter (or buffer); None for a module without tensors."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return None


def modules_in(obj, depth: int = 4) -> list[torch.nn.Module]:
    """The torch modules an object holds, outermost only (a module's submodules move with it), each once:
    the object itself if it is one, else its attributes, the items of its lists, tuples and dicts, a
    functools.partial's function and arguments, a bound method's object, to `depth` levels."""
    found: dict[int, torch.nn.Module] = {}
    seen: set[int] = set()

    def walk(x, level: int) -> None:
        if id(x) in seen or level > depth or isinstance(x, (type, types.ModuleType, str, bytes, int, float)):
            return
        seen.add(id(x))
        if isinstance(x, torch.nn.Module):
            found.setdefault(id(x), x)
            return
        if isinstance(x, torch.Tensor):
            return
        if isinstance(x, dict):
            children = list(x.values())
        elif isinstance(x, (list, tuple, set)):
            children = list(x)
        elif isinstance(x, functools.partial):
            children = [x.func, *x.args, *x.keywords.values()]
        elif isinstance(x, types.MethodType):
            children = [x.__self__]
        elif isinstance(x, types.FunctionType):  # what a closure or its default arguments hold
            children = [c.cell_contents for c in x.__closure__ or () if _filled(c)] + list(x.__defaults__ or ())
        else:
            children = list(getattr(x, "__dict__", {}).values())
        for child in children:
            walk(child, level + 1)

    walk(obj, 0)
    return list(found.values())


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not assigned yet
        return False
    return True


class Parked:
    """Modules kept in CPU memory, on `device` only inside `with self.visit():`.

    device: where they compute (default: where they are now, i.e. where they were built). Building a Parked
    moves them to the CPU at once."""

    def __init__(self, modules: list[torch.nn.Module], device: torch.device | str | None = None):
        self.modules = [m for m in modules if module_device(m) is not None]
        first = module_device(self.modules[0]) if self.modules else None
        self.device = torch.device(device) if device is not None else first
        self.park()

    def park(self) -> None:
        for m in self.modules:
            m.to(PARKING)

    @contextlib.contextmanager
    def visit(self):
        """The modules on their device for the block, back in CPU memory after it (also on an error)."""
        if self.device is None:  # no module with weights
            yield
            return
        try:
            for m in self.modules:
                m.to(self.device)
            yield
        finally:
            self.park()


def visiting(parked: Parked | None):
    """`parked.visit()`, or nothing when offload is off (`parked` None)."""
    return parked.visit() if parked is not None else contextlib.nullcontext()
