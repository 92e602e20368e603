"""The base model's fingerprint: a cheap digest of its weight files, kept in every checkpoint, so that a resume (or an
eval) of a checkpoint over other base weights at the same model.path is refused instead of going on silently.

The files are those that load (`weight_files`): of a diffusers pipeline directory, the weights of each component
its model_index.json names (not one saved as [null, null]), in the component's folder, by the names diffusers and
transformers load (`diffusion_pytorch_model`, `model`, `pytorch_model`, their shards), of the variant asked for
(model.variant: its files where the component has them, else the plain ones, as diffusers picks), the .safetensors
files where there are some, else the .bin; of a transformers (or single-model) directory, its config.json beside
them, the same names at its top. A file no load reads (a LoRA copied into the folder, a variant downloaded later and
never loaded) is not in it. A directory of neither layout has every `*.safetensors` / `*.bin` file under it.
For each file: its path there, its size, and a hash of
- a safetensors file: its header (the tensors' names, dtypes, shapes, offsets) and the first and last 256 bytes of
  every tensor (a header alone does not change when a fine-tune re-saves the same tensors);
- another file: its first and last MiB and 16 samples of 64 KiB between.
A few MiB read, even of a 20 GB model. A hub id is read from its snapshot in the local Hugging Face cache; a model that
cannot be found offline (or a `tiny-*` model built in code) has no fingerprint, and nothing is checked.

A fingerprint of the loaded files says so (`"scope": "loaded"`); one written before (of every weight file under the
directory) is compared on the files the current one would take (`differences`): its entries of the loaded files are
the same (same names, same digests), and its others (a stray file, another variant) are left out, so a checkpoint
written before stays comparable.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin")
CHUNK, EDGE, SAMPLES, TENSOR_EDGE = 64 * 1024, 1024 * 1024, 16, 256
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


def model_dir(path: str) -> Path | None:
    """The local directory of model.path `path`: itself, or the snapshot of a hub id in the local cache; None."""
    if os.path.isdir(path):
        return Path(path)
    if path.startswith("tiny-"):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, local_files_only=True))
    except Exception:  # not cached, not a valid id, no huggingface_hub: nothing to compare
        return None


def _tensor_spots(f, size: int) -> list[tuple[int, int]] | None:
    """(offset, length) of the header and of each tensor's first and last bytes of the safetensors file `f`; None
    when its header does not read."""
    n = int.from_bytes(f.read(8), "little")
    if not 0 < n <= min(MAX_HEADER, size - 8):
        return None
    try:
        header = json.loads(f.read(n))
        ranges = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
        spots = [(8, n)]
        for begin, end in sorted(ranges):
            length = min(TENSOR_EDGE, end - begin)
            spots += [(8 + n + begin, length), (8 + n + end - length, length)]
        return spots
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def file_digest(path: Path) -> str:
    """The hash of `path`'s size and sampled bytes (a safetensors file: its header and each tensor's ends)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        spots = _tensor_spots(f, size) if path.suffix == ".safetensors" and size >= 8 else None
        if spots is None:
            spots = [(0, EDGE), (max(size - EDGE, 0), EDGE)]
            spots += [(size * (k + 1) // (SAMPLES + 1), CHUNK) for k in range(SAMPLES)]
        for offset, length in spots:
            f.seek(offset)
            h.update(f.read(length))
    return h.hexdigest()[:32]


#: the weight files diffusers' models and transformers' load: NAME[.VARIANT][-0000k-of-0000n].(safetensors|bin)
LOADED = re.compile(
    r"^(?:diffusion_pytorch_model|model|pytorch_model)(?:\.(?P<variant>[^.-]+))?(?:-\d+-of-\d+)?"
    r"\.(?P<ext>safetensors|bin)$"
)


def _loaded_in(folder: Path, variant: str | None) -> list[Path]:
    """The weight files of one model's folder that a load of `variant` reads (see the module docstring): the
    variant's where there are some, else the plain files (only variants' and none asked for: those, which the
    preflight's variant check names); the .safetensors of them where there are some, else the .bin; a folder of
    no such name: every weight file in it."""
    names = sorted(n for n in os.listdir(folder) if os.path.isfile(folder / n))
    kinds = {n: m for n in names if (m := LOADED.match(n))}
    if not kinds:
        return [folder / n for n in names if n.endswith(WEIGHT_SUFFIXES)]
    present = {m["variant"] for m in kinds.values()}
    wanted = {variant} if variant in present else {None} if None in present else present
    chosen = {n: m for n, m in kinds.items() if m["variant"] in wanted}
    ext = "safetensors" if any(m["ext"] == "safetensors" for m in chosen.values()) else "bin"
    return [folder / n for n, m in chosen.items() if m["ext"] == ext]


def weight_files(root: Path, variant: str | None = None) -> list[Path] | None:
    """The weight files under the model directory `root` that its load reads (see the module docstring); None for a
    directory of neither a pipeline's layout (model_index.json) nor a model's (config.json): every weight file under
    it counts."""
    index = root / "model_index.json"
    if index.is_file():
        try:
            components = json.loads(index.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):  # the model's own checks name the file
            return None
        if not isinstance(components, dict):
            return None
        found = []
        for name, value in sorted(components.items()):
            listed = isinstance(value, (list, tuple)) and bool(value) and value[0] is not None
            if not name.startswith("_") and listed and (root / name).is_dir():
                found += _loaded_in(root / name, variant)
        return found
    if (root / "config.json").is_file():
        return _loaded_in(root, variant)
    return None


def fingerprint(path: str, variant: str | None = None) -> dict | None:
    """{"path": model.path, "files": {relative path: "size:digest"}, "scope": "loaded"} of model.path `path` loaded
    as `variant` (model.variant): its files that load (`weight_files`; of a directory of neither layout, every weight
    file under it, and no "scope"); None when it has no local directory."""
    root = model_dir(path)
    if root is None:
        return None
    files = {}
    try:
        loaded = weight_files(root, variant)
        scope = {} if loaded is None else {"scope": "loaded"}
        if loaded is None:
            loaded = []
            for folder, dirs, names in os.walk(root, followlinks=True):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                loaded += [Path(folder, name) for name in sorted(names) if name.endswith(WEIGHT_SUFFIXES)]
        for file in loaded:
            files[file.relative_to(root).as_posix()] = f"{file.stat().st_size}:{file_digest(file)}"
    except OSError:  # an unreadable file: the model load will say so; nothing to compare
        return None
    return {"path": path, "files": files, **scope}


def _would_load(name: str, loaded: dict) -> bool:
    """Whether the file `name` (a path in the model directory) is one the load that took the files `loaded` reads:
    a weight file of the same folder, of a loaded name (`LOADED`) and of the variant and suffix loaded there (a shard
    of the same weights)."""
    folder, _, file = name.rpartition("/")
    match = LOADED.match(file)
    if match is None:
        return False
    kinds = {
        (m["variant"], m["ext"])
        for n in loaded
        if n.rpartition("/")[0] == folder
        if (m := LOADED.match(n.rpartition("/")[2]))
    }
    return (match["variant"], match["ext"]) in kinds


def differences(saved: dict, current: dict) -> list[str]:
    """What changed between two fingerprints' files, e.g. ["changed: unet/x.safetensors", "missing: y.bin"]. A
    fingerprint written before they held the loaded files alone (no "scope") is compared on the files `current`
    would take: the others it holds (a stray file, another variant) are not differences."""
    old, new = saved.get("files", {}), current.get("files", {})
    if "scope" not in saved and current.get("scope") == "loaded":
        old = {n: v for n, v in old.items() if n in new or _would_load(n, new)}
    found = []
    for what, names in (
        ("changed", [n for n in old if n in new and old[n] != new[n]]),
        ("missing", [n for n in old if n not in new]),
        ("new", [n for n in new if n not in old]),
    ):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            found.append(f"{what}: {', '.join(sorted(names)[:3])}{more}")
    return found


#: a run directory's checkpoints, as flowrl.run.checkpoint names them
_CHECKPOINT = re.compile(r"^ckpt-\d{6}$")


def flowrl_run_hint(directory: str | Path) -> str | None:
    """What to do with `directory` given as model.path when it is a flowrl checkpoint (a `ckpt-XXXXXX`: its
    state.json or trainable.safetensors) or a run directory (its checkpoints, or its metrics.jsonl) and not a base
    model: the base model it was trained over as model.path (as its state.json's config names it), it as
    --checkpoint or lora.init_path; None for another directory. A clause that follows "DIR has no FILE: "."""
    root = Path(directory)
    if not root.is_dir():
        return None
    checkpoints = sorted(p for p in root.iterdir() if p.is_dir() and _CHECKPOINT.match(p.name))
    if (root / "state.json").is_file() or (root / "trainable.safetensors").is_file():
        what, newest = "a flowrl checkpoint", root
    elif checkpoints:
        what, newest = f"a flowrl run directory (its newest checkpoint: {checkpoints[-1].name})", checkpoints[-1]
    elif (root / "metrics.jsonl").is_file():
        return (
            "it is a flowrl run directory without a checkpoint yet, not a base model: set model.path to the base "
            "model (a diffusers pipeline directory or a hub id)"
        )
    else:
        return None
    base = None
    try:
        state = json.loads((newest / "state.json").read_text(encoding="utf-8"))
        base = state["config"]["model"]["path"]
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError):  # an older or damaged state: not named
        pass
    trained = f" it was trained over (model.path={base})" if isinstance(base, str) and base else " it was trained over"
    lora = f" or its LoRA as lora.init_path={directory}" if (newest / "lora").is_dir() else ""
    return (
        f"it is {what}, not a base model: set model.path to the base model{trained}, and give this as "
        f"--checkpoint {directory} (flowrl sample, flowrl eval){lora}"
    )
