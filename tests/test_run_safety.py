"""Nothing lost, nothing poisoned: run directories are not mixed, non-finite numbers never reach the weights or a
checkpoint, interrupts and broken checkpoints leave a resumable run. Tiny SD3 on the CPU."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from imagetiny import TINY_RUN

from flowrl.config import load_config
from flowrl.errors import CheckpointError, FlowrlError, NonFiniteError, RunDirError
from flowrl.run import rundir
from flowrl.run.checkpoint import (
    TRAINER_STATE,
    checkpoint_in,
    list_checkpoints,
    read_checkpoint,
    resolve_resume,
    resume_target,
    write_checkpoint,
)
from flowrl.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    *TINY_RUN,
    "eval.num_steps=2",
    "eval.num_prompts=2",
    "train.lr=3e-3",
    "train.grpo.clip_low=0.2",
]


def tiny_cfg(run_dir, *extra):
    return load_config(None, [*TINY, f"log.run_dir={run_dir}", *extra])


def metric_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def scripted_reward():
    """A registered image reward whose values per call come from a list the test sets (then the mean pixel)."""
    from rewards.registry import REWARDS, register

    plan: list = []

    @register("test_scripted", kind="image")
    def factory():
        def fn(images, prompts, **metadata):
            base = torch.tensor([float(np.asarray(im, dtype=np.float32).mean()) / 255 for im in images])
            return torch.tensor(plan.pop(0), dtype=torch.float32) if plan else base

        return fn

    yield plan
    REWARDS._items.pop("test_scripted", None)


# ------------------------------------------------------------------------------------------ run directories


def test_a_new_run_refuses_a_directory_holding_another_run_before_the_model_loads(tmp_path, monkeypatch):
    run = tmp_path / "run"
    Trainer(tiny_cfg(run, "train.epochs=1", "eval.grid=false")).fit()
    import flowrl.policies

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the run directory was checked")

    monkeypatch.setattr(flowrl.policies, "build_policy", no_load)
    with pytest.raises(
        RunDirError,
        match=r"already holds a run \(1 checkpoint \(newest ckpt-000001\), metrics to "
        r"epoch 1\).*checkpoint\.resume=auto.*log\.overwrite=true",
    ):
        Trainer(tiny_cfg(run, "train.epochs=1"))


def test_a_shorter_run_overwriting_a_longer_one_keeps_its_checkpoints_and_only_its_metrics(tmp_path):
    run = tmp_path / "run"
    Trainer(tiny_cfg(run, "train.epochs=4", "checkpoint.every=1", "checkpoint.keep=2", "eval.grid=false")).fit()
    assert [p.name for p in list_checkpoints(run)] == ["ckpt-000003", "ckpt-000004"]
    (run / "notes.txt").write_text("the user's own file")
    Trainer(
        tiny_cfg(
            run, "train.epochs=2", "checkpoint.every=1", "checkpoint.keep=2", "eval.grid=false", "log.overwrite=true"
        )
    ).fit()
    # today's bug: the new ckpt-000001/2 were deleted as the oldest of four, and the metrics mixed both runs
    assert [p.name for p in list_checkpoints(run)] == ["ckpt-000001", "ckpt-000002"]
    epochs = [r["epoch"] for r in metric_rows(run) if "policy/loss" in r]
    assert epochs == [1, 2]
    assert (run / "notes.txt").read_text() == "the user's own file"  # only flowrl's files go


def test_retention_never_deletes_the_checkpoint_just_written_nor_later_ones(tmp_path):
    w = {"w": torch.ones(2)}
    for epoch in (80, 90):  # another run's, later epochs
        write_checkpoint(tmp_path, epoch, trainable=w)
    for epoch in (1, 2, 3):
        write_checkpoint(tmp_path, epoch, trainable=w, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000002", "ckpt-000003", "ckpt-000080", "ckpt-000090"]


def test_resume_refuses_a_changed_adapter_and_warns_of_other_changes(tmp_path):
    run = tmp_path / "run"
    Trainer(tiny_cfg(run, "train.epochs=1", "eval.grid=false")).fit()
    with pytest.raises(CheckpointError, match=r"lora\.rank: 8 -> 4.*sample\.group_size: 4 -> 2"):
        Trainer(tiny_cfg(run, "train.epochs=2", "checkpoint.resume=auto", "lora.rank=4", "sample.group_size=2")).fit()
    tr = Trainer(tiny_cfg(run, "train.epochs=2", "checkpoint.resume=auto", "train.lr=1e-3", "eval.grid=false"))
    with pytest.warns(UserWarning, match=r"changed config: train\.lr: 0\.003 -> 0\.001$"):
        tr.fit()  # (train.epochs: 1 -> 2 is not listed: a longer run is what a resume is for)
    assert tr.state.epochs_done == 2
    # a resume whose only change is a longer run (train.epochs, train.max_minutes) warns of nothing
    longer = Trainer(tiny_cfg(run, "train.epochs=3", "checkpoint.resume=auto", "train.lr=1e-3", "eval.grid=false"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        longer.fit()
    assert longer.state.epochs_done == 3
    assert not [w for w in caught if "changed config" in str(w.message)]
    # each resume went on past the end of the run before it: the log holds the last run's final eval only
    assert [r["epoch"] for r in metric_rows(run) if "policy/loss" in r] == [1, 2, 3]
    assert [r["epoch"] for r in metric_rows(run) if r.get("final")] == [3]


def test_keys_newer_than_a_checkpoint_are_no_change_at_their_defaults():
    """A checkpoint written before a key existed lacks it: at its default it is not reported, set otherwise it is."""
    from flowrl.config import Config, to_dict
    from flowrl.run.rundir import compare_configs

    current = to_dict(load_config(None, list(TINY)))
    saved = json.loads(json.dumps(current))
    del saved["train"]["schedule_over"], saved["train"]["nft"]  # as a checkpoint from before those keys
    assert compare_configs(saved, current, to_dict(Config())) == ([], [])
    assert compare_configs(saved, current)[1]  # without the defaults every new key is reported
    current["train"]["schedule_over"] = "budget"
    assert compare_configs(saved, current, to_dict(Config())) == ([], ["train.schedule_over: '(unset)' -> 'budget'"])
    # a checkpoint from before train.objective was GRPO's: resuming it with another objective is refused
    del saved["train"]["objective"]
    assert compare_configs(saved, current, to_dict(Config()))[0] == []
    current["train"]["objective"] = "dpo"
    assert compare_configs(saved, current, to_dict(Config()))[0] == ["train.objective: '(unset)' -> 'dpo'"]


def test_resume_refuses_another_objective(tmp_path):
    """A run resumed with another train.objective would train a checkpoint made for one objective (its state: NFT's
    old policy, AWM's EMA policy) with another: refused, naming the change (e.g. `make demo` in a run directory of
    the GRPO demo, after the demo became DPO)."""
    run = tmp_path / "run"
    Trainer(tiny_cfg(run, "train.epochs=1", "eval.grid=false")).fit()
    with pytest.raises(CheckpointError, match=r"train\.objective: 'grpo' -> 'dpo'.*log\.overwrite=true"):
        Trainer(tiny_cfg(run, "train.epochs=2", "checkpoint.resume=auto", "train.objective=dpo")).fit()


def test_a_resume_redoes_epochs_without_duplicating_rows_and_clears_temporary_dirs(tmp_path):
    run = tmp_path / "run"
    Trainer(tiny_cfg(run, "train.epochs=4", "checkpoint.every=2", "checkpoint.keep=0", "eval.grid=false")).fit()
    import shutil

    shutil.rmtree(run / "ckpt-000004")  # as if the run had died after epoch 4's metrics, before its checkpoint
    (run / ".tmp-ckpt-000004-12345").mkdir()  # and a kill had cut a checkpoint write short
    (run / ".tmp-ckpt-000004-12345" / "trainable.safetensors").write_bytes(b"half")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"epoch": 4, "reward/total_m')  # a row cut by the kill
    Trainer(
        tiny_cfg(
            run,
            "train.epochs=4",
            "checkpoint.every=2",
            "checkpoint.keep=0",
            "eval.grid=false",
            "checkpoint.resume=auto",
        )
    ).fit()
    assert not (run / ".tmp-ckpt-000004-12345").exists()
    trained = [r["epoch"] for r in metric_rows(run) if "policy/loss" in r]
    assert trained == [1, 2, 3, 4]
    finals = [r["epoch"] for r in metric_rows(run) if r.get("final")]
    assert finals == [4]


def test_resuming_an_older_checkpoint_beside_later_ones_or_into_another_run_is_refused(tmp_path, monkeypatch):
    """checkpoint.resume=ckpt-000002 of a run that went on to ckpt-000004: the later checkpoint would stay beside the
    resumed run's (resume=auto would take it, checkpoint.keep would delete the resumed run's own), so it is refused
    before the model loads, naming the later checkpoint and a new directory to continue in; so is another run's
    checkpoint resumed into a directory holding a run. The newest, or any checkpoint into a new directory, resumes."""
    import flowrl.policies

    run, other = tmp_path / "run", tmp_path / "other"
    for d in (run, other):
        Trainer(tiny_cfg(d, "train.epochs=4", "checkpoint.every=2", "checkpoint.keep=0", "eval.grid=false")).fit()
    loads, real = [], flowrl.policies.build_policy
    monkeypatch.setattr(flowrl.policies, "build_policy", lambda *a, **k: loads.append(1) or real(*a, **k))
    with pytest.raises(RunDirError, match=r"holds later checkpoints of that run \(ckpt-000004\)") as info:
        Trainer(tiny_cfg(run, "train.epochs=5", f"checkpoint.resume={run / 'ckpt-000002'}"))
    assert f"log.run_dir=NEW checkpoint.resume={run / 'ckpt-000002'}" in str(info.value)
    with pytest.raises(RunDirError, match=r"is a checkpoint of another directory"):
        Trainer(tiny_cfg(other, "train.epochs=5", f"checkpoint.resume={run / 'ckpt-000002'}"))
    assert loads == []  # (before the model loads)
    resume = [f"checkpoint.resume={run / 'ckpt-000002'}", "eval.grid=false"]
    elsewhere = Trainer(tiny_cfg(tmp_path / "new", "train.epochs=3", *resume))
    elsewhere.fit()
    assert elsewhere.state.epochs_done == 3 and not (run / "ckpt-000003").exists()
    newest = Trainer(tiny_cfg(run, "train.epochs=5", f"checkpoint.resume={run / 'ckpt-000004'}", "eval.grid=false"))
    newest.fit()
    assert newest.state.epochs_done == 5


def test_a_corrupt_checkpoint_is_named_and_auto_falls_back_to_an_older_one(tmp_path):
    run = tmp_path / "run"
    Trainer(tiny_cfg(run, "train.epochs=2", "checkpoint.every=1", "checkpoint.keep=0", "eval.grid=false")).fit()
    bad = run / "ckpt-000002" / "trainable.safetensors"
    bad.write_bytes(bad.read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointError, match=rf"{bad}.*corrupt or truncated"):
        Trainer(tiny_cfg(run, "train.epochs=3", f"checkpoint.resume={run / 'ckpt-000002'}")).fit()
    tr = Trainer(tiny_cfg(run, "train.epochs=3", "checkpoint.resume=auto", "eval.grid=false"))
    with pytest.warns(UserWarning, match=r"skipping .*ckpt-000002.*trainable\.safetensors.*older checkpoint"):
        tr.fit()
    assert tr.state.epochs_done == 3
    assert [r["epoch"] for r in metric_rows(run) if "policy/loss" in r] == [1, 2, 3]  # epoch 2 redone, once


def test_overwrite_deletes_every_file_of_the_old_run_and_nothing_else(tmp_path):
    """log.overwrite=true: the old run's files go, with those a kill left under their temporary names (its best.json
    would name a checkpoint of the new run as the best), a video eval's folder too; a file of the user's stays."""
    run = tmp_path / "run"
    write_checkpoint(run, 2, trainable={"w": torch.ones(2)})
    old = ["metrics.jsonl", "metrics.jsonl.tmp", "completions.jsonl.tmp", "best.json", "best.json.tmp"]
    old += [".curves.png.tmp", "before_after.tmp.png", "eval-final.tmp", "eval-final.tmp.png", "eval-final.png"]
    for name in [*old, "notes.txt", "eval-notes.txt"]:
        (run / name).write_text('{"epoch": 2}\n')
    (run / "eval-final").mkdir()
    (run / "eval-final" / "000.webp").write_bytes(b"video")
    rundir.claim(run, resume=None, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == ["eval-notes.txt", "notes.txt"]


GOOD_STATE = {"counters": {"epochs_done": 1, "optimizer_steps": 2}}


def test_a_state_json_of_the_wrong_structure_is_named_and_auto_falls_back_to_an_older_checkpoint(tmp_path):
    """Valid JSON that is not a checkpoint's state (empty, a list, without its counters or RNG, a counter that is not
    a number, an RNG state that does not load) is a CheckpointError naming the file and what is wrong, as a
    truncated one is: checkpoint.resume=auto takes the previous checkpoint. Another writer's state without counters
    (scripts/pretrain_arith.py's) reads, as long as no trainer requires them."""
    w = {"w": torch.ones(2)}
    for epoch in (1, 2):
        write_checkpoint(tmp_path, epoch, trainable=w, state=GOOD_STATE)
    ckpt = tmp_path / "ckpt-000002"
    file = ckpt / "state.json"
    written = json.loads(file.read_text())
    without_rng = {k: v for k, v in written.items() if k != "rng"}
    cases = [
        ({}, rf"{re.escape(str(file))} has no 'counters'"),
        ([], rf"{re.escape(str(file))} holds a list, not a checkpoint's state"),
        ({**written, "counters": [1, 2]}, "has 'counters' of a list"),
        ({**written, "counters": {"optimizer_steps": 2}}, "has no counter epochs_done"),
        ({**written, "counters": {"epochs_done": "2", "optimizer_steps": 2}}, "counter 'epochs_done' is a string"),
        (without_rng, rf"{re.escape(str(file))} has no 'rng'"),
        ({**written, "rng": {"python": []}}, "has an 'rng' without the Python and NumPy"),
        ({**written, "config": ["model"]}, "has 'config' of a list"),
        (
            {**written, "rng": {**written["rng"], "python": [3, [1, 2], None]}},
            "random generators' states .* do not load",
        ),
    ]
    for state, problem in cases:
        file.write_text(json.dumps(state))
        with pytest.raises(CheckpointError, match=problem):
            read_checkpoint(ckpt, TRAINER_STATE)
        with pytest.warns(UserWarning, match=rf"skipping {re.escape(str(ckpt))}: .*{problem}"):
            found = resolve_resume("auto", tmp_path, require=TRAINER_STATE)
        assert found[0] == tmp_path / "ckpt-000001"
    write_checkpoint(tmp_path, 3, trainable=w, state={"step": 3, "scheduler": {}})
    assert resolve_resume("auto", tmp_path)[1]["state"]["step"] == 3
    with pytest.warns(UserWarning, match=r"ckpt-000003.*has no 'counters' \(the run's epochs and steps"):
        assert resolve_resume("auto", tmp_path, require=TRAINER_STATE)[0] == tmp_path / "ckpt-000001"


def test_a_checkpoint_without_its_state_is_named_and_a_run_of_damaged_ones_says_they_all_are(tmp_path):
    """A ckpt-XXXXXX without its state.json is skipped by checkpoint.resume=auto and `--checkpoint RUN` with a
    warning naming it, as other damage is; when every checkpoint of a run directory is damaged, the error says so
    and names the newest one's problem (not "a run directory without a complete checkpoint yet")."""
    w = {"w": torch.ones(2)}
    for epoch in (1, 2):
        write_checkpoint(tmp_path, epoch, trainable=w, state=GOOD_STATE)
    first, newest = tmp_path / "ckpt-000001", tmp_path / "ckpt-000002"
    (newest / "state.json").unlink()
    missing = rf"{re.escape(str(newest / 'state.json'))} is missing: the checkpoint is incomplete"
    with pytest.warns(UserWarning, match=rf"checkpoint\.resume=auto: skipping {re.escape(str(newest))}: {missing}"):
        assert resolve_resume("auto", tmp_path)[0] == first
    with pytest.warns(
        UserWarning, match=rf"skipping {re.escape(str(newest))}: {missing}; taking the older ckpt-000001"
    ):
        assert checkpoint_in(tmp_path) == first
    (first / "trainable.safetensors").write_bytes(b"cut short")
    every = r"holds 2 checkpoints, all damaged \(the newest, ckpt-000002: " + missing
    with pytest.raises(CheckpointError, match=rf"--checkpoint {re.escape(str(tmp_path))}: the run directory .*{every}"):
        checkpoint_in(tmp_path)
    with pytest.raises(CheckpointError, match=rf"checkpoint\.resume={re.escape(str(tmp_path))}: .*{every}"):
        resume_target(str(tmp_path), tmp_path / "new")
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 2}\n')
    (first / "state.json").unlink()  # (none listed: refused before the model loads)
    with pytest.raises(
        RunDirError, match=rf"no intact checkpoint .*\(2 checkpoints, all damaged; the newest: {missing}"
    ):
        rundir.claim(tmp_path, resume="auto", overwrite=False)


