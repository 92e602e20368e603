"""rollout.async: a worker process samples epoch k+1 with the weights of epoch k while the trainer updates on epoch k.
Its batch equals a synchronous rollout with the weights of the version it names (GRPO's recorded log-probs
included); a worker that dies or raises is one flowrl line, and the run resumes; a stop signal leaves no worker."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from imagetiny import TINY_RUN

from flowrl.config import ConfigError, describe, load_config
from flowrl.run.metrics import read_metrics
from flowrl.train import Trainer
from flowrl.train.async_rollout import RolloutWorkerError

TINY = [
    *TINY_RUN,
    "train.epochs=3",
    "train.lr=3e-3",
    "train.steps_per_forward=3",
    "eval.before=false",
    "eval.num_steps=2",
    "eval.num_prompts=2",
    "log.every=1",
    "rollout.async=true",
]


def same(a, b) -> bool:
    """Exactly equal: tensors element for element, images pixel for pixel, containers and dataclasses field by
    field."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if hasattr(a, "convert") and hasattr(a, "size"):  # a PIL image
        return np.array_equal(np.asarray(a), np.asarray(b))
    if dataclasses.is_dataclass(a) or hasattr(a, "__dict__") and not callable(a):
        return type(a) is type(b) and same(vars(a), vars(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def recording_trainer(cfg):
    """A Trainer that keeps each epoch's batch and version lag, and the weights (with the objective's state) of each
    version: those before epoch v's update."""
    tr = Trainer(cfg)
    seen, versions = [], {}
    update = tr.update

    def record(batch, adv, keep, epoch):
        versions[tr.state.epochs_done] = (
            {n: p.detach().clone() for n, p in tr.named_params.items()},
            {n: v.clone() for n, v in tr.objective.state_dict().items()},
        )
        seen.append((epoch, batch, tr.updater.version_lag))
        return update(batch, adv, keep, epoch)

    tr.update = record
    return tr, seen, versions


@pytest.mark.parametrize("objective", ["grpo", "nft"])
def test_the_workers_batch_is_a_synchronous_rollout_with_the_version_it_names(tmp_path, objective):
    cfg = load_config(None, [*TINY, f"log.run_dir={tmp_path}", f"train.objective={objective}"])
    tr, seen, versions = recording_trainer(cfg)
    tr.fit()
    assert tr.rollouts.process is None  # stopped and joined when fit ended
    assert [lag for _, _, lag in seen] == [0, 1, 1]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["rollout/version_lag"] for r in rows if "rollout/version_lag" in r] == [0, 1, 1]
    assert all("time/rollout_wait" in r and "time/worker_idle" in r for r in rows if "rollout/version_lag" in r)
    # a synchronous trainer of the same run, with the weights of the version each batch names (a fresh one: after
    # an update the same process's rollout can differ in the last float bit)
    ref = Trainer(
        load_config(
            None, [*TINY, f"log.run_dir={tmp_path / 'sync'}", f"train.objective={objective}", "rollout.async=false"]
        )
    )
    for epoch, batch, lag in seen:
        trained, state = versions[epoch - lag]
        with torch.no_grad():
            for n, p in ref.named_params.items():
                p.copy_(trained[n])
        ref.objective.load_state_dict(state)
        sync = ref.rollout(epoch)
        assert same(batch.traj, sync.traj), f"epoch {epoch}"
        assert same(batch.images, sync.images) and batch.prompts == sync.prompts
        assert torch.equal(batch.group_ids, sync.group_ids) and batch.epoch_prompts == sync.epoch_prompts
    if objective == "grpo":  # the recorded log-probs are the sampling version's (compared above)
        assert seen[1][1].traj.log_probs is not None
    # the versions differ (the comparison above could not pass with the wrong one)
    assert any(not torch.equal(versions[0][0][n], versions[1][0][n]) for n in versions[0][0])


def test_lag_skips_the_on_policy_warning_only():
    import warnings

    from flowrl.train.update import Updater

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Updater.on_policy_metrics((0.9, 1.0), 3, lag=1)["policy/ratio_first_dev"] == pytest.approx(0.1)
    with pytest.warns(UserWarning, match="not on-policy"):
        Updater.on_policy_metrics((0.9, 1.0), 3, lag=0)


def test_the_key_is_rollout_async():
    keys = [row[0] for row in describe()]
    assert "rollout.async" in keys and "rollout.async_" not in keys
    assert load_config(None, ["rollout.async=true"]).rollout.async_ is True
    assert load_config(None, []).rollout.async_ is False


def test_refused_for_text_overlap_rewards_and_several_processes(tmp_path):
    with pytest.raises(ConfigError, match="rollout.async .* set rollout.async=false"):
        load_config(None, ["backend=text", "model.path=tiny-gpt2", "rollout.async=true"])
    with pytest.raises(ConfigError, match="rollout.async and rollout.overlap_rewards .*=false"):
        load_config(None, ["rollout.async=true", "rollout.overlap_rewards=true"])
    cfg = load_config(None, [*TINY, f"log.run_dir={tmp_path}"])
    two = SimpleNamespace(
        num_processes=2, is_main_process=True, process_index=0, device=torch.device("cpu"), wait_for_everyone=lambda: 0
    )
    with pytest.raises(ConfigError, match="rollout.async runs one rollout worker .* this run has 2"):
        Trainer(cfg, accelerator=two)


def failing_worker(cfg, device, threads, commands, results):
    """A worker whose rollout raises (it must be importable by the spawned process: a module-level function)."""
    from flowrl.train import async_rollout

    def broken(objective, epoch, request):
        raise RuntimeError(f"no rollout for epoch {epoch}")

    async_rollout.run_rollout = broken
    async_rollout.worker_main(cfg, device, threads, commands, results)


def test_a_worker_error_is_one_line(tmp_path):
    cfg = load_config(None, [*TINY, f"log.run_dir={tmp_path}", "train.objective=dpo"])
    tr = Trainer(cfg)
    tr.rollouts.target = failing_worker
    with pytest.raises(RolloutWorkerError) as info:
        tr.fit()
    assert "\n" not in str(info.value)
    assert "failed during epoch 1's rollout: RuntimeError: no rollout for epoch 0" in str(info.value)
    assert tr.rollouts.process is None
    assert not list(tmp_path.glob("ckpt-*")) and not (tmp_path / "metrics.jsonl").exists()  # nothing trained


def test_a_killed_worker_is_one_line_and_the_run_resumes_exactly(tmp_path):
    over = [*TINY, f"log.run_dir={tmp_path}", "train.objective=dpo", "checkpoint.every=1", "train.epochs=4"]
    tr = Trainer(load_config(None, over))
    update = tr.update

    def kill_after_second(batch, adv, keep, epoch):
        out = update(batch, adv, keep, epoch)
        if epoch == 1:  # while it samples epoch 3
            proc = tr.rollouts.process
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
        return out

    tr.update = kill_after_second
    with pytest.raises(RolloutWorkerError, match=r"died during epoch 3's rollout with exit code -9; resume with"):
        tr.fit()
    assert tr.state.epochs_done == 2 and tr.rollouts.process is None
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2] and (tmp_path / "ckpt-000002").is_dir()

    resumed, seen, _ = recording_trainer(load_config(None, [*over, "checkpoint.resume=auto"]))
    resumed.fit()
    # from the checkpoint of epoch 2, to the end; epoch 3 is sampled with the version the killed run sampled it with
    # (the checkpoint keeps it), so the resumed run is the uninterrupted one
    assert [(e, lag) for e, _, lag in seen] == [(2, 1), (3, 1)]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["epoch"] for r in rows if "rollout/version_lag" in r] == [1, 2, 3, 4]
    straight_dir = tmp_path / "straight"
    straight = Trainer(load_config(None, [*over, f"log.run_dir={straight_dir}"]))
    straight.fit()
    for name, p in straight.named_params.items():
        assert torch.equal(p, resumed.named_params[name]), name
    straight_rows = read_metrics(straight_dir / "metrics.jsonl")
    key = "reward/total_mean"
    assert [r[key] for r in rows if key in r] == [r[key] for r in straight_rows if key in r]


