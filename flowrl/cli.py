"""The `flowrl` command line.

flowrl train [CONFIG] [key=value ...]       RL fine-tuning (`flowrl train --help` lists every key)
flowrl eval CONFIG [--checkpoint DIR]       evaluate a checkpoint (without one: the base model) on the
            [--weights auto|ema|trained]    held-out prompts (auto: the EMA weights when the run kept them)
flowrl sample CONFIG [--checkpoint DIR] --prompt TEXT ... | --prompts FILE   save images
flowrl serve-reward NAME [--host 127.0.0.1] [--port 8000]  serve a reward over HTTP
flowrl report RUN_DIR [RUN_DIR ...]          plot the reward and eval curves (several runs: compared)
flowrl plan CONFIG [--gpus N] [--gpu-memory 80GiB]   memory per GPU, estimated before renting them
flowrl demo [CONFIG] [key=value ...]        the embedded default (--toy: the tabular GRPO toy, seconds)
flowrl calibrate CONFIG [--checkpoint DIR]   measure mag_cache's step ratios for rollout.acceleration
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import textwrap
import time

from .errors import ConfigError


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
    import os

    from .train import train
    from .train.signals import StopSignals

    cfg = _load(args)
    with StopSignals(announce=os.environ.get("RANK", "0") == "0").installed():  # from the start to the end
        metrics = train(cfg)
    keys = [k for k in sorted(metrics) if k.startswith(("eval/", "reward/total"))]
    if keys and os.environ.get("RANK", "0") in ("", "0"):  # (none: nothing was trained, which the run said)
        # the main process's alone: another rank's metrics lack the eval, and one JSON object reads as one result
        from .run.metrics import strict_json

        print(json.dumps(strict_json({k: metrics[k] for k in keys}), indent=1))  # NaN as null: strict JSON
        for line in before_after_lines(cfg.log.run_dir, metrics):
            print(f"flowrl: {line}", file=sys.stderr)
    return 0


def before_after_lines(run_dir, final: dict) -> list[str]:
    """'eval/KEY_mean: before B -> after A (+D)' for each eval mean of `final` (a run's last metrics: a reward's
    mean, its components' and groups' means, not the per-group values) that the run's first eval also has (its
    metrics.jsonl); [] without an eval before training to compare with."""
    from pathlib import Path

    from .run.metrics import read_metrics
    from .run.report import eval_before_training

    first = eval_before_training(read_metrics(Path(run_dir) / "metrics.jsonl"))
    if first is None:  # (eval.before=false: the first eval is the final one, or one after training began)
        return []
    return compare_lines(first, final, ("before", "after"))


def compare_lines(first: dict, second: dict, labels: tuple[str, str]) -> list[str]:
    """'eval/KEY_mean: L1 B -> L2 A (+D)' for each plain eval mean (a reward's mean, its components' and groups'
    means; not per-group values nor diversity metrics) that both metric dicts hold as numbers."""
    lines = []
    for key in sorted(second):
        plain = key.startswith("eval/") and key.endswith("mean") and "/by_" not in key and "_by_" not in key
        if not plain or "diversity" in key or key not in first:
            continue
        before, after = first[key], second[key]
        if isinstance(before, (int, float)) and isinstance(after, (int, float)):
            lines.append(f"{key}: {labels[0]} {before:#.4g} -> {labels[1]} {after:#.4g} ({after - before:+#.3g})")
    return lines


def base_metrics(base_dir) -> dict | None:
    """The base model's eval metrics that a base directory holds: its eval-base-metrics.json (`BaseMetrics`), else
    (a directory written before that file was) a run directory's eval before training (the first eval row of its
    metrics.jsonl) or the eval.json of `flowrl eval` of the base model with --out; None when it holds none."""
    from pathlib import Path

    from .eval.diversity import BaseMetrics
    from .run.metrics import read_metrics

    base_dir = Path(base_dir)
    stored = BaseMetrics(base_dir).load()
    if stored:
        return stored
    if (base_dir / "metrics.jsonl").is_file():
        rows = read_metrics(base_dir / "metrics.jsonl")
        return next((r for r in rows if any(k.startswith("eval/") for k in r)), None)
    try:
        found = json.loads((base_dir / "eval.json").read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and found.get("checkpoint") == "(base model)" else None


def _device(cfg) -> str:
    """Where `flowrl eval` and `flowrl sample` run the model: model.device, `auto` = CUDA when there is one."""
    import torch

    from .preflight import check_device

    check_device(cfg.model.device)
    if cfg.model.device in ("auto", "cpu") and not torch.cuda.is_available():
        return "cpu"
    return "cuda" if cfg.model.device == "auto" else cfg.model.device


def _checkpoint_arg(args) -> str:
    """--checkpoint: a checkpoint directory as given; a run directory's newest checkpoint, said on stderr."""
    from pathlib import Path

    from .run.checkpoint import checkpoint_in

    found = checkpoint_in(args.checkpoint)
    if found != Path(args.checkpoint):
        print(
            f"flowrl {args.command}: {args.checkpoint} is a run directory: its newest checkpoint, {found}",
            file=sys.stderr,
        )
    return str(found)