def test_a_checkpoint_of_other_shapes_non_finite_weights_or_unknown_counters_is_refused(tmp_path):
    """A trained tensor of another shape than the model's is refused naming it and both shapes (a copy would
    broadcast [1, 32] into [8, 32]), for an eval and a resume; NaN or inf in a checkpoint's tensors is refused
    naming the file (resume=auto takes the previous checkpoint); counters of a newer flowrl are refused by name."""
    from safetensors.torch import load_file, save_file

    from flowrl.run.loading import policy_from_checkpoint

    run = tmp_path / "run"
    args = ["checkpoint.every=1", "checkpoint.keep=0", "eval.grid=false", "eval.before=false"]
    cfg = tiny_cfg(run, "train.epochs=2", *args)
    Trainer(cfg).fit()
    ckpt = run / "ckpt-000002"
    file = ckpt / "trainable.safetensors"
    tensors = load_file(file)
    name = next(n for n, t in tensors.items() if t.ndim == 2 and t.shape[0] > 1)
    rows, cols = tensors[name].shape
    save_file({**tensors, name: tensors[name][:1].clone()}, file)
    shapes = rf"its trained weights {re.escape(name)} has shape \[1, {cols}\], the model's \[{rows}, {cols}\]"
    with pytest.raises(CheckpointError, match=shapes):
        policy_from_checkpoint(cfg, str(ckpt), "trained")
    with pytest.raises(CheckpointError, match=shapes):
        Trainer(tiny_cfg(run, "train.epochs=3", *args, f"checkpoint.resume={ckpt}")).fit()

    save_file({**tensors, name: torch.full_like(tensors[name], float("nan"))}, file)
    nan = rf"{re.escape(str(file))} holds NaN or inf in 1 tensor\(s\) \({re.escape(name)}\): the checkpoint is damaged"
    with pytest.raises(CheckpointError, match=nan):
        policy_from_checkpoint(cfg, str(ckpt))
    tr = Trainer(tiny_cfg(run, "train.epochs=3", *args, "checkpoint.resume=auto"))
    with pytest.warns(UserWarning, match=rf"skipping {re.escape(str(ckpt))}: {nan}"):
        tr.fit()
    assert tr.state.epochs_done == 3 and torch.isfinite(read_checkpoint(ckpt)["trainable"][name]).all()

    state = run / "ckpt-000003" / "state.json"
    written = json.loads(state.read_text())
    written["counters"]["tokens_seen"] = 12
    state.write_text(json.dumps(written))
    with pytest.raises(
        CheckpointError,
        match=r"holds counters this flowrl does not know \(tokens_seen\): it was written by a newer flowrl",
    ):
        Trainer(tiny_cfg(run, "train.epochs=4", *args, "checkpoint.resume=auto")).fit()


