"""Where an RL run on the shapes world starts from, family by family: how often the model gets a prompt right, how
often a group of G images of one prompt holds at least one right image (pass@G), and how often it holds both a right
and a wrong one, the groups that teach anything: a GRPO group with a non-zero advantage, a DPO pair under the
strict reward. A family whose groups are almost never mixed gives every objective almost nothing to learn from.

    python scripts/shapes_pass_at_k.py                                   # the base model, the validation prompts
    python scripts/shapes_pass_at_k.py --checkpoint runs/race/dpo-seed0/ckpt-000120 --prompts samples/shapes/val.jsonl

Each prompt gets G images from the deterministic ODE with the eval's seeds (`eval.images_per_prompt=G`, the race's
10 eval steps and guidance 3.0), scored strictly (every clause holds). Prints a Markdown table; `--json` writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def family_table(families: list[str], correct: list[list[bool]]) -> dict[str, dict[str, float]]:
    """Per family (and `all`, the mean over the families, as GenEval's overall): the prompts, the accuracy over
    their images, the fraction of prompts whose G images hold a right one (pass@G) and both kinds (mixed)."""
    rows: dict[str, dict[str, float]] = {}
    for name in sorted(set(families)):
        groups = [c for f, c in zip(families, correct) if f == name]
        rows[name] = {
            "prompts": len(groups),
            "accuracy": sum(sum(g) for g in groups) / sum(len(g) for g in groups),
            "pass": sum(any(g) for g in groups) / len(groups),
            "mixed": sum(any(g) and not all(g) for g in groups) / len(groups),
        }
    names = list(rows)
    rows["all"] = {k: sum(rows[n][k] for n in names) / len(names) for k in ("accuracy", "pass", "mixed")}
    rows["all"]["prompts"] = len(families)
    return rows


def measure(config: str, prompts: str, checkpoint: str | None, group: int, overrides: list[str]) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from flowrl.config import load_config
    from flowrl.eval import Evaluator
    from flowrl.preflight import preflight
    from flowrl.run.loading import policy_from_checkpoint
    from flowrl.train.scoring import build_reward_fns

    cfg = load_config(
        config,
        [
            f"data.eval_prompts={prompts}",
            f"eval.images_per_prompt={group}",
            "eval.group_by=null",
            "eval.images_per_group=0",
            "eval.num_prompts=0",
            "eval.num_steps=10",
            "eval.guidance_scale=3.0",
            "eval.base_cache=null",
            "log.progress=false",
            "model.device=cpu",
            *overrides,
        ],
    )
    _, eval_set = preflight(cfg)
    evaluator = Evaluator(cfg, eval_set, "cpu")
    policy = policy_from_checkpoint(cfg, checkpoint, "auto", "cpu")
    _, scores = evaluator.sample(policy, build_reward_fns(cfg, policy.reward_kind))
    if "shapes_geneval/strict" not in scores:
        raise ValueError(f"the config scores {sorted(scores)}: it needs the shapes_geneval reward")
    strict = [float(s) for s in scores["shapes_geneval/strict"]]  # every clause holds
    if len(strict) != group * len(eval_set):
        raise RuntimeError(f"{len(strict)} scores for {len(eval_set)} prompts x {group}")
    correct = [[s > 0.5 for s in strict[i * group : (i + 1) * group]] for i in range(len(eval_set))]
    families = [m.get("family", "?") for m in eval_set.metadata]
    return {
        "checkpoint": checkpoint or "(base model)",
        "prompts": prompts,
        "group": group,
        "families": family_table(families, correct),
    }


def markdown(result: dict) -> list[str]:
    g = result["group"]
    lines = [
        f"| family | prompts | accuracy | pass@{g} (a right image) | mixed (right and wrong: a pair) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, row in result["families"].items():
        lines.append(f"| {name} | {row['prompts']} | {row['accuracy']:.3f} | {row['pass']:.2f} | {row['mixed']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "shapes_grpo.yaml"))
    parser.add_argument("--prompts", default=str(ROOT / "samples" / "shapes" / "val.jsonl"))
    parser.add_argument("--checkpoint", default=None, help="a checkpoint (its EMA weights when kept); none: the base")
    parser.add_argument("--group", type=int, default=8, help="images per prompt (the rollouts' group size)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    if args.group < 2:
        parser.error(f"--group must be at least 2 (a group of {args.group} cannot be mixed)")
    result = measure(args.config, args.prompts, args.checkpoint, args.group, args.overrides)
    print(f"{result['checkpoint']} on {result['prompts']}, {args.group} images a prompt:")
    print("\n".join(markdown(result)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
