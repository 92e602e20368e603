"""The repository's scripts and benchmarks (not a package) imported by their path, for the tests that call them."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_module(relative: str, name: str, *, register: bool = False):
    """The file `relative` (to the repository root, e.g. "scripts/race_objectives.py") imported as module `name`, anew
    each call; `register`: put in sys.modules first (a module whose dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