def test_a_run_directory_as_checkpoint_resume_resumes_its_newest_and_a_refused_run_leaves_no_folder(tmp_path, capsys):
    """checkpoint.resume=RUN (a run directory, as `--checkpoint RUN` takes one): its newest intact checkpoint, into
    a new directory or its own. checkpoint.resume=auto of a folder without a run (a typo) says it starts a new run. A
    run refused before it writes anything (before or after the model loads) leaves no new folder behind."""
    run = tmp_path / "run"
    args = ["checkpoint.every=1", "checkpoint.keep=0", "eval.grid=false", "eval.before=false"]
    Trainer(tiny_cfg(run, "train.epochs=2", *args, "checkpoint.resume=auto")).fit()
    assert f"checkpoint.resume=auto: no checkpoint in {run}: starting a new run" in capsys.readouterr().out
    elsewhere = Trainer(tiny_cfg(tmp_path / "new", "train.epochs=3", *args, f"checkpoint.resume={run}"))
    elsewhere.fit()
    assert f"resumed from {run / 'ckpt-000002'} after 2 epochs" in capsys.readouterr().out
    assert elsewhere.state.epochs_done == 3 and not (run / "ckpt-000003").exists()
    again = Trainer(tiny_cfg(run, "train.epochs=3", *args, f"checkpoint.resume={run}"))
    again.fit()
    assert f"resumed from {run / 'ckpt-000002'} after 2 epochs" in capsys.readouterr().out
    assert [p.name for p in list_checkpoints(run)] == ["ckpt-000001", "ckpt-000002", "ckpt-000003"]

    refused = tmp_path / "refused" / "run"
    with pytest.raises(CheckpointError, match=r"checkpoint\.resume=.*nowhere' does not exist"):
        Trainer(tiny_cfg(refused, "train.epochs=4", *args, f"checkpoint.resume={tmp_path / 'nowhere'}"))
    assert not (tmp_path / "refused").exists()
    with pytest.raises(CheckpointError, match=r"lora\.rank: 8 -> 4"):  # (after the model loaded)
        Trainer(tiny_cfg(refused, "train.epochs=4", *args, f"checkpoint.resume={run}", "lora.rank=4")).fit()
    assert not (tmp_path / "refused").exists()


