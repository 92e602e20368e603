"""Seeds: every random draw of a run follows from `train.seed` and where it happens (epoch, process, ...)."""

from __future__ import annotations

import random

import numpy as np
import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (seed, epoch, rank, ...), the same on every run and machine."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
