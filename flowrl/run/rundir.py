"""A run directory belongs to one run: a new run refuses a directory that holds another run's files unless it
resumes that run or is told to overwrite it, and a resumed run's logs carry no rows of epochs it redoes.

Only the files flowrl writes are ever touched (a run directory may be a folder that holds other things too).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from flowrl.errors import RunDirError

from .checkpoint import CKPT_RE, TEMP_RE, TRAINER_STATE, checkpoint_dirs, damage, list_checkpoints

#: Files a run writes into its run_dir (besides ckpt-XXXXXX/, the temporary checkpoint dirs and the eval's files),
#: with the temporary names they are written under before a rename (a kill can leave those behind).
RUN_FILES = (
    "metrics.jsonl",
    "metrics.jsonl.tmp",  # (truncate_logs)
    "completions.jsonl",
    "completions.jsonl.tmp",
    "curves.png",
    ".curves.png.tmp",  # (flowrl.run.report.save_figure)
    "before_after.png",
    "before_after.tmp.png",
    "best.json",  # checkpoint.keep_best: it names a checkpoint of its run
    "best.json.tmp",
)
#: The eval's files: grids (eval-TAG.png), a text run's completions (eval-TAG.jsonl, written as eval-TAG.tmp), the
#: base model's eval (eval-base-*.json, eval-base-features.safetensors), each with its temporary name.
RUN_GLOBS = ("eval-*.png", "eval-*.tmp.png", "eval-*.json", "eval-*.jsonl", "eval-*.tmp", "eval-*.safetensors")
#: A video run's eval folders (eval-TAG/NNN.webp beside the grid eval-TAG.png).
EVAL_DIR_RE = re.compile(r"^eval-(epoch\d{6}|final)$")
TRACKER_DIRS = ("flowrl",)  # accelerate's TensorBoard logs (project_dir/<project name>)


def run_files(run_dir: str | Path) -> list[Path]:
    """The files and directories of a run in `run_dir` (empty when there is none)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if CKPT_RE.match(p.name) or TEMP_RE.match(p.name)]
    found += [p for p in run_dir.iterdir() if p.is_dir() and EVAL_DIR_RE.match(p.name)]
    found += [run_dir / n for n in RUN_FILES if (run_dir / n).exists()]
    found += [p for g in RUN_GLOBS for p in run_dir.glob(g)]
    found += [run_dir / n for n in TRACKER_DIRS if (run_dir / n).is_dir()]
    return sorted(set(found))