def test_a_run_refused_before_its_first_checkpoint_clears_what_a_killed_write_left(tmp_path, no_model_load):
    """A run killed during its first checkpoint write left a temporary folder; the next command, refused (there is
    no checkpoint to resume), removes it all the same (the folder's lock is held: no other run writes there)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"epoch": 1, "reward/total_mean": 0.5}\n')
    (run / ".tmp-ckpt-000001-12345").mkdir()
    with pytest.raises(RunDirError, match="no intact checkpoint to resume from"):
        Trainer(tiny_cfg(run, "train.epochs=2", "checkpoint.resume=auto"))
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


# ------------------------------------------------------------------------------------------ non-finite numbers


def test_non_finite_rewards_are_left_out_of_the_advantages(tmp_path):
    tr = Trainer(tiny_cfg(tmp_path / "run"))
    batch = tr.rollout(epoch=0)
    scores = torch.tensor([[1.0], [float("nan")], [0.0], [3.0], [2.0], [float("inf")], [-1.0], [0.5]])
    with pytest.warns(UserWarning, match=r"2 of 8 samples have a non-finite reward"):
        adv, keep, invalid = tr.advantages(batch, scores)
    assert invalid == 2
    assert keep.tolist() == [True, False, True, True, True, False, True, True]
    assert adv[1] == 0 and adv[5] == 0
    from flowrl.core import group_advantages

    # each group's advantages are those of its finite samples alone (NaN is not 0, inf does not swamp the std)
    torch.testing.assert_close(adv[[0, 2, 3]], group_advantages(torch.tensor([1.0, 0.0, 3.0]), [0, 0, 0]))
    torch.testing.assert_close(adv[[4, 6, 7]], group_advantages(torch.tensor([2.0, -1.0, 0.5]), [1, 1, 1]))


def test_an_infinite_reward_does_not_poison_the_weights_or_the_checkpoint(tmp_path, scripted_reward):
    run = tmp_path / "run"
    scripted_reward.extend([[0.1, 0.5, float("inf"), 0.2, 0.9, 0.3, float("nan"), 0.4]])
    tr = Trainer(
        tiny_cfg(run, "train.epochs=1", "eval.grid=false", "eval.before=false", "rewards=[{name: test_scripted}]")
    )
    with pytest.warns(UserWarning, match="non-finite reward"):
        tr.fit()
    assert all(torch.isfinite(p).all() for p in tr.params)
    row = next(r for r in metric_rows(run) if "policy/loss" in r)
    assert row["reward/nonfinite_count"] == 2 and math.isfinite(row["reward/total_mean"])
    assert math.isfinite(row["policy/loss"]) and row["adv/kept_frac"] == 0.75
    from safetensors.torch import load_file

    saved = load_file(run / "ckpt-000001" / "trainable.safetensors")
    assert all(torch.isfinite(t).all() for t in saved.values())


INF_REWARD = '''
def brightness(images, prompts, **metadata):
    """Mean pixel, but +inf for the first image of every call."""
    return [float("inf") if i == 0 else sum(im.convert("L").getdata()) / (255.0 * im.width * im.height)
            for i, im in enumerate(images)]
'''


def strict_rows(path) -> list[dict]:
    """metrics.jsonl read as strict JSON: NaN, Infinity and -Infinity are refused."""

    def refuse(token):
        raise ValueError(f"{token} in {path}")

    return [json.loads(line, parse_constant=refuse) for line in Path(path).read_text().splitlines()]


def test_the_eval_leaves_non_finite_scores_out_of_its_means_and_writes_strict_json(tmp_path):
    """A user reward returning +inf for some images: the eval's mean is that of the finite scores, the count is
    logged as eval/<reward>_nonfinite, one warning says so, and metrics.jsonl holds no Infinity / NaN."""
    (tmp_path / "inf_scores.py").write_text(INF_REWARD)
    run = tmp_path / "run"
    tr = Trainer(
        tiny_cfg(
            run,
            "train.epochs=1",
            "eval.grid=false",
            "eval.num_prompts=3",
            f"rewards=[{{name: '{tmp_path / 'inf_scores.py'}:brightness'}}]",
        )
    )
    outputs, scores = tr.evaluator.sample(tr.policy, tr.scorer.fns)
    column = next(iter(scores.values()))
    with pytest.warns(UserWarning, match=r"eval: scores that are not finite .*\(brightness 1 of 3\)"):
        results = tr.evaluator.results(outputs, scores, base_dir=None, this_is_base=True)
    name = tr.cfg.rewards[0].name
    assert results[f"eval/{name}_nonfinite"] == 1
    assert results[f"eval/{name}_mean"] == pytest.approx(float(column[1:].mean()))
    with pytest.warns(UserWarning, match="not finite"):
        tr.fit()
    rows = strict_rows(run / "metrics.jsonl")
    evals = [r for r in rows if f"eval/{name}_mean" in r]
    assert len(evals) == 2 and all(r[f"eval/{name}_nonfinite"] == 1 for r in evals)
    assert all(math.isfinite(r[f"eval/{name}_mean"]) for r in evals)


def test_metrics_jsonl_writes_non_finite_numbers_as_null(tmp_path):
    from flowrl.run.metrics import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.log({"a": float("inf"), "b": torch.tensor(float("nan")), "c": np.float32("-inf"), "d": 2, "e": "x"}, step=1)
    (row,) = strict_rows(tmp_path / "metrics.jsonl")
    assert (row["a"], row["b"], row["c"], row["d"], row["e"]) == (None, None, None, 2.0, "x")


def test_non_finite_losses_skip_steps_then_stop_the_run(tmp_path, monkeypatch):
    tr = Trainer(
        tiny_cfg(
            tmp_path / "run",
            "train.epochs=3",
            "train.minibatch_size=4",
            "eval.before=false",
            "train.max_nonfinite_steps=3",
        )
    )
    before = {n: p.detach().clone() for n, p in tr.named_params.items()}
    evaluate = tr.policy.unit_log_probs

    def poisoned(*args, **kwargs):
        out = evaluate(*args, **kwargs)
        out.log_prob = out.log_prob * float("nan")
        return out

    monkeypatch.setattr(tr.policy, "unit_log_probs", poisoned)
    with pytest.warns(UserWarning, match=r"non-finite loss or gradient.*no optimizer step \(1 in a row of at most 3"):
        with pytest.raises(
            NonFiniteError,
            match=r"NaN/inf in 3 minibatches in a row.*weights and the last "
            r"checkpoint are finite",
        ):
            tr.fit()
    for n, p in tr.named_params.items():  # no step was taken on a NaN gradient
        assert torch.equal(p.detach(), before[n])
    assert tr.state.optimizer_steps == 0


def test_a_good_minibatch_resets_the_count_of_bad_ones(tmp_path, monkeypatch):
    tr = Trainer(
        tiny_cfg(
            tmp_path / "run",
            "train.epochs=2",
            "train.minibatch_size=4",
            "eval.before=false",
            "eval.grid=false",
            "train.max_nonfinite_steps=2",
            "train.steps_per_forward=8",
        )
    )
    evaluate, calls = tr.policy.unit_log_probs, []

    def every_other(*args, **kwargs):  # minibatches (one model call each) alternate bad, good, bad, good
        out = evaluate(*args, **kwargs)
        calls.append(1)
        if len(calls) % 2:
            out.log_prob = out.log_prob * float("nan")
        return out

    monkeypatch.setattr(tr.policy, "unit_log_probs", every_other)
    with pytest.warns(UserWarning, match="non-finite loss"):
        metrics = tr.fit()
    assert tr.state.optimizer_steps == 2 and metrics["policy/skipped_nonfinite"] == 1


def test_a_checkpoint_with_non_finite_weights_is_never_written(tmp_path):
    with pytest.raises(NonFiniteError, match=r"trainable/w"):
        write_checkpoint(tmp_path, 1, trainable={"w": torch.tensor([1.0, float("nan")])})
    with pytest.raises(NonFiniteError, match=r"optimizer/state\.0\.exp_avg"):
        write_checkpoint(
            tmp_path,
            1,
            trainable={"w": torch.ones(2)},
            optimizer={"state": {0: {"exp_avg": torch.tensor([float("inf")])}}, "param_groups": []},
        )
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------ signals


SIGNAL_REWARD = '''
import os, signal
calls = 0

def brightness(images, prompts, signal_on_call=2, signum=2, times=1, **metadata):
    """Mean pixel; sends this process signal `signum` (`times` times) during its call number `signal_on_call`
    (counted in training rollouts and evals alike); each call appends its number to calls.txt."""
    global calls
    calls += 1
    with open("calls.txt", "a") as f:
        f.write(f"{calls}\\n")
    if calls == signal_on_call:
        for _ in range(times):
            os.kill(os.getpid(), signum)
    return [sum(im.convert("L").getdata()) / (255.0 * im.width * im.height) for im in images]
'''
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def signal_reward(on_call: int, signum: int, times: int = 1) -> str:
    """The rewards= override of SIGNAL_REWARD (scores.py in the working directory)."""
    kwargs = f"signal_on_call: {on_call}, signum: {int(signum)}, times: {times}"
    return f"rewards=[{{name: 'scores.py:brightness', kwargs: {{{kwargs}}}}}]"


def run_flowrl(tmp_path, *args, code: str | None = None) -> subprocess.CompletedProcess:
    """`flowrl ARGS` in a subprocess in `tmp_path` (with SIGNAL_REWARD there as scores.py); `code`: Python run
    before the command line (e.g. to patch what it calls)."""
    (tmp_path / "scores.py").write_text(SIGNAL_REWARD)
    head = [sys.executable, "-c", f"{code}\nimport sys\nfrom flowrl.cli import main\nsys.exit(main(sys.argv[1:]))"]
    return subprocess.run(
        [*(head if code else [sys.executable, "-m", "flowrl"]), *args],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


def reward_calls(tmp_path) -> list[int]:
    return [int(x) for x in (tmp_path / "calls.txt").read_text().split()]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_writes_a_checkpoint_and_says_how_to_resume(tmp_path, signum):
    """`flowrl train` in a subprocess receives the signal during epoch 2's reward (call 3: eval before, epoch 1,
    epoch 2): it stops before that epoch's update, checkpoints epoch 1's end, exits 128 + signum with one line;
    the resumed run finishes with one row per epoch."""
    (tmp_path / "scores.py").write_text(SIGNAL_REWARD)
    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "flowrl",
        "train",
        *TINY,
        f"log.run_dir={run}",
        "train.epochs=3",
        "checkpoint.every=0",
        "eval.grid=false",
        f"rewards=[{{name: 'scores.py:brightness', kwargs: {{signal_on_call: 3, signum: {int(signum)}}}}}]",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 128 + signum, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("flowrl train: stopped by") and "checkpoint.resume=auto" in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert [p.name for p in list_checkpoints(run)] == ["ckpt-000001"]
    resumed = subprocess.run(
        [*args[:-1], "checkpoint.resume=auto", "rewards=[{name: 'scores.py:brightness', kwargs: {signal_on_call: 0}}]"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [r["epoch"] for r in metric_rows(run) if "policy/loss" in r] == [1, 2, 3]


KILL_IN_UPDATE = """
import os, signal
import flowrl.train.update as update
_backward, calls = update.Updater.minibatch_backward, [0]
def backward(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == {call}:
        os.kill(os.getpid(), signal.SIGTERM)
    return _backward(self, *args, **kwargs)
update.Updater.minibatch_backward = backward
"""


def test_a_signal_during_an_update_stops_at_the_epochs_end_and_resumes_exactly(tmp_path):
    """SIGTERM during epoch 2's first minibatch (of two): the update runs to its end, the checkpoint is epoch 2's
    (not epoch 1's with a part of epoch 2's update in its weights, which the resumed run would train again), and the
    resumed run ends with the weights and optimizer steps of a run that was never stopped."""
    from safetensors.torch import load_file

    args = [
        "train",
        *TINY,
        "train.minibatch_size=4",  # 8 samples an epoch: two minibatches, so the signal comes before the last
        "train.epochs=3",
        "checkpoint.every=0",
        "eval.grid=false",
        "rewards=[{name: 'scores.py:brightness', kwargs: {signal_on_call: 0}}]",
    ]
    stopped = run_flowrl(tmp_path, *args, f"log.run_dir={tmp_path / 'run'}", code=KILL_IN_UPDATE.format(call=3))
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-2000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("flowrl train: stopped by SIGTERM after 2 epochs; checkpoint "), stopped.stderr[-2000:]
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["ckpt-000002"]
    resumed = run_flowrl(tmp_path, *args, f"log.run_dir={tmp_path / 'run'}", "checkpoint.resume=auto")
    whole = run_flowrl(tmp_path, *args, f"log.run_dir={tmp_path / 'whole'}")
    assert resumed.returncode == 0 and whole.returncode == 0, (resumed.stderr[-2000:], whole.stderr[-2000:])
    assert [r["epoch"] for r in metric_rows(tmp_path / "run") if "policy/loss" in r] == [1, 2, 3]
    ckpts = [tmp_path / d / "ckpt-000003" for d in ("run", "whole")]
    steps = [json.loads((c / "state.json").read_text())["counters"]["optimizer_steps"] for c in ckpts]
    assert steps[0] == steps[1] == 6, steps  # 3 epochs x 2 minibatches, none trained twice
    a, b = (load_file(c / "trainable.safetensors") for c in ckpts)
    assert a.keys() == b.keys() and a
    assert max((a[n] - t).abs().max().item() for n, t in b.items()) <= 1e-6


def test_a_signal_during_the_eval_before_training_abandons_it_and_writes_nothing(tmp_path):
    """SIGINT during the eval before training (its reward, call 1): the eval is abandoned (no row), no epoch's
    rollout or reward follows, nothing trained so no checkpoint; one line, exit 130."""
    run = tmp_path / "run"
    proc = run_flowrl(tmp_path, "train", *TINY, f"log.run_dir={run}", "train.epochs=2", signal_reward(1, signal.SIGINT))
    assert proc.returncode == 130, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("flowrl train: stopped by SIGINT after 0 epochs (the eval before training was abandoned)")
    assert "nothing was trained" in last and "Traceback" not in proc.stderr
    assert reward_calls(tmp_path) == [1]  # no epoch-1 rollout's reward
    assert not (run / "metrics.jsonl").exists() or metric_rows(run) == []
    assert list_checkpoints(run) == [] and not list(run.glob("eval-*"))


def test_a_signal_during_an_eval_in_training_logs_the_epoch_not_the_eval_and_checkpoints(tmp_path):
    """SIGTERM during the eval after epoch 1 (call 3: eval before, epoch 1, that eval): the epoch's row is logged
    without eval results, ckpt-000001 is written, epoch 2 never starts; exit 143."""
    run = tmp_path / "run"
    proc = run_flowrl(
        tmp_path,
        "train",
        *TINY,
        f"log.run_dir={run}",
        "train.epochs=3",
        "eval.every=1",
        "eval.grid=false",
        signal_reward(3, signal.SIGTERM),
    )
    assert proc.returncode == 143, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("flowrl train: stopped by SIGTERM after 1 epoch (the eval after epoch 1 was abandoned)")
    assert "checkpoint.resume=auto" in last and "Traceback" not in proc.stderr
    assert reward_calls(tmp_path) == [1, 2, 3]
    rows = metric_rows(run)
    assert [r["epoch"] for r in rows] == [0, 1]
    assert any(k.startswith("eval/") for k in rows[0]) and not any(k.startswith("eval/") for k in rows[1])
    assert [p.name for p in list_checkpoints(run)] == ["ckpt-000001"]


def test_a_second_signal_during_the_checkpoint_write_stops_once_it_is_whole(tmp_path):
    """The first SIGTERM (epoch 2's reward) asks for the checkpoint; a second one arrives while it is written: the
    write completes, then the run stops with one line per signal, exit 143, not killed by the signal."""
    from flowrl.run.checkpoint import read_checkpoint

    patch = (
        "import os, signal, flowrl.train.trainer as t\n"
        "write = t.write_checkpoint\n"
        "def interrupted_write(run_dir, epoch, **kw):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return write(run_dir, epoch, **kw)\n"
        "t.write_checkpoint = interrupted_write"
    )
    run = tmp_path / "run"
    args = ["train", *TINY, f"log.run_dir={run}", "train.epochs=3", "eval.grid=false"]
    proc = run_flowrl(tmp_path, *args, signal_reward(3, signal.SIGTERM), code=patch)
    assert proc.returncode == 143, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        f"flowrl train: second SIGTERM received: stopping now; checkpoint {run / 'ckpt-000001'} is written "
        "(resume with checkpoint.resume=auto)"
    ), proc.stderr[-2000:]
    assert "stopping once the checkpoint being written is whole" in proc.stderr  # (notices: stderr)
    assert "Traceback" not in proc.stderr
    assert [p.name for p in list_checkpoints(run)] == ["ckpt-000001"]
    assert read_checkpoint(run / "ckpt-000001")["state"]["counters"]["epochs_done"] == 1
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # no temporary directory left


@pytest.mark.parametrize("times", [1, 2])
def test_a_signal_during_flowrl_eval_is_one_line_and_writes_nothing(tmp_path, times):
    """`flowrl eval`: a SIGINT (during its reward) abandons the eval: one line, exit 130, --out not written; two
    SIGTERMs stop at once: one line, exit 143. No traceback either way."""
    signum = signal.SIGINT if times == 1 else signal.SIGTERM
    out = tmp_path / "out"
    proc = run_flowrl(
        tmp_path,
        "eval",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        "--out",
        str(out),
        *TINY,
        signal_reward(1, signum, times),
    )
    assert proc.returncode == 128 + signum, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    if times == 1:
        assert last == "flowrl eval: interrupted by SIGINT during the eval; nothing written"
    else:
        assert last == "flowrl eval: second SIGTERM received: stopping now"
    assert "Traceback" not in proc.stderr and not out.exists()


FAILING_REWARD = """
from pathlib import Path


def brightness(images, prompts, **metadata):
    \"\"\"Mean pixel; call N (evals too, counted in calls.txt) raises when fail_on_call.txt holds N.\"\"\"
    log, fail = Path("calls.txt"), Path("fail_on_call.txt")
    calls = (log.read_text().split() if log.exists() else []) + [None]
    log.write_text("x " * len(calls))
    if fail.exists() and int(fail.read_text()) == len(calls):
        raise ConnectionError("the reward server went away")
    return [sum(im.convert("L").getdata()) / (255.0 * im.width * im.height) for im in images]
"""


def test_a_run_whose_reward_fails_keeps_its_epochs_and_resumes_as_if_uninterrupted(tmp_path, capsys, monkeypatch):
    """The reward raises during epoch 2 (call 3: the eval before, epoch 1, epoch 2): the command line says so in one
    line naming the plug-in's line, and a second naming the checkpoint it wrote of epoch 1 (checkpoint.every is 0);
    resumed, the run ends with the weights of a run that never failed."""
    from safetensors.torch import load_file

    from flowrl.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "scores.py").write_text(FAILING_REWARD)
    args = [
        "train",
        *TINY,
        "train.epochs=3",
        "checkpoint.every=0",
        "eval.grid=false",
        "rewards=[{name: 'scores.py:brightness'}]",
    ]
    (tmp_path / "fail_on_call.txt").write_text("3")
    assert main([*args, f"log.run_dir={tmp_path / 'run'}"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("flowrl train:")]
    assert err[0] == (
        "flowrl train: reward 'scores.py:brightness' failed: ConnectionError: the reward server went away "
        "(at scores.py:11, in brightness)"
    ), err
    assert err[1].startswith(f"flowrl train: the 1 epoch done is in checkpoint {tmp_path / 'run' / 'ckpt-000001'}")
    assert "checkpoint.resume=auto" in err[1] and len(err) == 2, err
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["ckpt-000001"]

    (tmp_path / "fail_on_call.txt").unlink()
    assert main([*args, f"log.run_dir={tmp_path / 'run'}", "checkpoint.resume=auto"]) == 0
    assert main([*args, f"log.run_dir={tmp_path / 'whole'}"]) == 0
    assert [r["epoch"] for r in metric_rows(tmp_path / "run") if "policy/loss" in r] == [1, 2, 3]
    resumed, whole = (load_file(tmp_path / d / "ckpt-000003" / "trainable.safetensors") for d in ("run", "whole"))
    assert resumed.keys() == whole.keys() and resumed
    assert max((resumed[n] - t).abs().max().item() for n, t in whole.items()) <= 1e-6  # as any resume (objectives)
    first = load_file(tmp_path / "run" / "ckpt-000001" / "trainable.safetensors")
    assert any(not torch.equal(first[n], t) for n, t in whole.items())  # (epochs 2 and 3 trained something)


def test_a_run_whose_final_eval_fails_keeps_its_trained_epochs_and_says_how_to_evaluate_them(tmp_path, monkeypatch):
    """The reward raises in the final eval (call 4: the eval before, epochs 1 and 2, the final eval): the two epochs
    are checkpointed (checkpoint.every is 0), and the note says to evaluate them (a resume would train nothing)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scores.py").write_text(FAILING_REWARD)
    (tmp_path / "fail_on_call.txt").write_text("4")
    cfg = tiny_cfg(
        tmp_path / "run",
        "train.epochs=2",
        "checkpoint.every=0",
        "eval.grid=false",
        "rewards=[{name: 'scores.py:brightness'}]",
    )
    with pytest.raises(FlowrlError, match="the reward server went away") as info:
        Trainer(cfg).fit()
    ckpt = tmp_path / "run" / "ckpt-000002"
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == [ckpt.name]
    assert info.value.__notes__ == [
        f"the 2 epochs trained are in checkpoint {ckpt}: once the cause is fixed, `flowrl eval CONFIG --checkpoint "
        f"{ckpt}` makes the final eval"
    ]


def test_a_run_that_fails_in_an_update_names_its_newest_checkpoint_and_writes_none(tmp_path, monkeypatch):
    """A failure inside an update, after one of its optimizer steps (the weights half-trained by the epoch), writes no
    checkpoint: its note names the newest one."""
    import flowrl.train.update as update_module

    cfg = tiny_cfg(
        tmp_path / "run", "train.epochs=3", "checkpoint.every=1", "train.minibatch_size=4", "eval.grid=false"
    )
    trainer = Trainer(cfg)
    backward, calls = update_module.Updater.minibatch_backward, []

    def failing(self, *args, **kwargs):  # two minibatches an epoch: the 4th is epoch 2's second
        calls.append(trainer.state.optimizer_steps)
        if len(calls) == 4:
            raise MemoryError("out of memory in the update")
        return backward(self, *args, **kwargs)

    monkeypatch.setattr(update_module.Updater, "minibatch_backward", failing)
    with pytest.raises(MemoryError) as info:
        trainer.fit()
    assert calls == [0, 1, 2, 3]  # epoch 2 had taken one optimizer step
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["ckpt-000001"]
    assert info.value.__notes__ == [
        f"it failed during epoch 2's update; the newest checkpoint is {tmp_path / 'run' / 'ckpt-000001'} (after 1 "
        f"epoch): checkpoint.resume=auto continues from there"
    ]


def test_a_rollout_is_abandoned_between_its_batches(tmp_path, monkeypatch):
    """A stop signal during the first rollout batch: the next batch is not sampled, the epoch's rewards are not
    computed, and nothing trained means no checkpoint."""
    from flowrl.errors import Interrupted

    tr = Trainer(tiny_cfg(tmp_path / "run", "train.epochs=2", "eval.before=false", "sample.rollout_batch_size=4"))
    backend_rollout, calls = tr.policy.backend.rollout, []

    def rollout(*args, **kwargs):
        calls.append(1)
        tr.signals.signum = signal.SIGINT  # as the handler does on a first signal
        return backend_rollout(*args, **kwargs)

    monkeypatch.setattr(tr.policy.backend, "rollout", rollout)
    monkeypatch.setattr(tr, "score", lambda *a, **k: pytest.fail("the abandoned rollout was scored"))
    with pytest.raises(Interrupted, match=r"stopped by SIGINT after 0 epochs \(epoch 1's rollout was abandoned\)"):
        tr.fit()
    assert len(calls) == 1 and list_checkpoints(tmp_path / "run") == []


def test_a_signal_during_the_final_eval_checkpoints_the_trained_run_and_logs_no_final_row(tmp_path):
    from flowrl.errors import Interrupted

    run = tmp_path / "run"
    tr = Trainer(tiny_cfg(run, "train.epochs=1", "eval.grid=false"))
    sample, calls = tr.evaluator.sample, []

    def signalled_on_the_second(*args, **kwargs):  # the eval before training, then the final one
        calls.append(1)
        if len(calls) == 2:
            tr.signals.signum = signal.SIGTERM  # as the handler does on a first signal
        return sample(*args, **kwargs)

    tr.evaluator.sample = signalled_on_the_second
    with pytest.raises(Interrupted, match=r"after 1 epoch \(the final eval, which `flowrl eval .* was abandoned\)"):
        tr.fit()
    assert [p.name for p in list_checkpoints(run)] == ["ckpt-000001"]
    assert [r["epoch"] for r in metric_rows(run)] == [0, 1] and not any(r.get("final") for r in metric_rows(run))


def test_the_eval_in_batches_is_the_eval_at_once_and_stops_between_them(tmp_path):
    """The eval samples in calls of whole prompts, the size of a training rollout's (the epoch batch, 8 images
    here; sample.rollout_batch_size when set): the same images as at once (every image keeps its noise); its
    `stop` runs before each batch and each reward, and raising abandons it."""
    from flowrl.train.signals import Abandoned

    eval3 = ["eval.num_prompts=3", "eval.images_per_prompt=3"]  # 9 images
    default = Trainer(tiny_cfg(tmp_path / "a", *eval3))
    batched = Trainer(tiny_cfg(tmp_path / "b", *eval3, "sample.rollout_batch_size=1"))
    ev = default.evaluator
    images, scores, _ = default.policy.evaluate_prompts(
        ev.prompts, ev.meta, default.scorer.fns, ev.eval_cfg, per_call=10**6
    )  # all 9 in one call
    for tr, sizes in ((default, [6, 3]), (batched, [3, 3, 3])):  # whole prompts: 2 of 3 images fit in 8, 1 in 1
        calls, stops, rollout = [], [], tr.policy.backend.rollout

        def counted(prompts, *args, _rollout=rollout, **kwargs):
            calls.append(len(prompts) * kwargs["group_size"])
            return _rollout(prompts, *args, **kwargs)

        tr.policy.backend.rollout = counted
        images_b, scores_b = tr.evaluator.sample(tr.policy, tr.scorer.fns, stop=lambda: stops.append(1))
        assert calls == sizes and len(stops) == len(sizes) + 1  # one reward
        for a, b in zip(images, images_b, strict=True):
            assert np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16)).max() <= 1
        # a pixel level apart moves a JPEG's size a little (0.003 of the score seen on one CPU); other noise, a lot
        torch.testing.assert_close(scores[0], scores_b["jpeg_compressibility"], atol=1e-2, rtol=0)

    def stop_at_the_second():
        stops.append(2)
        if stops.count(2) == 2:
            raise Abandoned

    with pytest.raises(Abandoned):
        batched.evaluator.sample(batched.policy, batched.scorer.fns, stop=stop_at_the_second)


