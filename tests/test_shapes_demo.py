"""A 1-epoch smoke run of the embedded default's preset on the shipped tiny SD3."""

import json
import math
from pathlib import Path

import pytest

from flowrl.config import load_config
from flowrl.objectives import OBJECTIVES
from flowrl.train import Trainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / "samples/shapes/model/model_index.json").exists(), reason="model not built")
@pytest.mark.parametrize("preset", ["shapes", "shapes_grpo"])
def test_shapes_preset_one_epoch(preset, tmp_path, monkeypatch):
    """The demo's preset (online Diffusion-DPO) and the GRPO one, the race's base config."""
    monkeypatch.chdir(ROOT)  # the preset's paths are relative to the repository
    cfg = load_config(
        ROOT / "configs" / f"{preset}.yaml",
        [
            f"log.run_dir={tmp_path}",
            f"eval.base_cache={tmp_path / 'base-evals'}",  # not the repository's (the demo's shipped one)
            "train.epochs=1",
            "sample.prompts_per_epoch=2",
            "eval.num_prompts=3",
            "eval.images_per_group=2",
            "eval.num_steps=4",
            "log.progress=false",
        ],
    )
    tr = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in tr.named_params.items()}
    evaluated = []
    evaluate_prompts = tr.policy.evaluate_prompts

    def spy(prompts, meta, fns, eval_cfg, part=None, **kwargs):
        evaluated.append((list(prompts[part or slice(None)]), eval_cfg.images_per_prompt))
        return evaluate_prompts(prompts, meta, fns, eval_cfg, part=part, **kwargs)

    tr.policy.evaluate_prompts = spy
    tr.fit()
    # the first 3 test prompts: one single-object prompt, two two-object ones; 2 images per family
    p0, p1, p2 = tr.eval_set.prompts[:3]
    assert evaluated == [([p0, p0, p1, p2], 1)] * 2  # before and after
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    epoch = next(r for r in rows if "policy/loss" in r)
    assert cfg.train.objective == {"shapes": "dpo", "shapes_grpo": "grpo"}[preset]
    if preset == "shapes_grpo":  # on-policy: the first minibatch's ratio is 1
        assert epoch["policy/ratio_first_dev"] <= 1e-4
    else:  # matched pairs: min(correct, incorrect) per group of 8 (2 prompts: at most 8), all 10 steps, twice
        assert cfg.train.dpo.pairing == "matched" and cfg.sample.group_size == 8
        assert epoch["objective/dpo_pairs"] in range(9) and "policy/ratio_first_dev" not in epoch
        assert cfg.train.inner_epochs == 2
        if epoch["objective/dpo_pairs"]:
            # pairs x steps x passes, the step at pure noise (weight 0) not computed
            assert epoch["policy/trained_units"] == 9 * 2 * epoch["objective/dpo_pairs"]
    assert 0.0 <= epoch["reward/shapes_geneval/strict_mean"] <= 1.0
    assert all(math.isfinite(v) for v in epoch.values() if isinstance(v, float))
    assert any("eval/shapes_geneval/strict_mean" in r for r in rows)
    # the preset breaks eval down by GenEval family and logs their mean (GenEval's overall)
    assert any("eval/shapes_geneval/strict_family_mean" in r for r in rows)
    assert (tmp_path / "eval-epoch000000.png").exists() and (tmp_path / "eval-final.png").exists()
    # the diversity metric: the colours of objects the prompts left uncoloured, against the first eval's
    evals = [r for r in rows if "eval/diversity/shapes_geneval/color_entropy_bits" in r]
    assert len(evals) == 2 and evals[0]["eval/diversity/shapes_geneval/color_tv_from_base"] == 0.0
    assert 0.0 <= evals[1]["eval/diversity/shapes_geneval/color_tv_from_base"] <= 1.0
    assert (tmp_path / "eval-base-distribution.json").exists()
    ref = "eval/diversity/shapes_geneval/color_tv_from_reference"  # eval.free_reference: the world's uniform colours
    if preset == "shapes":
        assert cfg.eval.free_reference == "uniform"
        # the base's, by hand from its counts (every palette colour at 1/4); the trained model's in range
        counts = json.loads((tmp_path / "eval-base-distribution.json").read_text())["histograms"]
        counts = counts["shapes_geneval/color"]
        total = sum(counts.values())
        assert len(counts) == 4 and evals[0][ref] == pytest.approx(
            0.5 * sum(abs(c / total - 0.25) for c in counts.values()), abs=1e-9
        )
        assert 0.0 <= evals[1][ref] <= 0.75
    else:
        assert all(ref not in r for r in rows)
    # `flowrl train` itself draws the figures the issue asks of the demo, not only `flowrl demo`
    assert (tmp_path / "before_after.png").stat().st_size > 0 and (tmp_path / "curves.png").stat().st_size > 0
    if epoch["adv/abs_max"] > 0:  # a group with different rewards moved the LoRA
        assert any((p.detach() - before[n]).abs().max() > 0 for n, p in tr.named_params.items())