def test_a_worker_that_dies_while_its_batch_is_in_the_queue_is_one_line(tmp_path):
    """The worker put its batch and died before the trainer took it: the batch's tensors are file descriptors the
    dead worker can no longer hand over (receiving them raises ConnectionRefusedError); one line, as a worker that
    died while sampling (seen in CI under load)."""
    over = [*TINY, f"log.run_dir={tmp_path}", "train.objective=dpo", "checkpoint.every=1", "train.epochs=4"]
    tr = Trainer(load_config(None, over))
    update = tr.update

    def kill_after_second(batch, adv, keep, epoch):
        out = update(batch, adv, keep, epoch)
        if epoch == 1:
            proc = tr.rollouts.process
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()

            def lost(*args, **kwargs):
                raise ConnectionRefusedError(111, "Connection refused")

            tr.rollouts.results.get = lost
        return out

    tr.update = kill_after_second
    with pytest.raises(RolloutWorkerError, match=r"died during epoch 3's rollout with exit code -9; resume with"):
        tr.fit()
    assert tr.state.epochs_done == 2 and (tmp_path / "ckpt-000002").is_dir()


SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from flowrl.config import load_config
from flowrl.errors import Interrupted
from flowrl.train import Trainer
from test_async_rollout import TINY

if __name__ == "__main__":
    tr = Trainer(load_config(None, [*TINY, "log.run_dir=" + sys.argv[1], "train.epochs=1000", "train.objective=dpo"]))
    update = tr.update

    def announce(batch, adv, keep, epoch):
        if epoch == 1:
            print("WORKER", tr.rollouts.process.pid, flush=True)
        return update(batch, adv, keep, epoch)

    tr.update = announce
    try:
        tr.fit()
    except Interrupted as e:
        print("INTERRUPTED", e, flush=True)
