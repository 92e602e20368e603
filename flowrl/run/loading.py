"""One checkpoint loader for `flowrl train` (resume), `flowrl eval` and `flowrl sample`.

A checkpoint is checked against the config before its weights go anywhere: its saved config (read with the keys'
current spellings) must describe the same model, adapter and batch shape for a resume (`RESUME_KEYS`: the other
changes are listed in a warning), the same model and adapter for an eval or a sample (`MODEL_KEYS`). Its trained
weights must be the ones the policy trains (same names), and the base model's weight files those it was trained over
(`flowrl.run.basemodel`: a fingerprint kept in the checkpoint), unless checkpoint.allow_other_base=true.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from flowrl.config import Config, migrate, to_dict, without_other_objectives
from flowrl.errors import CheckpointConfigError, CheckpointError

from . import basemodel, rundir
from .checkpoint import check_state, list_checkpoints

#: Which of a checkpoint's weights an eval or a sample uses: its EMA of the trained weights, the trained weights as
#: the optimizer left them, or `auto`: the EMA when the run kept one (as its evals did).
WEIGHTS = ("auto", "ema", "trained")
#: The sections of a config that define the model a checkpoint's weights belong to.
MODEL_KEYS = ("backend", "model", "lora")


def saved_config(ck: dict, objective: str) -> dict | None:
    """The config a checkpoint was written with, in the current layout (keys that moved read where they are now),
    without the sections of objectives other than `objective`; None for a checkpoint that kept none."""
    saved = ck["state"].get("config")
    return None if saved is None else without_other_objectives(migrate(saved, hint=False), objective)


def same_base_path(saved: dict, ck: dict, cfg: Config, current: dict | None) -> dict:
    """`saved` (a checkpoint's config, a dict) with the config's model.path when the two name the same base weights
    by another spelling: the checkpoint's fingerprint of its base model's files (`basemodel`) is `current`'s, the
    fingerprint of the files at model.path now (a trailing slash, a relative or `~` path, a copy elsewhere, a hub
    id and its cache snapshot), for a resume, an eval or a sample: the weights make the model."""
    model = saved.get("model")
    kept = ck["state"].get("base_model")
    if not isinstance(model, dict) or model.get("path") == cfg.model.path or current is None or kept is None:
        return saved
    if not kept.get("files") or basemodel.differences(kept, current):
        return saved
    return {**saved, "model": {**model, "path": cfg.model.path}}


def check_resume(ck: dict, path: Path, cfg: Config, *, warn: bool = True, current: dict | None = None) -> None:
    """A resume of checkpoint `path` (read: `ck`) with `cfg`: a changed model, adapter, batch shape or objective is
    refused with the differing keys (one line); other config changes are listed in a warning (but train.epochs and
    train.max_minutes, which a resume changes to train on: `rundir.ROUTINE_KEYS`). `current`: the
    fingerprint of model.path's files now; the same weights under another spelling of the path are the same model
    (`same_base_path`)."""
    objective = cfg.train.objective
    saved = saved_config(ck, objective)
    if saved is None:
        return
    saved = same_base_path(saved, ck, cfg, current)
    now, defaults = (without_other_objectives(to_dict(c), objective) for c in (cfg, Config()))
    refused, allowed = rundir.compare_configs(saved, now, defaults)
    allowed = [line for line in allowed if line.split(":", 1)[0] not in rundir.ROUTINE_KEYS]  # a longer run
    if refused:
        raise changed_what_was_trained(path, "; ".join(refused), "those changes")
    if allowed and warn:
        warnings.warn(f"resuming from {path} with a changed config: {'; '.join(allowed)}", stacklevel=3)


def changed_what_was_trained(path: str | Path, what: str, undo: str) -> CheckpointConfigError:
    """The refusal of a resume of checkpoint `path` whose config changed `what` it was trained as (what to `undo`
    named: "that change", "those changes")."""
    return CheckpointConfigError(
        f"cannot resume from {path}: the config changed what the checkpoint was trained as ({what}); undo {undo}, "
        "or start a new run in another log.run_dir (or log.overwrite=true)"
    )


def check_model(ck: dict, path: str | Path, cfg: Config, base: dict | None = None) -> None:
    """An eval or a sample of checkpoint `path` with `cfg`: its model and adapter must be the config's (`base`: the
    fingerprint of model.path's files now; the same weights under another path are the same model:
    `same_base_path`)."""
    saved = ck["state"].get("config") or {}
    if not saved:
        return
    saved = same_base_path(migrate(saved, hint=False), ck, cfg, base)
    now = to_dict(cfg)
    refused, _ = rundir.compare_configs({k: saved.get(k) for k in MODEL_KEYS}, {k: now[k] for k in MODEL_KEYS})
    if refused:
        raise CheckpointConfigError(
            f"checkpoint {path} was trained with another model or adapter than this config's "
            f"({'; '.join(refused)}); pass the config of its run"
        )


def check_base(state: dict, path: str | Path, current: dict | None, allow: bool, *, note: bool = False) -> None:
    """Checkpoint `path` (its state.json: `state`) was trained over the base weights whose fingerprint is `current`
    (`basemodel.fingerprint`; None: not known, nothing to check): other weights are refused in one line naming the
    files that differ, or a warning with `allow` (checkpoint.allow_other_base). A checkpoint that kept no fingerprint
    (written before flowrl kept them) passes, with a note when `note`."""
    saved = state.get("base_model")
    if current is None:
        return
    if saved is None:
        if note:
            warnings.warn(
                f"checkpoint {path} kept no fingerprint of its base model (it is older than them): "
                "the base model's weights are not checked",
                stacklevel=3,
            )
        return
    changes = basemodel.differences(saved, current)
    if not changes:
        return
    what = (
        f"checkpoint {path} was trained over other base weights than model.path={current['path']} holds now "
        f"({'; '.join(changes)})"
    )
    if allow:
        warnings.warn(f"{what}; going on, as checkpoint.allow_other_base=true asks", stacklevel=3)
        return
    raise CheckpointError(
        f"{what}; use the base model it was trained from, or set checkpoint.allow_other_base=true to go on anyway"
    )


def check_moved_base(state: dict, path: str | Path, cfg: Config, current: dict) -> None:
    """A resume whose model.path names other base weights than the checkpoint's run trained over (another path,
    other files) is a change of the model, which no resume allows (`check_resume`): refused in those words, with
    the files that differ, before the base-weights check would offer checkpoint.allow_other_base."""
    saved_model = (state.get("config") or {}).get("model")
    saved_path = saved_model.get("path") if isinstance(saved_model, dict) else None
    kept = state.get("base_model")
    if saved_path is None or saved_path == cfg.model.path or not kept:
        return
    changes = basemodel.differences(kept, current)
    if changes:
        what = f"model.path: {saved_path!r} -> {cfg.model.path!r}, other base weights: {'; '.join(changes)}"
        raise changed_what_was_trained(path, what, "that change")


def check_resume_base(cfg: Config, run_dir: str | Path, current: dict | None, resume: str | None = None) -> Path | None:
    """Before the model loads: the checkpoint a resume will read (`resume`, checkpoint.resume when not given, as
    `checkpoint.resume_target` resolved it; auto: the newest) was trained over the base weights of fingerprint
    `current` (`check_base`); returns the checkpoint checked. One whose state.json does not read, or is not a
    checkpoint's state (`check_state`), is left to the resume's own checks (`resolve_resume`)."""
    resume = cfg.checkpoint.resume if resume is None else resume
    if not resume or current is None:
        return None
    found = list_checkpoints(run_dir)[-1:] if resume == "auto" else [Path(resume)]
    for path in found:
        try:
            state = json.loads((path / "state.json").read_text(encoding="utf-8"))
            check_state(state, path / "state.json")
        except (OSError, ValueError):  # (CheckpointError is a ValueError)
            return None
        check_moved_base(state, path, cfg, current)
        check_base(state, path, current, cfg.checkpoint.allow_other_base, note=True)
        return path
    return None


def checkpoint_weights(ck: dict, path: str | Path, which: str = "auto") -> dict[str, torch.Tensor]:
    """The weights `which` (one of WEIGHTS) picks from a read checkpoint."""
    if which not in WEIGHTS:
        raise CheckpointError(f"--weights {which!r} is not one of {', '.join(WEIGHTS)}")
    if which == "ema" and "ema" not in ck:
        raise CheckpointError(
            f"checkpoint {path} has no EMA weights (its run had train.ema_decay=0); use --weights trained (or auto)"
        )
    return ck["trainable"] if which == "trained" else ck.get("ema", ck["trainable"])


def check_weights(
    named: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], path: str | Path, what: str = "trained weights"
) -> None:
    """The checkpoint's weights (`what` they are, for the error) hold every trained weight of the policy, each of its
    shape (else it is another model or adapter: a copy would broadcast a [1, 32] tensor into an [8, 32] weight)."""
    missing = set(named) - set(weights)
    if missing:
        raise CheckpointError(
            f"checkpoint {path} does not match this config's model/LoRA: it lacks {what} "
            f"{sorted(missing)[:3]} (a different model or LoRA config?)"
        )
    for n, p in named.items():
        shape = tuple(getattr(p, "ds_shape", None) or p.shape)  # (DeepSpeed ZeRO-3 keeps the whole shape there)
        if tuple(weights[n].shape) != shape:
            raise CheckpointError(
                f"checkpoint {path} does not match this config's model/LoRA: its {what} {n} has shape "
                f"{list(weights[n].shape)}, the model's {list(shape)} (a different model or LoRA config?)"
            )


def read_checked(cfg: Config, checkpoint: str | Path, which: str = "auto") -> tuple[dict, dict[str, torch.Tensor]]:
    """Checkpoint `checkpoint` read (`read_checkpoint`) and checked against `cfg` before any model loads: its model
    and adapter must be the config's (`check_model`), its base weights those at model.path (`check_base`), and it
    must hold the weights `which` picks (see WEIGHTS). Returns (the checkpoint, those weights)."""
    from .checkpoint import read_checkpoint

    ck = read_checkpoint(checkpoint)
    weights = checkpoint_weights(ck, checkpoint, which)
    current = basemodel.fingerprint(cfg.model.path, cfg.model.variant)
    check_model(ck, checkpoint, cfg, current)
    check_base(ck["state"], checkpoint, current, cfg.checkpoint.allow_other_base, note=True)
    return ck, weights


def policy_from_checkpoint(
    cfg: Config, checkpoint: str | None, which: str = "auto", device: str = "cpu", read: tuple | None = None
):
    """The config's policy on `device`, with checkpoint `checkpoint`'s weights (`which`: see WEIGHTS) when given.
    The checkpoint is read and checked before the model loads (`read`: `read_checked`'s answer, when the caller
    read it already)."""
    from flowrl.policies import build_policy

    weights = None
    if checkpoint:  # a bad path or choice fails before the model loads
        ck, weights = read if read is not None else read_checked(cfg, checkpoint, which)
    policy = build_policy(cfg, device)
    if weights is not None:
        # which weights `which` picked ("ema" or "trained"; "... (auto)" when auto chose), for the eval's record
        picked = "trained" if which == "trained" or "ema" not in ck else "ema"
        policy.loaded_weights = f"{picked} (auto)" if which == "auto" else picked
        named = dict(policy.named_trainable_parameters())
        check_weights(named, weights, checkpoint)
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(weights[n].to(p.dtype))
    return policy