def test_the_demo_is_the_measured_dpo_setting():
    """configs/shapes.yaml (the demo) is the race's DPO (configs/shapes_grpo.yaml with the race's DPO overrides)
    with the settings the demo's seeds were measured with (docs/demo_eval.md): every step of the schedule trained,
    matched pairs, the rollout in bfloat16, lr 1e-3 with Adam's beta2 0.95, 44 epochs of two update passes (the
    reference kept between them, a pair's ten times in one forward), the eval on an EMA of decay 0.97. Only keys
    DPO does not read (GRPO's section: the race's base config is the GRPO preset) may differ."""

    from repo_files import load_module

    from flowrl.config import to_dict, without_other_objectives
    from flowrl.run.rundir import _flatten

    race = load_module("scripts/race_objectives.py", "race")
    assert race.CONFIG == ROOT / "configs" / "shapes_grpo.yaml"

    demo = load_config(ROOT / "configs" / "shapes.yaml")
    measured = load_config(
        race.CONFIG,
        [
            *race.OBJECTIVE_SETTINGS["dpo"],
            "train.dpo.timesteps=0",
            "train.dpo.pairing=matched",
            "rollout.acceleration=[autocast]",
            "train.lr=1e-3",
            "train.adam_betas=[0.9,0.95]",
            "train.epochs=44",
            "train.inner_epochs=2",
            "train.cache_reference=true",  # the same math, the second pass's reference read from the first
            "train.steps_per_forward=10",  # the same math in fewer, larger forward passes
            "train.ema_decay=0.97",
            "log.run_dir=runs/shapes_dpo",
            "eval.base_cache=samples/shapes/base-evals",  # where the base model's eval is read from: no training key
            # the eval, not the training: 4x the race's images per family (a quarter of them in the grids), and the
            # free colours' distance from the world's uniform draw
            "eval.images_per_group=192",
            "eval.grid_images=288",
            "eval.free_reference=uniform",
        ],
    )
    assert demo.train.objective == measured.train.objective == "dpo"
    assert measured.train.grpo.window.kind == "fixed"  # GRPO's window in the race's base, ignored by DPO
    demo, measured = (_flatten(without_other_objectives(to_dict(c), "dpo")) for c in (demo, measured))
    assert demo.keys() == measured.keys() and "train.dpo.beta" in demo and "train.grpo.beta" not in demo
    assert {k for k in demo if demo[k] != measured[k]} == set()


@pytest.mark.skipif(not (ROOT / "samples/shapes/model/model_index.json").exists(), reason="model not built")
def test_the_demo_from_another_folder_reads_the_checkouts_files(tmp_path, monkeypatch, capsys):
    """`flowrl demo` run outside the checkout trains the shipped model (not the toy, which it said was not built),
    its relative paths read from the checkout; without an eval before training it says so, not `before X -> after
    X`."""
    from flowrl.cli import main

    monkeypatch.chdir(tmp_path)
    tiny = ["train.epochs=1", "sample.prompts_per_epoch=2", "eval.before=false", "eval.num_prompts=2"]
    tiny += ["eval.images_per_group=0", "eval.group_by=null", "eval.num_steps=2", "eval.base_cache="]
    assert main(["demo", *tiny, f"log.run_dir={tmp_path / 'run'}", "log.progress=false"]) == 0
    out = capsys.readouterr().out
    assert f"+ LoRA on {ROOT / 'samples' / 'shapes' / 'model'}, trained on" in out and "tabular" not in out
    assert "eval/shapes_geneval/strict_mean: after " in out and "(no eval before training: eval.before=false)" in out
    assert " -> after" not in out  # nothing compared with itself
    assert (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "runs").exists()