def test_the_eval_calls_are_a_process_share_of_the_epoch_batch():
    """Without sample.rollout_batch_size an eval call holds what one process's training rollout samples at once."""
    from flowrl.eval.evaluator import images_per_call

    cfg = tiny_cfg("unused").sample  # 2 prompts x 4 images an epoch
    assert images_per_call(cfg) == 8 and images_per_call(cfg, processes=2) == 4
    assert images_per_call(load_config(None, [*TINY, "sample.rollout_batch_size=2"]).sample, processes=2) == 2


def test_the_eval_shows_a_progress_bar_over_its_images(tmp_path, capsys, monkeypatch):
    import flowrl.eval.evaluator as evaluator

    updates = []

    class Recorded(evaluator.tqdm):
        def update(self, n=1):
            updates.append(n)
            return super().update(n)

    monkeypatch.setattr(evaluator, "tqdm", Recorded)
    tr = Trainer(tiny_cfg(tmp_path / "run", "eval.num_prompts=3", "eval.images_per_prompt=3"))
    tr.evaluator.sample(tr.policy, tr.scorer.fns, progress=True)
    assert updates == [6, 3]  # after each call (2 prompts of 3 images in the epoch's 8, then 1)
    err = capsys.readouterr().err
    assert "eval: " in err and "/9 [" in err and "image/s" in err
    tr.evaluator.sample(tr.policy, tr.scorer.fns)  # progress off by default (a library call)
    assert "eval" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ what a person sees


