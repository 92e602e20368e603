"""Race the training objectives on the shapes world at an equal training budget (issue 23).

    python scripts/race_objectives.py --minutes 15 --seeds 0 1 2 3 4 --jobs 2

Every (objective, seed) run is `flowrl train configs/shapes_grpo.yaml` (the GRPO preset, the demo when the race ran)
with `train.objective=<name>` and the objective's settings from OBJECTIVE_SETTINGS, one torch thread, and a budget
of `--minutes` of training CPU time
(`train.max_minutes` on `train.budget_clock=process`: rollout, reward and update count, evals do not; at one thread
this is the wall-clock of the same run on an idle machine; a process beside the race's inflates it by about a
fifth, so nothing else runs beside a race). An eval on the test split (GenEval-style strict accuracy, the mean
over the prompt families, and the diversity metric: the colour distribution's total variation from the base
model's where prompts leave colour free) runs every few epochs; after training, the final weights and the base
model are evaluated on the out-of-template split (samples/shapes/out_of_template.jsonl).

`--split val` races for choosing settings (issue 39): each run trains on the training prompts less the validation
split (samples/shapes/train_minus_val.jsonl) and its curve is on the validation split (samples/shapes/val.jsonl);
the test split is read once per run, on its final weights (`test_after`, against the base model's), and the table
gains that column. Its results go to their own folder (default samples/shapes/race/val-runs), its table and plot to
race-val.md, race-val.json and race-val.png beside it.

Each finished (objective, seed) leaves a small JSON in --results (default samples/shapes/race/runs, committed): its
curve, its settings and its out-of-template accuracy. A run with a result file is not run again, so the race resumes
where it stopped, on this machine or another; a result raced with other settings is an error, not a silent mix. A
run cut short in --out (the machine stopped) goes on from its last checkpoint, with the budget it had spent.
Beside --results (in its parent folder) go `race.json` (every run), `race.md` (per objective: the median and range
over seeds of the gain on the test split, the training minutes to reach +0.20, the colour TV from the base, the
out-of-template accuracy before and after) and `race.png` (test accuracy against training minutes: the median over
seeds per objective, the band from the worst seed to the best). Run directories (checkpoints, logs) go to --out.
`--jobs 2` runs two trainings at once, each on one thread.

A CPU-minute is not the same work on every machine: the same runs took up to a third more CPU time per epoch on some
machines than on others. `--calibrate-pace` measures this machine's pace against the race's earlier machines: it
trains the first eval interval of the committed GRPO runs again (the same seeds, the same trajectory, so the same
work) and divides the CPU time it takes here by theirs, the median over the seeds. `--pace P` then gives each new
run a budget of P x --minutes CPU-minutes and divides its curve's minutes by P (the minutes are the reference
machines'); the result file records its pace.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "shapes_grpo.yaml"
OUT_OF_TEMPLATE = ROOT / "samples" / "shapes" / "out_of_template.jsonl"
TEST = ROOT / "samples" / "shapes" / "test.jsonl"
#: --split val: train on the training prompts less the validation split, curves on the validation split
#: (paths relative to the repository, where every run starts: a result file holds them and stays valid in another
#: checkout)
VAL_DATA = [
    "data.train_prompts=samples/shapes/train_minus_val.jsonl",
    "data.eval_prompts=samples/shapes/val.jsonl",
    "eval.images_per_group=56",  # a multiple of each family's validation prompts (colour attribution has 14)
]
HEADLINE = "eval/shapes_geneval/strict_family_mean"
FAMILY = "eval/shapes_geneval/strict_by_family/"  # + the GenEval family: its strict accuracy (the headline's terms)
TV = "eval/diversity/shapes_geneval/color_tv_from_base"
TARGET_GAIN = 0.20

#: Every eval of the race (the test split during training, the out-of-template split after) samples with 10 ODE steps,
#: half the demo's 20: the base model's test accuracy is then 0.271 instead of 0.299.
EVAL = ["eval.num_steps=10"]
#: Each objective's settings on the shapes world (key=value overrides of configs/shapes_grpo.yaml): 4 training times
#: per sample (GRPO trains 4 steps: the preset's window); NFT's beta 0.1 and DPO's beta 100 learned faster than
#: their defaults (1 and 5000) on a tiny model in the first hand runs. AWM's from trials on seed 0: rollouts of 6 ODE
#: steps instead of 10 (cheaper epochs, the same gain per epoch); at a constant lr (6-minute trials) 3e-3 reached
#: +0.20 in 2.8 minutes but fell back after 5 (colours drifting, TV 0.41), and with a KL of 1e-3 collapsed after
#: 3.5; at a constant lr 2e-3 and KL 1e-2 (15 minutes) it peaked at +0.246 after 7 minutes, then its colours
#: collapsed (TV 0.43) and it ended at -0.021. A cosine lr over the budget (`train.schedule_over=budget`, 15-minute
#: trials) did not stop the drift at KL 1e-2 (lr 2e-3: peak +0.264 at 6.3 minutes, +0.21 and TV 0.34 near the end;
#: lr 3e-3: peak +0.243 at 3.9, +0.16 and TV 0.39 near the end); a KL of 3e-2 with lr 3e-3 learned more slowly and
#: drifted less.
OBJECTIVE_SETTINGS: dict[str, list[str]] = {
    "grpo": [],
    "nft": ["train.objective=nft", "train.nft.beta=0.1", "train.nft.timesteps=4"],
    "awm": [
        "train.objective=awm",
        "train.awm.timesteps=4",
        "sample.num_steps=6",
        "train.lr=3e-3",
        "train.awm.kl_coef=3e-2",
        "train.schedule=cosine",
        "train.schedule_over=budget",
    ],
    "dpo": ["train.objective=dpo", "train.dpo.beta=100", "train.dpo.timesteps=4"],
    # issue 39: Flow-DPPO (GRPO with a per-step KL trust region instead of the ratio clip, its default threshold)
    # and Pref-GRPO (GRPO on each group's win rates from the shapes judge instead of normalised scores)
    "dppo": ["train.grpo.policy_loss=dppo"],
    "pairwise": ["rewards.0.pairwise=true"],
    # ELBO policy gradient at 4 training times (as nft, awm and dpo), its defaults otherwise (PEPG, adaptive weights)
    "elbo": ["train.objective=elbo", "train.elbo.timesteps=4"],
    # CRD at 4 training times, its KL anchored to the base guided at the rollouts' guidance (3, not the paper's 4.5)
    "crd": ["train.objective=crd", "train.crd.timesteps=4", "train.crd.kl_cfg=3.0"],
    # DGPO at its defaults (4 shared training times, beta 100, DSM clipping against the EMA policy)
    "dgpo": ["train.objective=dgpo"],
    # offline DPO on the 64 shipped pairs (samples/shapes_pairs: training prompts less the validation split), 8 pairs
    # an epoch in 4 optimizer steps (as online DPO's pairs per step), DPO's beta and 4 training times; nothing is
    # sampled, so an epoch costs about 1.6 CPU-seconds against online DPO's 8.3: an eval every 32 epochs keeps its
    # curve's points about a CPU-minute apart, as every 6 epochs does for the others (every 6 would spend several times
    # the training's time in evals)
    "dpo_offline": [
        "train.objective=dpo_offline",
        "train.dpo_offline.pairs=samples/shapes_pairs/pairs.jsonl",
        "sample.group_size=2",
        "train.minibatch_size=4",
        "train.dpo_offline.beta=100",
        "train.dpo_offline.timesteps=4",
        "eval.every=32",
    ],
}


def run_dir(out: Path, objective: str, seed: int) -> Path:
    return out / f"{objective}-seed{seed}"


def finished(directory: Path) -> bool:
    metrics = directory / "metrics.jsonl"
    return metrics.exists() and any(
        json.loads(line).get("final") for line in metrics.read_text().splitlines() if line.strip()
    )


def train(
    out: Path, objective: str, seed: int, minutes: float, eval_every: int, extra: list[str], epochs: int = 100000
) -> Path:
    """One training run (skipped when already finished); its stdout and stderr go to train.log beside it. The
    budget is training CPU minutes (`train.budget_clock=process`, one torch thread); what work a CPU-minute buys
    depends on the machine and on what else runs beside it (`--pace`). `epochs`: at most that many."""
    directory = run_dir(out, objective, seed)
    if finished(directory):
        return directory
    # a run cut short (the machine stopped) goes on from its last checkpoint, budget included; none: afresh
    partial = directory.is_dir() and any(p.is_dir() for p in directory.glob("ckpt-*"))
    directory.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "flowrl",
        "train",
        str(CONFIG),
        f"train.seed={seed}",
        f"train.max_minutes={minutes}",
        "train.budget_clock=process",
        f"train.epochs={epochs}",
        f"eval.every={eval_every}",
        "log.progress=false",
        f"log.run_dir={directory}",
        "checkpoint.resume=auto" if partial else "log.overwrite=true",
        "checkpoint.keep=0",
        *EVAL,
        *OBJECTIVE_SETTINGS[objective],
        *extra,
    ]  # every checkpoint kept (a few MB each): the demo's eval of any epoch (docs/demo_eval.md)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    say(
        f"{objective} seed {seed}: {'resumed from its last checkpoint' if partial else 'training'}, {minutes:g} "
        f"CPU-minutes (log: {directory / 'train.log'})"
    )
    with open(directory / "train.log", "a" if partial else "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return directory


def race_run(out: Path, results: Path, objective: str, seed: int, args) -> dict:
    """One (objective, seed): its result file in `results` when there (the race resumes across machines from the
    committed files), else train, evaluate the final weights on the out-of-template split and write it."""
    settings = {"settings": OBJECTIVE_SETTINGS[objective] + split_data(args) + args.extra, "minutes": args.minutes}
    path = results / f"{objective}-seed{seed}.json"
    if path.exists():
        result = json.loads(path.read_text())
        if {k: result.get(k) for k in settings} != settings:
            raise SystemExit(
                f"{path} was raced with other settings ({ {k: result.get(k) for k in settings} }, now "
                f"{settings}): delete it to race it again, or pass another --results"
            )
        return result
    minutes = args.minutes * args.pace  # this machine's CPU-minutes for the reference machines' budget
    directory = train(out, objective, seed, minutes, args.eval_every, split_data(args) + args.extra)
    # the run's budget keys too: an override that needs them (train.schedule_over=budget) is valid in eval as well
    budget = [f"train.max_minutes={minutes}", "train.budget_clock=process", *args.extra]
    final = directory / f"ckpt-{_last_ckpt(directory):06d}"
    after = evaluate(directory, final, "oot-final", budget)
    result = {"objective": objective, "seed": seed, **settings, "curve": curve(directory, args.pace)}
    result.update({"oot_after": after[HEADLINE], **({"pace": args.pace} if args.pace != 1 else {})})
    if args.split == "val":  # the test split, read once: the final weights
        result["test_after"] = evaluate(directory, final, "test-final", budget, prompts=TEST)[HEADLINE]
    write_json(path, result)
    c = result["curve"]
    test = f", test {result['test_after']:.3f}" if "test_after" in result else ""
    say(
        f"{objective} seed {seed}: done, {c['accuracy'][0]:.3f} -> {c['accuracy'][-1]:.3f} on its eval split{test}, "
        f"colour TV {c['tv'][-1]:.3f} ({path})"
    )
    return result


#: the objective whose committed runs are the pace's reference (the race's base config, the GRPO preset)
PACE_REFERENCE = "grpo"


def calibrate_pace(args) -> float:
    """This machine's pace against the race's earlier machines: each committed run of PACE_REFERENCE raced at the
    reference pace (no `pace` in its result) trains again here up to its first eval after the start (the same seed
    and settings: the same work), and its CPU minutes here are divided by the committed curve's; the pace is the
    median of these ratios. A run whose accuracy there differs from the committed curve's did not repeat the same
    trajectory, and is refused."""
    references = []
    for path in sorted(args.results.glob(f"{PACE_REFERENCE}-seed*.json")):
        r = json.loads(path.read_text())
        if "pace" not in r and len(r["curve"]["epochs"]) > 1:
            if r["settings"] != OBJECTIVE_SETTINGS[PACE_REFERENCE] + split_data(args) + args.extra:
                raise SystemExit(f"--calibrate-pace: {path} was raced with other settings ({r['settings']})")
            references.append(r)
    if not references:
        raise SystemExit(
            f"--calibrate-pace: no result of {PACE_REFERENCE} raced at the reference pace in {args.results}"
        )
    out = args.out / "pace"

    def one(r: dict) -> float:
        epochs = r["curve"]["epochs"][1]
        directory = run_dir(out, r["objective"], r["seed"])
        shutil.rmtree(directory, ignore_errors=True)  # a fresh run: the whole interval is measured
        train(out, r["objective"], r["seed"], 10 * r["minutes"], epochs, split_data(args) + args.extra, epochs=epochs)
        here = curve(directory)
        committed = r["curve"]["accuracy"][1]
        if here["epochs"][1:2] != [epochs] or here["accuracy"][1] != committed:
            raise SystemExit(
                f"--calibrate-pace: {directory} did not repeat {r['objective']} seed {r['seed']}'s trajectory "
                f"(accuracy {here['accuracy'][1:2]} at epoch {epochs}, committed {committed}): other code, so not "
                "the same work"
            )
        ratio = here["minutes"][1] / r["curve"]["minutes"][1]
        say(
            f"pace: {r['objective']} seed {r['seed']}, {epochs} epochs: {here['minutes'][1]:.2f} CPU-minutes here, "
            f"{r['curve']['minutes'][1]:.2f} committed: {ratio:.3f}"
        )
        return ratio

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        ratios = list(pool.map(one, references))
    pace = statistics.median(ratios)
    say(f"pace {pace:.3f} (the median of {len(ratios)}): race on this machine with --pace {pace:.3f}")
    return pace


def say(line: str) -> None:
    """A progress line of the race, timed and written at once (a log file is not line-buffered)."""
    print(f"{time.strftime('%H:%M:%S')} race: {line}", flush=True)


def write_json(path: Path, data) -> None:
    """`data` as JSON at `path`, atomically (a temporary file, then renamed)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def split_data(args) -> list[str]:
    """The data overrides of --split: none for the test-split race, the validation split's for --split val."""
    return VAL_DATA if args.split == "val" else []