def holds_a_run(run_dir: str | Path) -> bool:
    """True when `run_dir` holds checkpoints or logged metrics of a run."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    has_metrics = metrics.is_file() and metrics.stat().st_size > 0
    return has_metrics or any(CKPT_RE.match(p.name) for p in run_files(run_dir))


def describe_run(run_dir: str | Path) -> str:
    """A short account of what `run_dir` holds, e.g. "2 checkpoints (newest ckpt-000040), metrics to epoch 40"."""
    run_dir = Path(run_dir)
    ckpts = sorted(p.name for p in run_files(run_dir) if CKPT_RE.match(p.name))
    parts = []
    if ckpts:
        parts.append(f"{len(ckpts)} checkpoint{'s' if len(ckpts) > 1 else ''} (newest {ckpts[-1]})")
    epochs = [row.get("epoch") for row in _rows(run_dir / "metrics.jsonl")]
    epochs = [e for e in epochs if isinstance(e, (int, float))]
    if epochs:
        parts.append(f"metrics to epoch {int(max(epochs))}")
    return ", ".join(parts) or "files of a run"


def check_writable(
    run_dir: str | Path, what: str = "log.run_dir", *, keep: bool = True, problem: Callable[[str], str] | None = None
) -> list[Path]:
    """Create `run_dir` if needed and make sure a file can be written in it (before any model loads); `what`: the
    key or option that named it, for the error; `problem(why)`: the error's whole text instead (`why`: the OS's
    reason, or that the path is a file). Returns the folders it created, outermost first (`remove_empty` takes
    them away again when a run is refused before it wrote anything); keep=False removes them at once (an output
    folder that a stopped command should not leave behind, empty)."""
    run_dir = Path(run_dir)
    chain = [*reversed(run_dir.absolute().parents), run_dir.absolute()]
    file = next((p for p in chain if p.exists() and not p.is_dir()), None)
    if file is not None:
        whose = "it" if file == run_dir.absolute() else f"its folder {str(file)!r}"
        why = f"{whose} is a file, not a directory"
        default = f"{what}={str(run_dir)!r}: {why}; choose a directory with {what}=PATH"
        raise RunDirError(problem(why) if problem else default)
    created = []
    try:
        for p in chain:
            if not p.exists():
                p.mkdir()
                created.append(p)
        probe = run_dir / f".flowrl-write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        why = str(e.strerror or e)
        default = (
            f"{what}={str(run_dir)!r} is not writable ({why}); choose a directory you can write to with {what}=PATH"
        )
        raise RunDirError(problem(why) if problem else default) from None
    finally:
        if not keep:
            remove_empty(created)
    return created if keep else []


def remove_empty(created: list[Path]) -> None:
    """Remove the folders `check_writable` created (outermost first) that are still empty, innermost first: a run
    refused before it wrote anything leaves no run directory behind."""
    for p in reversed(created):
        with contextlib.suppress(OSError):
            p.rmdir()


def claim(run_dir: str | Path, *, resume: str | None, overwrite: bool) -> None:
    """Make `run_dir` this run's: an error when it holds another run and the run neither resumes nor overwrites;
    with `overwrite`, that run's files are deleted (and nothing else)."""
    run_dir = Path(run_dir)
    if not holds_a_run(run_dir):
        return
    if overwrite:
        for p in run_files(run_dir):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        return
    if resume == "auto" and not list_checkpoints(run_dir):
        first = next(iter(checkpoint_dirs(run_dir)[::-1]), None)
        raise nothing_to_resume(run_dir, damage(first, TRAINER_STATE) if first is not None else None)
    if resume and resume != "auto":
        _check_resumed_line(run_dir, Path(resume))
    if resume:
        return
    raise RunDirError(
        f"log.run_dir={str(run_dir)!r} already holds a run ({describe_run(run_dir)}). Continue it with "
        "checkpoint.resume=auto, start over there with log.overwrite=true (deletes that run's files), "
        "or pick a new log.run_dir"
    )


def _check_resumed_line(run_dir: Path, given: Path) -> None:
    """checkpoint.resume=PATH into `run_dir`, which holds a run: PATH must be a checkpoint of that run with none
    newer beside it. A later one would stay beside the resumed run's own (its metrics rows are gone, truncated at
    PATH's epoch): `checkpoint.resume=auto` would take it, and checkpoint.keep would delete the resumed run's
    checkpoints before it. Another run's checkpoint would mix two runs in one directory. Either is a RunDirError
    naming a new log.run_dir to continue PATH in."""
    elsewhere = f"continue from it in a new directory (log.run_dir=NEW checkpoint.resume={given})"
    if not given.is_dir():
        return  # (resolve_resume says what is wrong with it)
    if given.resolve().parent != run_dir.resolve():
        raise RunDirError(
            f"log.run_dir={str(run_dir)!r} already holds a run ({describe_run(run_dir)}) and "
            f"checkpoint.resume={given} is a checkpoint of another directory: {elsewhere}, or start over here with "
            "log.overwrite=true (deletes that run's files)"
        )
    newer = [p.name for p in list_checkpoints(run_dir) if p.name > given.name and CKPT_RE.match(given.name)]
    if newer:
        raise RunDirError(
            f"checkpoint.resume={given}: {run_dir} holds later checkpoints of that run ({', '.join(newer)}), which "
            f"would stay beside the resumed run's own (checkpoint.resume=auto would take them, and checkpoint.keep "
            f"would delete the resumed run's first): resume the newest, delete the later ones, or {elsewhere}"
        )