def test_eval_grids_go_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    Trainer(tiny_cfg(tmp_path / "run", "train.epochs=1", "log.tensorboard=true")).fit()
    events = sorted((tmp_path / "run").rglob("events.out.tfevents.*"))
    tags = set()
    for path in events:
        acc = EventAccumulator(str(path), size_guidance={"images": 0})
        acc.Reload()
        tags |= set(acc.Tags()["images"])
    assert {"eval/epoch000000", "eval/final"} <= tags


def test_the_progress_bar_names_the_on_policy_ratio(tmp_path, capsys):
    Trainer(tiny_cfg(tmp_path / "run", "train.epochs=1", "eval.grid=false", "log.progress=true")).fit()
    err = capsys.readouterr().err
    assert "on_policy_ratio=1.00000" in err and "ratio0" not in err


def test_the_progress_bar_shows_a_ratio_only_for_grpo():
    """The forward-process objectives have no ratio: no "on_policy_ratio=-" on every epoch; DPO shows its pairs."""
    from flowrl.objectives import get_objective
    from flowrl.train import progress_postfix

    grpo, dpo, nft = (get_objective(name) for name in ("grpo", "dpo", "nft"))
    assert progress_postfix({"reward/total_mean": 0.5, "policy/ratio_first": 1.0}, grpo) == {
        "reward": "0.500",
        "on_policy_ratio": "1.00000",
    }
    assert progress_postfix({"reward/total_mean": 0.5}, grpo)["on_policy_ratio"] == "-"  # nothing trained
    assert progress_postfix({"reward/total_mean": 0.25, "objective/dpo_pairs": 3.0}, dpo) == {
        "reward": "0.250",
        "pairs": "3",
    }
    assert progress_postfix({"reward/total_mean": 0.25}, nft) == {"reward": "0.250"}


