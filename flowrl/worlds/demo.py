"""The embedded default (`make demo`, `flowrl demo`): configs/shapes.yaml, online Diffusion-DPO on the shapes world's
tiny SD3, trained as `flowrl train` trains it and summed up before and after; or another config run the same way,
or (`--toy`, or before the shapes model is built) a tabular GRPO toy in seconds."""

from __future__ import annotations

import time
from pathlib import Path

SHAPES_MODEL = Path("samples/shapes/model")
DEMO_CONFIG = Path("configs/shapes.yaml")
#: the checkout flowrl runs from (configs/ and samples/ beside the package), whatever the working directory
REPO_ROOT = Path(__file__).resolve().parents[2]


def demo_files(config: Path) -> tuple[Path, Path]:
    """(the demo config to read, the shapes model it needs): `config` as given, or, for the default one when the
    working directory has no configs/shapes.yaml, the checkout's (`REPO_ROOT`)."""
    if config == DEMO_CONFIG and not config.exists() and (REPO_ROOT / DEMO_CONFIG).exists():
        return REPO_ROOT / DEMO_CONFIG, REPO_ROOT / SHAPES_MODEL
    return config, SHAPES_MODEL


def anchored(path: Path, overrides: list[str]) -> list[str]:
    """Overrides that give each relative path of the config at `path` which is missing from the working directory
    and present beside the config (`paths_beside`: the shipped model, prompts and base-eval cache) as the path it
    has there, before `overrides` (which win): the demo run from another folder reads the checkout's files."""
    import warnings

    from flowrl.config import load_config
    from flowrl.config.load import paths_beside

    with warnings.catch_warnings():  # (the config is read again with them; its warnings are said then)
        warnings.simplefilter("ignore")
        cfg = load_config(path, overrides)
    return [f"{key}={where / value}" for key, value, where in paths_beside(cfg, path) if "[" not in key]


def describe_rewards(specs) -> str:
    """The weighted sum a run trains on, e.g. "1 x shapes_soft (reported only, weight 0: shapes_geneval)"."""
    trained = " + ".join(f"{r.weight:g} x {r.name}" for r in specs if r.weight) or "no reward (all weights 0)"
    reported = [r.name for r in specs if not r.weight]
    return trained + (f" (reported only, weight 0: {', '.join(reported)})" if reported else "")


def time_split(rows: list[dict]) -> str:
    """Where a run's time went, from its metrics rows: the epochs' rollout, reward and update phases (summed over the
    logged epochs; with rollout.async the rollout phase is the trainer's wait for the worker) and the evals (sampled;
    an eval before training read from eval.base_cache is said apart)."""
    epochs = [r for r in rows if "time/train" in r]
    evals = [r["time/eval"] for r in rows if "time/eval" in r]

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in epochs)

    read = [r["time/eval_read"] for r in rows if "time/eval_read" in r]
    rollout = "waiting for the rollout worker" if any("time/rollout_wait" in r for r in epochs) else "rollouts"
    return (
        f"time: {rollout} {total('time/rollout'):.0f} s, rewards {total('time/reward'):.0f} s, updates "
        f"{total('time/train'):.0f} s ({len(epochs)} epoch{'s' * (len(epochs) != 1)}); evals {sum(evals):.0f} s "
        f"({len(evals)})" + (f", the base model's read from eval.base_cache in {sum(read):.1f} s" if read else "")
    )


def run_demo(config: str | Path = DEMO_CONFIG, overrides: list[str] | None = None, *, toy: bool = False) -> int:
    """Train `config` (with `overrides`) and print its eval before and after: the headline first, the diversity's
    distance from the base model, the wall-clock beside the torch thread count and where the run's time went, and the
    figures written."""
    import torch

    from flowrl.config import load_config
    from flowrl.objectives import get_objective
    from flowrl.run.metrics import read_metrics
    from flowrl.run.report import eval_before_training, result_keys
    from flowrl.train import train

    path, model = demo_files(Path(config))
    if not toy and Path(config) == DEMO_CONFIG and not (model / "model_index.json").exists():
        dropped = f" (the overrides {' '.join(overrides)} are not used by it)" if overrides else ""
        print(
            f"flowrl demo: the shapes world's pre-trained model ({model}) is not built yet "
            "(scripts/pretrain_shapes.py), so this runs the smallest real thing instead: GRPO from flowrl.core "
            f"teaching a tabular token policy to spell 'flowrl' (reward = matching letters){dropped}."
        )
        toy = True
    if toy:
        from .toy import run_toy_grpo

        history = run_toy_grpo(steps=60, seed=0)
        print(f"mean reward, first 5 steps {sum(history[:5]) / 5:.3f} -> last 5 steps {sum(history[-5:]) / 5:.3f}")
        return 0
    if not path.exists():
        raise SystemExit(f"flowrl demo: {path} not found; run it from the repository root (where configs/ is)")
    overrides = list(overrides or [])
    if path != Path(config):  # the checkout's demo, from another folder: its shipped files, by their whole paths
        overrides = [*anchored(path, overrides), *overrides]
    cfg = load_config(path, overrides)
    objective = get_objective(cfg.train.objective).title
    adapter = "LoRA" if cfg.lora.enabled else "full fine-tuning"
    print(
        f"flowrl demo: {objective} + {adapter} on {cfg.model.path}, trained on {describe_rewards(cfg.rewards)}, "
        f"{cfg.train.epochs} epoch{'s' * (cfg.train.epochs != 1)} of {cfg.sample.prompts_per_epoch} prompts x "
        f"{cfg.sample.group_size} images, "
        f"on the CPU"
    )
    t0 = time.perf_counter()
    train(cfg)  # what `flowrl train` runs: it evaluates before and after and draws the figures
    minutes = (time.perf_counter() - t0) / 60
    run = Path(cfg.log.run_dir)
    rows = read_metrics(run / "metrics.jsonl")
    before = eval_before_training(rows) or {}
    for key in result_keys(rows, cfg.rewards[0].name, cfg.eval.group_by):  # headline first: GenEval's overall
        a = [r for r in rows if key in r][-1][key]
        if key in before:
            print(f"{key}: before {before[key]:.3f} -> after {a:.3f} ({a - before[key]:+.3f})")
        else:  # (eval.before=false)
            print(f"{key}: after {a:.3f} (no eval before training: eval.before=false)")
    # what the reward does not see: how far the model's free choices (colours...) moved from the base model's
    final = next((r for r in reversed(rows) if r.get("final")), {})
    for key in sorted(k for k in final if k.startswith("eval/diversity/") and k.endswith("_from_base")):
        meaning = "1 = as diverse as the base model" if key.endswith("spread_from_base") else "0 = the base model's"
        print(f"{key}: {final[key]:.3f} ({meaning})")
    # and how far they are from what they should follow (eval.free_reference), before and after
    for key in sorted(k for k in final if k.startswith("eval/diversity/") and k.endswith("_from_reference")):
        was = f"before {before[key]:.3f} -> " if key in before else ""
        print(f"{key}: {was}after {final[key]:.3f} (0 = eval.free_reference's distribution)")
    # the thread count changes float rounding, so the trajectory, and the time: printed beside the figures
    threads = torch.get_num_threads()
    print(f"wall-clock {minutes:.1f} min ({minutes * 60:.0f} s) at {threads} torch thread{'s' * (threads != 1)}")
    print(time_split(rows))
    figures = [str(f) for f in (run / "before_after.png", run / "curves.png") if f.exists()]
    if figures:
        print("wrote " + " and ".join(figures))
    return 0
