"""A run directory is one run's at a time (its lock). Tiny SD3 on the CPU."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import RunDirError
from flowrl.run import rundir
from flowrl.run.lock import LOCK_NAME, RunLock
from flowrl.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "sample.height=32",
    "sample.width=32",
    "sample.num_steps=3",
    "sample.max_sequence_length=16",
    "sample.prompts_per_epoch=2",
    "sample.group_size=4",
    "eval.num_steps=2",
    "eval.num_prompts=2",
    "eval.grid=false",
    "log.progress=false",
    "model.device=cpu",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def tiny_cfg(run_dir, *extra):
    return load_config(None, [*TINY, f"log.run_dir={run_dir}", *extra])


def one_line_error(capsys, rc) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 1, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a model is loaded: the checks under test must come first."""
    import flowrl.policies

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the mistake was reported")

    monkeypatch.setattr(flowrl.policies, "build_policy", refuse)


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


# ------------------------------------------------------------------------------------------ the run lock


BLOCKING_REWARD = '''
import os, time

def gated(images, prompts, **metadata):
    """Mean pixel, once the file `go` exists (it writes `started` first): the run stays alive until the test says."""
    open("started", "w").close()
    deadline = time.time() + 300
    while not os.path.exists("go") and time.time() < deadline:
        time.sleep(0.05)
    return [sum(im.convert("L").getdata()) / (255.0 * im.width * im.height) for im in images]
'''


def test_a_second_run_into_a_locked_folder_refuses_naming_the_first(tmp_path, capsys, no_model_load):
    """Two `flowrl train` into one log.run_dir: the second (started while the first runs) refuses in one line naming
    the first's pid, before its model loads; the first ends normally, its metrics its own, and its lock goes."""
    (tmp_path / "scores.py").write_text(BLOCKING_REWARD)
    run = tmp_path / "run"
    args = [*TINY, f"log.run_dir={run}", "train.epochs=1", "rewards=[{name: 'scores.py:gated'}]"]
    first = subprocess.Popen(
        [sys.executable, "-m", "flowrl", "train", *args],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not (tmp_path / "started").exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "started").exists(), first.communicate()[1][-2000:]
        holder = json.loads((run / LOCK_NAME).read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
        err = one_line_error(capsys, main(["train", *TINY, f"log.run_dir={run}", "train.epochs=1"]))
        assert f"is in use by another run (pid {first.pid} on {socket.gethostname()}, since " in err
        assert "pick another log.run_dir, or wait for that run to end" in err
    finally:
        (tmp_path / "go").touch()
        _, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr[-2000:]
    assert not (run / LOCK_NAME).exists()
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows if "policy/loss" in r] == [1] and sum("final" in r for r in rows) == 1


def test_a_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    pid = dead_pid()
    stale = {"pid": pid, "host": socket.gethostname(), "started": "2020-01-01 00:00:00"}
    (run / LOCK_NAME).write_text(json.dumps(stale))
    assert rundir.run_files(run) == [] and not rundir.holds_a_run(run)  # a lock is not a run's file
    with pytest.warns(
        UserWarning, match=rf"taking over the lock of a run that is gone \(pid {pid} on this host, since"
    ):
        tr = Trainer(tiny_cfg(run, "train.epochs=1"))
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    tr.fit()
    assert not (run / LOCK_NAME).exists()


def test_a_lock_of_another_host_refuses_and_says_how_to_remove_it(tmp_path, no_model_load):
    run = tmp_path / "run"
    run.mkdir()
    other = {"pid": 4242, "host": "gpu-node-7", "started": "2020-01-01 00:00:00"}
    (run / LOCK_NAME).write_text(json.dumps(other))
    with pytest.raises(
        RunDirError,
        match=r"locked by a run on host gpu-node-7 \(pid 4242, since 2020-01-01 00:00:00\).*pick another "
        rf"log\.run_dir.*if you are sure it is gone, delete {run / LOCK_NAME}",
    ):
        Trainer(tiny_cfg(run, "train.epochs=1"))
    assert json.loads((run / LOCK_NAME).read_text()) == other  # left alone


def test_the_lock_is_held_during_a_run_and_removed_after_it_fails_or_ends(tmp_path, monkeypatch):
    run = tmp_path / "run"
    seen = []

    def failing_epoch(self, epoch):
        seen.append(json.loads((run / LOCK_NAME).read_text()))
        seen.append(rundir.run_files(run))
        raise RuntimeError("boom")

    monkeypatch.setattr(Trainer, "train_epoch", failing_epoch)
    with pytest.raises(RuntimeError, match="boom"):
        Trainer(tiny_cfg(run, "train.epochs=1", "eval.before=false")).fit()
    assert seen[0]["pid"] == os.getpid() and seen[1] == []  # held, and not one of the run's files
    assert not (run / LOCK_NAME).exists()
    monkeypatch.undo()
    Trainer(tiny_cfg(run, "train.epochs=1", "log.overwrite=true")).fit()
    assert not (run / LOCK_NAME).exists()


def test_a_lock_is_removed_only_by_its_holder(tmp_path):
    first = RunLock(tmp_path).acquire()
    (tmp_path / LOCK_NAME).unlink()  # (a user removed it) and another run took it
    second = RunLock(tmp_path).acquire()
    first.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == second.info["token"]
    second.release()
    assert not (tmp_path / LOCK_NAME).exists()