def test_a_wall_clock_budget_ends_the_run_after_the_epoch_that_spends_it(tmp_path):
    """train.max_minutes: the epoch during which the budget runs out is the last one; its metrics are logged (with
    log.every larger than 1), then the final eval and the checkpoint, as after the last epoch."""
    from flowrl.train import Trainer

    tr = Trainer(tiny_cfg(tmp_path, "train.epochs=5", "train.max_minutes=0.0001", "log.every=4"))
    tr.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows if "policy/loss" in r] == [1]
    assert rows[-1].get("final") and rows[-1]["epoch"] == 1
    assert tr.state.epochs_done == 1 and (tmp_path / "ckpt-000001").is_dir()


def test_a_process_clock_budget_counts_training_cpu_time_and_every_row_carries_both_clocks(tmp_path):
    """train.budget_clock=process: the budget is this process's CPU time in training epochs; the rows log the
    cumulative training time on both clocks, growing from epoch to epoch."""
    from flowrl.train import Trainer

    tr = Trainer(tiny_cfg(tmp_path, "train.epochs=5", "train.max_minutes=0.00001", "train.budget_clock=process"))
    tr.fit()
    assert tr.state.epochs_done == 1
    tr = Trainer(tiny_cfg(tmp_path / "b", "train.epochs=3", "train.max_minutes=1000", "train.budget_clock=process"))
    tr.fit()
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "policy/loss" in r]
    assert tr.state.epochs_done == 3 and len(train_rows) == 3
    for key in ("time/train_wall_minutes", "time/train_process_minutes"):
        values = [r[key] for r in train_rows]
        assert 0 < values[0] < values[1] < values[2], (key, values)


