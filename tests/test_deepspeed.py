"""DeepSpeed ZeRO through accelerate on 2 CPU processes (DeepSpeed's CPU accelerator, gloo): the update of a ZeRO-2 or
ZeRO-3 run takes the weights where a 1-process plain run over the same global batch takes them, its checkpoints are
a plain run's (the optimizer state gathered from the partitions) and resume it exactly, and `flowrl train` runs end
to end with every weight of the denoiser partitioned. `make test` installs deepspeed (an optional extra, built with
--no-build-isolation); a plain `pip install -e ".[dev]"` does not, and then these tests are skipped."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launching import accelerate_launch
from test_trainer_image import TINY, tiny_cfg

from flowrl.train import Trainer

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "accelerate"

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="deepspeed is not installed (make test installs it: pip install --no-build-isolation deepspeed)",
    ),
    pytest.mark.skipif(sys.platform != "linux", reason="gloo multi-process test written for linux"),
]


def accelerate_config(directory: Path, stage: int) -> list[str]:
    """`accelerate launch` arguments for 2 processes on this machine: ZeRO-2 the shipped 8-GPU config; ZeRO-3 a
    DeepSpeed config file that partitions every weight of the tiny model (by default ZeRO-3 keeps a weight of fewer
    than 100k elements whole on every process)."""
    if stage == 2:
        return ["--config_file", str(CONFIGS / "deepspeed_zero2.yaml"), "--num_processes", "2"]
    (directory / "ds3.json").write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                "train_micro_batch_size_per_gpu": "auto",
                "bf16": {"enabled": False},
                "fp16": {"enabled": False},
            }
        )
    )
    (directory / "ds3.yaml").write_text(f"""compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {directory / "ds3.json"}
  zero3_init_flag: false
