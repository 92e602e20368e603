"""Checkpoints: safetensors for tensors, JSON for the rest, written atomically (tmp dir, then rename).

A checkpoint directory `ckpt-{epoch:06d}/` holds
    trainable.safetensors   the trained weights (LoRA or the full denoiser), by parameter name
    ema.safetensors         the EMA of the trained weights (when EMA is on)
    objective.safetensors   what the training objective keeps besides them (DiffusionNFT's old policy), if anything
    rollout.safetensors     rollout.async: the older weights the next epoch's rollout samples with, if any
    optimizer.safetensors   the optimizer's tensors; optimizer.json its structure and hyper-parameters
    state.json              counters, scheduler, stat trackers, python/numpy RNG, config
    rng.safetensors         torch RNG states (CPU, and CUDA when present)
    lora/                   the LoRA in the diffusers format (`pipe.load_lora_weights(dir)`), when LoRA is on
Nothing is pickled, so a checkpoint from elsewhere cannot run code when it is loaded.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from flowrl.errors import CheckpointError, NonFiniteError

CKPT_RE = re.compile(r"^ckpt-(\d{6})$")
#: Temporary directories of a checkpoint write (`.tmp-ckpt-…`, `.old-ckpt-…`); a kill can leave them behind.
TEMP_RE = re.compile(r"^\.(tmp|old)-ckpt-\d{6}-\d+$")


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing memory with another (safetensors refuses shared storage: e.g.
    bitsandbytes' quantisation maps, one tensor in every parameter's state)."""
    out, seen = {}, set()
    for k, v in tensors.items():
        v = v.detach().contiguous().cpu()
        if v.numel() and v.untyped_storage().data_ptr() in seen:
            v = v.clone()
        seen.add(v.untyped_storage().data_ptr())
        out[k] = v
    return out