def _eval(args) -> int:
    """The eval of a checkpoint (or of the base model) on the eval prompts. The diversity metrics compare with the
    base model's eval: an eval of the base model with --out writes its files there; an eval of a checkpoint reads
    them from --base, else from the checkpoint's run directory (its eval before training), when there."""
    from pathlib import Path

    from .eval import Evaluator, base_for_eval
    from .preflight import preflight
    from .run.loading import policy_from_checkpoint, read_checked
    from .run.metrics import strict_json
    from .run.rundir import check_writable
    from .train.scoring import build_reward_fns
    from .train.signals import eval_signals

    cfg = _load(args)
    # prompts, rewards and the model's class and size are checked before the model loads
    # the eval's completions are greedy, on the trainer's own model; the training prompts are not read
    _, eval_set = preflight(cfg, engine=False, train=False)
    if args.out:
        check_writable(args.out, "--out", keep=False)  # (not after the eval's sampling)
    # the checkpoint's model first: one of another model is that error alone, not the base eval's settings too
    read = read_checked(cfg, args.checkpoint, args.weights) if args.checkpoint else None
    evaluator = Evaluator(cfg, eval_set, _device(cfg))
    base_dir = base_for_eval(args.base, args.checkpoint, evaluator.settings)
    with eval_signals() as signals:  # a signal abandons the eval between its batches: nothing is written
        policy = policy_from_checkpoint(cfg, args.checkpoint, args.weights, _device(cfg), read=read)
        reward_fns = build_reward_fns(cfg, policy.reward_kind)
        t0 = time.perf_counter()
        outputs, scores = evaluator.sample(policy, reward_fns, stop=signals.stop_point, progress=cfg.log.progress)
        signals.stop_point()
        out = Path(args.out) if args.out else None
        if out:
            out.mkdir(parents=True, exist_ok=True)
        result = evaluator.results(
            outputs, scores, base_dir=base_dir, this_is_base=not args.checkpoint, save_base_to=out
        )
        # (an eval without a checkpoint is of the model a run starts from: with lora.init_path, that adapter's)
        start = f"(base model + lora.init_path={cfg.lora.init_path})" if cfg.lora.init_path else "(base model)"
        result["checkpoint"] = args.checkpoint or start
        if args.checkpoint:
            result["weights"] = getattr(policy, "loaded_weights", args.weights)  # e.g. "ema (auto)"
        if base_dir:
            result["base"] = str(base_dir)
        result["num_samples"] = len(outputs)
        result = strict_json(result)  # no NaN / Infinity in the JSON
        if out:
            evaluator.write_outputs(policy, outputs, scores, out / "eval")
            (out / "eval.json").write_text(json.dumps(result, indent=1))
        if cfg.eval.base_cache and not args.checkpoint:  # an eval of the base model: an entry for training runs
            _add_to_base_cache(cfg, evaluator, policy, reward_fns, outputs, scores, result, time.perf_counter() - t0)
    print(json.dumps(result, indent=1))
    base = base_metrics(base_dir) if (args.checkpoint and base_dir) else None
    for line in compare_lines(base, result, ("base", "checkpoint")) if base else []:
        print(f"flowrl eval: {line}", file=sys.stderr)
    return 0


