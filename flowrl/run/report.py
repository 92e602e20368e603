"""Plots of a run directory's metrics.jsonl: the training reward per epoch and the eval metrics."""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

SCALE_RATIO = 10.0  # eval series whose largest values differ by more than this get separate axes


def load_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of `run_dir`/metrics.jsonl, checked: a missing directory or file raises FileNotFoundError, and an
    empty file or a line that is not a JSON object with a numeric "epoch" raises ValueError naming file and line."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not run_dir.exists():
        raise FileNotFoundError(f"{run_dir} is not a run directory: it does not exist (pass the log.run_dir of a run)")
    if not run_dir.is_dir():
        raise FileNotFoundError(
            f"{run_dir} is not a run directory but a file: pass the directory that holds "
            "metrics.jsonl" + (f" ({run_dir.parent})" if run_dir.name == "metrics.jsonl" else "")
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"{run_dir} is not a run directory: no metrics.jsonl (a run writes it after its first logged epoch)"
        )
    rows = []
    data = path.read_bytes()
    lines = data.splitlines()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            rows.append(parse_row(raw, path, number))
        except ValueError:
            # the last line without its newline: a line being written now, or cut short by a crash (a resume
            # drops it); the lines before it are the run's, and the report is of them
            if number == len(lines) and not data.endswith(b"\n") and rows:
                warnings.warn(f"{path}:{number}: the last line is cut short (a crash, or being written); left out")
                break
            raise
    if not rows:
        raise ValueError(
            f"{path} is empty: no epoch logged yet (a run writes a line per logged epoch; wait for "
            "the first, or lower log.every)"
        )
    return rows


def parse_row(raw: bytes, path: Path, number: int) -> dict:
    """One line of metrics.jsonl as a dict; a ValueError naming `path`:`number` when it is not a JSON object with a
    numeric "epoch" (a line cut short by a crash, or an edit)."""
    where = f"{path}:{number}"
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(
            f"{where}: not UTF-8 text; metrics.jsonl holds one JSON object a line (delete or fix this line)"
        ) from None
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{where}: not valid JSON ({err.msg.removesuffix(' at')} at column {err.colno}); metrics.jsonl holds "
            "one JSON object a line (delete or fix this line)"
        ) from None
    epoch = row.get("epoch") if isinstance(row, dict) else None
    if not isinstance(epoch, (int, float)) or isinstance(epoch, bool):
        raise ValueError(
            f'{where}: a metrics row is a JSON object with a numeric "epoch", got '
            f"{raw.decode('utf-8')[:60]!r} (delete or fix this line)"
        )
    return row


@dataclass
class Curve:
    """One line of the plot: the metric keys it stands for (several when their values are all equal), and one
    value per epoch."""

    keys: list[str]
    epochs: list[float]
    values: list[float]

    @property
    def magnitude(self) -> float:
        """The largest |value| (0 when there is none): what decides which axes the curve shares."""
        return max((abs(v) for v in self.values if math.isfinite(v)), default=0.0)


