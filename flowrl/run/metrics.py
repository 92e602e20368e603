"""What a run writes as it goes: metrics as JSONL (and to accelerate's trackers), and the time of each phase."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import numpy as np
import torch


class MetricsLog:
    """Metrics as JSONL (one line per logged epoch) plus accelerate's trackers when given."""

    def __init__(self, path: str | Path, accelerator=None, enabled: bool = True):
        self.path = Path(path)
        self.accelerator = accelerator
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        numbers = (int, float, np.floating, torch.Tensor)
        clean = strict_json({k: float(v) if isinstance(v, numbers) else v for k, v in metrics.items()})
        with open(self.path, "a") as f:
            f.write(json.dumps({"epoch": step, "time": time.time(), **clean}, allow_nan=False) + "\n")
        if self.accelerator is not None and self.accelerator.trackers:
            self.accelerator.log({k: v for k, v in clean.items() if isinstance(v, float)}, step=step)


def strict_json(values: dict) -> dict:
    """`values` with its floats that are not finite (NaN, inf) as None: strict JSON has no NaN or Infinity, and
    readers other than Python's refuse them."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl ([] when there is none)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Timer:
    """Accumulates wall-clock seconds per named phase: `with timer("rollout"): ...`."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out
