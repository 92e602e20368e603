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

    def draw(self, n: int, epoch: int, seed: int, balance_by: str = "") -> tuple[list[str], list[dict]]:
        """n prompts for `epoch`: a seeded shuffle of the whole set, walked in order across epochs, so every
        prompt is seen once before any repeats; the same (seed, epoch) always gives the same prompts.

        balance_by: a metadata column (e.g. GenEval's `family`). Each value of it is then drawn equally often,
        however many prompts it has: draws go round the G values (in a seeded order, reshuffled every round),
        and each value walks its own seeded shuffle of its prompts. Every G consecutive draws, counted across
        epochs, hold each value once."""
        if balance_by:
            return self._draw_balanced(n, epoch, seed, balance_by)
        order: list[int] = []
        start = epoch * n
        cycle = start // len(self)
        while len(order) < start % len(self) + n:
            order.extend(self._permutation(seed, cycle))
            cycle += 1
        idx = order[start % len(self): start % len(self) + n]
        return [self.prompts[i] for i in idx], [dict(self.metadata[i]) for i in idx]

    def strata(self, column: str) -> list[list[int]]:
        """The prompts' indices grouped by their value of `column`, values in first-seen order (cached); an
        error names the columns the prompts do have when some prompt lacks this one."""
        cache = self.__dict__.setdefault("_strata", {})
        if column not in cache:
            require_column(self.metadata, column, f"cannot balance prompts by {column!r}")
            groups: dict = {}
            for i, meta in enumerate(self.metadata):
                groups.setdefault(json.dumps(meta[column], sort_keys=True), []).append(i)
            cache[column] = list(groups.values())
        return cache[column]

    def _draw_balanced(self, n: int, epoch: int, seed: int, column: str) -> tuple[list[str], list[dict]]:
        groups = self.strata(column)
        g = len(groups)
        idx = []
        for k in range(epoch * n, epoch * n + n):  # the k-th draw of the run
            rnd, pos = divmod(k, g)
            order = list(range(g))
            random.Random(f"{seed}/round/{rnd}").shuffle(order)
            members = groups[order[pos]]
            cycle, at = divmod(rnd, len(members))  # this value's rnd-th draw: its own shuffle, walked in order
            perm = list(members)
            random.Random(f"{seed}/{order[pos]}/{cycle}").shuffle(perm)
            idx.append(perm[at])
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


def require_column(metadata: list[dict], column: str, what: str) -> None:
    """Raise ValueError, starting with `what`, when a prompt's metadata lacks `column`; the message names the
    first such prompt and the columns the prompts do have."""
    missing = next((i for i, m in enumerate(metadata) if column not in (m or {})), None)
    if missing is not None:
        keys = sorted({k for m in metadata for k in (m or {})})
        raise ValueError(f"{what}: prompt {missing} has no column {column!r}; the prompts' metadata columns are "
                         f"{keys or 'none (plain-text prompts, e.g. a .txt prompt file)'}")


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