def evaluate(
    directory: Path, checkpoint: Path | None, out_name: str, extra: list[str], prompts: Path = OUT_OF_TEMPLATE
) -> dict:
    """`flowrl eval` of a checkpoint (None: the base model) on the out-of-template split (or `prompts`: the test
    split, once per run of a --split val race, every prompt at the demo's images per family)."""
    target = directory / out_name
    if (target / "eval.json").exists():
        return json.loads((target / "eval.json").read_text())
    cmd = [
        sys.executable,
        "-m",
        "flowrl",
        "eval",
        str(CONFIG),
        *EVAL,
        *extra,
        f"data.eval_prompts={prompts}",
        *(
            ["eval.num_prompts=48", "eval.images_per_group=0", "eval.images_per_prompt=2"]
            if prompts == OUT_OF_TEMPLATE
            else []
        ),
        "--out",
        str(target),
    ]
    if checkpoint is not None:
        cmd += ["--checkpoint", str(checkpoint)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads((target / "eval.json").read_text())


def curve(directory: Path, pace: float = 1.0) -> dict:
    """A run's eval curve: at each eval, the training minutes spent so far (this process's CPU time in training
    epochs, evals excluded: `time/train_process_minutes`, divided by the machine's `pace`), the headline accuracy,
    the colour TV, and each GenEval family's accuracy (`families`: {family: [accuracy at each eval]}, whose mean
    the headline is)."""
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines() if line.strip()]
    spent, out = 0.0, {"minutes": [], "accuracy": [], "tv": [], "epochs": [], "families": {}}
    for r in rows:
        spent = r.get("time/train_process_minutes", spent)  # the final eval's row follows the last epoch's
        if HEADLINE in r:
            for key, value in zip(out, (spent / pace, r[HEADLINE], r.get(TV), r["epoch"])):
                out[key].append(value)
            for key in sorted(k for k in r if k.startswith(FAMILY)):
                out["families"].setdefault(key[len(FAMILY) :], []).append(r[key])
    return out


