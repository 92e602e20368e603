"""Plots of a run directory's metrics.jsonl: the training reward per epoch and the eval metrics."""

from __future__ import annotations

import os
from pathlib import Path

from .train_utils import read_metrics


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["epoch"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def headline_eval_keys(rows: list[dict]) -> list[str]:
    """The eval metrics worth a line in the plot: every `eval/...` key except per-group breakdowns
    (`..._by_<column>/<value>`, e.g. GenEval's per-family scores), which stay in metrics.jsonl."""
    return sorted({k for r in rows for k in r if k.startswith("eval/") and "_by_" not in k})


def result_keys(rows: list[dict], reward: str, group_by: str = "") -> list[str]:
    """The eval metrics a run reports as its result, headline first, among those `rows` hold: with `group_by`, the
    mean over its groups (GenEval's overall), then the plain mean; a reward's `strict` component (strict
    correctness) before the reward's own value. Empty when nothing was evaluated."""
    groups = [f"eval/{reward}/strict_{group_by}_mean", f"eval/{reward}_{group_by}_mean"] if group_by else []
    candidates = groups + [f"eval/{reward}/strict_mean", f"eval/{reward}_mean"]
    present = {k for r in rows for k in r}
    return [k for k in candidates if k in present]


def write_before_after(run_dir: str | Path, rows: list[dict], key: str | None) -> Path | None:
    """`before_after.png` from a run's first and final eval grids (`eval-epoch000000.png`, `eval-final.png`: the
    same prompts and seeds), captioned with metric `key`'s first and last values in `rows` (the run's metrics;
    `key` from `result_keys`). None when the run has no such pair of grids (text runs, `eval.grid: false`)."""
    from .images import before_after

    run_dir = Path(run_dir)
    first, final = run_dir / "eval-epoch000000.png", run_dir / "eval-final.png"
    if not (first.exists() and final.exists()):
        return None
    evals = [r for r in rows if key and key in r]
    if len(evals) < 2:
        labels = ("before", "after")
    else:
        labels = (f"before: {key[len('eval/'):]} {evals[0][key]:.3f}", f"after: {evals[-1][key]:.3f}")
    return before_after(first, final, run_dir / "before_after.png", labels=labels)


def plot_curves(run_dir: str | Path, out: str | Path | None = None, title: str | None = None) -> Path:
    """Write `curves.png` (or `out`): left, the mean training reward per epoch (and a moving average); right,
    the headline eval metrics (`headline_eval_keys`) against the epoch. Returns the PNG's path."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'} has no metrics to plot")
    fig, (ax_r, ax_e) = plt.subplots(1, 2, figsize=(10, 3.6))
    x, y = _series(rows, "reward/total_mean")
    if x:
        ax_r.plot(x, y, color="#9ab", lw=0.8, label="batch mean")
        k = max(1, round(len(y) / 8))  # an eighth of the run: a batch mean of a few prompts is noisy
        smooth = [sum(y[max(0, i - k + 1): i + 1]) / len(y[max(0, i - k + 1): i + 1]) for i in range(len(y))]
        ax_r.plot(x, smooth, color="#c33", lw=1.6, label=f"moving average ({k})")
        ax_r.legend(frameon=False, fontsize=8)
    ax_r.set(xlabel="epoch", ylabel="training reward", title="reward")
    plotted = False
    for key in headline_eval_keys(rows):
        ex, ey = _series(rows, key)
        if ex:
            ax_e.plot(ex, ey, marker="o", ms=3, label=key[len("eval/"):])
            plotted = True
    if plotted:
        ax_e.legend(frameon=False, fontsize=8)
    ax_e.set(xlabel="epoch", title="held-out eval")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
    return out
