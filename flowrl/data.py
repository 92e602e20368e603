"""Prompt sets: a .txt file (one prompt per line) or .jsonl (a "prompt" key; the other keys are metadata
that reaches the reward functions, e.g. GenEval-style object lists)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

BUILTIN_PROMPTS = [
    "a red circle", "a blue square", "a green triangle", "a yellow circle",
    "two red squares", "a cat on a mat", "a photo of a mountain lake", "an apple on a table",
]


@dataclass
class PromptSet:
    prompts: list[str]
    metadata: list[dict] = field(default_factory=list)

    def __post_init__(self):
        if not self.metadata:
            self.metadata = [{} for _ in self.prompts]
        if len(self.metadata) != len(self.prompts):
            raise ValueError("prompts and metadata differ in length")
        if not self.prompts:
            raise ValueError("a prompt set needs at least one prompt")

    def __len__(self) -> int:
        return len(self.prompts)

    def draw(self, n: int, epoch: int, seed: int) -> tuple[list[str], list[dict]]:
        """n prompts for `epoch`: a seeded shuffle of the whole set, walked in order across epochs, so every
        prompt is seen once before any repeats; the same (seed, epoch) always gives the same prompts."""
        order: list[int] = []
        start = epoch * n
        cycle = start // len(self)
        while len(order) < start % len(self) + n:
            order.extend(self._permutation(seed, cycle))
            cycle += 1
        idx = order[start % len(self): start % len(self) + n]
        return [self.prompts[i] for i in idx], [dict(self.metadata[i]) for i in idx]

    def _permutation(self, seed: int, cycle: int) -> list[int]:
        """The seeded order of one pass over the set (cached: a pass spans many epochs)."""
        cache = self.__dict__.setdefault("_perm_cache", {})
        if (seed, cycle) not in cache:
            perm = list(range(len(self)))
            random.Random(seed * 1_000_003 + cycle).shuffle(perm)
            cache.clear()
            cache[(seed, cycle)] = perm
        return cache[(seed, cycle)]

    def head(self, n: int) -> tuple[list[str], list[dict]]:
        n = len(self) if n <= 0 else min(n, len(self))
        return self.prompts[:n], [dict(m) for m in self.metadata[:n]]


def load_prompts(path: str | Path | None) -> PromptSet:
    """Read a prompt file; an empty path gives the built-in prompts."""
    if not path:
        return PromptSet(list(BUILTIN_PROMPTS))
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist (expected .txt or .jsonl)")
    if path.suffix == ".jsonl":
        prompts, meta = [], []
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt" not in row:
                raise ValueError(f"{path}:{i + 1}: a JSONL prompt row needs a 'prompt' key, got keys {sorted(row)}")
            prompts.append(row.pop("prompt"))
            meta.append(row)
        return PromptSet(prompts, meta)
    if path.suffix == ".txt":
        return PromptSet([line.strip() for line in path.read_text().splitlines() if line.strip()])
    raise ValueError(f"prompt file {str(path)!r}: unknown format {path.suffix!r}; use .txt or .jsonl")