def nothing_to_resume(run_dir: str | Path, problem: str | None = None) -> RunDirError:
    """The error for checkpoint.resume=auto in a run directory that holds a run but no intact checkpoint;
    `problem`: what is wrong with its newest checkpoint, when it has any."""
    n = len(checkpoint_dirs(run_dir))
    damaged = f" ({n} checkpoints, all damaged; the newest: {problem})" if n > 1 else f" (its checkpoint: {problem})"
    damaged = damaged if problem else ""
    return RunDirError(
        f"log.run_dir={str(run_dir)!r} holds a run ({describe_run(run_dir)}) but no intact checkpoint "
        f"to resume from (checkpoint.resume=auto){damaged}; start over there with log.overwrite=true (deletes "
        "that run's files), or pick a new log.run_dir"
    )


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill mid-write
        if isinstance(row, dict):
            rows.append(row)
    return rows


#: Metrics a run logs once it has trained, at its end: its final eval's row is marked `final`.
END_ROW_KEYS = ("dist/replica_max_abs_diff",)


def _end_row(row: dict) -> bool:
    """A row a run logged at its end (the final eval's, the replicas' divergence), which a run resumed past it
    makes again at its own end."""
    return bool(row.get("final")) or any(k in row for k in END_ROW_KEYS)


def truncate_logs(run_dir: str | Path, epochs_done: int, *, past_end: bool = False) -> int:
    """Drop what a resumed run will log again: rows of metrics.jsonl past `epochs_done` (its `epoch` counts epochs
    done), rows of completions.jsonl of epochs >= `epochs_done` (0-based epoch index), and lines cut short by a kill;
    `past_end` (the resumed run trains on past the end of the run it resumes): that run's end rows too (its final
    eval's, `_end_row`), else the log would hold two final evals. Rewritten atomically; returns the number of rows
    dropped."""
    run_dir = Path(run_dir)
    dropped = 0

    def kept_metrics(r: dict) -> bool:
        return r.get("epoch", 0) <= epochs_done and epochs_done > 0 and not (past_end and _end_row(r))

    for name, keep in (
        ("metrics.jsonl", kept_metrics),
        ("completions.jsonl", lambda r: r.get("epoch", 0) < epochs_done),
    ):
        path = run_dir / name
        if not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        rows = _rows(path)
        kept = [r for r in rows if keep(r)]
        if len(kept) == len(lines):
            continue
        dropped += len(lines) - len(kept)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


#: Config keys a resumed run may not change: they decide the trained weights' shapes (model, adapter) or the batch
#: a checkpoint's optimizer and counters were made for. Other changes are allowed with a warning.
SHAPE_KEYS = (
    "backend",
    "model.path",
    "model.family",
    "model.drop_t5",
    "lora.enabled",
    "lora.rank",
    "lora.alpha",
    "lora.target_modules",
    "sample.group_size",
    "sample.prompts_per_epoch",
    "train.minibatch_size",
    "train.objective",
)  # an objective's state (NFT's old policy, AWM's EMA policy) is another's nothing
#: Keys whose change says nothing about the run (where it logs, how it resumes).
IGNORED_KEYS = ("checkpoint.resume", "checkpoint.allow_other_base", "log.overwrite", "log.progress", "log.run_dir")
#: Keys a resume changes as a matter of course (a longer run: "raise train.epochs to train on"): no warning.
ROUTINE_KEYS = ("train.epochs", "train.max_minutes")


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def compare_configs(saved: dict, current: dict, defaults: dict | None = None) -> tuple[list[str], list[str]]:
    """(refused, allowed): the keys that differ between a checkpoint's config and the current one, as
    "key: old -> new" lines; `refused` are those of SHAPE_KEYS (a list of sections, e.g. rewards, compares whole).
    A key the checkpoint's config lacks (it was written before the key existed) whose current value is its default
    in `defaults` (a whole default config) is no change: a new key's default keeps the behaviour it had before."""
    old, new = _flatten(saved), _flatten(current)
    default = _flatten(defaults) if defaults is not None else {}
    refused, allowed = [], []
    for key in sorted(set(old) | set(new)):
        if key in IGNORED_KEYS or old.get(key) == new.get(key):
            continue
        if key not in old and key in default and new.get(key) == default[key]:
            continue
        line = f"{key}: {old.get(key, '(unset)')!r} -> {new.get(key, '(unset)')!r}"
        (refused if key in SHAPE_KEYS else allowed).append(line)
    return refused, allowed