def test_a_resumed_run_trains_what_is_left_of_its_time_budget(tmp_path, capsys):
    """A checkpoint keeps the budget spent and both training clocks: resuming a run that stopped on its budget
    trains nothing (and says how to train on); raising train.max_minutes trains on, and the time metrics go on
    from the checkpoint's instead of restarting at 0."""

    args = [
        "train.epochs=100000",
        "train.budget_clock=process",
        "eval.every=0",
        "eval.before=false",
        "checkpoint.resume=auto",
    ]
    first = Trainer(tiny_cfg(tmp_path, *args, "train.max_minutes=0.00001"))
    first.fit()
    assert first.state.epochs_done == 1
    saved = json.loads((tmp_path / "ckpt-000001" / "state.json").read_text())["counters"]
    assert saved["budget_seconds"] == pytest.approx(first.state.train_cpu_seconds) and saved["budget_seconds"] > 0
    assert saved["train_wall_seconds"] >= saved["train_cpu_seconds"] * 0.5 > 0
    n_rows = len(metric_rows(tmp_path))
    capsys.readouterr()

    again = Trainer(tiny_cfg(tmp_path, *args, "train.max_minutes=0.00001"))
    assert again.fit() == {} and again.state.epochs_done == 1
    assert "train.max_minutes=1e-05 was spent" in capsys.readouterr().out
    assert len(metric_rows(tmp_path)) == n_rows  # nothing trained, nothing logged

    more = Trainer(tiny_cfg(tmp_path, *args[1:], "train.epochs=3", "train.max_minutes=1000"))
    more.fit()
    assert more.state.epochs_done == 3
    rows = [r for r in metric_rows(tmp_path) if "policy/loss" in r]
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    for key, before in (
        ("time/train_process_minutes", saved["train_cpu_seconds"] / 60),
        ("time/train_wall_minutes", saved["train_wall_seconds"] / 60),
    ):
        assert rows[0][key] == pytest.approx(before)
        assert before < rows[1][key] < rows[2][key], key  # cumulative over the resume, not from 0
    assert more.state.train_cpu_seconds == pytest.approx(rows[2]["time/train_process_minutes"] * 60)


def test_a_finished_run_resumed_or_zero_epochs_says_there_is_nothing_to_train(tmp_path, capsys):
    from flowrl.cli import main

    run = tmp_path / "run"
    common = ["train", *TINY, f"log.run_dir={run}", "eval.grid=false"]
    assert main([*common, "train.epochs=1"]) == 0
    capsys.readouterr()
    assert main([*common, "train.epochs=1", "checkpoint.resume=auto"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == (
        f"train.epochs=1 and the run in {run} has done 1 epoch: nothing to train (raise train.epochs to train on; "
        f"`flowrl eval CONFIG --checkpoint {run}` evaluates its newest checkpoint)"
    )  # and no empty JSON after it
    assert main([*common, "train.epochs=0", f"log.run_dir={tmp_path / 'none'}"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "train.epochs=0: nothing to train"


def test_a_cosine_over_the_time_budget_follows_the_training_minutes_spent(tmp_path):
    """train.schedule_over=budget: each epoch's lr is lr (1 + cos(pi b)) / 2 with b the share of the budget spent
    before the epoch, which the previous row logs as time/train_process_minutes (the epoch count barely moves
    it at 10^5 epochs); the first epoch trains at the full lr. A budget schedule without a budget is refused."""
    from flowrl.config import ConfigError
    from flowrl.train import Trainer

    budget = 0.02
    tr = Trainer(
        tiny_cfg(
            tmp_path,
            "train.epochs=100000",
            f"train.max_minutes={budget}",
            "train.budget_clock=process",
            "train.schedule=cosine",
            "train.schedule_over=budget",
            "train.lr=1e-3",
            "eval.every=0",
        )
    )
    tr.fit()
    rows = [r for r in metric_rows(tmp_path) if "policy/loss" in r]
    assert len(rows) >= 2 and rows[0]["lr"] == pytest.approx(1e-3, rel=1e-6)
    for before, row in zip(rows, rows[1:]):
        spent = min(1.0, before["time/train_process_minutes"] / budget)
        assert row["lr"] == pytest.approx(1e-3 * (1 + math.cos(math.pi * spent)) / 2, rel=1e-6, abs=1e-12)
    assert rows[1]["lr"] < rows[0]["lr"]
    with pytest.raises(ConfigError, match="train.schedule_over=budget .* set train.max_minutes"):
        tiny_cfg(tmp_path / "b", "train.schedule=cosine", "train.schedule_over=budget")