def refresh_curve(result: dict, directory: Path) -> dict | None:
    """`result` with its curve read again from its run directory (`curve`: the per-family accuracies added to a
    result written before they were kept), or None when the directory is not there. The curve's other entries
    must be the ones the result holds: a directory of another run is refused."""
    if not (directory / "metrics.jsonl").exists():
        return None
    fresh = curve(directory, result.get("pace", 1.0))
    kept = {k: result["curve"][k] for k in ("minutes", "accuracy", "tv", "epochs")}
    if {k: fresh[k] for k in kept} != kept:
        raise SystemExit(
            f"{directory} holds another run than its result file's curve ({result['objective']}, "
            f"seed {result['seed']}): refresh from the race's own --out"
        )
    return {**result, "curve": fresh}


def minutes_to_gain(c: dict, gain: float) -> float | None:
    """The first eval's minutes at which accuracy is `gain` above the first eval's (None: never)."""
    start = c["accuracy"][0]
    return next((m for m, a in zip(c["minutes"], c["accuracy"]) if a - start >= gain), None)


def summarise(results: dict, test_base: float | None = None) -> list[str]:
    """The race's table: per objective, the final and the best eval's gain over the first (median and range over
    seeds), the minutes to +0.20 (median, a seed that never reached it counted as never, and each seed's in seed
    order, `-` for never), colour TV and out-of-template accuracy. `test_base`: the base model's test accuracy of a
    --split val race (its gains are on the validation split, and a last column gives the test split's gain of the
    final weights, read once)."""
    split = "test" if test_base is None else "val"
    lines = [
        f"| objective | seeds | gain on {split}, median (min - max) | best gain, median (min - max) | minutes to "
        "+0.20, median (each seed) | colour TV from base, median (max) | out-of-template before -> after, median |"
        + ("" if test_base is None else " test gain of the final weights, median (min - max) |"),
        "| --- | --- | --- | --- | --- | --- | --- |" + ("" if test_base is None else " --- |"),
    ]
    for objective, runs in results.items():
        gains = [r["curve"]["accuracy"][-1] - r["curve"]["accuracy"][0] for r in runs]
        best = [max(r["curve"]["accuracy"]) - r["curve"]["accuracy"][0] for r in runs]  # its best eval's
        reach = [minutes_to_gain(r["curve"], TARGET_GAIN) for r in runs]
        median_reach = statistics.median([math.inf if m is None else m for m in reach])  # a miss counts as never
        tvs = [r["curve"]["tv"][-1] for r in runs if r["curve"]["tv"][-1] is not None]
        before = [r["oot_before"] for r in runs]
        after = [r["oot_after"] for r in runs]
        lines.append(
            f"| {objective} | {len(runs)} | {statistics.median(gains):+.3f} ({min(gains):+.3f} - {max(gains):+.3f}) | "
            f"{statistics.median(best):+.3f} ({min(best):+.3f} - {max(best):+.3f}) | "
            + (f"{median_reach:.1f}" if median_reach < math.inf else f"> {runs[0]['minutes']:g}")
            + f" ({', '.join('-' if m is None else f'{m:.1f}' for m in reach)})"
            + " | "
            + (f"{statistics.median(tvs):.3f} ({max(tvs):.3f})" if tvs else "-")
            + f" | {statistics.median(before):.3f} -> {statistics.median(after):.3f} |"
        )
        if test_base is not None:
            tests = [r["test_after"] - test_base for r in runs]
            lines[-1] += f" {statistics.median(tests):+.3f} ({min(tests):+.3f} - {max(tests):+.3f}) |"
    return lines


