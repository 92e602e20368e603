"""The `flowrl` command line.

    flowrl train [CONFIG] [key=value ...]       RL fine-tuning (`flowrl train --help` lists every key)
    flowrl eval CONFIG --checkpoint DIR         evaluate a checkpoint on the held-out prompts
                [--weights auto|ema|trained]    (auto: the EMA weights when the run kept them)
    flowrl sample CONFIG [--checkpoint DIR] --prompt TEXT ...   save images
    flowrl serve-reward NAME [--host 127.0.0.1] [--port 8000]  serve a reward over HTTP
    flowrl report RUN_DIR                        plot the reward and eval curves to RUN_DIR/curves.png
    flowrl plan CONFIG [--gpus N] [--gpu-memory 80GiB]   memory per GPU, estimated before renting them
    flowrl demo                                  the embedded default
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap


def _config_help() -> str:
    from .config import describe

    lines = ["config keys (set in the YAML file or as key=value):", ""]
    for key, tp, default, doc in describe():
        lines.append(f"  {key} ({tp}, default {default!r})")
        lines.extend("      " + line for line in textwrap.wrap(doc, 96))
    return "\n".join(lines)


class _HelpWithConfig(argparse.RawDescriptionHelpFormatter):
    pass


def _load(args) -> "object":
    from .config import load_config

    return load_config(args.config, args.overrides)  # a ConfigError becomes one line in main()


def _train(args) -> int:
    from .train import train

    cfg = _load(args)
    metrics = train(cfg)
    keys = [k for k in sorted(metrics) if k.startswith(("eval/", "reward/total"))]
    print(json.dumps({k: metrics[k] for k in keys}, indent=1))
    return 0


def _device(cfg) -> str:
    """Where `flowrl eval` and `flowrl sample` run the model: model.device, `auto` = CUDA when there is one."""
    import torch

    if cfg.model.device in ("auto", "cpu") and not torch.cuda.is_available():
        return "cpu"
    return "cuda" if cfg.model.device == "auto" else cfg.model.device


def _eval_base(args, settings: dict) -> "Path | None":
    """The directory whose base-model eval files (`eval-base-distribution.json`, `eval-base-features.safetensors`)
    `flowrl eval` of a checkpoint compares with: --base, else the checkpoint's run directory when it holds one
    (its eval before training wrote them), else None. The base's eval must have been sampled with this eval's
    `settings` (`flowrl.eval.diversity.eval_settings`: prompts, steps, CFG, seed, size), else its images do not pair with
    these: a --base that differs is an error naming the differences; a run directory that differs (e.g. an eval of
    the run's checkpoint on other prompts) is not compared with (said on stderr)."""
    from pathlib import Path

    from .eval.diversity import BaseDistribution, BaseFeatures, settings_differences

    def holds(d: Path) -> bool:
        return BaseDistribution(d).path.exists() or BaseFeatures(d).exists()

    def differences(d: Path) -> list[str]:
        found = [store.settings() for store in (BaseDistribution(d), BaseFeatures(d)) if store.path.exists()]
        return sorted({line for stored in found for line in settings_differences(stored, settings)})

    if args.base:
        base = Path(args.base)
        if not holds(base):
            raise SystemExit(f"flowrl eval: --base {base} holds no base-model eval ({BaseDistribution(base).path.name} "
                             f"or {BaseFeatures.NAME}): pass a training run's directory (its eval before training "
                             f"writes them) or the --out of `flowrl eval` of the base model (no --checkpoint)")
        unlike = differences(base)
        if unlike:
            raise SystemExit(f"flowrl eval: --base {base} holds a base-model eval sampled with other settings than "
                             f"this eval's ({'; '.join(unlike)}), whose images do not pair with these: give this eval "
                             f"the base's settings, or make a base with this eval's (`flowrl eval` of the same config "
                             f"and overrides without --checkpoint, --out DIR)")
        return base
    if args.checkpoint and holds(Path(args.checkpoint).parent):
        run = Path(args.checkpoint).parent
        unlike = differences(run)
        if unlike:
            print(f"flowrl eval: the run directory {run} holds the base model's eval with other settings than this "
                  f"eval's ({'; '.join(unlike)}): no comparison with the base model (pass --base DIR of a base eval "
                  f"with these settings to compare)", file=sys.stderr)
            return None
        return run
    return None


def _eval(args) -> int:
    """The eval of a checkpoint (or of the base model) on the eval prompts. The diversity metrics compare with the
    base model's eval: an eval of the base model with --out writes its files there; an eval of a checkpoint reads
    them from --base, else from the checkpoint's run directory (its eval before training), when there."""
    from pathlib import Path

    from .eval import Evaluator
    from .preflight import preflight
    from .run.loading import policy_from_checkpoint
    from .train.scoring import build_reward_fns

    cfg = _load(args)
    # prompts, rewards and the model's class and size are checked before the model loads
    _, eval_set = preflight(cfg)
    evaluator = Evaluator(cfg, eval_set, _device(cfg))
    base_dir = _eval_base(args, evaluator.settings)
    policy = policy_from_checkpoint(cfg, args.checkpoint, args.weights, _device(cfg))
    outputs, scores = evaluator.sample(policy, build_reward_fns(cfg, policy.reward_kind))
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    result = evaluator.results(outputs, scores, base_dir=base_dir, this_is_base=not args.checkpoint,
                               save_base_to=out)
    result["checkpoint"] = args.checkpoint or "(base model)"
    if args.checkpoint:
        result["weights"] = args.weights
    if base_dir:
        result["base"] = str(base_dir)
    result["num_samples"] = len(outputs)
    if out:
        evaluator.write_outputs(policy, outputs, scores, out / "eval")
        (out / "eval.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


def _sample(args) -> int:
    """Images of each --prompt with seeds --seed, --seed + 1, ... (--num of them), named `PPP_seedS.png` (prompt
    index, seed; a video model's `PPP_seedS.webp`, eval.video_format); image (prompt, seed) is the same whatever
    else is sampled beside it. samples.jsonl lists them."""
    from pathlib import Path

    from .preflight import check_model
    from .run.loading import policy_from_checkpoint

    cfg = _load(args)
    if cfg.backend != "image":
        raise SystemExit("flowrl sample: draws images; for a text config use flowrl eval")
    if args.num < 1 or args.steps < 0:
        raise SystemExit(f"flowrl sample: --num must be >= 1 and --steps >= 0, got {args.num} and {args.steps}")
    family_name = check_model(cfg)  # the model's class and the image size, before it loads
    _check_sample_images(family_name, args.image or [])
    policy = policy_from_checkpoint(cfg, args.checkpoint, args.weights, _device(cfg))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [args.seed + k for k in range(args.num)]
    images = policy.sample(args.prompt, seeds, num_steps=args.steps or cfg.eval.num_steps,
                           guidance_scale=cfg.eval.guidance_scale, image_paths=args.image)
    rows = []
    for i, prompt in enumerate(args.prompt):
        for k, seed in enumerate(seeds):
            path = policy.save_sample(images[i * len(seeds) + k], out / f"{i:03d}_seed{seed}")
            rows.append({"file": path.name, "prompt": prompt, "seed": seed})
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} images to {out} (listed in samples.jsonl)")
    return 0


def _check_sample_images(family_name: str, paths: list[str]) -> None:
    """`flowrl sample --image`: each path a file Pillow reads, as many as the model's family takes per prompt."""
    from PIL import Image, UnidentifiedImageError

    from .conditioning import count_problem
    from .families import family
    from .preflight import PreflightError

    for path in paths:
        try:
            with Image.open(path) as im:
                im.verify()
        except (OSError, UnidentifiedImageError) as e:
            raise PreflightError(f"--image {path!r} is not an image Pillow reads ({e})") from None
    problem = count_problem(len(paths), family(family_name).condition_images, family_name)
    if problem:
        raise PreflightError(f"--image: {problem} (give each image with its own --image)")


def _plan(args) -> int:
    """`flowrl plan CONFIG`: the memory estimate per GPU (flowrl.plan); exit 1 when the config fits no strategy."""
    from .plan import main as plan_main

    if args.gpus < 1:
        raise SystemExit(f"flowrl plan: --gpus must be >= 1, got {args.gpus}")
    return plan_main(args.config, args.overrides, gpus=args.gpus, gpu_memory=args.gpu_memory)


def _report(args) -> int:
    from .errors import RunDirError
    from .run.report import plot_curves

    try:
        print(plot_curves(args.run_dir, args.out))
    except (FileNotFoundError, ValueError) as e:  # not a run directory, or its metrics.jsonl is empty or broken
        raise RunDirError(str(e)) from None
    return 0


def _demo(args: argparse.Namespace) -> int:
    """The embedded default: configs/shapes.yaml (online Diffusion-DPO on the shapes world's tiny SD3), evaluated
    before and after; or another config run the same way."""
    import time
    from pathlib import Path

    from .config import load_config
    from .objectives import get_objective
    from .run.metrics import read_metrics
    from .run.report import result_keys
    from .train import train

    path = Path(args.config)
    model_dir = Path("samples/shapes/model")
    if not args.toy and path == Path("configs/shapes.yaml") and not (model_dir / "model_index.json").exists():
        print(f"flowrl demo: the shapes world's pre-trained model ({model_dir}) is not built yet "
              "(scripts/pretrain_shapes.py), so this runs the smallest real thing instead: GRPO from flowrl.core "
              "teaching a tabular token policy to spell 'flowrl' (reward = matching letters).")
        args.toy = True
    if args.toy:
        from .toy import run_toy_grpo

        history = run_toy_grpo(steps=60, seed=0)
        print(f"mean reward, first 5 steps {sum(history[:5]) / 5:.3f} -> last 5 steps {sum(history[-5:]) / 5:.3f}")
        return 0
    if not path.exists():
        raise SystemExit(f"flowrl demo: {path} not found; run it from the repository root (where configs/ is)")
    cfg = load_config(path, args.overrides)
    objective = get_objective(cfg.train.objective).title
    adapter = "LoRA" if cfg.lora.enabled else "full fine-tuning"
    print(f"flowrl demo: {objective} + {adapter} on {cfg.model.path}, trained on {describe_rewards(cfg.rewards)}, "
          f"{cfg.train.epochs} epochs of {cfg.sample.prompts_per_epoch} prompts x {cfg.sample.group_size} images, "
          f"on the CPU")
    t0 = time.perf_counter()
    train(cfg)  # what `flowrl train` runs: it evaluates before and after and draws the figures
    minutes = (time.perf_counter() - t0) / 60
    run = Path(cfg.log.run_dir)
    rows = read_metrics(run / "metrics.jsonl")
    for key in result_keys(rows, cfg.rewards[0].name, cfg.eval.group_by):  # headline first: GenEval's overall
        evals = [r for r in rows if key in r]
        b, a = evals[0][key], evals[-1][key]
        print(f"{key}: before {b:.3f} -> after {a:.3f} ({a - b:+.3f})")
    # what the reward does not see: how far the model's free choices (colours...) moved from the base model's
    final = next((r for r in reversed(rows) if r.get("final")), {})
    for key in sorted(k for k in final if k.startswith("eval/diversity/") and k.endswith("_from_base")):
        meaning = "1 = as diverse as the base model" if key.endswith("spread_from_base") else "0 = the base model's"
        print(f"{key}: {final[key]:.3f} ({meaning})")
    import torch

    # the thread count changes float rounding, so the trajectory, and the time: printed beside the figures
    print(f"wall-clock {minutes:.1f} min at {torch.get_num_threads()} torch threads")
    figures = [str(f) for f in (run / "before_after.png", run / "curves.png") if f.exists()]
    if figures:
        print("wrote " + " and ".join(figures))
    return 0


def describe_rewards(specs) -> str:
    """The weighted sum a run trains on, e.g. "1 x shapes_soft (reported only, weight 0: shapes_geneval)"."""
    trained = " + ".join(f"{r.weight:g} x {r.name}" for r in specs if r.weight) or "no reward (all weights 0)"
    reported = [r.name for r in specs if not r.weight]
    return trained + (f" (reported only, weight 0: {', '.join(reported)})" if reported else "")


def build_parser() -> argparse.ArgumentParser:
    from .run.loading import WEIGHTS

    parser = argparse.ArgumentParser(prog="flowrl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p, optional: bool):
        p.add_argument("config", nargs="?" if optional else None, help="YAML preset (configs/*.yaml)")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.lr=1e-4")

    train = sub.add_parser("train", help="RL fine-tuning (GRPO, DiffusionNFT, AWM, online DPO)", epilog=_config_help(),
                           formatter_class=_HelpWithConfig)
    with_config(train, optional=True)
    train.set_defaults(func=_train)

    ev = sub.add_parser("eval", help="evaluate a checkpoint (or the base model) on the eval prompts")
    ev.add_argument("--checkpoint", default=None, help="a ckpt-XXXXXX directory; omit for the base model")
    ev.add_argument("--out", default=None, help="directory for the image grid and eval.json")
    ev.add_argument("--weights", choices=WEIGHTS, default="auto",
                    help="the checkpoint's EMA weights, its trained weights, or auto: the EMA when it has one")
    ev.add_argument("--base", default=None,
                    help="a directory holding the base model's eval (a run directory, or the --out of an eval "
                         "without --checkpoint) for the diversity metrics' comparisons; default: the "
                         "checkpoint's run directory, when its eval before training wrote one")
    with_config(ev, optional=False)
    ev.set_defaults(func=_eval)

    sa = sub.add_parser("sample", help="sample images (deterministic ODE) from a config and checkpoint")
    sa.add_argument("--checkpoint", default=None)
    sa.add_argument("--weights", choices=WEIGHTS, default="auto", help="as for eval")
    sa.add_argument("--prompt", action="append", required=True, help="repeatable")
    sa.add_argument("--image", action="append", default=None,
                    help="repeatable: a conditioning image of every prompt (an editing or image-to-video model)")
    sa.add_argument("--num", type=int, default=1, help="images per prompt")
    sa.add_argument("--steps", type=int, default=0, help="ODE steps (default eval.num_steps)")
    sa.add_argument("--seed", type=int, default=0)
    sa.add_argument("--out", default="samples_out")
    with_config(sa, optional=False)
    sa.set_defaults(func=_sample)

    rep = sub.add_parser("report", help="plot a run directory's reward and eval curves to curves.png")
    rep.add_argument("run_dir")
    rep.add_argument("--out", default=None)
    rep.set_defaults(func=_report)

    demo = sub.add_parser("demo", help="run the embedded default (offline, CPU): online Diffusion-DPO on the shapes "
                                       "world")
    demo.add_argument("config", nargs="?", default="configs/shapes.yaml")
    demo.add_argument("overrides", nargs="*", metavar="key=value")
    demo.add_argument("--toy", action="store_true", help="the tabular GRPO toy instead (seconds)")
    demo.set_defaults(func=_demo)

    pl = sub.add_parser("plan", help="estimate the memory a config needs per GPU, before renting them")
    pl.add_argument("--gpus", type=int, default=1, help="GPUs (processes) the run will use")
    pl.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU, e.g. 80GiB, 24GiB, 40960MiB")
    with_config(pl, optional=False)
    pl.set_defaults(func=_plan)

    sub.add_parser("serve-reward", add_help=False,
                   help="serve a registered reward over HTTP (see `flowrl serve-reward --help`)")
    return parser


def _split_overrides(args) -> None:
    """argparse cannot tell an optional CONFIG from the first key=value: move it."""
    if getattr(args, "config", None) and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides = [args.config, *args.overrides]
        args.config = None


def parse_args(argv: list[str]) -> argparse.Namespace:
    """argparse, with `key=value` overrides accepted anywhere after the command (also after options, where argparse
    alone stops reading positionals: `flowrl eval CFG --out DIR train.seed=1`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*(args.overrides or []), *extra]
    _split_overrides(args)
    return args


def _one_line_config_hints() -> None:
    """Print a config hint (ConfigWarning: a key spelled the old way) as one line `flowrl: ...` on stderr, not as
    Python's two-line warning with the source line."""
    import warnings

    from .config import ConfigWarning

    shown = warnings.showwarning
    if getattr(shown, "flowrl_config_hints", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, ConfigWarning):
            print(f"flowrl: {message}", file=file or sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    show.flowrl_config_hints = True
    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    """The command line. A FlowrlError (config, data, checkpoint, run directory, a stopped run) is printed as one
    line `flowrl: ...` with its exit code; FLOWRL_DEBUG=1 shows the traceback instead."""
    import os

    from .errors import FlowrlError

    argv = sys.argv[1:] if argv is None else list(argv)
    _one_line_config_hints()
    if argv and argv[0] == "serve-reward":
        from rewards.server import serve_main

        return serve_main(argv[1:])
    args = parse_args(argv)
    try:
        return args.func(args)
    except FlowrlError as e:
        if os.environ.get("FLOWRL_DEBUG"):
            raise
        print(f"flowrl {args.command}: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
