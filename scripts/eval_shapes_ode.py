"""Strict accuracy of a shapes-world pipeline: ODE-sample prompts with the diffusers pipeline, score with the detector.

Loads the model exactly as a user loads SD3 (`StableDiffusion3Pipeline.from_pretrained`), samples the
prompts of a JSONL file (the test split by default) in turn, `--images` in all, with the pipeline's own
Euler ODE sampler and classifier-free guidance, and reports GenEval's strict accuracy (every clause
holds), the mean fraction of clauses that hold, the strict accuracy per family, and why images fail (the share
of images with each of `flowrl.worlds.shapes.detect.FAILURE_KINDS`: a missing shape, a swapped colour, ...).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python scripts/eval_shapes_ode.py --model samples/shapes/model \
        --prompts samples/shapes/test.jsonl --images 256 --steps 20 --guidance 5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "samples/shapes/model"), help="a save_pretrained directory")
    p.add_argument(
        "--lora", default=None, help="a LoRA to load on top (a run's `ckpt-XXXXXX/lora` directory, diffusers format)"
    )
    p.add_argument("--prompts", default=str(ROOT / "samples/shapes/test.jsonl"), help="prompt records (JSONL)")
    p.add_argument("--images", type=int, default=256, help="images in all, cycling through the prompts")
    p.add_argument("--steps", type=int, default=20, help="ODE (Euler) steps")
    p.add_argument("--guidance", type=float, default=5.0, help="classifier-free guidance scale")
    p.add_argument("--shift", type=float, default=None, help="override the scheduler's timestep shift")
    p.add_argument("--seed", type=int, default=0, help="batch k uses seed + k * batch")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--grid", default=None, help="save the first 64 images as a PNG grid here")
    p.add_argument("--json", default=None, help="write the figures as JSON here")
    return p.parse_args(argv)


def save_grid(images, path: str, columns: int = 8) -> None:
    """uint8[N, H, W, 3] -> one PNG, `columns` images per row (1-pixel grey gutters)."""
    import numpy as np
    from PIL import Image

    n, h, w, _ = images.shape
    rows = -(-n // columns)
    grid = np.full((rows * (h + 1) + 1, columns * (w + 1) + 1, 3), 128, dtype=np.uint8)
    for i, im in enumerate(images):
        r, c = divmod(i, columns)
        grid[1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + c * (w + 1) : 1 + c * (w + 1) + w] = im
    Image.fromarray(grid).save(path)


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from flowrl.worlds.shapes import load_jsonl
    from flowrl.worlds.shapes.model import MAX_SEQUENCE_LENGTH, ode_accuracy

    torch.set_num_threads(args.threads)
    pipe = StableDiffusion3Pipeline.from_pretrained(args.model)
    if args.lora is not None:
        pipe.load_lora_weights(args.lora)
    if args.shift is not None:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=args.shift)
    pipe.set_progress_bar_config(disable=True)
    records = load_jsonl(args.prompts)
    t0 = time.time()
    res = ode_accuracy(pipe, records, args.images, args.steps, args.guidance, args.seed, args.batch)
    seconds = time.time() - t0
    if args.grid:
        save_grid(res["images"][:64], args.grid)
    report = {
        "model": args.model,
        "lora": args.lora,
        "prompts": args.prompts,
        "images": args.images,
        "steps": args.steps,
        "guidance": args.guidance,
        "shift": pipe.scheduler.config.shift,
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "seed": args.seed,
        "strict": round(res["strict"], 4),
        "fraction": round(res["fraction"], 4),
        "by_family": {k: round(v, 4) for k, v in res["by_family"].items()},
        # why images fail: the share of images with each kind of failure (an image may have several)
        "failures": {k: round(v, 4) for k, v in res["failures"].items()},
        "failures_by_family": {
            f: {k: round(v, 4) for k, v in kinds.items() if v} for f, kinds in res["failures_by_family"].items()
        },
        "seconds": round(seconds, 1),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