def families_table(results: dict) -> list[str]:
    """Each GenEval family's accuracy, the median over an objective's seeds at the base model (its first eval) and
    at the end, for the objectives whose every run kept its families (`curve`): which families the gains come from
    and which none moves."""
    kept = {o: runs for o, runs in results.items() if all(r["curve"].get("families") for r in runs)}
    if not kept:
        return []
    names = sorted({f for runs in kept.values() for r in runs for f in r["curve"]["families"]})
    first = next(iter(kept.values()))
    base = [statistics.median(r["curve"]["families"][f][0] for r in first) for f in names]
    lines = [
        "Per family: strict accuracy, the median over seeds at the end (the base model's first).",
        "",
        "| objective | " + " | ".join(n.replace("_", " ") for n in names) + " |",
        "| --- |" + " --- |" * len(names),
        "| base | " + " | ".join(f"{b:.2f}" for b in base) + " |",
    ]
    for objective, runs in kept.items():
        finals = [statistics.median(r["curve"]["families"][f][-1] for r in runs) for f in names]
        lines.append(f"| {objective} ({len(runs)}) | " + " | ".join(f"{a:.2f}" for a in finals) + " |")
    return lines


def seeds_table(results: dict, test_base: float | None = None) -> list[str]:
    """Every run on its own line: the final and the best eval's gain over the first (with the training minutes of
    the best), the minutes to +0.20 (`-`: never), the colour TV and out-of-template accuracy at the end, and on a
    --split val race the test gain of the final weights: what the medians above are taken over."""
    split = "test" if test_base is None else "val"
    lines = [
        "Per seed: each run's figures (gains on " + split + "; `-`: did not reach +0.20 in the budget).",
        "",
        f"| objective | seed | gain on {split} | best gain (minute) | minutes to +0.20 | colour TV | out-of-template |"
        + ("" if test_base is None else " test gain |"),
        "| --- | --- | --- | --- | --- | --- | --- |" + ("" if test_base is None else " --- |"),
    ]
    for objective, runs in results.items():
        for r in sorted(runs, key=lambda r: r["seed"]):
            c = r["curve"]
            k = max(range(len(c["accuracy"])), key=lambda i: (c["accuracy"][i], -i))  # the first eval at the best
            reach = minutes_to_gain(c, TARGET_GAIN)
            tv = c["tv"][-1]
            lines.append(
                f"| {objective} | {r['seed']} | {c['accuracy'][-1] - c['accuracy'][0]:+.3f} | "
                f"{c['accuracy'][k] - c['accuracy'][0]:+.3f} ({c['minutes'][k]:.1f}) | "
                + ("-" if reach is None else f"{reach:.1f}")
                + " | "
                + ("-" if tv is None else f"{tv:.3f}")
                + f" | {r['oot_after']:.3f} |"
                + ("" if test_base is None else f" {r['test_after'] - test_base:+.3f} |")
            )
    paced = []
    for objective, runs in results.items():
        others = [r["curve"]["epochs"][-1] for r in runs if "pace" not in r]
        span = f"; at the reference pace {min(others)}-{max(others)}" if others else ""
        for r in (r for r in runs if "pace" in r):
            paced.append(f"{objective} {r['seed']} (pace {r['pace']:.2f}, {r['curve']['epochs'][-1]} epochs{span})")
    if paced:
        lines += [
            "",
            "Raced at another pace (`--pace`: the machine's CPU time per unit of work against the reference machines', "
            "measured on GRPO; budget and minutes in the reference machines' minutes): " + ", ".join(paced) + ".",
        ]
    return lines


