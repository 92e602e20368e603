"""The base model's fingerprint: a cheap digest of its weight files, kept in every checkpoint, so that a resume (or an
eval) of a checkpoint over other base weights at the same model.path is refused instead of going on silently.

For each `*.safetensors` / `*.bin` file under the model's directory: its path there, its size, and a hash of
- a safetensors file: its header (the tensors' names, dtypes, shapes, offsets) and the first and last 256 bytes of
  every tensor (a header alone does not change when a fine-tune re-saves the same tensors);
- another file: its first and last MiB and 16 samples of 64 KiB between.
A few MiB read, even of a 20 GB model. A hub id is read from its snapshot in the local Hugging Face cache; a model that
cannot be found offline (or a `tiny-*` model built in code) has no fingerprint, and nothing is checked.
"""

from __future__ import annotations

import hashlib
import json
import os
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


def fingerprint(path: str) -> dict | None:
    """{"path": model.path, "files": {relative path: "size:digest"}} of model.path `path`; None when it has no
    local directory."""
    root = model_dir(path)
    if root is None:
        return None
    files = {}
    try:
        for folder, dirs, names in os.walk(root, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(names):
                if name.endswith(WEIGHT_SUFFIXES):
                    file = Path(folder, name)
                    files[file.relative_to(root).as_posix()] = f"{file.stat().st_size}:{file_digest(file)}"
    except OSError:  # an unreadable file: the model load will say so; nothing to compare
        return None
    return {"path": path, "files": files}


def differences(saved: dict, current: dict) -> list[str]:
    """What changed between two fingerprints' files, e.g. ["changed: unet/x.safetensors", "missing: y.bin"]."""
    old, new = saved.get("files", {}), current.get("files", {})
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