def _add_to_base_cache(cfg, evaluator, policy, reward_fns, outputs, scores, result, seconds) -> None:
    """`flowrl eval` of the base model with eval.base_cache set: the eval added to the cache as the eval before
    training of a run of this config (its grid, its base-model files, its metrics), said on stderr."""
    import tempfile
    from pathlib import Path

    from .eval.base_cache import BaseEvalCache, fingerprint_of_run

    cache = BaseEvalCache(cfg.eval.base_cache)
    fp = fingerprint_of_run(cfg, evaluator, policy, reward_fns, _device(cfg))
    if fp is None:
        print(
            f"flowrl eval: eval.base_cache: model.path={cfg.model.path}'s files cannot be identified: not kept",
            file=sys.stderr,
        )
        return
    with tempfile.TemporaryDirectory() as tmp:  # laid out as a run directory's eval before training
        evaluator.results(outputs, scores, base_dir=None, this_is_base=True, save_base_to=Path(tmp))
        if cfg.eval.grid:
            evaluator.write_outputs(policy, outputs, scores, Path(tmp) / "eval-epoch000000")
        metrics = {k: v for k, v in result.items() if k.startswith("eval/")}
        entry = cache.store(fp, metrics, Path(tmp), "epoch000000", seconds)
    print(f"flowrl eval: the base model's eval is in eval.base_cache: {entry}", file=sys.stderr)


def _sample(args) -> int:
    """Images of each --prompt with seeds --seed, --seed + 1, ... (--num of them): flowrl.eval.samples."""
    from pathlib import Path

    from .data import check_prompt_lengths
    from .eval.evaluator import images_per_call
    from .eval.samples import sample_to_dir
    from .preflight import check_lora_init, check_model, check_sample_images
    from .run.loading import policy_from_checkpoint
    from .run.rundir import check_writable

    cfg = _load(args)
    given = _sample_prompts(cfg, args)
    args.prompt = list(given.prompts)
    if args.num < 1:
        raise ConfigError(f"--num must be >= 1 (images or completions per prompt), got {args.num}")
    if args.steps < 0:
        raise ConfigError(f"--steps must be >= 0 (0: eval.num_steps), got {args.steps}")
    check_writable(args.out, "--out", keep=False)  # before the model loads: no sampling lost to a bad folder
    if cfg.backend == "text":
        return _sample_text(cfg, args, given)
    if args.greedy:
        raise ConfigError("--greedy is a text model's decoding; an image model samples the ODE")
    family_name = check_model(cfg)  # the model's class and the image size, before it loads
    images_of = _row_images(cfg, args, given, family_name)  # a prompt file's own conditioning images, if it has any
    if images_of is None:
        check_sample_images(family_name, args.image or [])
    check_lora_init(cfg, family_name)  # lora.init_path's settings and component, before the model loads too
    policy = policy_from_checkpoint(cfg, args.checkpoint, args.weights, _device(cfg))
    # one line for prompts a text encoder cuts (and the libraries' own truncation logs silenced), as training does
    check_prompt_lengths(policy, {"--prompts" if args.prompts else "--prompt": given})
    seeds = [args.seed + k for k in range(args.num)]
    count = sample_to_dir(
        policy,
        args.prompt,
        seeds,
        Path(args.out),
        num_steps=args.steps or cfg.eval.num_steps,
        guidance_scale=cfg.eval.guidance_scale,
        image_paths=args.image,
        images_of=images_of,
        per_call=images_per_call(cfg.sample),  # a training rollout's call: what fits where training does
        progress=cfg.log.progress,
    )
    from .families import family

    what = "videos" if family(family_name).video else "images"
    print(f"wrote {count} {what} to {args.out} (listed in samples.jsonl)")
    return 0


