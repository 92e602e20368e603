"""Training throughput of the image GRPO update, and the share of time spent outside the model.

    python benchmarks/train_step.py                       # tiny SD3 built in code, 1 thread
    python benchmarks/train_step.py --model PATH --height 512 --width 512 --device cuda

For steps_per_forward 1 and 4 it runs the update (evaluate recorded steps with grad, clipped loss, KL to the
reference, backward, optimizer step) over one rollout batch and prints
  - throughput: trained steps x samples per second;
  - outside share: 1 - (time inside the denoiser's forward and backward) / (update time).
"Model time" is the same denoiser calls (recorded with a hook during one update) replayed bare: a forward, and
for the calls with grad a backward of the output.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-sd3")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--height", type=int, default=32)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8, help="denoising steps (all trained)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--beta", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # the update is repeated on one batch, so later passes are off-policy by design: no warning for that
    warnings.filterwarnings("ignore", message=".*not on-policy.*")

    from flowrl.config import load_config
    from flowrl.train import Trainer

    print(
        f"model {args.model}  device {args.device}  threads {torch.get_num_threads()}  "
        f"batch {args.prompts}x{args.group}  steps {args.steps}  {args.height}x{args.width}  beta {args.beta}"
    )
    for k in (1, 4):
        cfg = load_config(
            None,
            [
                f"model.path={args.model}",
                f"model.device={args.device}",
                f"sample.height={args.height}",
                f"sample.width={args.width}",
                f"sample.num_steps={args.steps}",
                f"sample.prompts_per_epoch={args.prompts}",
                f"sample.group_size={args.group}",
                "sample.max_sequence_length=16",
                f"train.grpo.beta={args.beta}",
                f"train.steps_per_forward={k}",
                "log.progress=false",
                "log.run_dir=/tmp/flowrl-bench",
            ],
        )
        tr = Trainer(cfg)
        den = tr.policy.backend.denoiser
        calls = []

        def record(mod, args, kwargs):
            calls.append((args, kwargs, torch.is_grad_enabled()))

        batch = tr.rollout(epoch=0)
        adv = torch.linspace(-1, 1, len(batch.prompts))
        keep = torch.ones(len(adv), dtype=torch.bool)
        tr.update(batch, adv, keep, epoch=0)  # warm-up
        best = None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = tr.update(batch, adv, keep, epoch=0)
            total = time.perf_counter() - t0
            best = min(best or total, total)
        # The same denoiser calls replayed bare: forward (+ backward of the output for the calls with grad).
        hook = den.register_forward_pre_hook(record, with_kwargs=True)
        tr.update(batch, adv, keep, epoch=0)
        hook.remove()
        model = None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for a, kw, grad in calls:
                with torch.set_grad_enabled(grad):
                    y = den(*a, **kw)[0]
                    if grad:
                        y.float().square().mean().backward()
            elapsed = time.perf_counter() - t0
            model = min(model or elapsed, elapsed)
        tr.opt.zero_grad(set_to_none=True)
        units = out["policy/trained_units"]
        print(
            f"steps_per_forward={k}: {units / best:8.1f} trained steps x samples / s   "
            f"update {best * 1e3:7.1f} ms   model fwd/bwd alone {model * 1e3:7.1f} ms   "
            f"outside model {100 * max(0.0, 1 - model / best):5.1f}%   ({len(calls)} denoiser calls, "
            f"threads {torch.get_num_threads()})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
