"""What an eval samples and how its scores are summed up: the eval plan (which prompts, how many images each), the
scores' means, their break-down by a metadata column, and the free attributes' distributions."""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from flowrl.config import EvalConfig


def grouped_means(name: str, values, metadata: list[dict], column: str) -> dict[str, float]:
    """Break one eval score down by a metadata column of the prompts.

    values: [P * n] per-sample scores, prompt-major (n samples of prompt 0, then of prompt 1, ...);
    metadata: [P] the prompts' metadata dicts; column: the key to group by (every prompt must have it).
    -> {f"eval/{name}_by_{column}/{value}": mean over that group's samples,
        f"eval/{name}_{column}_mean": unweighted mean of the group means}.
    NaN samples (a reward that does not apply) and infinite ones are left out of their group's mean.
    """
    vals = [float(v) for v in values]
    if not metadata or len(vals) % len(metadata):
        raise ValueError(
            f"eval.group_by={column!r}: {len(vals)} scores do not split evenly over {len(metadata)} prompts"
        )
    from flowrl.data import require_column

    require_column(metadata, column, f"eval.group_by={column!r}")
    n = len(vals) // len(metadata)
    groups: dict[str, list[float]] = {}
    for i, m in enumerate(metadata):
        groups.setdefault(str(m[column]), []).extend(v for v in vals[i * n : (i + 1) * n] if math.isfinite(v))
    means = {g: sum(v) / len(v) for g, v in sorted(groups.items()) if v}
    out = {f"eval/{name}_by_{column}/{g}": m for g, m in means.items()}
    if means:
        out[f"eval/{name}_{column}_mean"] = sum(means.values()) / len(means)
    return out


def group_prompt_counts(meta: list[dict], column: str) -> dict[str, int]:
    """{value of `column`: how many of the prompts (their metadata rows) have it}, in order of first appearance."""
    counts: dict[str, int] = {}
    for m in meta:
        counts[str(m[column])] = counts.get(str(m[column]), 0) + 1
    return counts


def eval_plan(prompt_set, eval_cfg) -> tuple[list[str], list[dict], EvalConfig]:
    """What an evaluation samples: (prompts, metadata, eval_cfg'), where eval_cfg' is `eval_cfg` with
    `images_per_prompt` = n, the number of images of each listed prompt (prompt-major), to sample with.

    Plain: the first `eval_cfg.num_prompts` prompts of `prompt_set`, `images_per_prompt` images each.
    With `images_per_group` = N (and `group_by`): a prompt of a group of g prompts is listed N / g times in a
    row, one image each (n = 1), so that every group gets N images whatever its number of prompts; each
    listing draws its own noise. An error names the groups' prompt counts and the smallest valid N."""
    prompts, meta = prompt_set.head(eval_cfg.num_prompts)
    per_group = eval_cfg.images_per_group
    if not per_group:
        return prompts, meta, eval_cfg
    from flowrl.data import require_column

    column = eval_cfg.group_by
    require_column(meta, column, f"eval.group_by={column!r}")
    counts = group_prompt_counts(meta, column)
    bad = {g: c for g, c in counts.items() if per_group % c}
    if bad:
        lcm = math.lcm(*counts.values())
        raise ValueError(
            f"eval.images_per_group={per_group} must be a multiple of every {column!r} group's "
            f"prompt count {dict(sorted(counts.items()))}; {dict(sorted(bad.items()))} do not divide "
            f"it; the smallest that works is {lcm} (or a multiple of it)"
        )
    reps = [per_group // counts[str(m[column])] for m in meta]
    return (
        [p for p, r in zip(prompts, reps) for _ in range(r)],
        [dict(m) for m, r in zip(meta, reps) for _ in range(r)],
        dataclasses.replace(eval_cfg, images_per_prompt=1),
    )


def eval_summary(
    scores: dict,
    metadata: list[dict],
    group_by: str = "",
    base: dict[str, dict[str, float]] | None = None,
    reference: str | dict[str, dict[str, float]] | None = None,
    nan_is_absent: bool = False,
) -> dict[str, float]:
    """{name: per-sample scores [P * n]} -> {"eval/<name>_mean": mean} plus, with `group_by`, the
    `grouped_means` of every score (shared by the trainer's evaluations and `flowrl eval`). Free-attribute counts
    (`flowrl.eval.diversity`: "<reward>/free_<attribute>=<value>") are not averaged: they become the distribution's
    entropy and, given the base model's histograms `base`, its total variation distance from them (and from
    `reference`, eval.free_reference as `diversity.load_free_reference` reads it).
    Scores that are not finite (inf, NaN) are left out of the means, as training leaves them out of the advantages:
    their number is `eval/<name>_nonfinite` (when there are any; one warning names them), and a score with no
    finite value has no mean. `nan_is_absent` (text rewards, whose None and NaN mean "does not apply", as in
    training): a NaN is no score rather than a failure, left out of the means without a warning, and the share
    that has one is `eval/<name>_applies` (when it is not all); an inf is still a failure."""
    from .diversity import distribution_metrics, histograms, is_count

    out: dict[str, float] = {}
    bad = []
    for name, vals in scores.items():
        if is_count(name):
            continue
        vals = torch.as_tensor(vals, dtype=torch.float64)
        finite = torch.isfinite(vals)
        failed = ~finite & ~vals.isnan() if nan_is_absent else ~finite
        if nan_is_absent and vals.isnan().any():
            out[f"eval/{name}_applies"] = float((~vals.isnan()).double().mean())
        if failed.any():
            out[f"eval/{name}_nonfinite"] = int(failed.sum())
            bad.append(f"{name} {int(failed.sum())} of {len(vals)}")
        if finite.any():
            out[f"eval/{name}_mean"] = float(vals[finite].mean())
        if group_by:
            out.update(grouped_means(name, vals, metadata, group_by))
    if bad:
        warnings.warn(
            f"eval: scores that are not finite (inf or NaN) are left out of the eval's means ({'; '.join(bad)}), "
            "counted in eval/<reward>_nonfinite",
            stacklevel=2,
        )
    out.update(distribution_metrics(histograms(scores), base, reference=reference))
    return out