def _sample_prompts(cfg, args):
    """The prompts of `flowrl sample`: each --prompt, then those of --prompts FILE (read as data.train_prompts is:
    its column, template and image column), as a PromptSet whose origins name them (--prompt #i, FILE:line) and
    whose metadata holds each file row's columns (its conditioning images among them)."""
    from .data import PromptSet, load_prompts

    given = list(args.prompt or [])
    origins = [f"--prompt #{i + 1}" for i in range(len(given))]
    metadata = [{} for _ in given]
    if args.prompts:
        d = cfg.data
        try:
            listed = load_prompts(
                args.prompts, column=d.prompt_column, template=d.prompt_template, image_column=d.image_column
            )
        except ValueError as e:  # PromptFileError: one line naming the file and line
            raise SystemExit(f"flowrl sample: --prompts: {e}") from None
        given, origins = given + listed.prompts, origins + listed.origins
        metadata += listed.metadata
    if not given:
        raise ConfigError("no prompts: give --prompt TEXT (repeatable) or --prompts FILE")
    return PromptSet(given, metadata=metadata, origins=origins)


def _row_images(cfg, args, given, family_name: str) -> list[list[str]] | None:
    """The conditioning images of each prompt when --prompts FILE's rows carry them (data.image_column): checked
    against what the family takes per prompt (a --prompt beside them has none); None when no row has any (then
    --image gives every prompt's). A file's images and --image together are refused: one source per run."""
    from .conditioning import check_image_counts
    from .families import family
    from .preflight import PreflightError

    column = cfg.data.image_column
    own = [(m or {}).get(column) if column else None for m in given.metadata]
    if not any(own):
        return None
    if args.image:
        raise PreflightError(
            f"--prompts {args.prompts} gives each row's images (its {column!r} column, data.image_column) and "
            f"--image every prompt's: give one of them"
        )
    try:
        check_image_counts(given.metadata, given.origins, column, family(family_name).condition_images, family_name)
    except ValueError as e:
        raise PreflightError(str(e)) from None
    return [[v] if isinstance(v, str) else list(v or []) for v in own]


