"""eval.base_cache: the eval before training read from a cache of base-model evals instead of sampled, exactly as
sampling it would have been, and only for a run whose fingerprint (model files, eval settings, rewards, code) is
the entry's."""

import json
import shutil

import torch
from imagetiny import TINY_RUN

from flowrl.config import load_config
from flowrl.eval.base_cache import BaseEvalCache, key_of, tree_digest
from flowrl.train import Trainer

torch.set_num_threads(1)

TINY = [
    *TINY_RUN,
    "eval.num_steps=3",
    "eval.num_prompts=2",
    "eval.images_per_prompt=2",
    "train.lr=3e-3",
    "train.epochs=1",
]


def run(run_dir, *extra):
    trainer = Trainer(load_config(None, [*TINY, f"log.run_dir={run_dir}", *extra]))
    trainer.fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [
        {k: v for k, v in r.items() if k.startswith("eval/")} for r in rows if "time/eval" in r or "time/eval_read" in r
    ]
    weights = {n: p.detach().clone() for n, p in trainer.named_params.items()}
    return evals, weights


def test_a_cached_base_eval_is_the_sampled_one_and_changes_nothing_else(tmp_path, capsys):
    cache = tmp_path / "cache"
    first_evals, first_weights = run(tmp_path / "a", f"eval.base_cache={cache}")
    entries = list(cache.iterdir())
    assert len(entries) == 1 and "read from" not in capsys.readouterr().out
    record = json.loads((entries[0] / "record.json").read_text())
    assert {k: v for k, v in record["metrics"].items() if k.startswith("eval/")} == first_evals[0]
    assert "eval-epoch000000.png" in record["files"] and record["fingerprint"]["model"] == "tiny tiny-sd3"

    second_evals, second_weights = run(tmp_path / "b", f"eval.base_cache={cache}")
    assert f"read from {entries[0]}" in capsys.readouterr().out
    assert second_evals[0] == first_evals[0]  # the eval before training, read
    assert (tmp_path / "b" / "eval-epoch000000.png").read_bytes() == (
        tmp_path / "a" / "eval-epoch000000.png"
    ).read_bytes()
    # not sampling it changes no training step: the same weights, the same eval after training
    assert all(torch.equal(first_weights[n], second_weights[n]) for n in first_weights)
    assert second_evals[-1] == first_evals[-1]
    assert (tmp_path / "b" / "before_after.png").exists() or not (tmp_path / "a" / "before_after.png").exists()

    # another eval seed is another base eval: sampled, and a second entry
    third_evals, _ = run(tmp_path / "c", f"eval.base_cache={cache}", "eval.seed=7")
    assert "read from" not in capsys.readouterr().out and len(list(cache.iterdir())) == 2
    assert third_evals[0] != first_evals[0]


def test_an_entry_that_is_not_this_runs_is_not_read(tmp_path, capsys):
    cache = tmp_path / "cache"
    run(tmp_path / "a", f"eval.base_cache={cache}")
    (entry,) = cache.iterdir()
    record = json.loads((entry / "record.json").read_text())
    record["fingerprint"]["eval settings"]["eval.seed"] = 99  # a key collision with another fingerprint
    (entry / "record.json").write_text(json.dumps(record))
    run(tmp_path / "b", f"eval.base_cache={cache}")
    assert "read from" not in capsys.readouterr().out  # sampled again, and the entry is this run's again
    assert json.loads((entry / "record.json").read_text())["fingerprint"]["eval settings"]["eval.seed"] == 1234
    (entry / "record.json").write_text("{not json")
    run(tmp_path / "c", f"eval.base_cache={cache}")
    assert "read from" not in capsys.readouterr().out


def test_the_model_digest_follows_contents_not_names_or_dates(tmp_path):
    model = tmp_path / "model"
    (model / "transformer").mkdir(parents=True)
    (model / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    (model / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"\x00" * 1000)
    (model / ".cache").mkdir()
    (model / ".cache" / "lock").write_text("x")
    digest = tree_digest(model)
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)  # new dates; hidden files differ
    (copy / ".cache" / "lock").write_text("y")
    assert tree_digest(copy) == digest
    weights = copy / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"\x00" * 999 + b"\x01")  # one byte of the weights
    assert tree_digest(copy) != digest
    weights.write_bytes(b"\x00" * 1000)
    (copy / "transformer" / "diffusion_pytorch_model.safetensors").rename(copy / "transformer" / "other.safetensors")
    assert tree_digest(copy) != digest  # a file's name is part of the model