def optimizer_to_files(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split `optimizer.state_dict()` into tensors ("state.{param}.{key}[.{subkey}...]": nested dicts, such as
    bitsandbytes' quantisation state, are flattened) and a JSON-able rest."""
    tensors, meta = {}, {"param_groups": state["param_groups"], "state": {}}

    def split(prefix: str, entries: dict) -> dict:
        out = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}.{key}"] = value
                out[key] = {"tensor": True}
            elif isinstance(value, dict):
                out[key] = {"dict": split(f"{prefix}.{key}", value)}
            else:
                out[key] = {"value": value}
        return out

    for pid, pstate in state["state"].items():
        meta["state"][str(pid)] = split(f"state.{pid}", pstate)
    return tensors, meta


def optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    def join(prefix: str, entries: dict) -> dict:
        return {
            k: tensors[f"{prefix}.{k}"]
            if e.get("tensor")
            else join(f"{prefix}.{k}", e["dict"])
            if "dict" in e
            else e["value"]
            for k, e in entries.items()
        }

    state = {int(pid): join(f"state.{pid}", entries) for pid, entries in meta["state"].items()}
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    np_state = np.random.get_state()
    meta = {"python": _jsonable(random.getstate()), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(_tupled(meta["python"]))
    n = meta["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))


def _jsonable(x):
    if isinstance(x, tuple):
        return [_jsonable(v) for v in x]
    return x


def _tupled(x):
    if isinstance(x, list):
        return tuple(_tupled(v) for v in x)
    return x


def nonfinite_tensors(groups: dict[str, dict[str, torch.Tensor] | None]) -> list[str]:
    """Names (`group/name`) of the floating-point tensors holding NaN or inf, e.g. of the trained weights, their EMA
    and the optimizer's moments."""
    bad = []
    for group, tensors in groups.items():
        for name, t in (tensors or {}).items():
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
                bad.append(f"{group}/{name}")
    return bad


def write_checkpoint(
    run_dir: str | Path,
    epoch: int,
    *,
    trainable: dict[str, torch.Tensor],
    optimizer: dict | None = None,
    ema: dict[str, torch.Tensor] | None = None,
    state: dict[str, Any] | None = None,
    extra_dirs: dict[str, Any] | None = None,
    keep: int = 0,
    objective: dict[str, torch.Tensor] | None = None,
    rollout: dict[str, torch.Tensor] | None = None,
    protect: tuple[int, ...] = (),
) -> Path:
    """Write `ckpt-{epoch:06d}` under `run_dir` atomically; returns its path.

    `extra_dirs`: name -> callable(path) that writes a sub-directory (e.g. the diffusers LoRA export).
    `objective`: the training objective's tensors (flowrl.objectives: e.g. NFT's old adapter), if it keeps any.
    `rollout`: rollout.async's weights of the version the next epoch samples with, when older than `trainable`.
    `keep` > 0 then keeps this checkpoint and the newest `keep - 1` older ones (by epoch); checkpoints of later
    epochs than this one (another run's, or a future this run was resumed before) are never deleted, nor those of
    the epochs in `protect` (checkpoint.keep_best's).
    Weights with NaN or inf are never written: NonFiniteError names them and nothing is written.
    """
    opt_tensors, opt_meta = optimizer_to_files(optimizer) if optimizer is not None else ({}, None)
    named = {"trainable": trainable, "ema": ema, "optimizer": opt_tensors, "objective": objective, "rollout": rollout}
    bad = nonfinite_tensors(named)
    if bad:
        raise NonFiniteError(
            f"not writing checkpoint epoch {epoch}: {len(bad)} tensor(s) hold NaN or inf "
            f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})"
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / f"ckpt-{epoch:06d}"
    tmp = run_dir / f".tmp-ckpt-{epoch:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        save_file(_contiguous(trainable), tmp / "trainable.safetensors")
        if ema is not None:
            save_file(_contiguous(ema), tmp / "ema.safetensors")
        if objective is not None:
            save_file(_contiguous(objective), tmp / "objective.safetensors")
        if rollout is not None:
            save_file(_contiguous(rollout), tmp / "rollout.safetensors")
        if opt_meta is not None:
            save_file(_contiguous(opt_tensors), tmp / "optimizer.safetensors")
            (tmp / "optimizer.json").write_text(json.dumps(opt_meta))
        rng_tensors, rng_meta = rng_state()
        save_file(_contiguous(rng_tensors), tmp / "rng.safetensors")
        full_state = dict(state or {})
        full_state["rng"] = rng_meta
        full_state["epoch"] = epoch
        (tmp / "state.json").write_text(json.dumps(full_state, indent=1, default=str))
        for name, writer in (extra_dirs or {}).items():
            writer(tmp / name)
        # fsync the files so a crash right after the rename cannot leave an empty checkpoint
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
    except BaseException as e:  # nothing half-written stays behind; a full disk is one line
        shutil.rmtree(tmp, ignore_errors=True)
        reason = out_of_space(e)
        if reason is None:
            raise
        groups = (trainable, ema, opt_tensors, objective, rollout, *([trainable] * len(extra_dirs or {})))
        need = sum(t.numel() * t.element_size() for g in groups for t in (g or {}).values())
        raise CheckpointError(no_space_message(run_dir, final, reason, need)) from None
    if final.exists():
        old = run_dir / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    if keep > 0:
        older = [
            c for c in list_checkpoints(run_dir) if checkpoint_epoch(c) < epoch and checkpoint_epoch(c) not in protect
        ]
        for stale in older[: len(older) - (keep - 1)]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


#: The errors of a full disk or quota (EDQUOT is not on every platform).
SPACE_ERRNOS = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


def out_of_space(error: BaseException) -> str | None:
    """Why `error` (or an error it was raised from) is a full disk or quota, e.g. "No space left on device"; None
    when it is not. safetensors' writer raises its own error type, naming the OS error's number."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in SPACE_ERRNOS:
            return error.strerror or os.strerror(error.errno)
        code = re.search(r"os error (\d+)", str(error))
        if code and int(code.group(1)) in SPACE_ERRNOS:
            return os.strerror(int(code.group(1)))
        error = error.__cause__ or error.__context__
    return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def no_space_message(run_dir: Path, final: Path, reason: str, need: int) -> str:
    """The one line of a checkpoint write that ran out of space: what it needs, what is free, which checkpoint is
    intact, how to go on."""
    try:
        free = f", {_size(shutil.disk_usage(run_dir).free)} free there"
    except OSError:
        free = ""
    intact = [c for c in list_checkpoints(run_dir) if checkpoint_epoch(c) <= checkpoint_epoch(final)]
    then = (
        f"the previous checkpoint {intact[-1].name} is intact; free space and resume with checkpoint.resume=auto"
        if intact
        else "there is no earlier checkpoint; free space and run again"
    )
    return (
        f"could not write checkpoint {final}: {reason} (it needs at least {_size(need)}{free}); its temporary "
        f"folder was removed and {then}"
    )


def checkpoint_epoch(path: str | Path) -> int:
    """The epoch in a checkpoint directory's name (`ckpt-000040` -> 40)."""
    m = CKPT_RE.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not named like a checkpoint (ckpt-XXXXXX)")
    return int(m.group(1))


def remove_temporary(run_dir: str | Path) -> list[Path]:
    """Delete the temporary directories an interrupted checkpoint write left in `run_dir`; returns them."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    stale = [p for p in run_dir.iterdir() if p.is_dir() and TEMP_RE.match(p.name)]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `run_dir`, oldest first (temporary dirs of an interrupted write are ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and CKPT_RE.match(p.name) and (p / "state.json").exists()]
    return sorted(found, key=lambda p: p.name)


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Every `ckpt-XXXXXX` directory in `run_dir`, oldest first, whole or damaged (`list_checkpoints`: those with a
    state.json)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted((p for p in run_dir.iterdir() if p.is_dir() and CKPT_RE.match(p.name)), key=lambda p: p.name)


#: The files every checkpoint holds (`write_checkpoint`), in the order `read_checkpoint` reads them; the others
#: are there when their part of the run is.
REQUIRED_FILES = ("trainable.safetensors", "state.json", "rng.safetensors")


def damage(path: str | Path, require: tuple[str, ...] = ()) -> str | None:
    """What is wrong with checkpoint directory `path`, found without reading its tensors (its state.json read and
    checked, `require` as `check_state` takes it; its safetensors files' headers opened: a file cut short does not
    open), e.g. "state.json is missing"; None when nothing is (`read_checkpoint` reads the tensors, and refuses NaN
    or inf in them)."""
    from safetensors import safe_open

    path = Path(path)
    try:
        if not is_checkpoint_dir(path):
            raise CheckpointError(f"{path} holds no state.json nor trainable.safetensors")
        for name in REQUIRED_FILES:
            if not (path / name).is_file():
                raise CheckpointError(f"{path / name} is missing: the checkpoint is incomplete")
        check_state(_load_json(path / "state.json"), path / "state.json", require)
        if (path / "optimizer.json").is_file() and not (path / "optimizer.safetensors").is_file():
            raise CheckpointError(f"{path / 'optimizer.safetensors'} is missing: the checkpoint is incomplete")
        for file in sorted(path.glob("*.safetensors")):
            try:
                with safe_open(str(file), "pt"):
                    pass
            except Exception as e:  # safetensors raises its own error types for truncated or foreign files
                raise CheckpointError(f"{file} is corrupt or truncated ({type(e).__name__}: {e})") from None
    except CheckpointError as e:
        return str(e)
    return None


def intact_checkpoint(run_dir: str | Path, what: str, require: tuple[str, ...] = ()) -> Path:
    """The newest checkpoint of run directory `run_dir` that `damage` (with `require`) finds nothing wrong with (a
    newer damaged one is skipped with a warning naming its problem); none is a CheckpointError saying how many there
    are, all damaged, and the newest one's problem. `what`: how the directory was given, for the messages (e.g.
    "--checkpoint RUN")."""
    found = checkpoint_dirs(run_dir)
    problems = []
    for path in reversed(found):
        problem = damage(path, require)
        if problem is None:
            for skipped, why in problems:
                warnings.warn(f"{what}: skipping {skipped}: {why}; taking the older {path.name}", stacklevel=3)
            return path
        problems.append((path, problem))
    n, (newest, problem) = len(found), problems[0]
    which = (
        f"{n} checkpoints, all damaged (the newest, {newest.name}" if n > 1 else f"1 checkpoint, damaged ({newest.name}"
    )
    raise CheckpointError(
        f"{what}: the run directory {str(run_dir)!r} holds {which}: {problem}); resume or evaluate one that is whole, "
        "or start over"
    )


def is_checkpoint_dir(path: Path) -> bool:
    """`path` holds a checkpoint's files (complete or not: `read_checkpoint` says what is missing)."""
    return (path / "state.json").is_file() or (path / "trainable.safetensors").is_file()


def _lora_file(path: Path) -> Path | None:
    """The LoRA file `path` is, or holds (a .safetensors file whose tensors are a LoRA's, as diffusers'
    save_lora_weights and peft's save_pretrained write them), when it is not a checkpoint directory; else None."""
    from flowrl.lora_files import is_lora_file

    if path.is_dir() and is_checkpoint_dir(path):
        return None
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    return next((file for file in files if is_lora_file(file)), None)


def checkpoint_in(path: str | Path) -> Path:
    """The checkpoint a `--checkpoint PATH` names: PATH itself when it is a checkpoint directory (or not a directory:
    `read_checkpoint` says what it is), else, PATH being a run directory, its newest complete checkpoint (as
    checkpoint.resume=auto takes it: a newer damaged one is skipped, with a warning); a run directory without one is
    a CheckpointError naming it (or, its checkpoints all damaged, the newest one's problem)."""
    path = Path(path)
    lora = _lora_file(path)
    if lora is not None:
        owner = next((p for p in (path.parent, path.parent.parent) if is_checkpoint_dir(p)), None)
        if owner is not None:  # a checkpoint's lora/ (or its file): the checkpoint is a folder above
            raise CheckpointError(
                f"{str(path)!r} is the LoRA that checkpoint {str(owner)!r} exports (for diffusers' "
                f"load_lora_weights); give the checkpoint itself: --checkpoint {owner}"
            )
        raise CheckpointError(
            f"{str(path)!r} holds a LoRA ({lora.name}), not a flowrl checkpoint (a run's ckpt-XXXXXX directory); to "
            f"sample or evaluate this LoRA give it as lora.init_path={path} and no --checkpoint (with the lora.rank, "
            "lora.alpha and lora.target_modules it was made with: a mismatch names them)"
        )
    if not path.is_dir() or is_checkpoint_dir(path):
        return path
    if checkpoint_dirs(path):  # (all of them damaged: an error naming the newest one's problem)
        return intact_checkpoint(path, f"--checkpoint {path}")
    if (path / "metrics.jsonl").exists():
        raise CheckpointError(
            f"{str(path)!r} is a run directory without a complete checkpoint yet (checkpoint.every sets how often "
            "one is written; a run writes one at its end)"
        )
    raise CheckpointError(
        f"{str(path)!r} is not a checkpoint directory (no state.json or trainable.safetensors) nor a run directory "
        "holding one; checkpoints are the ckpt-XXXXXX directories of a run directory"
    )


def resolve_resume(
    resume: str | None, run_dir: str | Path, skipped: list[str] | None = None, require: tuple[str, ...] = ()
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from, read (`require`: the sections its state.json must hold, as `check_state`
    takes them): `None` -> None; `auto` -> the newest intact checkpoint in run_dir (a damaged one, a checkpoint
    directory without its state.json too, is skipped with a warning that names it and its problem, which `skipped`
    collects; None when there is none); else that directory, whose problems are errors."""
    if not resume:
        return None
    if resume == "auto":
        for path in reversed(checkpoint_dirs(run_dir)):
            try:
                return path, read_checkpoint(path, require)
            except CheckpointError as e:
                if skipped is not None:
                    skipped.append(str(e))
                warnings.warn(
                    f"checkpoint.resume=auto: skipping {path}: {e}; falling back to an older checkpoint", stacklevel=2
                )
        return None
    path = Path(resume_target(resume, run_dir, require))
    return path, read_checkpoint(path, require)


def resume_target(resume: str | None, run_dir: str | Path, require: tuple[str, ...] = ()) -> str | None:
    """checkpoint.resume as the checkpoint it names, checked before the model loads: `None` and `auto` as they are;
    a run directory (one holding ckpt-XXXXXX directories) -> its newest intact checkpoint (as `--checkpoint RUN`
    takes it, `require` as `damage` takes it; all of them damaged: an error naming the newest one's problem); a path
    that is not a directory, an error; else the path (`read_checkpoint` says what is wrong with it)."""
    if not resume or resume == "auto":
        return resume
    path = Path(resume)
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise CheckpointError(
            f"checkpoint.resume={resume!r} {what}; use 'auto' (the newest checkpoint of log.run_dir) or a checkpoint "
            f"directory like {Path(run_dir) / 'ckpt-000010'}"
        )
    if is_checkpoint_dir(path) or not checkpoint_dirs(path):
        return resume
    return str(intact_checkpoint(path, f"checkpoint.resume={resume}", require))


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own error types for truncated or foreign files
        raise CheckpointError(f"{path} is corrupt or truncated ({type(e).__name__}: {e})") from None


def _load_json(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt or truncated ({e})") from None


#: The sections of state.json besides the counters and the RNG: each a JSON object, or null, when there.
STATE_SECTIONS = ("config", "tracker", "prompt_draws", "base_model")
#: The counters every trainer's checkpoint has kept (the others default when a checkpoint is older than them).
REQUIRED_COUNTERS = ("epochs_done", "optimizer_steps")
#: What a trainer's resume requires of a checkpoint's state.json (`check_state`'s `require`): its counters (a
#: checkpoint written by another user of `write_checkpoint`, e.g. scripts/pretrain_arith.py, keeps its own state).
TRAINER_STATE = ("counters",)
#: What the sections `require` may name hold, for the errors.
SECTIONS = {"counters": "the run's epochs and steps, an object"}


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), repr(value))


def check_state(state: Any, file: Path, require: tuple[str, ...] = ()) -> None:
    """A state.json's structure (what `write_checkpoint` writes: an object holding `rng`, the Python and NumPy
    generators' states, and the caller's sections: a trainer's `counters`, numbers by name, which `require` names
    when they must be there, e.g. TRAINER_STATE; its other sections objects or null): what is missing or of the
    wrong kind is a CheckpointError naming the file. Which counters a trainer knows is its own check."""
    damaged = "the checkpoint is damaged"
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} holds {_kind(state)}, not a checkpoint's state (an object): {damaged}")
    for key in require:
        if key not in state:
            raise CheckpointError(f"{file} has no {key!r} ({SECTIONS.get(key, 'a section')}): {damaged}")
    counters = state.get("counters")
    if "counters" in state and not isinstance(counters, dict):
        raise CheckpointError(f"{file} has 'counters' of {_kind(counters)} ({SECTIONS['counters']}): {damaged}")
    missing = [k for k in REQUIRED_COUNTERS if k not in counters] if "counters" in state else []
    if missing:
        raise CheckpointError(f"{file} has no counter {', '.join(missing)} in its 'counters': {damaged}")
    for key, value in (counters or {}).items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise CheckpointError(f"{file}: counter {key!r} is {_kind(value)}, not a number: {damaged}")
    rng = state.get("rng")
    if not isinstance(rng, dict) or not isinstance(rng.get("python"), list) or not isinstance(rng.get("numpy"), list):
        what = "has no 'rng'" if rng is None else "has an 'rng' without the Python and NumPy generators' states"
        raise CheckpointError(f"{file} {what} (the random generators' states): {damaged}")
    for key in STATE_SECTIONS:
        if state.get(key) is not None and not isinstance(state[key], dict):
            raise CheckpointError(f"{file} has {key!r} of {_kind(state[key])}, not an object: {damaged}")


def _check_rng(tensors: dict[str, torch.Tensor], meta: dict, path: Path) -> None:
    """The RNG states load (into generators of their own: the process's are set by `set_rng_state`, later)."""
    try:
        torch.Generator().set_state(tensors["torch_cpu"])
        random.Random().setstate(_tupled(meta["python"]))
        n = meta["numpy"]
        np.random.RandomState().set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise CheckpointError(
            f"{path}: its random generators' states (state.json's 'rng', rng.safetensors) do not load "
            f"({type(e).__name__}: {e}): the checkpoint is damaged"
        ) from None


def _finite(tensors: dict[str, torch.Tensor], file: Path) -> dict[str, torch.Tensor]:
    """`tensors` (read from `file`), refused when a floating-point one holds NaN or inf (flowrl never writes such a
    checkpoint: it was damaged since)."""
    bad = nonfinite_tensors({"": tensors})
    if bad:
        names = ", ".join(b.removeprefix("/") for b in bad[:3]) + (", ..." if len(bad) > 3 else "")
        raise CheckpointError(
            f"{file} holds NaN or inf in {len(bad)} tensor(s) ({names}): the checkpoint is damaged (flowrl never "
            "writes such weights); use an earlier checkpoint"
        )
    return tensors


def read_checkpoint(path: str | Path, require: tuple[str, ...] = ()) -> dict[str, Any]:
    """Everything `write_checkpoint` wrote, as tensors and plain data (RNG not yet applied). A missing directory
    or file, one that does not parse, a state.json of the wrong structure (`check_state`, with the sections
    `require` names), a tensor holding NaN or inf, or an RNG state that does not load is a CheckpointError naming
    the file."""
    path = Path(path)
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise CheckpointError(
            f"checkpoint directory {str(path)!r} {what}; checkpoints are the ckpt-XXXXXX directories of a run directory"
        )
    if not is_checkpoint_dir(path):
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint directory (no state.json or trainable.safetensors); "
            "checkpoints are the ckpt-XXXXXX directories of a run directory"
        )
    trainable = path / "trainable.safetensors"
    out: dict[str, Any] = {"trainable": _finite(_load_tensors(trainable), trainable)}
    state = out["state"] = _load_json(path / "state.json")
    check_state(state, path / "state.json", require)
    for name in ("ema", "objective", "rollout"):
        file = path / f"{name}.safetensors"
        if file.exists():
            out[name] = _finite(_load_tensors(file), file)
    if (path / "optimizer.json").exists():
        file = path / "optimizer.safetensors"
        tensors = _finite(_load_tensors(file), file)
        try:
            out["optimizer"] = optimizer_from_files(tensors, _load_json(path / "optimizer.json"))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{path / 'optimizer.json'} does not match optimizer.safetensors ({e})") from None
    out["rng_tensors"] = _load_tensors(path / "rng.safetensors")
    _check_rng(out["rng_tensors"], state["rng"], path)
    return out
