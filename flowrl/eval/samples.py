"""`flowrl sample`: images (or videos) of prompts with given seeds, written to a folder with their list."""

from __future__ import annotations

import json
from pathlib import Path


def sample_to_dir(
    policy,
    prompts: list[str],
    seeds: list[int],
    out: Path,
    *,
    num_steps: int,
    guidance_scale: float,
    image_paths: list[str] | None = None,
) -> int:
    """Sample every prompt with every seed (the deterministic ODE) into `out`, named `PPP_seedS.png` (prompt index,
    seed; a video model's `PPP_seedS.webp`), and list them in `out/samples.jsonl` (file, prompt, seed). Sample
    (prompt, seed) is the same whatever else is sampled beside it. Returns how many were written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    images = policy.sample(prompts, seeds, num_steps=num_steps, guidance_scale=guidance_scale, image_paths=image_paths)
    rows = []
    for i, prompt in enumerate(prompts):
        for k, seed in enumerate(seeds):
            path = policy.save_sample(images[i * len(seeds) + k], out / f"{i:03d}_seed{seed}")
            rows.append({"file": path.name, "prompt": prompt, "seed": seed})
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)