def _sample_text(cfg, args, given) -> int:
    """A text config's `flowrl sample`: --num completions of each --prompt, drawn as the rollouts draw them (seeds
    --seed, --seed + 1, ...), or with --greedy the eval's greedy one; printed and listed in --out/samples.jsonl."""
    from pathlib import Path

    from .data import check_prompt_lengths
    from .eval.samples import listed_rows, write_listing
    from .preflight import check_model
    from .run.loading import policy_from_checkpoint

    if args.image or args.steps:
        raise ConfigError("--image and --steps are an image model's; a text config takes neither")
    if args.greedy and args.num != 1:
        raise ConfigError(f"--greedy gives one completion per prompt, and --num is {args.num}")
    empty = [o for p, o in zip(given.prompts, given.origins) if not p.strip()]
    if empty:
        raise ConfigError(f"{empty[0]} is empty; a language model continues a prompt: give it text")
    check_model(cfg)
    policy = policy_from_checkpoint(cfg, args.checkpoint, args.weights, _device(cfg))
    check_prompt_lengths(policy, {"--prompts" if args.prompts else "--prompt": given})
    seeds = None if args.greedy else [args.seed + k for k in range(args.num)]
    completions = policy.sample_completions(list(args.prompt), seeds, [dict(m or {}) for m in given.metadata])
    rows = [
        {"prompt": prompt, "seed": "greedy" if seeds is None else seeds[k], "completion": text}
        for prompt, texts in zip(args.prompt, completions)
        for k, text in enumerate(texts)
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    listing = out / "samples.jsonl"  # an earlier listing's other completions are kept
    earlier = listed_rows(listing, "completion")
    write_listing(listing, earlier, rows, key=lambda r: (r.get("prompt"), r.get("seed")))
    for r in rows:
        print(f"[{r['seed']}] {r['prompt']}\n{r['completion']}\n")
    print(f"wrote {len(rows)} completion{'' if len(rows) == 1 else 's'} to {listing}")
    return 0


def _calibrate(args) -> int:
    """mag_cache's ratios for the config's model and rollout: diffusers' MagCache in calibration mode over the
    config's training rollout of --prompts training prompts (sample.group_size images each); prints them and the
    rollout.acceleration entry that uses them."""
    import torch

    from .objectives import get_objective
    from .preflight import preflight
    from .run.loading import policy_from_checkpoint
    from .sampling.acceleration import calibrating_mag_cache

    cfg = _load(args)
    if cfg.backend != "image":
        raise ConfigError(f"flowrl calibrate measures an image denoiser's steps, and backend={cfg.backend}")
    if args.prompts < 1:
        raise ConfigError(f"--prompts must be >= 1, got {args.prompts}")
    train_set, _ = preflight(cfg)
    policy = policy_from_checkpoint(cfg, args.checkpoint, args.weights, _device(cfg))
    k = min(args.prompts, len(train_set))
    G = cfg.sample.group_size
    prompts = [p for p in train_set.prompts[:k] for _ in range(G)]
    metadata = [m for m in train_set.metadata[:k] for _ in range(G)]
    from .sampling.acceleration import decoupled_objectives

    coupled = get_objective(cfg.train.objective).coupled
    policy.accelerators = []  # the config's own accelerators stay off while measuring
    try:
        with torch.no_grad(), calibrating_mag_cache(policy.backend, cfg.sample.num_steps) as found:
            policy.rollout(
                prompts,
                metadata,
                epoch=0,
                generator=torch.Generator("cpu").manual_seed(args.seed),
                final_only=not coupled,
            )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ratios = [round(r, 4) for r in found.ratios()]
    print(
        f"mag_ratios of {cfg.model.path} over {len(found.done)} rollout passes ({k} prompts x {G} images, "
        f"{cfg.sample.num_steps} steps): {ratios}"
    )
    print(f"rollout:\n  acceleration:\n    - name: mag_cache\n      threshold: 0.06\n      mag_ratios: {ratios}")
    if coupled:
        print(
            f"note: mag_cache is lossy, and train.objective={cfg.train.objective} may not use it "
            f"(the decoupled objectives may: {', '.join(decoupled_objectives())})"
        )
    return 0


def _plan(args) -> int:
    """`flowrl plan CONFIG`: the memory estimate per GPU (flowrl.plan); exit 1 when the config fits no strategy (said
    on stderr too), 2 when it cannot be planned."""
    from .plan import main as plan_main

    if args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
    code = plan_main(args.config, args.overrides, gpus=args.gpus, gpu_memory=args.gpu_memory)
    if code:
        gpus = f"{args.gpus} GPU{'s' * (args.gpus != 1)}"
        print(
            f"flowrl plan: the config as written fits under no column of the plan above ({gpus} of "
            f"{args.gpu_memory}); a column's micro-batch, or more GPUs, may",
            file=sys.stderr,
        )
    return code


def _report(args) -> int:
    from pathlib import Path

    from .errors import RunDirError
    from .run.report import figure_format, plot_comparison, plot_curves
    from .run.rundir import check_writable

    if args.out and Path(args.out).is_dir():  # a folder: the figure's own name in it
        args.out = str(Path(args.out) / ("curves.png" if len(args.run_dir) == 1 else "compare.png"))
    if args.out:  # its format from its suffix, and its folder made and writable, before any run is read
        figure_format(args.out)
        folder = Path(args.out).parent
        check_writable(folder, problem=lambda why: f"--out {args.out}: its folder {folder} cannot be written ({why})")
    try:
        if len(args.run_dir) == 1:
            ignored = [f for f, given in (("--metric", args.metric), ("--x", args.x != "epoch")) if given]
            if ignored:  # (they choose what several runs are compared on)
                print(
                    f"flowrl report: {' and '.join(ignored)} {'compares' if len(ignored) == 1 else 'compare'} "
                    "several runs; one run's figure shows all its curves by epoch",
                    file=sys.stderr,
                )
            print(plot_curves(args.run_dir[0], args.out))
            return 0
        out, table = plot_comparison(args.run_dir, args.out or "compare.png", args.x, args.metric)
    except (FileNotFoundError, ValueError) as e:  # not a run directory, or its metrics.jsonl is empty or broken
        raise RunDirError(str(e)) from None
    print("\n".join(table))
    print(out)
    return 0


def _demo(args: argparse.Namespace) -> int:
    """The embedded default (`make demo`): flowrl.worlds.demo."""
    from .worlds.demo import DEMO_CONFIG, run_demo

    if args.toy and (args.config or args.overrides):
        given = " ".join([*([args.config] if args.config else []), *args.overrides])
        raise ConfigError(f"--toy trains the tabular toy, which takes no config or overrides (got {given})")
    return run_demo(args.config or DEMO_CONFIG, args.overrides, toy=args.toy)


def _seed(text: str) -> int:
    """A --seed: an integer torch's generators take (`flowrl.ranges.SEED`), as train.seed and eval.seed are."""
    from .ranges import SEED

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a seed is {SEED.text()}, got {text!r}") from None
    if value not in SEED:
        raise argparse.ArgumentTypeError(f"a seed is {SEED.text()}, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    from .run.loading import WEIGHTS

    parser = argparse.ArgumentParser(
        prog="flowrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    try:
        installed = version("flowrl")
    except PackageNotFoundError:  # (a checkout on sys.path, not installed)
        installed = "unknown (not installed)"
    parser.add_argument("--version", action="version", version=f"flowrl {installed}")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p, optional: bool):
        p.add_argument("config", nargs="?" if optional else None, help="YAML preset (configs/*.yaml)")
        # default=[]: argparse otherwise lists the optional overrides among "the following arguments are required"
        p.add_argument(
            "overrides", nargs="*", default=[], metavar="key=value", help="config overrides, e.g. train.lr=1e-4"
        )

    train = sub.add_parser(
        "train",
        help="RL fine-tuning (GRPO and Flow-DPPO, DiffusionNFT, AWM, DPO online and offline, ELBO, CRD, DGPO)",
        epilog=_config_help(),
        formatter_class=_HelpWithConfig,
    )
    with_config(train, optional=True)
    train.set_defaults(func=_train)

    ev = sub.add_parser("eval", help="evaluate a checkpoint (or the base model) on the eval prompts")
    ev.add_argument(
        "--checkpoint", default=None, help="a ckpt-XXXXXX directory, or a run directory (its newest); omit for the base"
    )
    ev.add_argument("--out", default=None, help="directory for the image grid and eval.json")
    ev.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="auto",
        help="the checkpoint's EMA weights, its trained weights, or auto: the EMA when it has one",
    )
    ev.add_argument(
        "--base",
        default=None,
        help="a directory holding the base model's eval (a run directory, or the --out of an eval "
        "without --checkpoint) for the diversity metrics' comparisons; default: the "
        "checkpoint's run directory, when its eval before training wrote one",
    )
    with_config(ev, optional=False)
    ev.set_defaults(func=_eval)

    sa = sub.add_parser(
        "sample",
        help="sample images (deterministic ODE) from a config and checkpoint; a text config: completions",
    )
    sa.add_argument("--checkpoint", default=None, help="a ckpt-XXXXXX directory, or a run directory (its newest)")
    sa.add_argument("--weights", choices=WEIGHTS, default="auto", help="as for eval")
    sa.add_argument("--prompt", action="append", default=None, help="repeatable (or --prompts FILE)")
    sa.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="a prompt file (.txt, .jsonl, .json, .csv/.tsv, hf:...; data.prompt_column and data.prompt_template "
        "apply), its prompts after any --prompt",
    )
    sa.add_argument(
        "--image",
        action="append",
        default=None,
        help="repeatable: a conditioning image of every prompt (an editing or image-to-video model)",
    )
    sa.add_argument("--num", type=int, default=1, help="images (a text config: completions) per prompt (default 1)")
    sa.add_argument("--steps", type=int, default=0, help="ODE steps (default eval.num_steps)")
    sa.add_argument("--seed", type=_seed, default=0, help="the first image's seed; the others follow (default 0)")
    sa.add_argument(
        "--greedy",
        action="store_true",
        help="a text config: the eval's greedy completion instead of sampled ones (text.temperature, ...)",
    )
    sa.add_argument(
        "--out", default="samples_out", help="directory of the images and samples.jsonl (default samples_out)"
    )
    with_config(sa, optional=False)
    sa.set_defaults(func=_sample)

    rep = sub.add_parser(
        "report",
        help="plot a run directory's reward and eval curves to curves.png; several runs: one figure comparing them",
    )
    rep.add_argument("run_dir", nargs="+", help="a run's log.run_dir; several: compared (a sweep's runs)")
    rep.add_argument(
        "--out",
        default=None,
        help="the figure (one run: RUN_DIR/curves.png; several: compare.png in the working directory); a directory: "
        "that name in it; its suffix picks the format: .png, .pdf, .svg, .jpg/.jpeg, .webp (none: PNG)",
    )
    rep.add_argument(
        "--metric",
        action="append",
        default=None,
        help="several runs: an eval metric to compare (repeatable; its name without eval/); default: every one they "
        "all logged",
    )
    rep.add_argument(
        "--x",
        choices=("epoch", "minutes", "cpu_minutes"),
        default="epoch",
        help="several runs: the x axis (minutes: the training wall-clock; cpu_minutes: the process's CPU time)",
    )
    rep.set_defaults(func=_report)

    demo = sub.add_parser(
        "demo", help="run the embedded default (offline, CPU): online Diffusion-DPO on the shapes world"
    )
    demo.add_argument("config", nargs="?", default=None, help="the demo's config (default configs/shapes.yaml)")
    demo.add_argument(
        "overrides", nargs="*", default=[], metavar="key=value", help="config overrides, e.g. train.seed=1"
    )
    demo.add_argument("--toy", action="store_true", help="the tabular GRPO toy instead (seconds)")
    demo.set_defaults(func=_demo)

    ca = sub.add_parser(
        "calibrate", help="measure mag_cache's ratios (rollout.acceleration) for a config's model and rollout"
    )
    ca.add_argument("--prompts", type=int, default=8, help="training prompts to sample (sample.group_size each)")
    ca.add_argument(
        "--checkpoint", default=None, help="a ckpt-XXXXXX directory, or a run directory (its newest); omit for the base"
    )
    ca.add_argument("--weights", choices=WEIGHTS, default="auto", help="as for eval")
    ca.add_argument("--seed", type=_seed, default=0, help="the seed of the calibration's noise (default 0)")
    with_config(ca, optional=False)
    ca.set_defaults(func=_calibrate)

    pl = sub.add_parser("plan", help="estimate the memory a config needs per GPU, before renting them")
    pl.add_argument("--gpus", type=int, default=1, help="GPUs (processes) the run will use")
    pl.add_argument(
        "--gpu-memory",
        default="80GiB",
        help="memory of one GPU, e.g. 80GiB, 80GB, 40960MiB; a bare number is GiB (default 80GiB)",
    )
    with_config(pl, optional=False)
    pl.set_defaults(func=_plan)

    sub.add_parser(
        "serve-reward", add_help=False, help="serve a registered reward over HTTP (see `flowrl serve-reward --help`)"
    )
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
        # the command's own usage and options (not the top level's list of commands), and the option meant
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        command = commands.get(getattr(args, "command", None), parser)
        options = [o for a in command._actions for o in a.option_strings if o.startswith("--")]
        flags = [x.split("=", 1)[0] for x in stray if x.startswith("--")]
        close = [m for f in flags for m in difflib.get_close_matches(f, options, n=1, cutoff=0.6)]
        hint = f" (did you mean {', '.join(dict.fromkeys(close))}?)" if close else ""
        command.error(f"unrecognized arguments: {' '.join(stray or extra)}{hint}")
    if extra:
        args.overrides = [*(args.overrides or []), *extra]
    _split_overrides(args)
    return args