@pytest.mark.skipif(not (ROOT / "samples/shapes/model/model_index.json").exists(), reason="model not built")
def test_demo_command_reports_and_writes_figures(tmp_path, monkeypatch, capsys):
    """`flowrl demo` (what `make demo` runs), shrunk to 1 epoch: the before/after grid, the curves and the summary."""
    from flowrl.cli import main

    monkeypatch.chdir(ROOT)
    overrides = ["sample.prompts_per_epoch=2", "eval.num_prompts=2", "eval.images_per_prompt=2", "eval.num_steps=4"]
    overrides.append(f"eval.base_cache={tmp_path / 'base-evals'}")  # not the repository's shipped one
    # no CONFIG: the demo's own (its first key=value is an override, not a config path)
    main(["demo", f"log.run_dir={tmp_path}", "train.epochs=1", "log.progress=false", *overrides])
    out = capsys.readouterr().out
    assert "eval/shapes_geneval/strict_family_mean: before" in out  # the headline, GenEval's overall
    assert "eval/shapes_geneval/strict_mean: before" in out
    import torch

    threads = torch.get_num_threads()
    assert "wall-clock " in out and f" s) at {threads} torch thread{'s' * (threads != 1)}\n" in out
    assert "time: rollouts " in out and " s (1 epoch); evals " in out and " s (2)" in out  # the base's and the final
    assert "eval/diversity/shapes_geneval/color_tv_from_base: " in out and "(0 = the base model's)" in out
    assert "eval/diversity/shapes_geneval/color_tv_from_reference: before " in out  # the world's colours
    assert "trained on 1 x shapes_geneval," in out  # the banner names what the preset trains on, with weights
    objective = OBJECTIVES.get(load_config(ROOT / "configs" / "shapes.yaml").train.objective).title
    assert f"flowrl demo: {objective} + LoRA on samples/shapes/model" in out  # and with which objective
    assert (tmp_path / "before_after.png").stat().st_size > 0 and (tmp_path / "curves.png").stat().st_size > 0
    # the demo's before and after are what `flowrl eval` measures: the base model, then the run's checkpoint
    # (its EMA weights), the same images and the same scores
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    key = "eval/shapes_geneval/strict_family_mean"
    first, last = [r for r in rows if key in r][0], [r for r in rows if key in r][-1]
    ckpt = sorted(tmp_path.glob("ckpt-*"))[-1]
    for checkpoint, logged, grid in ((None, first, "eval-epoch000000.png"), (ckpt, last, "eval-final.png")):
        out = tmp_path / ("eval-" + (checkpoint.name if checkpoint else "base"))
        main(
            ["eval", "configs/shapes.yaml", *overrides, "--out", str(out)]
            + (["--checkpoint", str(checkpoint)] if checkpoint else [])
        )
        result = json.loads((out / "eval.json").read_text())
        assert result[key] == pytest.approx(logged[key], abs=1e-9)
        assert result["eval/shapes_geneval/fraction_mean"] == pytest.approx(
            logged["eval/shapes_geneval/fraction_mean"], abs=1e-6
        )
        assert _pixels(out / "eval.png") == _pixels(tmp_path / grid)
        # the colour drift too: the checkpoint's eval compares with its run's base histogram, as training did
        tv = "eval/diversity/shapes_geneval/color_tv_from_base"
        assert result[tv] == pytest.approx(logged[tv], abs=1e-9)
        assert result.get("base") == (str(tmp_path) if checkpoint else None)
    # resumed with other eval settings, the run's evals no longer pair with its base's images: no TV, and a warning
    with pytest.warns(UserWarning, match=r"other settings \(eval.num_steps: 4 \(base\) vs 3\)"):
        main(
            [
                "train",
                "configs/shapes.yaml",
                f"log.run_dir={tmp_path}",
                "train.epochs=2",
                "log.progress=false",
                *overrides,
                "eval.num_steps=3",
            ]
        )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in rows if key in r][-1]
    assert resumed["epoch"] == 2 and "eval/diversity/shapes_geneval/color_entropy_bits" in resumed
    assert "eval/diversity/shapes_geneval/color_tv_from_base" not in resumed