def test_a_store_is_whole_or_absent_and_keeps_an_existing_entry(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "eval-epoch000000.png").write_bytes(b"grid")
    (run_dir / "eval-epoch000006.png").write_bytes(b"later")
    cache = BaseEvalCache(tmp_path / "cache")
    fp = {"model": "tiny tiny-sd3", "eval settings": {"eval.seed": 1}}
    entry = cache.store(fp, {"eval/x": 0.5, "time/eval": 3.0}, run_dir, "epoch000000", 3.0)
    assert entry.name == key_of(fp) and sorted(p.name for p in entry.iterdir()) == [
        "eval-epoch000000.png",
        "record.json",
    ]
    assert cache.load(fp)["metrics"] == {"eval/x": 0.5}  # the time is the run's, not the eval's
    cache.store(fp, {"eval/x": 0.9}, run_dir, "epoch000000", 1.0)
    assert cache.load(fp)["metrics"] == {"eval/x": 0.5}
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]
    target = tmp_path / "target"
    target.mkdir()
    assert cache.restore(fp, target)["metrics"] == {"eval/x": 0.5}
    assert (target / "eval-epoch000000.png").read_bytes() == b"grid"
    assert cache.restore({**fp, "model": "tiny tiny-flux"}, target) is None


def test_flowrl_eval_of_the_base_model_makes_the_entry_a_run_reads(tmp_path, capsys):
    """`flowrl eval CONFIG` (no checkpoint) with eval.base_cache adds the entry; a training run then reads its eval
    before training from it, the same numbers a run that sampled it logged."""
    from flowrl.cli import main

    cache = tmp_path / "cache"
    assert main(["eval", *TINY, f"eval.base_cache={cache}", "--out", str(tmp_path / "ev")]) == 0
    assert "the base model's eval is in eval.base_cache" in capsys.readouterr().err
    (entry,) = cache.iterdir()
    # the grid as a run's eval before training names it, and the base's metrics (the JPEG reward counts no free
    # attribute: no histogram)
    assert json.loads((entry / "record.json").read_text())["files"] == [
        "eval-epoch000000.png",
        "eval-base-metrics.json",
    ]
    read_evals, read_weights = run(tmp_path / "a", f"eval.base_cache={cache}")
    assert f"read from {entry}" in capsys.readouterr().out
    sampled_evals, sampled_weights = run(tmp_path / "b")
    assert read_evals[0] == sampled_evals[0]
    assert all(torch.equal(read_weights[n], sampled_weights[n]) for n in read_weights)
    # a checkpoint's eval is not the base model's: nothing added
    ckpt = sorted((tmp_path / "a").glob("ckpt-*"))[-1]
    main(["eval", *TINY, f"eval.base_cache={cache}", "--checkpoint", str(ckpt)])
    assert len(list(cache.iterdir())) == 1


def test_a_text_runs_base_eval_is_read_too(tiny_lm, tmp_path, capsys):
    """The text backend's eval before training (completions, accuracy) is read like an image run's: the same
    metrics, its completions file, the same weights after an epoch; the model is named by its files' digest."""
    from test_trainer_text import text_cfg

    def text_run(run_dir):
        trainer = Trainer(text_cfg(tiny_lm, run_dir, "train.epochs=1", f"eval.base_cache={tmp_path / 'cache'}"))
        trainer.fit()
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        first = {k: v for k, v in rows[0].items() if k.startswith("eval/")}
        return first, {n: p.detach().clone() for n, p in trainer.named_params.items()}

    sampled, sampled_weights = text_run(tmp_path / "a")
    (entry,) = (tmp_path / "cache").iterdir()
    record = json.loads((entry / "record.json").read_text())
    assert record["fingerprint"]["model"] == f"local sha256 {tree_digest(tiny_lm)}"
    assert sampled and record["files"] and all((tmp_path / "a" / f).exists() for f in record["files"])
    read, read_weights = text_run(tmp_path / "b")
    assert f"read from {entry}" in capsys.readouterr().out
    assert read == sampled and all(torch.equal(read_weights[n], sampled_weights[n]) for n in read_weights)


