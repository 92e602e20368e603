"""Diversity of what a model draws where the prompt leaves it free, against the base model.

RL on a reward can narrow a model: asked for "a square" with no colour, a trained model may draw it red far
more often than the base model did, a drift the reward never sees and accuracy hides. A reward reports, per
image, how many of the things the prompt left free came out with each value, as components named

    "free_<attribute>=<value>"        e.g. shapes_geneval's "free_color=red": [n] counts per image

(for each object whose colour the prompt does not fix, +1 to the count of its detected colour). Summed over an
eval's images they make a distribution p over the values; `distribution_metrics` reports its entropy (bits) and,
given the base model's distribution q (the first eval, before training), the total variation distance
TV(p, q) = 1/2 sum_v |p_v - q_v|, the share of the mass that moved to other values (0: unchanged, 1: disjoint).
Entropy alone hides a drift that keeps the spread: from mostly green to mostly red is no entropy change.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

#: a reward component that counts, per image, the free attribute's values: "<reward>/free_<attribute>=<value>"
COUNT_RE = re.compile(r"^(?P<reward>.+)/free_(?P<attr>[A-Za-z0-9_]+)=(?P<value>[^/]+)$")


def is_count(name: str) -> bool:
    """Whether a score's name is a free-attribute count (summed into a distribution, not averaged)."""
    return COUNT_RE.match(name) is not None


def histograms(scores: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """{"<reward>/<attribute>": {value: total count over the images}} from the count components of `scores`."""
    out: dict[str, dict[str, float]] = {}
    for name, values in scores.items():
        m = COUNT_RE.match(name)
        if m:
            counts = out.setdefault(f"{m['reward']}/{m['attr']}", {})
            counts[m["value"]] = counts.get(m["value"], 0.0) + float(torch.as_tensor(values, dtype=torch.float64).sum())
    return out


def normalised(counts: dict[str, float]) -> dict[str, float]:
    total = sum(counts.values())
    return {v: c / total for v, c in counts.items()} if total > 0 else {}


def entropy_bits(p: dict[str, float]) -> float:
    """H(p) = -sum_v p_v log2 p_v (0 log 0 = 0)."""
    return -sum(x * math.log2(x) for x in p.values() if x > 0)


def total_variation(p: dict[str, float], q: dict[str, float]) -> float:
    """TV(p, q) = 1/2 sum_v |p_v - q_v| over the values of either (a missing value has probability 0)."""
    return 0.5 * sum(abs(p.get(v, 0.0) - q.get(v, 0.0)) for v in set(p) | set(q))


def distribution_metrics(hists: dict[str, dict[str, float]], base: dict[str, dict[str, float]] | None = None,
                         prefix: str = "eval/diversity/") -> dict[str, float]:
    """For every "<reward>/<attribute>" histogram: its entropy in bits, the number of free things counted, and
    with `base` (the same keys, counts or probabilities) the total variation distance from the base's
    distribution. An attribute with nothing counted reports nothing."""
    out = {}
    for key, counts in sorted(hists.items()):
        p = normalised(counts)
        if not p:
            continue
        out[f"{prefix}{key}_entropy_bits"] = entropy_bits(p)
        out[f"{prefix}{key}_count"] = sum(counts.values())
        q = normalised((base or {}).get(key, {}))
        if q:
            out[f"{prefix}{key}_tv_from_base"] = total_variation(p, q)
    return out


class BaseDistribution:
    """The base model's free-attribute histograms, kept in the run directory (`eval-base-distribution.json`):
    written by the first evaluation that counts anything (the one before training, when eval.before is on) and
    read by the later ones, also after a resume."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "eval-base-distribution.json"

    def load(self) -> dict[str, dict[str, float]] | None:
        if not self.path.exists():
            return None
        return json.loads(self.path.read_text())

    def save(self, hists: dict[str, dict[str, float]]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(hists, indent=1, sort_keys=True))
        tmp.replace(self.path)