#: the demo's targets of issue 39 (on the race's split and 10-step eval): the median gain, every seed's gain, every
#: seed's colour TV, within these training minutes
DEMO_TARGETS = {"median_gain": 0.30, "min_gain": 0.25, "max_tv": 0.10, "minutes": 10.0}
FRONTIER_MINUTES = (2.5, 5.0, 7.5, 10.0, 12.5, 15.0)


def at_minutes(c: dict, minutes: float) -> tuple[float, float]:
    """(gain over the first eval, colour TV) of a run stopped after `minutes` of training: its last eval at or
    before then (the first eval, gain 0, when none is)."""
    k = max([i for i, m in enumerate(c["minutes"]) if m <= minutes + 1e-9] or [0])
    return c["accuracy"][k] - c["accuracy"][0], c["tv"][k] or 0.0


def settings_at(results: dict, grid=FRONTIER_MINUTES) -> list[dict]:
    """Every (objective, training minutes) of the race as a setting: each run stopped at that many minutes (its
    checkpoint of the last eval by then), with the median and the worst seed's gain and the largest colour TV."""
    out = []
    for objective, runs in results.items():
        for minutes in grid:
            points = [at_minutes(r["curve"], minutes) for r in runs]
            gains = [g for g, _ in points]
            out.append(
                {
                    "objective": objective,
                    "minutes": minutes,
                    "seeds": len(runs),
                    "median_gain": statistics.median(gains),
                    "min_gain": min(gains),
                    "max_tv": max(tv for _, tv in points),
                }
            )
    return out