"""


def test_a_stop_signal_stops_and_joins_the_worker(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests=os.path.dirname(__file__))))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    pid = None
    lines = []
    for line in proc.stdout:
        lines.append(line.decode())
        if line.startswith(b"WORKER"):
            pid = int(line.split()[1])
            proc.send_signal(signal.SIGINT)
            break
    out = proc.communicate(timeout=300)[0].decode()
    assert pid is not None, "".join(lines)
    assert proc.returncode == 0 and "INTERRUPTED stopped by SIGINT" in out, out
    assert list((tmp_path / "run").glob("ckpt-*"))
    for _ in range(50):  # the worker was joined before the trainer exited: gone (not even a zombie)
        if not os.path.exists(f"/proc/{pid}"):
            break
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}")


def test_elbo_takes_its_ratio_against_the_version_that_sampled_the_batch(tmp_path):
    """ELBO on-policy: "old" is the weights that sampled the batch. With a lag of one epoch those are the previous
    version's, not the trained ones: "old" equals that version at the update's start and the first ratio is not 1
    (it was exactly 1 when "old" was reset to the trained weights)."""
    cfg = load_config(None, [*TINY, f"log.run_dir={tmp_path}", "train.objective=elbo"])
    tr, seen, versions = recording_trainer(cfg)
    olds, prepare = [], tr.objective.prepare

    def record_old(batch, *args, **kwargs):
        keep = prepare(batch, *args, **kwargs)
        olds.append({n: w.detach().clone() for n, w in tr.policy.shadow_parameters("old").items()})
        return keep

    tr.objective.prepare = record_old
    tr.fit()
    assert [lag for _, _, lag in seen] == [0, 1, 1]
    assert seen[0][1].sampled_with is None and seen[1][1].sampled_with is not None
    for (epoch, _, lag), old in zip(seen, olds, strict=True):
        trained = versions[epoch - lag][0]
        assert all(torch.equal(old[n], trained[n]) for n in trained), f"epoch {epoch}"
    assert any(not torch.equal(versions[0][0][n], versions[1][0][n]) for n in versions[0][0])
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "policy/ratio_first" in r]
    assert rows[0]["policy/ratio_first"] == 1.0  # the trained weights sampled epoch 0
    assert all(r["policy/ratio_first_dev"] > 1e-6 for r in rows[1:])  # an older version sampled these


def test_on_a_cpu_the_trainer_leaves_the_workers_threads_while_it_samples(tmp_path):
    """Trainer and worker share the run's threads: with 2 torch threads and rollout.async_threads=1, the trainer
    updates at 1 while the worker samples the next epoch, and takes both back when the worker samples nothing (the
    eval after the last epoch) and when the run ends. The worker is started before the eval before training, so
    its start overlaps that eval."""
    cfg = load_config(None, [*TINY, f"log.run_dir={tmp_path}", "train.objective=dpo", "eval.before=true"])
    torch.set_num_threads(2)
    try:
        tr = Trainer(cfg)
        at_update, at_eval = [], []
        update, evaluate = tr.update, tr.evaluate

        def record_update(*args):
            at_update.append(torch.get_num_threads())
            return update(*args)

        def record_eval(tag):
            at_eval.append((tag, torch.get_num_threads(), tr.rollouts.process is not None))
            return evaluate(tag)

        tr.update, tr.evaluate = record_update, record_eval
        tr.fit()
        # the last epoch's update has no next epoch beside it: all the threads
        assert at_update == [1, 1, 2]
        assert at_eval == [("epoch000000", 2, True), ("final", 2, True)]  # the worker was already starting
        assert torch.get_num_threads() == 2
        rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "rollout/trainer_threads" in r]
        assert [r["rollout/trainer_threads"] for r in rows] == [1, 1, 2]
    finally:
        torch.set_num_threads(1)