@pytest.mark.skipif(not (ROOT / "samples/shapes/model/model_index.json").exists(), reason="model not built")
def test_the_demo_ships_its_base_models_eval(tmp_path, monkeypatch):
    """samples/shapes/base-evals holds the eval before training of configs/shapes.yaml at 2 threads on a CPU with
    this code, one entry per CPU kind it was sampled on (a CPU's instruction set picks the kernels, so their last
    bits): so the demo reads it there. A change to the code that samples or scores, the model, the eval settings or
    the rewards fails here until the entries are made again (the message says how)."""
    import torch

    from flowrl.eval.base_cache import BaseEvalCache, fingerprint_of_run

    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "configs" / "shapes.yaml", [f"log.run_dir={tmp_path}"])
    shipped = ROOT / cfg.eval.base_cache
    entries = [p for p in shipped.iterdir() if not p.name.startswith(".")]
    again = (
        f"make them again: rm -r {cfg.eval.base_cache} && OMP_NUM_THREADS=2 flowrl eval configs/shapes.yaml "
        f"(on a CPU, 2 torch threads; on each kind of CPU that had an entry)"
    )
    assert entries, f"{shipped} holds no entry: {again}"
    tr = Trainer(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fp = fingerprint_of_run(cfg, tr.evaluator, tr.policy, tr.scorer.fns, "cpu")
    finally:
        torch.set_num_threads(threads)
    records = [json.loads((e / "record.json").read_text())["fingerprint"] for e in entries]
    # another torch or diffusers (a user's own), or another CPU, makes the demo sample its base eval, rightly: not a
    # stale entry
    machine = ("versions", "hardware")
    for entry, record in zip(entries, records):
        stale = sorted(k for k in fp.keys() | record.keys() if k not in machine and fp.get(k) != record.get(k))
        assert not stale, f"the demo's shipped base eval {entry.name} differs from this code's in {stale}: {again}"
    kinds = [record["hardware"] for record in records]
    assert len(set(kinds)) == len(kinds), f"two entries for one CPU kind: {kinds}"
    if any(all(record[k] == fp[k] for k in machine) for record in records):
        assert BaseEvalCache(shipped).load(fp) is not None


def _pixels(path):
    from PIL import Image

    with Image.open(path) as im:
        return im.convert("RGB").tobytes()


def test_describe_rewards_names_weights_and_report_only_rewards():
    from flowrl.config import RewardSpec
    from flowrl.worlds.demo import describe_rewards

    assert describe_rewards([RewardSpec("shapes_geneval")]) == "1 x shapes_geneval"
    assert describe_rewards(
        [RewardSpec("shapes_geneval", 0.0), RewardSpec("shapes_soft"), RewardSpec("pickscore", 0.5)]
    ) == ("1 x shapes_soft + 0.5 x pickscore (reported only, weight 0: shapes_geneval)")
    assert describe_rewards([RewardSpec("a", 0.0)]).startswith("no reward")


def test_time_split_sums_each_phase_over_the_epochs_and_the_evals():
    """The demo's time split: each phase summed over the epoch rows, the evals over theirs (hand sums)."""
    from flowrl.worlds.demo import time_split

    rows = [
        {"epoch": 0, "time/eval": 40.2},
        {"epoch": 1, "time/rollout": 3.1, "time/reward": 0.2, "time/advantage": 0.01, "time/train": 1.5},
        {"epoch": 2, "time/rollout": 2.6, "time/reward": 0.2, "time/train": 1.2},
        {"epoch": 2, "time/eval": 41.1, "final": True},
    ]
    assert time_split(rows) == "time: rollouts 6 s, rewards 0 s, updates 3 s (2 epochs); evals 81 s (2)"
    waited = [{"time/rollout": 0.5, "time/rollout_wait": 0.5, "time/reward": 0.1, "time/train": 4.0}]
    assert time_split(waited) == (
        "time: waiting for the rollout worker 0 s, rewards 0 s, updates 4 s (1 epoch); evals 0 s (0)"
    )
    read = [{"epoch": 0, "time/eval_read": 0.04}, *rows[1:]]  # the eval before training read from eval.base_cache
    assert time_split(read) == (
        "time: rollouts 6 s, rewards 0 s, updates 3 s (2 epochs); evals 41 s (1), the base model's read from "
        "eval.base_cache in 0.0 s"
    )