def pareto(settings: list[dict]) -> list[dict]:
    """The settings no other beats on all of: a higher worst-seed gain, a lower largest TV, fewer minutes (at
    least as good on each, better on one); sorted by minutes, then gain."""

    def beats(a: dict, b: dict) -> bool:
        no_worse = a["min_gain"] >= b["min_gain"] and a["max_tv"] <= b["max_tv"] and a["minutes"] <= b["minutes"]
        return no_worse and (a["min_gain"], -a["max_tv"], -a["minutes"]) != (b["min_gain"], -b["max_tv"], -b["minutes"])

    front = [s for s in settings if not any(beats(o, s) for o in settings)]
    return sorted(front, key=lambda s: (s["minutes"], -s["min_gain"]))


def frontier(results: dict, split: str) -> list[str]:
    """The race read as the demo's choice (issue 39): the Pareto frontier of worst-seed gain, largest colour TV and
    training minutes over every (objective, minutes) setting, which settings meet the demo's targets, and the
    best worst-seed gain within the targets' colour TV and minutes."""
    t = DEMO_TARGETS
    settings = settings_at(results)
    lines = [
        f"Frontier: each objective's runs stopped after a number of training minutes (the last eval by then); gains "
        f"on {split}. A setting is listed unless another has a higher worst-seed gain, a lower largest TV and no "
        "more minutes.",
        "",
        "| objective | minutes | seeds | gain, median | gain, worst seed | colour TV, largest |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in pareto(settings):
        lines.append(
            f"| {s['objective']} | {s['minutes']:g} | {s['seeds']} | {s['median_gain']:+.3f} | {s['min_gain']:+.3f} "
            f"| {s['max_tv']:.3f} |"
        )
    meets = [
        s
        for s in settings
        if s["median_gain"] >= t["median_gain"]
        and s["min_gain"] >= t["min_gain"]
        and s["max_tv"] <= t["max_tv"]
        and s["minutes"] <= t["minutes"]
    ]
    within = [s for s in settings if s["max_tv"] <= t["max_tv"] and s["minutes"] <= t["minutes"]]
    lines.append("")
    target = (
        f"median gain >= +{t['median_gain']:.2f}, every seed >= +{t['min_gain']:.2f}, colour TV <= {t['max_tv']:.2f} "
        f"on each, within {t['minutes']:g} minutes"
    )
    if meets:
        names = ", ".join(f"{s['objective']} at {s['minutes']:g} min" for s in meets)
        lines.append(f"The demo's targets ({target}) are met by: {names}.")
    else:
        lines.append(f"No setting meets the demo's targets ({target}).")
    if within:
        best = max(within, key=lambda s: (s["min_gain"], s["median_gain"]))
        lines.append(
            f"Within their colour TV and minutes, the best worst-seed gain is {best['min_gain']:+.3f} (median "
            f"{best['median_gain']:+.3f}): {best['objective']} at {best['minutes']:g} min, over {best['seeds']} "
            f"seed{'s' if best['seeds'] != 1 else ''}."
        )
    return lines


def plot(results: dict, path: Path, split: str = "test") -> None:
    """Two panels against training minutes, per objective: accuracy on the curves' split (`split`: "test", or "val"
    for a --split val race) and the colour TV from the base model; each the median over seeds, with the band from
    the lowest seed to the highest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (acc, tv) = plt.subplots(1, 2, figsize=(12, 4.5))
    for objective, runs in results.items():
        grid = np.linspace(0, max(max(r["curve"]["minutes"]) for r in runs), 50)
        for ax, key in ((acc, "accuracy"), (tv, "tv")):
            ys = np.stack([np.interp(grid, r["curve"]["minutes"], [v or 0.0 for v in r["curve"][key]]) for r in runs])
            (line,) = ax.plot(grid, np.median(ys, 0), label=f"{objective} (median of {len(runs)})")
            ax.fill_between(grid, ys.min(0), ys.max(0), alpha=0.2, color=line.get_color())
    for ax in (acc, tv):
        ax.set_xlabel("training minutes (CPU time of one run at 1 torch thread, evals excluded)")
        ax.legend()
    name = {"test": "test", "val": "validation"}[split]
    acc.set_ylabel(f"{name} strict accuracy (family mean)")
    acc.set_title(f"accuracy on the {name} split")
    tv.set_ylabel("total variation from the base model")
    tv.set_title("colour drift on free-colour objects")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVE_SETTINGS), choices=list(OBJECTIVE_SETTINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--minutes", type=float, default=15.0, help="training CPU minutes of each run")
    parser.add_argument("--eval-every", type=int, default=5, help="epochs between evals on the test split")
    parser.add_argument("--jobs", type=int, default=2, help="training runs at once")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "race", help="run directories, table, plot")
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="one small JSON per finished (objective, seed): commit them, the race resumes from them (default "
        "samples/shapes/race/runs, with --split val samples/shapes/race/val-runs)",
    )
    parser.add_argument(
        "--split",
        choices=["test", "val"],
        default="test",
        help="the curves' split: test (the race as it was), or val (train less the validation split, curves on it, "
        "the test split read once on the final weights)",
    )
    parser.add_argument(
        "--report", action="store_true", help="train nothing: the table and plot of the runs that have result files"
    )
    parser.add_argument(
        "--refresh-curves",
        action="store_true",
        help="with --report: read the curves of the result files again from their run directories in --out (the "
        "per-family accuracies of results written before they were kept), then report",
    )
    parser.add_argument(
        "--pace",
        type=float,
        default=1.0,
        help="this machine's CPU time per unit of the race's work against the reference machines' (--calibrate-pace "
        "measures it): each new run trains --minutes x pace CPU-minutes, its curve's minutes divided by the pace",
    )
    parser.add_argument(
        "--calibrate-pace",
        action="store_true",
        help="train nothing of the race: measure --pace on this machine (the committed GRPO runs' first eval "
        "interval trained again) and print it",
    )
    parser.add_argument("extra", nargs="*", metavar="key=value", help="overrides for every run")
    args = parser.parse_args(argv)
    if args.results is None:
        args.results = ROOT / "samples" / "shapes" / "race" / ("val-runs" if args.split == "val" else "runs")
    if not (args.pace > 0 and math.isfinite(args.pace)):
        raise SystemExit(f"--pace must be a positive number (1: the reference machines' pace), got {args.pace}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.results.mkdir(parents=True, exist_ok=True)
    if args.calibrate_pace:
        calibrate_pace(args)
        return 0
    work = [(o, s) for s in args.seeds for o in args.objectives]  # seed by seed: a partial race covers every objective
    if args.report:  # the finished runs only: nothing trains
        work = [(o, s) for o, s in work if (args.results / f"{o}-seed{s}.json").exists()]
        if not work:
            raise SystemExit(f"--report: no result file in {args.results} for these objectives and seeds")
    if args.refresh_curves:
        if not args.report:
            raise SystemExit("--refresh-curves goes with --report (a race writes its curves whole)")
        for o, seed in work:
            path = args.results / f"{o}-seed{seed}.json"
            fresh = refresh_curve(json.loads(path.read_text()), run_dir(args.out, o, seed))
            if fresh is not None:
                write_json(path, fresh)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(lambda w: race_run(args.out, args.results, w[0], w[1], args), work))
    if not args.report:  # the report is of the whole race: the other objectives' and seeds' result files too
        done = {(r["objective"], r["seed"]) for r in runs}
        for path in sorted(args.results.glob("*-seed*.json")):
            r = json.loads(path.read_text())
            if r.get("objective") in OBJECTIVE_SETTINGS and (r["objective"], r["seed"]) not in done:
                runs.append(r)
        order = list(OBJECTIVE_SETTINGS)
        runs.sort(key=lambda r: (order.index(r["objective"]), r["seed"]))
    base_file = args.results / "oot-base.json"
    if not base_file.exists():
        base_file.write_text(json.dumps(evaluate(args.out, None, "oot-base", args.extra), indent=1))
    base = json.loads(base_file.read_text())[HEADLINE]
    test_base = None
    if args.split == "val":
        test_file = args.results / "test-base.json"
        if not test_file.exists():
            test_file.write_text(json.dumps(evaluate(args.out, None, "test-base", args.extra, prompts=TEST), indent=1))
        test_base = json.loads(test_file.read_text())[HEADLINE]
    results: dict[str, list[dict]] = {}
    for run in runs:
        results.setdefault(run["objective"], []).append({**run, "oot_before": base})
    report = args.results.parent
    stem = "race-val" if args.split == "val" else "race"  # a validation race does not overwrite the test race's
    (report / f"{stem}.json").write_text(json.dumps(results, indent=1))
    table = summarise(results, test_base) + ["", *frontier(results, "test" if test_base is None else "val")]
    families = families_table(results)
    table += ["", *families] if families else []
    table += ["", *seeds_table(results, test_base)]
    (report / f"{stem}.md").write_text("\n".join(table) + "\n")
    plot(results, report / f"{stem}.png", args.split)
    print("\n".join(table))
    return 0


def _last_ckpt(directory: Path) -> int:
    numbers = [int(p.name.split("-")[1]) for p in directory.glob("ckpt-*") if p.is_dir()]
    if not numbers:
        raise SystemExit(f"{directory} has no checkpoint (see its train.log)")
    return max(numbers)


if __name__ == "__main__":
    sys.exit(main())