def epoch_series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(epochs, values) of metric `key`: one point per epoch in increasing order, the last row that holds a number
    for `key` at that epoch winning (a resumed run logs again the epochs after its checkpoint; the final eval
    shares its epoch with the last training row but not its keys). Infinities become NaN (a gap in the line)."""
    by_epoch: dict[float, float] = {}
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            by_epoch[row["epoch"]] = float(value) if math.isfinite(value) or math.isnan(value) else math.nan
    epochs = sorted(by_epoch)
    return epochs, [by_epoch[e] for e in epochs]


def merge_equal_curves(curves: list[Curve]) -> list[Curve]:
    """One curve per distinct series: curves with the same epochs and equal values (e.g. GenEval's family mean and
    plain mean when the families have equally many images) become one curve holding all their keys."""
    merged: list[Curve] = []
    for curve in curves:
        twin = next((m for m in merged if same_points(m, curve)), None)
        if twin is None:
            merged.append(Curve(list(curve.keys), curve.epochs, curve.values))
        else:
            twin.keys.extend(curve.keys)
    return merged


def same_points(a: Curve, b: Curve) -> bool:
    """Whether two curves have the same epochs and values (NaN equal to NaN; relative tolerance 1e-9)."""
    return a.epochs == b.epochs and all(
        (math.isnan(u) and math.isnan(v)) or math.isclose(u, v, rel_tol=1e-9, abs_tol=1e-12)
        for u, v in zip(a.values, b.values)
    )


def scale_groups(curves: list[Curve], ratio: float = SCALE_RATIO) -> list[list[Curve]]:
    """The curves split into groups drawn on shared axes: curves whose magnitudes (largest |value|) are within
    `ratio` of the group's smallest share it, so an accuracy in [0, 1], a PickScore near 22 and a loss near 1e-3 each
    get their own axes. All-zero curves join the smallest-scale group. Groups (and curves in them) keep the order
    of `curves`."""
    scaled = sorted((c for c in curves if c.magnitude > 0), key=lambda c: c.magnitude)
    groups: list[list[Curve]] = []
    for curve in scaled:
        if groups and curve.magnitude <= ratio * groups[-1][0].magnitude:
            groups[-1].append(curve)
        else:
            groups.append([curve])
    zeros = [c for c in curves if c.magnitude == 0]
    if zeros:
        groups = [groups[0] + zeros] + groups[1:] if groups else [zeros]
    order = {id(c): i for i, c in enumerate(curves)}
    groups = [sorted(g, key=lambda c: order[id(c)]) for g in groups]
    return sorted(groups, key=lambda g: order[id(g[0])])


def headline_eval_keys(rows: list[dict]) -> list[str]:
    """The eval metrics worth a line in the plot: every `eval/...` key (the diversity metrics too: the colour
    entropy and TV from the base, the feature spread, its ratio to the base's and the distance from the base's
    images) except per-group breakdowns (`..._by_<column>/<value>`, e.g. GenEval's per-family scores) and the
    diversity metric's sample counts (`..._count`), which stay in metrics.jsonl."""
    return sorted(
        {
            k
            for r in rows
            for k in r
            if k.startswith("eval/")
            and "_by_" not in k
            and not (k.startswith("eval/diversity/") and k.endswith("_count"))
        }
    )


def eval_before_training(rows: list[dict]) -> dict | None:
    """The eval before training among a run's metrics `rows` (its first eval, at epoch 0); None when the run did not
    evaluate before it trained (eval.before=false: its first eval is one after training began)."""
    first = next((r for r in rows if any(k.startswith("eval/") for k in r)), None)
    return first if first is not None and first.get("epoch", 0) == 0 and not first.get("final") else None


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
    from flowrl.images import before_after

    run_dir = Path(run_dir)
    first, final = run_dir / "eval-epoch000000.png", run_dir / "eval-final.png"
    if not (first.exists() and final.exists()):
        return None
    evals = [r for r in rows if key and key in r]
    if len(evals) < 2:
        labels = ("before", "after")
    else:
        labels = (f"before: {key[len('eval/') :]} {evals[0][key]:.3f}", f"after: {evals[-1][key]:.3f}")
    try:
        return before_after(first, final, run_dir / "before_after.png", labels=labels)
    except OSError:  # (a full disk): no half-written temporary file stays behind
        (run_dir / "before_after.tmp.png").unlink(missing_ok=True)
        raise


def eval_curves(rows: list[dict]) -> list[list[Curve]]:
    """The headline eval metrics of `rows` as curves, equal series merged, split into scale groups (one axes each)."""
    curves = []
    for key in headline_eval_keys(rows):
        epochs, values = epoch_series(rows, key)
        if epochs:
            curves.append(Curve([key[len("eval/") :]], epochs, values))
    return scale_groups(merge_equal_curves(curves))


def curves_figure(rows: list[dict], title: str | None = None):
    """The matplotlib figure of `plot_curves`: first the mean training reward per epoch (and its moving average),
    then one axes per scale group of the headline eval metrics (`eval_curves`), every series drawn once with one
    point per epoch."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure to close

    groups = eval_curves(rows)
    panels = 1 + max(1, len(groups))
    fig = Figure(figsize=(4.6 * panels, 4.2), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)
    draw_reward(axes[0][0], rows)
    for ax, group in zip(axes[0][1:], groups or [[]]):
        draw_eval(ax, group)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def moving_average(values: list[float]) -> tuple[list[float], int]:
    """(the trailing mean of each value over the last k, k): k is an eighth of the run, since a batch mean of a few
    prompts is noisy."""
    k = max(1, round(len(values) / 8))
    return [
        sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))
    ], k


def draw_reward(ax, rows: list[dict]) -> None:
    """The mean training reward per epoch and its moving average over an eighth of the run."""
    x, y = epoch_series(rows, "reward/total_mean")
    if x:
        ax.plot(x, y, color="#9ab", lw=0.8, label="batch mean")
        smooth, k = moving_average(y)
        ax.plot(x, smooth, color="#c33", lw=1.6, label=f"moving average ({k})")
        ax.legend(frameon=False, fontsize=8)
    ax.set(xlabel="epoch", ylabel="training reward", title="reward")


def draw_eval(ax, group: list[Curve]) -> None:
    """One scale group of eval curves, a line with a marker per epoch each; curves standing for several equal
    metrics are labelled with all their names."""
    for curve in group:
        ax.plot(curve.epochs, curve.values, marker="o", ms=3, label="\n= ".join(curve.keys))
    if group:
        ax.legend(frameon=False, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=1)
    ax.set(xlabel="epoch", title="held-out eval")


def plot_curves(run_dir: str | Path, out: str | Path | None = None, title: str | None = None) -> Path:
    """Write `curves.png` (or `out`) from `run_dir`/metrics.jsonl (`curves_figure`). Returns the PNG's path.
    A missing run directory or metrics.jsonl raises FileNotFoundError, an empty or corrupt one ValueError."""
    run_dir = Path(run_dir)
    return save_figure(curves_figure(load_metrics(run_dir), title), Path(out) if out else run_dir / "curves.png")


FIGURE_FORMATS = {".png": "png", ".pdf": "pdf", ".svg": "svg", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}


def figure_format(out: str | Path) -> str:
    """The format a figure written to `out` takes from its suffix (none: PNG); another suffix is a ConfigError
    naming the ones there are."""
    from flowrl.errors import ConfigError

    suffix = Path(out).suffix.lower()
    if not suffix:
        return "png"
    if suffix not in FIGURE_FORMATS:
        raise ConfigError(
            f"--out {out}: a figure is written as {', '.join(FIGURE_FORMATS)} (by its suffix), not {suffix}"
        )
    return FIGURE_FORMATS[suffix]


def save_figure(fig, out: Path) -> Path:
    """`fig` at `out` in the format of its suffix (`figure_format`), written whole (a temporary file, then renamed;
    a write that fails, e.g. on a full disk, leaves neither)."""
    fmt = figure_format(out)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        fig.savefig(tmp, format=fmt, dpi=110, bbox_inches="tight")
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


# ---------------------------------------------------------------------------------------------- several runs


def run_labels(run_dirs: list[Path]) -> list[str]:
    """A short name per run: its directory's name, or as much of its path as tells it from the others."""
    parts = [Path(d).resolve().parts for d in run_dirs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(d) for d in run_dirs]  # the same directory twice


#: the x axes of a comparison: the metric that gives each epoch's position (None: the epoch itself) and its label
X_AXES = {
    "epoch": (None, "epoch"),
    "minutes": ("time/train_wall_minutes", "training minutes (wall-clock)"),
    "cpu_minutes": ("time/train_process_minutes", "training CPU minutes (the process's)"),
}


def minutes_by_epoch(rows: list[dict], key: str = "time/train_wall_minutes") -> dict[float, float]:
    """Epoch -> the run's training minutes when it ended (`key`: wall-clock, or the process's CPU time; epoch 0: 0),
    for a minutes axis; an eval row takes its epoch's."""
    out = {0: 0.0}
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[row["epoch"]] = float(value)
    return out


def shared_eval_keys(runs: dict[str, list[dict]]) -> list[str]:
    """The headline eval metrics (`headline_eval_keys`) that every run logged, sorted."""
    keys = [set(headline_eval_keys(rows)) for rows in runs.values()]
    return sorted(set.intersection(*keys)) if keys else []


def comparison_table(runs: dict[str, list[dict]], keys: list[str], x: str = "epoch") -> list[str]:
    """Markdown, a row per run: the epochs it logged, its training minutes (the CPU's with x="cpu_minutes", else the
    wall-clock's), and each shared eval metric's first and last value with the change between them."""
    position, axis = X_AXES["cpu_minutes" if x == "cpu_minutes" else "minutes"]
    header = ["run", "epochs", axis, *(k[len("eval/") :] for k in keys)]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for label, rows in runs.items():
        minutes = minutes_by_epoch(rows, position)
        cells = [label, f"{max(r['epoch'] for r in rows):g}", f"{max(minutes.values()):.1f}"]
        for key in keys:
            _, values = epoch_series(rows, key)
            first, last = values[0], values[-1]
            cells.append(f"{first:.3f} -> {last:.3f} ({last - first:+.3f})" if len(values) > 1 else f"{last:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def comparison_figure(runs: dict[str, list[dict]], keys: list[str], x: str = "epoch"):
    """One axes for the training reward (each run's moving average over an eighth of it) and one per shared eval
    metric, a line per run, against the epoch or the training minutes (`x`, a key of X_AXES: the wall-clock's, or
    the process's CPU time, which a paused run does not count)."""
    from matplotlib.figure import Figure

    if x not in X_AXES:
        raise ValueError(f"x axis {x!r}: valid: {', '.join(X_AXES)}")
    panels = 1 + len(keys)
    fig = Figure(figsize=(4.6 * panels, 4.2), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    position, xlabel = X_AXES[x]
    for label, rows in runs.items():
        to_x = minutes_by_epoch(rows, position) if position else None

        def place(epochs, to_x=to_x):
            return [to_x.get(e, math.nan) for e in epochs] if to_x is not None else epochs

        epochs, values = epoch_series(rows, "reward/total_mean")
        (line,) = axes[0].plot(place(epochs), moving_average(values)[0], lw=1.4, label=label)
        for ax, key in zip(axes[1:], keys):
            epochs, values = epoch_series(rows, key)
            ax.plot(place(epochs), values, marker="o", ms=3, color=line.get_color(), label=label)
    axes[0].set(xlabel=xlabel, ylabel="training reward (moving average)", title="reward")
    for ax, key in zip(axes[1:], keys):
        ax.set(xlabel=xlabel, title=key[len("eval/") :])
    axes[0].legend(frameon=False, fontsize=8)
    return fig


def plot_comparison(
    run_dirs: list[str | Path], out: str | Path, x: str = "epoch", metrics: list[str] | None = None
) -> tuple[Path, list[str]]:
    """Several runs on one figure (`comparison_figure`) at `out`, and their table (`comparison_table`), of
    `metrics` (eval metric names without `eval/`; None: every one the runs all logged). Each run directory is checked
    as `load_metrics` checks it; a metric some run did not log is a ValueError naming the ones they share."""
    dirs = [Path(d) for d in run_dirs]
    runs = dict(zip(run_labels(dirs), (load_metrics(d) for d in dirs)))
    keys = shared_eval_keys(runs)
    if metrics:
        shared = [k[len("eval/") :] for k in keys]
        missing = [m for m in metrics if m.removeprefix("eval/") not in shared]
        if missing:
            raise ValueError(
                f"--metric {', '.join(missing)}: not logged by every run; the eval metrics they all logged: "
                f"{', '.join(shared) or 'none'}"
            )
        keys = [f"eval/{m.removeprefix('eval/')}" for m in metrics]
    return save_figure(comparison_figure(runs, keys, x), Path(out)), comparison_table(runs, keys, x)