def _one_line_warnings() -> None:
    """Show flowrl's own warnings (a config key spelled the old way, a resume with a changed config, a non-finite
    reward, ...) as one line `flowrl: ...` on stderr, not as Python's two lines with the source line; warnings of
    other libraries keep their form. (The format changes, not the route: a caller recording warnings still gets
    them.) Every rank of a multi-process launch would say the same, so a rank other than 0 (RANK) prints none of
    flowrl's own: the launch shows each once."""
    import os
    import warnings

    import flowrl
    import rewards

    from .config import ConfigWarning

    formatted = warnings.formatwarning
    if getattr(formatted, "flowrl_one_line", False):
        return
    ours = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (flowrl, rewards))

    def one_line(message, category, filename, lineno, line=None):
        if issubclass(category, ConfigWarning) or os.path.abspath(filename).startswith(ours):
            return "" if os.environ.get("RANK", "0") not in ("", "0") else f"flowrl: {message}\n"
        return formatted(message, category, filename, lineno, line)

    one_line.flowrl_one_line = True
    warnings.formatwarning = one_line
    _quiet_offline_kernels()


def _quiet_offline_kernels() -> None:
    """With HF_HUB_OFFLINE, the `kernels` package (which transformers imports with bitsandbytes) logs that it skips
    a publisher check of a kernel flowrl never uses, on every command: a line of noise, dropped."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Skipping publisher trust check")

    logging.getLogger("kernels._internals.hf_hub").addFilter(keep)


def _leave(rc: int) -> int:
    """A rank of a multi-process launch (WORLD_SIZE > 1) that finished leaves without interpreter finalization:
    gloo's worker threads, alive into it, intermittently abort a finished rank ("terminate called without an active
    exception", pytorch/pytorch#179291; the process group is already destroyed, the run's files are written)."""
    import os

    if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc or 0)
    return rc


