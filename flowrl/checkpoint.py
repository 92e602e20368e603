"""Checkpoints: safetensors for tensors, JSON for the rest, written atomically (tmp dir, then rename).

A checkpoint directory `ckpt-{epoch:06d}/` holds
    trainable.safetensors   the trained weights (LoRA or the full denoiser), by parameter name
    ema.safetensors         the EMA of the trained weights (when EMA is on)
    optimizer.safetensors   the optimizer's tensors; optimizer.json its structure and hyper-parameters
    state.json              counters, scheduler, stat trackers, python/numpy RNG, config
    rng.safetensors         torch RNG states (CPU, and CUDA when present)
    lora/                   the LoRA in the diffusers format (`pipe.load_lora_weights(dir)`), when LoRA is on
Nothing is pickled, so a checkpoint from elsewhere cannot run code when it is loaded.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

CKPT_RE = re.compile(r"^ckpt-(\d{6})$")


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}


def optimizer_to_files(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split `optimizer.state_dict()` into tensors ("state.{param}.{key}") and a JSON-able rest."""
    tensors, meta = {}, {"param_groups": state["param_groups"], "state": {}}
    for pid, pstate in state["state"].items():
        meta["state"][str(pid)] = {}
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{pid}.{key}"] = value
                meta["state"][str(pid)][key] = {"tensor": True}
            else:
                meta["state"][str(pid)][key] = {"value": value}
    return tensors, meta


def optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state = {}
    for pid, entries in meta["state"].items():
        state[int(pid)] = {k: tensors[f"state.{pid}.{k}"] if e.get("tensor") else e["value"]
                           for k, e in entries.items()}
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    np_state = np.random.get_state()
    meta = {"python": _jsonable(random.getstate()),
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
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
) -> Path:
    """Write `ckpt-{epoch:06d}` under `run_dir` atomically; returns its path.

    `extra_dirs`: name -> callable(path) that writes a sub-directory (e.g. the diffusers LoRA export).
    `keep` > 0 deletes all but the newest `keep` checkpoints afterwards.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / f"ckpt-{epoch:06d}"
    tmp = run_dir / f".tmp-ckpt-{epoch:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(_contiguous(trainable), tmp / "trainable.safetensors")
    if ema is not None:
        save_file(_contiguous(ema), tmp / "ema.safetensors")
    if optimizer is not None:
        tensors, meta = optimizer_to_files(optimizer)
        save_file(_contiguous(tensors), tmp / "optimizer.safetensors")
        (tmp / "optimizer.json").write_text(json.dumps(meta))
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
    if final.exists():
        old = run_dir / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    if keep > 0:
        for stale in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `run_dir`, oldest first (temporary dirs of an interrupted write are ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and CKPT_RE.match(p.name) and (p / "state.json").exists()]
    return sorted(found, key=lambda p: p.name)


def resolve_resume(resume: str | None, run_dir: str | Path) -> Path | None:
    """`None` -> None; `auto` -> the newest checkpoint in run_dir (None when there is none); else the path."""
    if not resume:
        return None
    if resume == "auto":
        ckpts = list_checkpoints(run_dir)
        return ckpts[-1] if ckpts else None
    path = Path(resume)
    if not (path / "state.json").exists():
        raise FileNotFoundError(f"checkpoint.resume={resume!r} is not a checkpoint directory (no state.json); "
                                f"use 'auto' or a path like {Path(run_dir) / 'ckpt-000004'}")
    return path


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Everything `write_checkpoint` wrote, as tensors and plain data (RNG not yet applied)."""
    path = Path(path)
    out: dict[str, Any] = {"trainable": load_file(path / "trainable.safetensors"),
                           "state": json.loads((path / "state.json").read_text())}
    if (path / "ema.safetensors").exists():
        out["ema"] = load_file(path / "ema.safetensors")
    if (path / "optimizer.json").exists():
        tensors = load_file(path / "optimizer.safetensors")
        out["optimizer"] = optimizer_from_files(tensors, json.loads((path / "optimizer.json").read_text()))
    out["rng_tensors"] = load_file(path / "rng.safetensors")
    return out
