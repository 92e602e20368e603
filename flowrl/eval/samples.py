"""`flowrl sample`: images (or videos) of prompts with given seeds, written to a folder with their list."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from tqdm.auto import tqdm


def sample_to_dir(
    policy,
    prompts: list[str],
    seeds: list[int],
    out: Path,
    *,
    num_steps: int,
    guidance_scale: float,
    image_paths: list[str] | None = None,
    images_of: list[list[str] | None] | None = None,
    per_call: int = 0,
    progress: bool = False,
) -> int:
    """Sample every prompt with every seed (the deterministic ODE) into `out`, named `PPP_seedS.png` (prompt index,
    seed; a video model's `PPP_seedS.webp`), and list them in `out/samples.jsonl` (file, prompt, seed). Sample
    (prompt, seed) is the same whatever else is sampled beside it. The images are sampled about `per_call` at a time
    (whole prompts with all their seeds when they fit, else one prompt's seeds in parts; 0: everything in one
    call), and each is written when its call returns, so an interrupted run keeps what it sampled (the list is
    rewritten after each call). An `out` sampled into before keeps its list's other images listed (an image of the
    same name is replaced, in the list too). `image_paths`: every prompt's conditioning images; `images_of`: each
    prompt's own instead (a prompt file's image column; its prompts are then sampled one at a time, and the list
    names each image's sources). `progress`: a bar over the images. Returns how many were written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    earlier = listed_rows(out / "samples.jsonl")
    per_call = per_call or len(prompts) * len(seeds)
    seeds_per_call = min(len(seeds), per_call)
    prompts_per_call = max(1, per_call // len(seeds))  # whole prompts when all their seeds fit in a call
    if images_of is not None:  # a prompt's own sources: one prompt a call
        prompts_per_call = 1
    rows = []
    with tqdm(total=len(prompts) * len(seeds), desc="sample", unit="image", disable=not progress) as bar:
        for first in range(0, len(prompts), prompts_per_call):
            batch = prompts[first : first + prompts_per_call]
            for start in range(0, len(seeds), seeds_per_call):
                chunk = seeds[start : start + seeds_per_call]
                sources = images_of[first] if images_of is not None else image_paths
                images = policy.sample(
                    batch, chunk, num_steps=num_steps, guidance_scale=guidance_scale, image_paths=sources
                )  # prompt-major
                for j, prompt in enumerate(batch):
                    for k, seed in enumerate(chunk):
                        path = policy.save_sample(images[j * len(chunk) + k], out / f"{first + j:03d}_seed{seed}")
                        row = {"file": path.name, "prompt": prompt, "seed": seed}
                        rows.append({**row, "images": list(sources)} if sources else row)
                present = [r for r in earlier if (out / str(r.get("file"))).exists()]
                write_listing(out / "samples.jsonl", present, rows, key=lambda r: r.get("file"))
                bar.update(len(images))
    return len(rows)


def listed_rows(path: Path, key: str = "file") -> list[dict]:
    """The rows of an earlier samples.jsonl that hold `key` (nothing when there is none; a line that does not read
    is dropped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and key in row:
            rows.append(row)
    return rows


def write_listing(path: Path, earlier: list[dict], rows: list[dict], key: Callable[[dict], Any]) -> None:
    """Rewrite the listing `path` (a samples.jsonl) atomically: the rows of `earlier` that no row of `rows`
    replaces (one of the same `key`), then `rows`."""
    new = {key(r) for r in rows}
    kept = [r for r in earlier if key(r) not in new]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept + rows))
    tmp.replace(path)
