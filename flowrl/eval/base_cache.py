"""Base-model evals kept for reuse (`eval.base_cache`): the eval before training is a function of the base model,
the eval's prompts and settings, the rewards and the code that samples and scores; every run of a sweep over
training settings samples the same one again. A cache directory keeps each such eval under a key of everything it
depends on (`fingerprint`); a run whose fingerprint finds an entry reads its eval before training from it (its
metrics, its base-model files for the later evals' comparisons, its grid) instead of sampling it, and a run that
finds none samples it and adds the entry.

The fingerprint (a JSON dict; the entry's directory is named by a digest of it, and the whole dict is compared on
reading):
- the model: a digest of every file of a local directory (contents, not dates: a copy or a clone keeps it), a hub
  model's snapshot commit, or a tiny model's name; with model.dtype, variant, drop_t5, the device type, the
  hardware (a CPU's instruction set as torch dispatches on it, a GPU's model), on a CPU the torch threads, and the
  number of processes (whose shares set the eval's calls);
- the LoRA it starts from (lora.init_path's files' digest; a fresh LoRA adds exactly zero);
- the eval's prompts and settings (`eval_settings`, and the rest of the eval section but `every`, `before`);
- the image size and text length it samples with, the rewards as configured;
- the versions of flowrl, torch, diffusers and transformers, and a digest of the source files that sample and
  score it (the model's family, the sampler, the eval, the policy, the reward functions' modules and the scorers
  they name in `code_modules`).
What it does not see: a reward that reads a file of its own (a model's weights under an unchanged path) or an
edit family's conditioning images changed under unchanged names; delete the entry (or the directory) then.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import shutil
import sys
import time
from pathlib import Path

from .diversity import BaseDistribution, BaseFeatures, BaseMetrics

RECORD = "record.json"
#: the sample section's fields an eval's images depend on (the others shape the training batch: group size,
#: prompts per epoch, the SDE's noise)
SAMPLE_FIELDS = ("height", "width", "num_frames", "max_sequence_length", "negative_prompt")
#: the eval section's fields that do not change what the eval before training is
EVAL_IGNORED = ("every", "before", "base_cache")


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file's contents."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tree_digest(root: str | os.PathLike) -> str:
    """sha256 over a directory's files (relative path and contents, sorted; hidden entries left out) or one
    file's contents: the same for a copy, a clone or a move of it."""
    root = Path(root)
    if root.is_file():
        return file_digest(root)
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(f for f in files if not f.startswith(".")):
            path = Path(folder, name)
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + file_digest(path).encode() + b"\n")
    return h.hexdigest()


def model_identity(path: str) -> str | None:
    """What identifies the weights at model.path: a local directory's `tree_digest`, a hub model's snapshot commit
    (from the cache: the files' revision as downloaded), a tiny model's name; None when none of them is found."""
    if os.path.exists(path):
        return f"local sha256 {tree_digest(path)}"
    from flowrl.families import tiny_models

    if path in tiny_models():
        return f"tiny {path}"
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(path, "model_index.json") or try_to_load_from_cache(path, "config.json")
    except Exception:  # an id the hub library refuses: nothing cached to name
        found = None
    if isinstance(found, str):  # .../snapshots/<commit>/model_index.json
        return f"hub {path}@{Path(found).parent.name}"
    return None


def _reward_modules(fn) -> list[str]:
    """The modules a reward's scores come from: its own, the reward a wrapper holds (`.reward`: the registry's
    NamedReward, whose own module only calls it), and what each names in `code_modules` (the scorer a reward imports
    when it first scores, e.g. a world's detector)."""
    names, seen = [], set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        names.append(getattr(fn, "__module__", None) or type(fn).__module__)
        names.extend(getattr(fn, "code_modules", ()))
        fn = getattr(fn, "reward", None)
    return list(dict.fromkeys(names))


def _module(name: str | None):
    """The module `name`, imported when it is not yet (a reward's lazily imported scorer); None when it cannot be."""
    if not name:
        return None
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a module that cannot import is not part of what ran
        return None


def _source_files(modules: list[str], reward_fns) -> list[Path]:
    """The source files an eval's images and scores come from: the sampler and the eval, `modules` (the policy's
    and its model family's) and the reward functions' modules."""
    import flowrl

    root = Path(flowrl.__file__).parent
    # the eval's own modules but this one (the cache's machinery makes no image and no score)
    evaluation = [f for f in sorted((root / "eval").glob("*.py")) if f.name != Path(__file__).name]
    files = sorted((root / "sampling").glob("*.py")) + evaluation
    modules = list(modules) + [name for fn in reward_fns for name in _reward_modules(fn)]
    for name in modules:
        module = _module(name)
        try:
            found = inspect.getsourcefile(module) if module is not None else None
        except TypeError:  # a built-in module
            found = None
        if found:
            files.append(Path(found))
    return [f for f in dict.fromkeys(files) if f.exists()]