def test_two_processes_read_the_entry_two_processes_made(tmp_path):
    """Over 2 processes (gloo), the main process reads the entry and every process makes its share's encodings:
    the run trains as the one that sampled its eval before training (both ranks' weights equal, and equal to that
    run's). The entry names 2 processes: a 1-process run does not read it (its eval's calls differ)."""
    import os
    import subprocess
    from pathlib import Path

    from launching import accelerate_launch
    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    config = Path(__file__).resolve().parents[1] / "configs" / "accelerate" / "cpu_2proc.yaml"
    cache = tmp_path / "cache"

    def launch(run_dir):
        cmd = [*accelerate_launch(), "--config_file", str(config), "-m", "flowrl", "train", *TINY]
        cmd += ["sample.prompts_per_epoch=3", "sample.group_size=2", "eval.num_prompts=3"]
        cmd += [f"eval.base_cache={cache}", f"log.run_dir={run_dir}"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r for r in rows if "dist/replica_max_abs_diff" in r][-1]["dist/replica_max_abs_diff"] == 0.0
        return proc.stdout, rows, load_file(str(run_dir / "ckpt-000001" / "trainable.safetensors"))

    out_a, rows_a, weights_a = launch(tmp_path / "a")
    (entry,) = cache.iterdir()
    assert "read from" not in out_a and json.loads((entry / "record.json").read_text())["fingerprint"]["processes"] == 2
    out_b, rows_b, weights_b = launch(tmp_path / "b")
    assert f"read from {entry}" in out_b
    first = [{k: v for k, v in r.items() if k.startswith("eval/")} for r in (rows_a[0], rows_b[0])]
    assert first[0] == first[1] and weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    _, _ = run(
        tmp_path / "c",
        f"eval.base_cache={cache}",
        "sample.prompts_per_epoch=3",
        "sample.group_size=2",
        "eval.num_prompts=3",
    )
    assert len(list(cache.iterdir())) == 2  # one process: another entry


def test_a_cache_that_cannot_be_written_or_read_costs_only_the_saving(tmp_path):
    """An unwritable cache directory (here a file where the directory should be: a warning) or an entry with a
    file missing or unreadable: the eval sampled, the run trained."""
    import pytest

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file")
    with pytest.warns(UserWarning, match="the eval was not kept"):
        evals, _ = run(tmp_path / "a", f"eval.base_cache={blocked}")
    assert len(evals) == 2
    cache = tmp_path / "cache"
    run(tmp_path / "b", f"eval.base_cache={cache}")
    (entry,) = cache.iterdir()
    (entry / "eval-epoch000000.png").unlink()  # an entry missing a file it lists is no entry
    evals, _ = run(tmp_path / "c", f"eval.base_cache={cache}")
    assert len(evals) == 2 and (tmp_path / "c" / "eval-epoch000000.png").exists()
    assert (entry / "eval-epoch000000.png").is_file()  # the damaged entry replaced by the sampled eval
    unreadable = tmp_path / "cache2"
    run(tmp_path / "d", f"eval.base_cache={unreadable}")
    (entry2,) = unreadable.iterdir()
    (entry2 / "eval-epoch000000.png").unlink()
    (entry2 / "eval-epoch000000.png").mkdir()  # listed, there, and not a file a copy can read
    evals, _ = run(tmp_path / "e", f"eval.base_cache={unreadable}")
    assert len(evals) == 2


def test_the_code_digest_follows_a_wrapped_reward_to_its_scorer():
    """The registry's wrapper (NamedReward) only calls the reward: the digest takes the wrapped reward's module and
    the scorer it imports when it first scores (its code_modules), so a change to the detector makes the cached
    base eval stale."""
    import rewards
    from flowrl.eval.base_cache import _reward_modules, _source_files

    fn = rewards.build("shapes_geneval", {"score": "strict"}, "image")
    assert sorted(_reward_modules(fn)) == [
        "flowrl.worlds.shapes.detect",
        "flowrl.worlds.shapes.render",
        "rewards.registry",
        "rewards.shapes_geneval",
    ]
    files = {(f.parent.name, f.name) for f in _source_files([], [fn])}
    assert {("rewards", "shapes_geneval.py"), ("shapes", "detect.py"), ("shapes", "render.py")} <= files
    plain = {(f.parent.name, f.name) for f in _source_files([], [])}
    assert ("shapes", "detect.py") not in plain  # the sampler and the eval alone do not name it