def main(argv: list[str] | None = None) -> int:
    """The command line. A FlowrlError (config, data, checkpoint, run directory, a stopped run) and a second stop
    signal (StopNow) are printed as one line `flowrl: ...` (a line more for each note the run added: what it kept) with
    their exit code; FLOWRL_DEBUG=1 shows the traceback
    instead."""
    import os

    from .errors import FlowrlError, Interrupted, StopNow

    argv = sys.argv[1:] if argv is None else list(argv)
    _one_line_warnings()
    if argv and argv[0] == "serve-reward":
        from rewards.server import serve_main

        return serve_main(argv[1:])
    args = parse_args(argv)
    try:
        if getattr(args, "checkpoint", None):
            args.checkpoint = _checkpoint_arg(args)
        return _leave(args.func(args))
    except FlowrlError as e:
        if os.environ.get("FLOWRL_DEBUG"):
            raise
        if isinstance(e, Interrupted) and os.environ.get("RANK", "0") not in ("", "0"):
            return e.exit_code  # a stop of a multi-process run: the main process says it, naming the checkpoint
        print(f"flowrl {args.command}: {e}", file=sys.stderr)
        for note in getattr(e, "__notes__", ()):  # what the run kept (Trainer.save_after_failure)
            print(f"flowrl {args.command}: {note}", file=sys.stderr)
        return e.exit_code
    except StopNow as e:  # a second signal; what the first one stopped (a checkpoint written) is said first
        if os.environ.get("FLOWRL_DEBUG"):
            raise
        if isinstance(e.__context__, FlowrlError):
            print(f"flowrl {args.command}: {e.__context__}", file=sys.stderr)
        print(f"flowrl {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C where no stop handler is installed yet (e.g. while torch imports)
        if os.environ.get("FLOWRL_DEBUG"):
            raise
        print(f"flowrl {args.command}: interrupted by SIGINT", file=sys.stderr)
        return 128 + 2


if __name__ == "__main__":
    sys.exit(main())