num_machines: 1
machine_rank: 0
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
""")
    return ["--config_file", str(directory / "ds3.yaml")]


def launch(tmp_path, script_args, stage=2, **env_extra):
    env = {
        **os.environ,
        **env_extra,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    cmd = [*accelerate_launch(), *accelerate_config(tmp_path, stage), *script_args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("stage,dropped", [(2, True), (3, True)])
def test_zero_two_processes_update_as_one_process_over_the_same_global_batch(tmp_path, stage, dropped):
    """As tests/test_trainer_image.py's DDP / FSDP version: 3 optimizer steps (inner_epochs=3), the reference KL on,
    two units of steps per minibatch (several backward passes per step), gradient clipping and lr warmup on, within 1e-5
    relative.
    `dropped`: the second process has nothing to train (it runs placeholder passes)."""
    from safetensors.torch import load_file

    extra = [
        "train.inner_epochs=3",
        "train.grpo.beta=0.05",
        "train.steps_per_forward=2",
        "eval.grid=false",
        "train.max_grad_norm=1e-3",
        "train.warmup_steps=2",
    ]
    one = Trainer(tiny_cfg(tmp_path / "one", *extra))
    batch = one.rollout(epoch=0)
    adv = torch.tensor([1.2, -0.4, 0.3, -1.1, 0.8, -0.9, 0.5, -0.4])
    keep = torch.tensor([True, True, False, True] + [not dropped] * 4)
    torch.save(
        {"traj": batch.traj, "prompts": batch.prompts, "metadata": batch.metadata, "adv": adv, "keep": keep},
        tmp_path / "batch.pt",
    )
    metrics = one.update(batch, adv, keep, epoch=0)
    assert one.state.optimizer_steps == 3
    assert metrics["policy/grad_norm"] > 1e-3  # the clipping acts
    script = [
        str(Path(__file__).parent / "dist_update.py"),
        str(tmp_path / "batch.pt"),
        str(tmp_path / "two.safetensors"),
        *TINY,
        *extra,
        f"log.run_dir={tmp_path / 'two'}",
    ]
    proc = launch(tmp_path, script, stage)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "optimizer steps 3" in proc.stdout and "engine DeepSpeedEngine" in proc.stdout
    two = load_file(tmp_path / "two.safetensors")
    top = max(p.detach().abs().max().item() for p in one.named_params.values())
    assert set(two) == set(one.named_params)
    for name, p in one.named_params.items():
        assert (two[name] - p.detach()).abs().max().item() <= 1e-5 * top, name


@pytest.mark.parametrize("stage", [2])  # ZeRO-3 checkpoints and resumes in the end-to-end test below
@pytest.mark.filterwarnings("ignore:epoch 2. the first minibatch is not on-policy")
def test_zero_checkpoint_is_a_plain_runs_and_resumes_exactly(tmp_path, stage):
    """A 2-process ZeRO-2 / ZeRO-3 update writes a checkpoint whose weights and AdamW state (gathered from the
    partitions, in a plain AdamW's layout) are the 1-process run's; a second 2-process run resumes from it (the state
    put back into the partitions) and its next update again lands where the 1-process run's next update does."""
    from safetensors.torch import load_file

    from flowrl.run.checkpoint import read_checkpoint

    extra = [
        "train.inner_epochs=2",
        "train.grpo.beta=0.05",
        "train.steps_per_forward=2",
        "eval.grid=false",
        "train.weight_decay=0.1",
        "checkpoint.keep=0",
    ]
    one = Trainer(tiny_cfg(tmp_path / "one", *extra))
    batch = one.rollout(epoch=0)
    adv = torch.tensor([1.2, -0.4, 0.3, -1.1, 0.8, -0.9, 0.5, -0.4])
    torch.save(
        {"traj": batch.traj, "prompts": batch.prompts, "metadata": batch.metadata, "adv": adv}, tmp_path / "batch.pt"
    )
    keep = torch.ones(8, dtype=torch.bool)
    one.update(batch, adv, keep, epoch=0)
    one.state.epochs_done = 1
    one_ck = read_checkpoint(one.save())
    one.update(batch, adv, keep, epoch=1)

    script = [
        str(Path(__file__).parent / "dist_update.py"),
        str(tmp_path / "batch.pt"),
        str(tmp_path / "two.st"),
        *TINY,
        *extra,
        f"log.run_dir={tmp_path / 'two'}",
    ]
    proc = launch(tmp_path, script, stage, DIST_UPDATE_SAVE="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    two_ck = read_checkpoint(tmp_path / "two" / "ckpt-000001")
    top = max(p.detach().abs().max().item() for p in one.named_params.values())
    for name in one.named_params:
        assert (two_ck["trainable"][name] - one_ck["trainable"][name]).abs().max() <= 1e-5 * top, name
    a, b = one_ck["optimizer"], two_ck["optimizer"]
    assert a["param_groups"] == b["param_groups"] and set(a["state"]) == set(b["state"])
    for k, st in a["state"].items():
        assert float(st["step"]) == float(b["state"][k]["step"]) == 2
        for m in ("exp_avg", "exp_avg_sq"):
            ref = st[m].abs().max().item()
            assert (b["state"][k][m] - st[m]).abs().max().item() <= 1e-4 * ref, (k, m)

    proc = launch(tmp_path, [*script, "checkpoint.resume=auto"], stage, DIST_UPDATE_SAVE="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "optimizer steps 4" in proc.stdout
    two = load_file(tmp_path / "two.st")
    for name, p in one.named_params.items():
        assert (two[name] - p.detach()).abs().max().item() <= 1e-5 * top, name


def test_zero3_trains_checkpoints_exports_and_resumes(tmp_path):
    """`flowrl train` under ZeRO-3 on 2 processes, every weight of the denoiser partitioned: the rollouts and the eval
    run through the partitioned model, a checkpoint gathers the trained weights and their AdamW state, its exported
    LoRA loads into a fresh pipeline, and a resume (the state put back into the partitions) continues to epoch 3."""
    import json as json_

    from safetensors.torch import load_file

    from flowrl.families.sd3 import tiny_sd3_pipeline

    base = [
        "-m",
        "flowrl",
        "train",
        *TINY,
        "train.grpo.beta=0.05",
        "sample.prompts_per_epoch=2",
        "sample.group_size=2",
        "eval.num_prompts=3",
        "checkpoint.every=1",
        "checkpoint.keep=0",
        f"log.run_dir={tmp_path / 'run'}",
    ]
    proc = launch(tmp_path, [*base, "train.epochs=2"], stage=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = launch(tmp_path, [*base, "train.epochs=3", "checkpoint.resume=auto"], stage=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    rows = [json_.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "policy/loss" in r]
    assert [r["epoch"] for r in trained] == [1, 2, 3] and trained[0]["policy/ratio_first_dev"] <= 1e-5
    assert all(r["policy/ratio_first_dev"] <= 1e-5 for r in trained)  # the resumed weights are the rollouts'
    ck = load_file(tmp_path / "run" / "ckpt-000003" / "trainable.safetensors")
    before = load_file(tmp_path / "run" / "ckpt-000001" / "trainable.safetensors")
    assert set(ck) == set(before) and all(v.numel() > 0 for v in ck.values())
    assert max((ck[k] - before[k]).abs().max().item() for k in ck) > 0
    opt = load_file(tmp_path / "run" / "ckpt-000003" / "optimizer.safetensors")
    assert opt and all(v.numel() > 0 for v in opt.values())
    pipe = tiny_sd3_pipeline()
    pipe.load_lora_weights(tmp_path / "run" / "ckpt-000003" / "lora")


@pytest.mark.parametrize("stage", [3])  # ZeRO-3 needs the skipped engine step (ZeRO-2 dropped the NaN anyway)
def test_zero_a_non_finite_loss_on_one_process_skips_the_step_on_every_process(tmp_path, monkeypatch, stage):
    """The second process's first minibatch has NaN log-probs: DeepSpeed takes no step on it anywhere and drops its
    gradient (ZeRO-3 would keep it without flowrl's `engine.step()` on it); the next two steps land where a 1-process
    run that skips its first minibatch lands."""
    from safetensors.torch import load_file

    extra = ["train.inner_epochs=3", "train.steps_per_forward=2", "eval.grid=false"]
    one = Trainer(tiny_cfg(tmp_path / "one", *extra))
    batch = one.rollout(epoch=0)
    adv = torch.tensor([1.2, -0.4, 0.3, -1.1, 0.8, -0.9, 0.5, -0.4])
    torch.save(
        {"traj": batch.traj, "prompts": batch.prompts, "metadata": batch.metadata, "adv": adv}, tmp_path / "batch.pt"
    )
    unit_log_probs, calls = one.policy.unit_log_probs, []

    def poisoned(*args, **kwargs):
        out = unit_log_probs(*args, **kwargs)
        if not calls:
            out.log_prob = out.log_prob * float("nan")
        calls.append(1)
        return out

    monkeypatch.setattr(one.policy, "unit_log_probs", poisoned)
    with pytest.warns(UserWarning, match="non-finite loss"):
        metrics = one.update(batch, adv, torch.ones(8, dtype=torch.bool), epoch=0)
    assert one.state.optimizer_steps == 2 and metrics["policy/skipped_nonfinite"] == 1
    script = [
        str(Path(__file__).parent / "dist_update.py"),
        str(tmp_path / "batch.pt"),
        str(tmp_path / "two.st"),
        *TINY,
        *extra,
        f"log.run_dir={tmp_path / 'two'}",
    ]
    proc = launch(tmp_path, script, stage, DIST_UPDATE_POISON="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "optimizer steps 2" in proc.stdout and "skipped 1" in proc.stdout
    two = load_file(tmp_path / "two.st")
    top = max(p.detach().abs().max().item() for p in one.named_params.values())
    for name, p in one.named_params.items():
        assert (two[name] - p.detach()).abs().max().item() <= 1e-5 * top, name