def code_digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def fingerprint(
    cfg, settings: dict, *, device_type: str, modules: list[str], reward_fns, processes: int = 1
) -> dict | None:
    """Everything the eval before training of `cfg` depends on (see the module docstring); `settings`: the
    evaluator's `eval_settings`; `modules`: the modules that sample (the policy's, its model family's). None when
    the model's files cannot be identified (`model_identity`): such an eval is neither read nor kept."""
    import dataclasses

    import diffusers
    import torch
    import transformers

    import flowrl

    m, lora = cfg.model, cfg.lora
    model = model_identity(m.path)
    if model is None:
        return None
    evaluation = {k: v for k, v in dataclasses.asdict(cfg.eval).items() if k not in EVAL_IGNORED}
    return {
        "model": model,
        "model.dtype": m.dtype,
        "model.variant": getattr(m, "variant", None),
        "model.drop_t5": getattr(m, "drop_t5", False),
        "device": device_type,
        # a CPU's matrix products sum in an order that depends on the threads (the shapes model's images move by
        # ~3e-6 between 1 and 2): the eval is another one at another thread count
        "threads": torch.get_num_threads() if device_type == "cpu" else None,
        "hardware": hardware(device_type),  # the kernels a CPU's instruction set or a GPU's model selects
        # the eval's calls hold a process's share of the training batch: other calls, other last bits
        "processes": processes,
        "lora.init_path": tree_digest(lora.init_path) if getattr(lora, "init_path", "") else "",
        "eval": evaluation,
        "eval settings": settings,
        "sample": {k: getattr(cfg.sample, k, None) for k in SAMPLE_FIELDS},
        "rewards": [dataclasses.asdict(r) for r in cfg.rewards],
        "versions": {
            "flowrl": flowrl.__version__,
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
        },
        "code": code_digest(_source_files(modules, reward_fns)),
    }


def fingerprint_of_run(cfg, evaluator, policy, reward_fns, device, processes: int = 1) -> dict | None:
    """`fingerprint` of the eval of the base model that `evaluator` makes with `policy` and `reward_fns` on `device`
    (a training run's eval before training over `processes` processes, or `flowrl eval` without a checkpoint)."""
    import torch

    backend = getattr(policy, "backend", None)
    classes = type(policy).__mro__ + (type(backend).__mro__ if backend is not None else ())
    # the policy's and the model family's modules and those of their base classes (the rollout loop is the
    # families' base class's)
    modules = list(dict.fromkeys(c.__module__ for c in classes if c.__module__.startswith("flowrl.")))
    return fingerprint(
        cfg,
        evaluator.settings,
        device_type=torch.device(device).type,
        modules=modules,
        reward_fns=reward_fns,
        processes=processes,
    )


def hardware(device_type: str) -> str | None:
    """What selects the kernels, so the last bits of a result: a CPU's instruction set as torch dispatches on it
    (e.g. "AVX512"), a GPU's model."""
    import torch

    if device_type == "cpu":
        return f"cpu {torch.backends.cpu.get_cpu_capability()}"
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return device_type


def key_of(fp: dict) -> str:
    """The entry's name: a digest of the fingerprint."""
    return hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()[:16]


def eval_files(run_dir: Path, tag: str) -> list[Path]:
    """The files an eval of the base model tagged `tag` leaves in a run directory: its grid (and videos, or
    completions) and the base-model files the later evals compare with."""
    found = sorted(run_dir.glob(f"eval-{tag}*"))
    stores = (BaseDistribution(run_dir), BaseFeatures(run_dir), BaseMetrics(run_dir))
    found += [store.path for store in stores if store.path.exists()]
    return found


class BaseEvalCache:
    """A directory of base-model evals, one subdirectory per fingerprint (`key_of`): `record.json` (the
    fingerprint, the eval's metrics, when and in how long it was sampled) beside the eval's files."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def entry(self, fp: dict) -> Path:
        return self.directory / key_of(fp)

    def load(self, fp: dict) -> dict | None:
        """The record of the entry for `fp` (None: none, one whose fingerprint is not `fp`, unreadable, or missing a
        file it lists)."""
        record = self.entry(fp) / RECORD
        try:
            data = json.loads(record.read_text())
        except (OSError, ValueError):
            return None
        if data.get("fingerprint") != json.loads(json.dumps(fp, default=str)):
            return None
        if not all((self.entry(fp) / name).is_file() for name in data.get("files", [])):
            return None  # an entry with a file gone is no entry: sampled again, nothing half-copied
        return data

    def restore(self, fp: dict, run_dir: Path) -> dict | None:
        """Copy the entry's files for `fp` into `run_dir` and return its record (`load`; None: no entry)."""
        data = self.load(fp)
        if data is None:
            return None
        where = self.entry(fp)
        for name in data["files"]:
            shutil.copyfile(where / name, run_dir / name)
        return data

    def store(self, fp: dict, metrics: dict, run_dir: Path, tag: str, seconds: float) -> Path:
        """Add the eval of the base model tagged `tag` in `run_dir` (its files, its `metrics`) as the entry for
        `fp`, written whole or not at all (a temporary directory, renamed); a sound entry already there is kept, a
        damaged one (`load` refuses it) replaced."""
        final = self.entry(fp)
        if self.load(fp) is not None:
            return final
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{final.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files = eval_files(run_dir, tag)
        for f in files:
            shutil.copyfile(f, tmp / f.name)
        record = {
            "fingerprint": fp,
            "metrics": {k: v for k, v in metrics.items() if not k.startswith("time/")},
            "files": [f.name for f in files],
            "sampled": time.strftime("%Y-%m-%d %H:%M:%S"),
            "seconds": round(seconds, 1),
        }
        (tmp / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True, default=str))
        if final.exists() and self.load(fp) is None:  # a damaged entry (a file gone, another fingerprint): replaced
            shutil.rmtree(final, ignore_errors=True)
        try:
            tmp.rename(final)
        except OSError:  # another process added it meanwhile: theirs stays
            shutil.rmtree(tmp, ignore_errors=True)
        return final
