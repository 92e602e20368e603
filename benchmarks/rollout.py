"""Time `backend.rollout(...)` (with log-prob recording) against the plain `pipe(...)` call.

Same model, prompts, images per prompt, steps, size and guidance; both decode to PIL. The rollout's
prompt cache is cleared before every timed call so that both encode the prompts each time. Prints the
thread count, the median and best time of each and the overhead ratios rollout / pipe (target <= 1.10;
on a loaded machine the ratio of the best times is the steadier figure).

    python benchmarks/rollout.py                        # tiny random SD3 on CPU
    python benchmarks/rollout.py --model tiny-flux --steps 8
    python benchmarks/rollout.py --model stabilityai/stable-diffusion-3.5-medium --dtype bfloat16 \
        --device cuda --height 512 --width 512 --steps 10 --group-size 4

With --accelerators (names of rollout.acceleration, or `all`), it also times the rollout with each accelerator the
family supports (one at a time, with the knobs of --knobs) and prints, per accelerator, images per second beside
plain `pipe(...)`'s and the max difference of the final latents from an unaccelerated rollout of the same seed:

    python benchmarks/rollout.py --model tiny-flux --threads 1 --accelerators all --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

#: knobs that make each accelerator do something on a tiny model (mag_ratios: repeated to --steps)
DEFAULT_KNOBS = {
    "attention_backend": {"backend": "_native_math"},
    "first_block_cache": {"threshold": 0.2},
    "mag_cache": {"mag_ratios": [1.0], "threshold": 0.5},
}

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-sd3", help="hub id, local path, or tiny-sd3 | tiny-flux | tiny-sd15")
    parser.add_argument("--family", default="auto")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--guidance-scale", type=float, default=None)
    parser.add_argument("--sde-type", default=None)
    parser.add_argument("--max-sequence-length", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--accelerators", default="", help="comma-separated rollout accelerators, or all")
    parser.add_argument(
        "--knobs",
        default=json.dumps(DEFAULT_KNOBS),
        help="JSON: accelerator -> its knobs",
    )
    args = parser.parse_args(argv)

    import torch
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.set_verbosity_error()
    transformers_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    from flowrl.families import load_image_backend

    backend = load_image_backend(
        args.model,
        args.family,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        max_sequence_length=args.max_sequence_length,
    )
    pipe = backend.pipe
    prompts = [f"a cat {i}" for i in range(args.prompts)]
    guidance = backend.default_guidance_scale if args.guidance_scale is None else args.guidance_scale
    height, width = backend.check_image_size(args.height, args.width)
    pipe_kwargs = dict(
        num_images_per_prompt=args.group_size,
        num_inference_steps=args.steps,
        guidance_scale=guidance,
        height=height,
        width=width,
        output_type="pil",
    )
    if backend.max_sequence_length is not None:
        pipe_kwargs["max_sequence_length"] = backend.max_sequence_length
    if backend.family == "sd15":
        pipe_kwargs["eta"] = 1.0

    def sync():
        if torch.cuda.is_available() and str(args.device).startswith("cuda"):
            torch.cuda.synchronize()

    def run_pipe(seed):
        pipe(prompts, generator=torch.Generator("cpu").manual_seed(seed), **pipe_kwargs)

    def run_rollout(seed):
        backend._prompt_cache.clear()
        backend._negative = None
        backend.rollout(
            prompts,
            args.group_size,
            num_steps=args.steps,
            guidance_scale=guidance,
            sde_type=args.sde_type,
            height=height,
            width=width,
            seed=seed,
        )

    def timed(fn, seed):
        sync()
        start = time.perf_counter()
        with torch.no_grad():
            fn(seed)
        sync()
        return time.perf_counter() - start

    for seed in range(2):  # warm-up
        timed(run_pipe, seed)
        timed(run_rollout, seed)
    pipe_times, rollout_times = [], []
    for seed in range(args.repeats):  # interleaved, so drifting machine load hits both alike
        pipe_times.append(timed(run_pipe, seed))
        rollout_times.append(timed(run_rollout, seed))
    t_pipe, t_rollout = statistics.median(pipe_times), statistics.median(rollout_times)
    ratio, best_ratio = t_rollout / t_pipe, min(rollout_times) / min(pipe_times)
    print(
        f"model={args.model} family={backend.family} dtype={args.dtype} device={args.device} "
        f"threads={torch.get_num_threads()} batch={args.prompts}x{args.group_size} steps={args.steps} "
        f"size={height}x{width} guidance={guidance}"
    )
    print(f"pipe(...)      median {t_pipe * 1000:8.1f} ms, best {min(pipe_times) * 1000:8.1f} ms over {args.repeats}")
    print(
        f"rollout(...)   median {t_rollout * 1000:8.1f} ms, best {min(rollout_times) * 1000:8.1f} ms "
        "(records latents + log-probs)"
    )
    print(f"overhead ratio {ratio:.3f}x median, {best_ratio:.3f}x best  (target <= 1.10x)")
    if args.accelerators:
        accelerator_rows(args, backend, run_rollout, timed, t_pipe, t_rollout)
    return ratio


def accelerator_rows(args, backend, run_rollout, timed, t_pipe, t_rollout) -> None:
    """Images per second of the rollout with each accelerator (median over --repeats, after one warm-up call that
    compiles where `compile` is asked), and the max |final latents - plain rollout's| for the same seed."""
    import torch

    from flowrl.sampling.acceleration import ACCELERATORS, accelerated, parse

    names = ACCELERATORS.names() if args.accelerators == "all" else args.accelerators.split(",")
    knobs = json.loads(args.knobs)
    images = args.prompts * args.group_size
    threads = torch.get_num_threads()

    def final(seed, specs):
        with torch.no_grad(), accelerated(backend, specs, args.steps):
            return backend.rollout(
                [f"a cat {i}" for i in range(args.prompts)],
                args.group_size,
                num_steps=args.steps,
                guidance_scale=backend.default_guidance_scale if args.guidance_scale is None else args.guidance_scale,
                sde_type=args.sde_type,
                height=args.height,
                width=args.width,
                seed=seed,
                decode=False,
            ).final_latents

    plain = final(0, [])
    print(f"pipe(...)                    {images / t_pipe:8.2f} images/s  threads={threads}")
    print(f"rollout, no accelerator      {images / t_rollout:8.2f} images/s  threads={threads}")
    for name in names:
        entry = {"name": name, **knobs.get(name, {})}
        if name == "mag_cache" and "mag_ratios" in entry:
            entry["mag_ratios"] = [entry["mag_ratios"][0]] * args.steps
        specs = parse([entry])
        why = ACCELERATORS.get(name).problem(backend)
        if why is not None:
            print(f"{name:28s} not supported: {why}")
            continue
        diff = (final(0, specs) - plain).abs().max().item()  # the warm-up (compiles)
        times = []
        for seed in range(args.repeats):
            with accelerated(backend, specs, args.steps):
                times.append(timed(run_rollout, seed))
        t = statistics.median(times)
        kind = "lossless" if ACCELERATORS.get(name).lossless else "lossy"
        print(
            f"{name:28s} {images / t:8.2f} images/s  threads={threads}  {t_pipe / t:.2f}x pipe  "
            f"max |latents - plain| {diff:.2e}  ({kind}; {json.dumps({k: v for k, v in entry.items() if k != 'name'})})"
        )


if __name__ == "__main__":
    main()
