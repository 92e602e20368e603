"""What a lossy rollout accelerator does to the samples a decoupled objective trains on: the config's own training
rollout (its sampler, steps, guidance and size) of the eval prompts, N images each with the same seeds, with no
accelerator and with each setting asked for, scored by the config's rewards (each reward's mean and standard
error, and its components' means), beside the rollout's images per second. mag_cache's ratios are calibrated on
the training prompts first (`flowrl calibrate` does the same for a config) unless a setting gives its own.

    python benchmarks/cache_quality.py configs/shapes.yaml --threads 1 --images 8 \\
        --settings '[{"name": "mag_cache", "threshold": 0.06}, {"name": "taylorseer_cache"}]'

CPU figures at the thread count printed. The rewards' means over prompts x images are what the objective's pairs
or advantages are drawn from: a setting that lowers them changes what the model is trained toward.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    ap.add_argument("--settings", default="[]", help="JSON list of rollout.acceleration entries, one at a time")
    ap.add_argument("--images", type=int, default=8, help="images per eval prompt")
    ap.add_argument("--prompts", type=int, default=0, help="eval prompts (0 = all)")
    ap.add_argument("--calibration-prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.set_verbosity_error()
    transformers_logging.set_verbosity_error()
    from flowrl.config import load_config
    from flowrl.data import load_prompts
    from flowrl.run.loading import policy_from_checkpoint
    from flowrl.sampling.acceleration import ACCELERATORS, calibrating_mag_cache, parse
    from flowrl.train.scoring import build_reward_fns

    cfg = load_config(args.config, args.overrides)
    policy = policy_from_checkpoint(cfg, None, "auto", "cpu")
    fns = build_reward_fns(cfg, policy.reward_kind)
    d = cfg.data
    eval_set = load_prompts(d.eval_prompts, column=d.prompt_column, template=d.prompt_template)
    train_set = load_prompts(d.train_prompts, column=d.prompt_column, template=d.prompt_template)
    n = args.prompts or len(eval_set)
    prompts = [p for p in eval_set.prompts[:n] for _ in range(args.images)]
    metadata = [m for m in eval_set.metadata[:n] for _ in range(args.images)]
    from flowrl.objectives import get_objective

    final_only = not get_objective(cfg.train.objective).coupled  # the decoupled objectives' ODE rollout

    def rollout(specs, prompts=prompts, metadata=metadata):
        policy.accelerators = specs
        generator = torch.Generator("cpu").manual_seed(args.seed)
        start = time.perf_counter()
        with torch.no_grad():
            batch = policy.rollout(prompts, metadata, epoch=0, generator=generator, final_only=final_only)
        return batch, time.perf_counter() - start

    settings = json.loads(args.settings)
    ratios = None
    if any(s.get("name") == "mag_cache" and "mag_ratios" not in s for s in settings):
        k = args.calibration_prompts
        cal_prompts = [p for p in train_set.prompts[:k] for _ in range(cfg.sample.group_size)]
        cal_meta = [m for m in train_set.metadata[:k] for _ in range(cfg.sample.group_size)]
        with calibrating_mag_cache(policy.backend, cfg.sample.num_steps) as cal:
            rollout([], cal_prompts, cal_meta)
        ratios = [round(r, 4) for r in cal.ratios()]
        print(f"mag_ratios (calibrated on {k} training prompts x {cfg.sample.group_size}): {ratios}", flush=True)

    rows = []
    rollout([])  # warm-up
    for entry in [None, *settings]:
        if entry is not None and entry.get("name") == "mag_cache" and "mag_ratios" not in entry:
            entry = {**entry, "mag_ratios": ratios}
        specs = parse([entry]) if entry else []
        if specs and ACCELERATORS.get(entry["name"]).problem(policy.backend):
            print(f"{entry['name']}: not supported: {ACCELERATORS.get(entry['name']).problem(policy.backend)}")
            continue
        batch, seconds = rollout(specs)
        row = dict(
            setting=entry or "none",
            images=len(prompts),
            threads=torch.get_num_threads(),
            images_per_s=len(prompts) / seconds,
        )
        for fn in fns:
            name = getattr(fn, "__name__", type(fn).__name__)
            scores = policy.call_reward(fn, batch, {k: [m.get(k) for m in metadata] for k in metadata[0]})
            vals = scores.tolist()
            row[name] = statistics.fmean(vals)
            row[f"{name}_se"] = statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else float("nan")
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
