"""End-to-end image GRPO on a tiny SD3 on the CPU: the loop really trains, resumes exactly, exports a
LoRA diffusers loads, and the steps_per_forward / reference / weighting paths equal their definitions."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launching import accelerate_launch, flowrl_train_on_two_cpu_processes

from flowrl.config import load_config
from flowrl.train import Trainer

TINY = [
    "sample.height=32",
    "sample.width=32",
    "sample.num_steps=4",
    "sample.max_sequence_length=16",
    "sample.prompts_per_epoch=2",
    "sample.group_size=4",
    "eval.num_steps=3",
    "eval.num_prompts=2",
    "log.progress=false",
    "model.device=cpu",
    "train.lr=3e-3",
    "train.grpo.clip_low=0.2",
]


def tiny_cfg(run_dir, *extra):
    return load_config(None, [*TINY, f"log.run_dir={run_dir}", *extra])


def trained_weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.named_params.items()}


def test_two_epochs_train_lora_log_finite_and_export(tmp_path):
    cfg = tiny_cfg(
        tmp_path / "run",
        "train.epochs=2",
        "train.grpo.beta=0.05",
        "train.steps_per_forward=2",
        "train.inner_epochs=2",
        "train.minibatch_size=4",
    )
    tr = Trainer(cfg)
    before = trained_weights(tr)
    assert before and all("lora" in n for n in before)
    tr.fit()
    after = trained_weights(tr)
    changed = max((after[n] - before[n]).abs().max().item() for n in before)
    assert changed > 1e-6, "two epochs of GRPO did not change the LoRA weights"

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if "policy/loss" in r]
    assert [r["epoch"] for r in epochs] == [1, 2]
    for r in rows:
        for k, v in r.items():
            if isinstance(v, float):
                assert math.isfinite(v), (k, v)
    for r in epochs:
        # the first minibatch of every epoch is on-policy: ratio exactly 1
        assert r["policy/ratio_first_dev"] <= 1e-6 and abs(r["policy/ratio_first"] - 1) <= 1e-6
        for key in (
            "reward/jpeg_compressibility_mean",
            "adv/std",
            "policy/clipfrac",
            "policy/approx_kl",
            "policy/kl",
            "policy/grad_norm",
            "lr",
            "perf/samples_per_s",
            "time/rollout",
            "time/reward",
            "time/train",
            "policy/ratio_max",
            "policy/ratio_min",
        ):
            assert key in r, key
    assert epochs[1]["policy/kl"] > 0  # after updates the policy has left the reference
    # with 2 inner epochs the second pass is off-policy: the ratio leaves 1
    assert epochs[1]["policy/ratio_max"] > 1.0 or epochs[1]["policy/ratio_min"] < 1.0
    assert (tmp_path / "run" / "eval-final.png").exists()

    # the exported LoRA loads into a fresh diffusers pipeline and reproduces the trained denoiser
    from flowrl.families.sd3 import tiny_sd3_pipeline

    ckpt = tmp_path / "run" / "ckpt-000002"
    pipe = tiny_sd3_pipeline()
    pipe.load_lora_weights(ckpt / "lora")
    den_trained = tr.policy.backend.denoiser
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, *den_trained.config.in_channels and (den_trained.config.in_channels, 16, 16), generator=gen)
    enc = torch.randn(1, 5, den_trained.config.joint_attention_dim, generator=gen)
    pooled = torch.randn(1, den_trained.config.pooled_projection_dim, generator=gen)
    t = torch.tensor([500.0])
    with torch.no_grad():
        a = den_trained(hidden_states=x, encoder_hidden_states=enc, pooled_projections=pooled, timestep=t)[0]
        b = pipe.transformer(hidden_states=x, encoder_hidden_states=enc, pooled_projections=pooled, timestep=t)[0]
        pipe.transformer.disable_lora()
        base = pipe.transformer(hidden_states=x, encoder_hidden_states=enc, pooled_projections=pooled, timestep=t)[0]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert (a - base).abs().max() > 1e-6  # the adapter really is in the export


def test_resume_equals_straight_run(tmp_path):
    extra = [
        "train.epochs=4",
        "checkpoint.every=2",
        "checkpoint.keep=0",
        "train.schedule=cosine",
        "train.decay_frac=0.5",
        "train.warmup_steps=2",
        "train.ema_decay=0.5",
        "train.per_prompt_stats=true",
        "train.stat_min_count=2",
        "train.grpo.beta=0.01",
        "eval.grid=false",
    ]
    straight = Trainer(tiny_cfg(tmp_path / "a", *extra))
    straight.fit()
    w_straight = trained_weights(straight)
    assert (tmp_path / "a" / "ckpt-000002").exists() and (tmp_path / "a" / "ckpt-000004").exists()

    resumed = Trainer(tiny_cfg(tmp_path / "b", *extra, f"checkpoint.resume={tmp_path / 'a' / 'ckpt-000002'}"))
    resumed.fit()
    assert resumed.state.epochs_done == 4
    # bit for bit: the eval before training (which the resumed run does not repeat) encoded the eval prompts, and a
    # training prompt that is an eval prompt too trains with that encoding; the resumed run encodes them as it did
    for n, w in w_straight.items():
        assert torch.equal(resumed.named_params[n].detach(), w), n
        assert torch.equal(resumed.ema.shadow[n], straight.ema.shadow[n]), n
    assert resumed.tracker.state_dict() == straight.tracker.state_dict()

    # `resume: auto` picks the newest checkpoint: nothing left to do after epoch 4
    again = Trainer(tiny_cfg(tmp_path / "a", *extra, "checkpoint.resume=auto"))
    assert again.fit() == {} and again.state.epochs_done == 4


def _grads_with_units(tr, batch, adv, k):
    tr.opt.zero_grad(set_to_none=True)
    units = tr.policy.train_units(batch, k)
    n = sum(len(u) for u in units)
    keep = torch.ones(len(adv), dtype=torch.bool)
    idx = torch.arange(len(adv))
    for unit in units:
        loss, _ = tr.objective.loss(tr.policy.unit_log_probs(batch, idx, unit, with_reference=True), adv, keep)
        (loss * (len(unit) / n)).backward()
    return [p.grad.clone() for p in tr.params]


@pytest.mark.parametrize("weighting", ["none", "noise"])
def test_steps_per_forward_gives_the_same_gradients(tmp_path, weighting):
    tr = Trainer(tiny_cfg(tmp_path, "train.grpo.beta=0.1", f"train.grpo.step_weighting={weighting}"))
    with torch.no_grad():  # move off the reference so the KL has a gradient too
        for n, p in tr.named_params.items():
            p.add_(0.05 * torch.randn_like(p))
    batch = tr.rollout(epoch=0)
    adv = torch.linspace(-1.5, 1.5, len(batch.prompts))
    one = _grads_with_units(tr, batch, adv, 1)
    four = _grads_with_units(tr, batch, adv, 4)
    assert any(g.abs().max() > 0 for g in one)
    for g1, g4 in zip(one, four):
        torch.testing.assert_close(g4, g1, rtol=1e-4, atol=1e-7)


def test_reference_is_the_base_model_with_the_adapter_off(tmp_path):
    from flowrl.families.sd3 import tiny_sd3_pipeline

    tr = Trainer(tiny_cfg(tmp_path, "train.grpo.beta=0.1"))
    with torch.no_grad():
        for n, p in tr.named_params.items():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # lora_B starts at 0: perturb it so adapter on != off
    den = tr.policy.backend.denoiser
    base = tiny_sd3_pipeline().transformer
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, den.config.in_channels, 16, 16, generator=gen)
    enc = torch.randn(2, 5, den.config.joint_attention_dim, generator=gen)
    pooled = torch.randn(2, den.config.pooled_projection_dim, generator=gen)
    kw = dict(
        hidden_states=x, encoder_hidden_states=enc, pooled_projections=pooled, timestep=torch.tensor([300.0, 700.0])
    )
    with torch.no_grad():
        on = den(**kw)[0]
        with tr.policy.reference():
            off = tr.policy.backend.denoiser(**kw)[0]
        want = base(**kw)[0]
        on_again = den(**kw)[0]
    torch.testing.assert_close(off, want, rtol=0, atol=1e-6)
    assert (on - off).abs().max() > 1e-4
    torch.testing.assert_close(on_again, on, rtol=0, atol=0)  # the adapter is back on afterwards


def _unit_and_its_means(tr, batch, idx, unit):
    """The policy's unit output (with the reference) and, recomputed apart, the policy's step means and stds and the
    reference's means: (out, mean, std, ref_mean)."""
    out = tr.policy.unit_log_probs(batch, idx, unit, with_reference=True)
    backend = tr.policy.backend
    with torch.no_grad():
        _, mean, std = backend.step_log_prob(batch.traj, unit, sample_indices=idx)
        with tr.policy.reference():
            _, ref_mean, _ = backend.step_log_prob(batch.traj, unit, sample_indices=idx)
    return out, mean, std, ref_mean


def test_kl_matches_gaussian_kl_of_the_means(tmp_path):
    """The unit's KL equals (mean - mean_ref)^2 / (2 std^2) averaged over the latent, recomputed here from two
    separate step_log_prob calls (policy and reference); and `kl_std: sigma` divides std by sqrt(dt)."""
    from flowrl.core import gaussian_kl

    for kl_std in ("step", "sigma"):
        tr = Trainer(tiny_cfg(tmp_path / kl_std, "train.grpo.beta=0.1", f"train.grpo.kl_std={kl_std}"))
        batch = tr.rollout(epoch=0)
        # LoRA B starts at zero: before any update the policy IS the reference, so the KL is exactly 0
        fresh = tr.policy.unit_log_probs(batch, torch.arange(2), batch.traj.train_steps, with_reference=True)
        assert fresh.kl.abs().max().item() == 0.0
        with torch.no_grad():
            for n, p in tr.named_params.items():
                p.add_(0.05 * torch.randn_like(p))
        batch = tr.rollout(epoch=0)
        idx = torch.arange(3)
        unit = batch.traj.train_steps[1:3]
        out, mean, std, ref_mean = _unit_and_its_means(tr, batch, idx, unit)
        sig = batch.traj.sigmas
        for j, s in enumerate(unit):
            sd = std[:, j].flatten()
            if kl_std == "sigma":
                sd = sd / torch.sqrt(sig[s] - sig[s + 1])
            want = gaussian_kl(mean[:, j], ref_mean[:, j], sd)
            torch.testing.assert_close(out.kl[:, j].detach(), want, rtol=1e-5, atol=1e-9)
        assert out.kl.abs().max() > 0


def test_the_cps_kl_is_its_densitys_and_finite_at_the_last_step(tmp_path):
    """CPS trains with the unnormalised density -(x' - mean)^2, N(mean, 1/2)'s, and its transition std
    sigma_next sin(a pi / 2) is 0 at the last step: its KL is the mean squared difference of the means (the KL of
    that density; by hand here), finite at every step, and a run with a KL term trains (it was a NaN gradient at
    every step, blamed on the rewards)."""
    tr = Trainer(tiny_cfg(tmp_path / "cps", "train.grpo.beta=0.1", "train.grpo.sde_type=cps"))
    with torch.no_grad():
        for p in tr.named_params.values():
            p.add_(0.05 * torch.randn_like(p))
    batch = tr.rollout(epoch=0)
    assert batch.traj.sampler.sde_type == "cps"
    idx, unit = torch.arange(3), list(batch.traj.train_steps)
    assert unit[-1] == len(batch.traj.sigmas) - 2  # the last step, into sigma 0, is trained
    out, mean, std, ref_mean = _unit_and_its_means(tr, batch, idx, unit)
    assert std[:, -1].abs().max() == 0  # the last step's transition std
    want = ((mean.double() - ref_mean.double()) ** 2).flatten(2).mean(-1)  # [b, K]
    torch.testing.assert_close(out.kl.detach().double(), want, rtol=1e-5, atol=1e-12)
    assert torch.isfinite(out.kl).all() and out.kl.abs().max() > 0
    tr.fit()
    rows = [json.loads(line) for line in (tmp_path / "cps" / "metrics.jsonl").read_text().splitlines()]
    norms = [r["policy/grad_norm"] for r in rows if "policy/grad_norm" in r]
    assert norms and all(math.isfinite(n) and n > 0 for n in norms), norms


def test_noise_weights_follow_the_transition_std(tmp_path):
    tr = Trainer(tiny_cfg(tmp_path, "train.grpo.step_weighting=noise"))
    batch = tr.rollout(epoch=0)
    steps = batch.traj.train_steps
    stds = batch.traj.stds[steps]
    out = tr.policy.unit_log_probs(batch, torch.arange(2), steps, with_reference=False)
    torch.testing.assert_close(out.weight.flatten(), (stds / stds.mean()).float(), rtol=1e-6, atol=0)
    # and TempFlow-GRPO's premise: the std differs across steps, so the weights are not all 1
    assert out.weight.max() - out.weight.min() > 1e-3


def test_fixed_window_trains_only_the_window(tmp_path):
    tr = Trainer(
        tiny_cfg(tmp_path, "train.grpo.window.kind=fixed", "train.grpo.window.start=1", "train.grpo.window.size=2")
    )
    batch = tr.rollout(epoch=0)
    assert batch.traj.train_steps == [1, 2]
    assert tr.policy.train_units(batch, 4) == [[1, 2]]


def test_bad_values_fail_before_any_work(tmp_path):
    from flowrl.cli import main

    assert main(["train", "sample.group_size=1", f"log.run_dir={tmp_path}"]) == 2
    assert not any(tmp_path.iterdir())


def test_train_help_shows_field_docs(capsys):
    from flowrl.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "train.grpo.clip_low" in out and "Flow-GRPO uses 1e-4" in out and "train.grpo.window.kind" in out


RANK0_SIGNAL_REWARD = """
import os, signal
calls = 0

def brightness(images, prompts, on_call=3, **metadata):
    global calls
    calls += 1
    if calls == on_call and os.environ.get("RANK", "0") == "0":  # 3: epoch 2's (the eval before, epoch 1, epoch 2)
        os.kill(os.getpid(), signal.SIGTERM)
    return [sum(im.convert("L").getdata()) / (255.0 * im.width * im.height) for im in images]
"""


def test_a_signal_to_one_of_two_processes_stops_both_cleanly_on_a_checkpointed_state(tmp_path):
    """SIGTERM to rank 0 during epoch 2's reward, whose state (epoch 1's end) the newest checkpoint already holds:
    every process decides alike not to save again (a save is a collective; only the main process knows the path),
    so both stop with no traceback and the run resumes to its end."""
    (tmp_path / "scores.py").write_text(RANK0_SIGNAL_REWARD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = flowrl_train_on_two_cpu_processes(
        *TINY,
        "train.epochs=3",
        "checkpoint.every=1",
        "eval.num_prompts=2",
        "eval.grid=false",
        "rewards=[{name: 'scores.py:brightness'}]",
        f"log.run_dir={tmp_path / 'run'}",
    )
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    # (the launcher itself prints a traceback for any rank's non-zero exit: none from flowrl's processes)
    assert proc.returncode != 0 and "[rank" not in proc.stderr and "RuntimeError" not in proc.stderr, proc.stderr
    stopped = [line for line in proc.stderr.splitlines() if line.startswith("flowrl train: stopped by")]
    assert stopped == [  # said once, by the main process
        f"flowrl train: stopped by SIGTERM after 1 epoch; checkpoint {tmp_path / 'run' / 'ckpt-000001'}. Resume with "
        f"checkpoint.resume=auto (same config and log.run_dir={tmp_path / 'run'})"
    ], proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt-*")) == ["ckpt-000001"]
    again = [*cmd, "checkpoint.resume=auto", "rewards=[{name: 'scores.py:brightness', kwargs: {on_call: 0}}]"]
    resumed = subprocess.run(again, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (tmp_path / "run" / "ckpt-000003").is_dir()


@pytest.mark.skipif(sys.platform != "linux", reason="gloo multi-process test written for linux")
def test_two_processes_stay_in_sync(tmp_path):
    """`accelerate launch -m flowrl train` with 2 CPU processes (gloo): groups span the processes, gradients
    are averaged, and both ranks end with the same weights."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    config = Path(__file__).resolve().parents[1] / "configs" / "accelerate" / "cpu_2proc.yaml"  # the shipped one
    cmd = [
        *accelerate_launch(),
        "--config_file",
        str(config),
        "-m",
        "flowrl",
        "train",
        *TINY,
        "train.epochs=1",
        "sample.prompts_per_epoch=3",
        "sample.group_size=2",
        "eval.num_prompts=3",
        "eval.images_per_prompt=2",
        f"log.run_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # one result on stdout, the main process's (with the final eval), not one per rank
    assert proc.stdout.count('"reward/total_mean"') == 1 and '"eval/' in proc.stdout, proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sync = [r for r in rows if "dist/replica_max_abs_diff" in r]
    assert sync and sync[-1]["dist/replica_max_abs_diff"] == 0.0
    trained = [r for r in rows if "policy/loss" in r]
    assert trained and trained[0]["policy/ratio_first_dev"] <= 1e-6
    assert (tmp_path / "ckpt-000001" / "lora").is_dir()
    # the eval was shared out (rank 0: prompts 0-1, rank 1: prompt 2) and gathered: one process evaluating the
    # same weights on all prompts gets the same scores and the same grid
    from flowrl.cli import main

    final = next(r for r in rows if r.get("final"))["eval/jpeg_compressibility_mean"]
    out = tmp_path / "one"
    assert (
        main(
            [
                "eval",
                *TINY,
                "eval.num_prompts=3",
                "eval.images_per_prompt=2",
                "--checkpoint",
                str(tmp_path / "ckpt-000001"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    one = json.loads((out / "eval.json").read_text())
    assert one["num_samples"] == 6 and abs(one["eval/jpeg_compressibility_mean"] - final) <= 1e-4
    import numpy as np
    from PIL import Image

    a = np.asarray(Image.open(tmp_path / "eval-final.png"), dtype=np.int16)
    b = np.asarray(Image.open(out / "eval.png"), dtype=np.int16)
    assert a.shape == b.shape and np.abs(a - b).max() <= 2


@pytest.mark.skipif(sys.platform != "linux", reason="gloo multi-process test written for linux")
def test_two_processes_share_the_budget_schedule_and_the_feature_diversity(tmp_path):
    """Two processes with an lr that decays over the time budget measured on each process's own CPU clock (here
    rank 1's runs 3 times fast, tests/skewed_clock_train.py: each epoch's lr must be taken from one value for all,
    or the replicas drift apart), and feature-space diversity in the evals (the gathered images embedded on the
    main process while the other waits): the replicas end equal, the lr decays over the budget, the run stops on
    it, and the final eval logs the features against the first eval's."""
    from rewardtiny import save_tiny_dinov2
    from test_diversity_features import DISTANCE, RATIO, SPREAD

    dino = tmp_path / "dino"
    save_tiny_dinov2(dino)
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    config = Path(__file__).resolve().parents[1] / "configs" / "accelerate" / "cpu_2proc.yaml"
    # 10^5 epochs: the cosine's position is the budget's share spent, not the epoch count's
    cmd = [
        *accelerate_launch(),
        "--config_file",
        str(config),
        str(Path(__file__).parent / "skewed_clock_train.py"),
        *TINY,
        "train.epochs=100000",
        "sample.prompts_per_epoch=2",
        "sample.group_size=2",
        "eval.num_prompts=2",
        "eval.images_per_prompt=2",
        "eval.every=0",
        "eval.grid=false",
        f"eval.diversity_features={dino}",
        "train.schedule=cosine",
        "train.schedule_over=budget",
        "train.max_minutes=0.05",
        "train.budget_clock=process",
        f"log.run_dir={run}",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train.max_minutes=0.05 (process clock) reached" in proc.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in rows if "dist/replica_max_abs_diff" in r][-1]["dist/replica_max_abs_diff"] == 0.0
    lrs = [r["lr"] for r in rows if "policy/loss" in r]
    assert len(lrs) >= 2 and lrs[0] == pytest.approx(3e-3, rel=1e-6) and 0 <= lrs[-1] < lrs[0]
    evals = [r for r in rows if SPREAD in r]
    assert [r["epoch"] for r in evals] == [0, len(lrs)]
    assert (evals[0][RATIO], evals[0][DISTANCE]) == (1.0, 0.0)  # the base model against itself
    assert math.isfinite(evals[1][RATIO]) and evals[1][DISTANCE] >= 0
    assert (run / "eval-base-features.safetensors").is_file()  # written once, by the main process


@pytest.mark.skipif(sys.platform != "linux", reason="gloo multi-process test written for linux")
def test_fsdp_trains_checkpoints_exports_and_resumes_over_two_processes(tmp_path):
    """`flowrl train` with train.sharding=fsdp on 2 CPU processes: the LoRA'd SD3 sharded per block (FSDP2), the
    reference KL through the adapter switched off, a checkpoint gathered from the shards, its exported LoRA
    loading into a fresh pipeline, and a resume that continues to epoch 3."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    config = Path(__file__).resolve().parents[1] / "configs" / "accelerate" / "cpu_2proc.yaml"
    base = [
        *accelerate_launch(),
        "--config_file",
        str(config),
        "-m",
        "flowrl",
        "train",
        *TINY,
        "train.sharding=fsdp",
        "train.grpo.beta=0.05",
        "sample.prompts_per_epoch=2",
        "sample.group_size=2",
        "eval.num_prompts=3",
        "checkpoint.every=1",
        "checkpoint.keep=0",
        f"log.run_dir={tmp_path}",
    ]
    proc = subprocess.run([*base, "train.epochs=2"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run(
        [*base, "train.epochs=3", "checkpoint.resume=auto"], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "policy/loss" in r]
    assert [r["epoch"] for r in trained] == [1, 2, 3] and trained[0]["policy/ratio_first_dev"] <= 1e-5
    assert all(math.isfinite(r["policy/loss"]) for r in trained)
    from safetensors.torch import load_file

    from flowrl.families.sd3 import tiny_sd3_pipeline

    ck = load_file(tmp_path / "ckpt-000003" / "trainable.safetensors")
    before = load_file(tmp_path / "ckpt-000001" / "trainable.safetensors")
    assert set(ck) == set(before) and max((ck[k] - before[k]).abs().max().item() for k in ck) > 0
    pipe = tiny_sd3_pipeline()
    pipe.load_lora_weights(tmp_path / "ckpt-000003" / "lora")  # whole tensors, in the diffusers format


@pytest.mark.skipif(sys.platform != "linux", reason="gloo multi-process test written for linux")
def test_fsdp_full_fine_tuning_exports_the_gathered_model(tmp_path):
    """Full fine-tuning of bf16 weights under FSDP on 2 CPU processes, its frozen reference sharded too
    (train.grpo.beta > 0): the shards are float32 master weights gathered in bf16 for the forward, so the first
    minibatch is on-policy and its KL to the (bf16) reference is exactly 0; the checkpoint's exported denoiser,
    gathered from the shards, loads with diffusers' from_pretrained and holds the trained weights, which moved."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    config = Path(__file__).resolve().parents[1] / "configs" / "accelerate" / "cpu_2proc.yaml"
    cmd = [
        *accelerate_launch(),
        "--config_file",
        str(config),
        "-m",
        "flowrl",
        "train",
        *TINY,
        "train.sharding=fsdp",
        "lora.enabled=false",
        "model.dtype=bfloat16",
        "train.lr=1e-4",
        "train.grpo.beta=0.05",
        "train.epochs=1",
        "sample.prompts_per_epoch=2",
        "sample.group_size=2",
        "eval.num_prompts=2",
        "eval.grid=false",
        "checkpoint.every=1",
        f"log.run_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import load_file

    from flowrl.families.sd3 import tiny_sd3_pipeline

    row = next(
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "policy/kl" in line
    )
    assert row["policy/kl"] == 0.0 and row["policy/ratio_first_dev"] == 0.0
    trained = load_file(tmp_path / "ckpt-000001" / "trainable.safetensors")
    assert {v.dtype for v in trained.values()} == {torch.float32}  # the master weights
    model = SD3Transformer2DModel.from_pretrained(tmp_path / "ckpt-000001" / "model" / "transformer")
    state = model.state_dict()
    assert set(trained) <= set(state)
    assert all(torch.equal(state[k], trained[k]) for k in trained)
    base = tiny_sd3_pipeline().transformer.state_dict()
    assert max((state[k] - base[k].bfloat16().float()).abs().max().item() for k in trained) > 0


@pytest.mark.skipif(sys.platform != "linux", reason="gloo multi-process test written for linux")
@pytest.mark.parametrize(
    "dropped,sharding,lora",
    [(False, "none", True), (True, "none", True), (True, "fsdp", True), (False, "none", False), (False, "fsdp", False)],
)
def test_two_processes_update_as_one_process_over_the_same_global_batch(tmp_path, dropped, sharding, lora):
    """The update of a 2-process run (each process its half of the global batch, gradients averaged over the
    processes) takes the weights where a 1-process update over the whole batch takes them: 3 optimizer steps, the
    reference KL on, within 1e-5 relative. `dropped`: the second process's samples and one of the first's are left
    out of the loss (zero-advantage groups): the loss is still the mean over the kept samples of the whole batch,
    the second process taking part in the gradient average with nothing to add. `lora` False: full fine-tuning,
    whose reference is a frozen copy of the denoiser (sharded too under FSDP)."""
    from safetensors.torch import load_file

    extra = [
        "train.inner_epochs=3",
        "train.grpo.beta=0.05",
        "train.steps_per_forward=2",
        "eval.grid=false",
        f"lora.enabled={str(lora).lower()}",
    ] + ([] if lora else ["train.lr=1e-4"])
    one = Trainer(tiny_cfg(tmp_path / "one", *extra))
    batch = one.rollout(epoch=0)
    adv = torch.tensor([1.2, -0.4, 0.3, -1.1, 0.8, -0.9, 0.5, -0.4])
    keep = torch.tensor([True, True, False, True] + [not dropped] * 4)
    torch.save(
        {"traj": batch.traj, "prompts": batch.prompts, "metadata": batch.metadata, "adv": adv, "keep": keep},
        tmp_path / "batch.pt",
    )
    one.update(batch, adv, keep, epoch=0)
    assert one.state.optimizer_steps == 3
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        *accelerate_launch(),
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(Path(__file__).parent / "dist_update.py"),
        str(tmp_path / "batch.pt"),
        str(tmp_path / "two.safetensors"),
        *TINY,
        *extra,
        f"log.run_dir={tmp_path / 'two'}",
        f"train.sharding={sharding}",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "optimizer steps 3" in proc.stdout
    two = load_file(tmp_path / "two.safetensors")
    top = max(p.detach().abs().max().item() for p in one.named_params.values())
    for name, p in one.named_params.items():
        assert (two[name] - p.detach()).abs().max().item() <= 1e-5 * top, name


def test_same_noise_per_group_shares_the_initial_noise(tmp_path):
    tr = Trainer(tiny_cfg(tmp_path, "train.grpo.same_noise_per_group=true"))
    batch = tr.rollout(epoch=0)
    x0 = batch.traj.latents[:, 0]  # [B, ...] initial noise, prompt-major groups of 4
    for g in range(2):
        group = x0[4 * g : 4 * g + 4]
        assert torch.equal(group, group[:1].expand_as(group))
    assert not torch.equal(x0[0], x0[4])
    assert not torch.equal(batch.traj.latents[0, -1], batch.traj.latents[1, -1])  # the SDE noise differs


def test_off_policy_first_minibatch_warns(tmp_path):
    tr = Trainer(tiny_cfg(tmp_path))
    batch = tr.rollout(epoch=0)
    with torch.no_grad():  # the weights change between rollout and update: not on-policy any more
        for n, p in tr.named_params.items():
            p.add_(0.2 * torch.randn_like(p))
    adv = torch.linspace(-1, 1, len(batch.prompts))
    with pytest.warns(UserWarning, match="not on-policy"):
        out = tr.update(batch, adv, torch.ones(len(adv), dtype=torch.bool), epoch=0)
    assert out["policy/ratio_first_dev"] > 1e-4


def test_dropped_samples_are_not_computed_and_the_update_is_unchanged(tmp_path):
    """drop_zero_adv_groups masks a group out of every loss term; the update skips its forward passes. Checked
    against the masked computation over the whole minibatch (what the loss alone would give)."""
    import functools
    import warnings

    from flowrl.objectives.grpo import grpo_loss

    extra = ("train.drop_zero_adv_groups=true", "train.minibatch_size=2", "train.inner_epochs=2", "eval.grid=false")
    fast, masked = Trainer(tiny_cfg(tmp_path / "a", *extra)), Trainer(tiny_cfg(tmp_path / "b", *extra))
    for n, p in fast.named_params.items():
        assert torch.equal(p, masked.named_params[n])  # the same start
    batch = fast.rollout(epoch=0)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0])  # group 1 has no signal
    keep = adv != 0

    def spy(tr, seen):
        evaluate = tr.policy.unit_log_probs

        def wrapped(b, idx, unit, **kw):
            seen.append(idx.clone())
            return evaluate(b, idx, unit, **kw)

        tr.policy.unit_log_probs = wrapped

    fast_idx, masked_idx = [], []
    spy(fast, fast_idx), spy(masked, masked_idx)
    cfg = masked.cfg
    start = {n: p.detach().clone() for n, p in fast.named_params.items()}
    real_keep = {"keep": keep}
    # the reference: every sample forwarded, the dropped ones masked out of the loss by the real keep
    masked.objective.loss = lambda out, a, k, normalizer=None: grpo_loss(
        out, a, real_keep["keep"][masked_idx[-1]], cfg.train.grpo, masked.policy.aggregation, masked.policy.entropy_coef
    )
    # ... whose minibatches of dropped samples only take no optimizer step (AdamW moves on a zero gradient)
    opt_step = masked.opt.step

    @functools.wraps(opt_step)
    def step_if_any_kept():
        return opt_step() if real_keep["keep"][masked_idx[-1]].any() else None

    masked.opt.step = step_if_any_kept
    out_fast = fast.update(batch, adv, keep, epoch=0)
    masked.update(batch, adv, torch.ones_like(keep), epoch=0)
    forwarded = torch.cat(fast_idx)
    assert len(forwarded) and bool(keep[forwarded].all())  # no dropped sample was computed
    assert len(torch.cat(masked_idx)) == 2 * len(forwarded)  # half the samples were dropped
    assert any(not keep[i].any() for i in masked_idx)  # some minibatch was all dropped
    assert max((p - start[n]).abs().max().item() for n, p in fast.named_params.items()) > 0
    for n, p in fast.named_params.items():  # float sums over 2 rows vs 4 differ in the last bits (1.3e-6 seen)
        torch.testing.assert_close(p, masked.named_params[n], rtol=0, atol=5e-6)
    assert out_fast["policy/ratio_first_dev"] <= 1e-4  # from the first minibatch that trained
    # nothing kept: no forward pass, no ratio (not a spurious off-policy warning), and no optimizer step: AdamW
    # would move the weights on a zero gradient (momentum, weight decay)
    fast_idx.clear()
    none = torch.zeros(8, dtype=torch.bool)
    before, steps = trained_weights(fast), fast.state.optimizer_steps
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fast.update(batch, torch.zeros(8), none, epoch=1)
    assert not fast_idx and "policy/ratio_first" not in out and out["policy/trained_units"] == 0
    assert all(torch.equal(p, before[n]) for n, p in fast.named_params.items())
    assert fast.state.optimizer_steps == steps


def test_an_empty_leading_minibatch_does_not_step_before_the_on_policy_check(tmp_path):
    """With drop_zero_adv_groups, an epoch's first minibatch may hold only dropped samples. The first minibatch
    that trains must still see the rollout's weights (ratio 1): the empty one takes no optimizer step. The lr
    schedule follows the minibatch's slot in the run, so the skipped slot does not delay it."""
    import warnings

    from flowrl.seeding import derive_seed

    tr = Trainer(
        tiny_cfg(
            tmp_path,
            "train.drop_zero_adv_groups=true",
            "train.minibatch_size=2",
            "eval.grid=false",
            "train.lr=1e-2",
            "train.epochs=2",
            "train.schedule=cosine",
            "train.decay_frac=0.5",
        )
    )
    lrs = []
    opt_step = tr.opt.step
    tr.opt.step = lambda: (lrs.append(tr.opt.param_groups[0]["lr"]), opt_step())[1]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.5, -0.5])
    tr.update(tr.rollout(epoch=0), adv, torch.ones(8, dtype=torch.bool), epoch=0)  # Adam now has momentum
    batch = tr.rollout(epoch=1)  # on-policy again
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(derive_seed(tr.cfg.train.seed, 1, 0, 0, 7)))
    keep = torch.ones(8, dtype=torch.bool)
    keep[perm[:2]] = False  # the first minibatch is empty
    before, steps = trained_weights(tr), tr.state.optimizer_steps
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no off-policy warning
        out = tr.update(batch, adv * keep, keep, epoch=1)
    assert tr.state.optimizer_steps == steps + 3  # 4 minibatches, the empty one skipped: the perm matched
    assert out["policy/ratio_first_dev"] <= 1e-6
    assert max((p - before[n]).abs().max().item() for n, p in tr.named_params.items()) > 0
    # 8 slots, the cosine over the last half (slots 4-7): epoch 0 at the full lr; epoch 1 skips slot 4 and
    # steps at slots 5, 6, 7, i.e. (1 + cos(pi k / 4)) / 2 for k = 1, 2, 3
    expected = [1e-2] * 4 + [1e-2 * (1 + math.cos(math.pi * k / 4)) / 2 for k in (1, 2, 3)]
    assert lrs == pytest.approx(expected, rel=1e-12)


def test_tensorboard_through_accelerate_trackers(tmp_path):
    Trainer(tiny_cfg(tmp_path, "train.epochs=1", "log.tensorboard=true", "eval.grid=false")).fit()
    events = list(tmp_path.rglob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_cli_train_eval_sample(tmp_path, capsys):
    from flowrl.cli import main

    run = tmp_path / "run"
    args = [*TINY, f"log.run_dir={run}", "train.epochs=1"]
    cfg_file = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
    assert main(["train", str(cfg_file), *args]) == 0
    assert (run / "before_after.png").exists() and (run / "curves.png").exists()
    ckpt = run / "ckpt-000001"
    assert main(["eval", str(cfg_file), *TINY, "--checkpoint", str(ckpt), "--out", str(tmp_path / "ev")]) == 0
    result = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert result["checkpoint"] == str(ckpt) and math.isfinite(result["eval/jpeg_compressibility_mean"])
    assert (tmp_path / "ev" / "eval.png").exists()
    assert (
        main(
            [
                "sample",
                str(cfg_file),
                *TINY,
                "--checkpoint",
                str(ckpt),
                "--prompt",
                "a red circle",
                "--prompt",
                "a blue square",
                "--num",
                "2",
                "--out",
                str(tmp_path / "imgs"),
            ]
        )
        == 0
    )
    assert len(list((tmp_path / "imgs").glob("*.png"))) == 4


def test_no_before_after_grid_without_a_before_eval(tmp_path):
    from PIL import Image

    from flowrl.cli import main

    run = tmp_path / "run"
    run.mkdir()
    Image.new("RGB", (8, 8)).save(run / "eval-epoch000000.png")  # an earlier run's, in a reused directory
    cfg_file = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
    assert main(["train", str(cfg_file), *TINY, f"log.run_dir={run}", "train.epochs=1", "eval.before=false"]) == 0
    assert (run / "eval-final.png").exists() and (run / "curves.png").exists()
    assert not (run / "before_after.png").exists()


def test_eval_weights_choose_the_ema_or_the_trained_weights(tmp_path):
    from flowrl.errors import CheckpointError
    from flowrl.run.checkpoint import read_checkpoint
    from flowrl.run.loading import checkpoint_weights as _checkpoint_weights
    from flowrl.run.loading import policy_from_checkpoint as _policy_from_checkpoint

    cfg = tiny_cfg(tmp_path, "train.epochs=1", "train.ema_decay=0.5", "eval.grid=false", "train.lr=1e-2")
    Trainer(cfg).fit()
    ck_dir = str(tmp_path / "ckpt-000001")
    ck = read_checkpoint(ck_dir)
    name = next(n for n in ck["trainable"] if "lora_B" in n)
    assert not torch.equal(ck["ema"][name], ck["trainable"][name])  # the EMA lags the trained weights
    for which, key in [("auto", "ema"), ("ema", "ema"), ("trained", "trainable")]:
        policy = _policy_from_checkpoint(cfg, ck_dir, which)
        got = dict(policy.named_trainable_parameters())[name]
        torch.testing.assert_close(got.detach().float(), ck[key][name].float(), rtol=0, atol=0)
    no_ema = {"trainable": ck["trainable"]}
    assert _checkpoint_weights(no_ema, "ck", "auto") is ck["trainable"]
    with pytest.raises(CheckpointError, match="no EMA weights.*--weights trained"):
        _checkpoint_weights(no_ema, "ck", "ema")
    with pytest.raises(CheckpointError, match="auto, ema, trained"):
        _checkpoint_weights(ck, "ck", "best")


def test_full_finetuning_with_a_frozen_reference(tmp_path):
    tr = Trainer(
        tiny_cfg(
            tmp_path, "lora.enabled=false", "train.grpo.beta=0.1", "train.epochs=1", "eval.grid=false", "train.lr=1e-4"
        )
    )
    den = tr.policy.backend.denoiser
    assert len(tr.params) == len(list(den.parameters()))  # every denoiser weight is trained
    ref = tr.policy.ref_copy
    ref_before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    before = trained_weights(tr)
    tr.fit()
    assert max((p.detach() - before[n]).abs().max().item() for n, p in tr.named_params.items()) > 0
    for n, p in ref.named_parameters():  # the reference stays the base model
        assert torch.equal(p, ref_before[n]) and not p.requires_grad
    assert (tmp_path / "ckpt-000001" / "model" / "transformer").is_dir()


def test_ratio_norm_runs_on_policy(tmp_path):
    tr = Trainer(tiny_cfg(tmp_path, "train.grpo.step_weighting=ratio_norm", "train.epochs=1", "eval.grid=false"))
    batch = tr.rollout(epoch=0)
    assert batch.traj.means is not None  # RatioNorm needs the recorded means
    out = tr.policy.unit_log_probs(batch, torch.arange(3), batch.traj.train_steps[:2], with_reference=False)
    # on-policy: mu_theta = mu_old, so b_t = 0 and log rho = (log p - log p_old) * std = 0
    assert out.log_ratio.abs().max().item() <= 1e-6
    metrics = tr.fit()
    assert math.isfinite(metrics["policy/loss"])


def test_a_resolution_the_model_cannot_take_fails_before_work(tmp_path):
    with pytest.raises(ValueError, match="divisible by"):
        Trainer(tiny_cfg(tmp_path, "sample.height=30"))


def test_drop_zero_advantage_groups(tmp_path):
    tr = Trainer(tiny_cfg(tmp_path, "train.drop_zero_adv_groups=true"))
    batch = tr.rollout(epoch=0)
    scores = torch.tensor([[1.0], [1.0], [1.0], [1.0], [0.0], [1.0], [0.5], [0.2]])  # group 0 all equal
    adv, keep, invalid = tr.advantages(batch, scores)
    assert invalid == 0
    assert keep.tolist() == [False] * 4 + [True] * 4
    assert torch.equal(adv[:4], torch.zeros(4))


def test_rollout_in_chunks_is_one_batch(tmp_path):
    tr = Trainer(tiny_cfg(tmp_path, "sample.rollout_batch_size=2"))
    batch = tr.rollout(epoch=0)
    assert len(batch.traj) == 8 and len(batch.images) == 8 and batch.prompts == batch.traj.prompts
    out = tr.policy.unit_log_probs(batch, torch.arange(8), batch.traj.train_steps, with_reference=False)
    assert (out.log_prob - out.old_log_prob).abs().max().item() <= 1e-5  # still on-policy after the join


def test_lora_init_path_starts_from_an_exported_adapter(tmp_path):
    first = Trainer(tiny_cfg(tmp_path / "a", "train.epochs=1", "eval.grid=false"))
    first.fit()
    second = Trainer(tiny_cfg(tmp_path / "b", f"lora.init_path={tmp_path / 'a' / 'ckpt-000001' / 'lora'}"))
    trained = trained_weights(first)
    assert any(w.abs().max() > 0 for n, w in trained.items() if "lora_B" in n)
    for n, p in second.named_params.items():
        torch.testing.assert_close(p.detach(), trained[n], rtol=0, atol=1e-7)
    # the run directory itself, as --checkpoint takes it: its newest complete checkpoint's LoRA, named in one line
    with pytest.warns(UserWarning, match=r"is a run directory: starting from the LoRA of its newest complete ") as seen:
        third = Trainer(tiny_cfg(tmp_path / "c", f"lora.init_path={tmp_path / 'a'}"))
    (named,) = [str(w.message) for w in seen if "is a run directory" in str(w.message)]  # once, for two reads
    assert named.endswith(f"ckpt-000001 ({tmp_path / 'a' / 'ckpt-000001' / 'lora'})")
    for n, p in third.named_params.items():
        torch.testing.assert_close(p.detach(), trained[n], rtol=0, atol=1e-7)


def test_flowrl_eval_without_a_checkpoint_names_the_adapter_it_starts_from(tmp_path, capsys):
    """`flowrl eval` without --checkpoint evaluates the model a run starts from: with lora.init_path, the result
    says that adapter, not "(base model)"."""
    from flowrl.cli import main

    first = Trainer(tiny_cfg(tmp_path / "a", "train.epochs=1", "eval.grid=false", "eval.num_prompts=2"))
    first.fit()
    lora = tmp_path / "a" / "ckpt-000001" / "lora"
    args = [*TINY, "eval.num_prompts=2", "eval.num_steps=2", "eval.grid=false"]
    for extra, label in (([f"lora.init_path={lora}"], f"(base model + lora.init_path={lora})"), ([], "(base model)")):
        capsys.readouterr()
        assert main(["eval", *args, *extra]) == 0
        out = capsys.readouterr().out
        assert json.loads(out[out.index("{") :])["checkpoint"] == label


def test_a_missing_or_truncated_lora_init_path_fails_before_the_model_loads(tmp_path, monkeypatch):
    """lora.init_path that does not exist, holds no .safetensors file, or holds a truncated one: one PreflightError
    line naming it, before any model loads."""
    from safetensors.torch import save_file

    import flowrl.policies
    from flowrl.preflight import PreflightError

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before lora.init_path was checked")

    monkeypatch.setattr(flowrl.policies, "build_policy", no_load)
    missing = tmp_path / "nowhere"
    with pytest.raises(PreflightError, match=rf"lora\.init_path='{missing}' does not exist"):
        Trainer(tiny_cfg(tmp_path / "a", f"lora.init_path={missing}"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match=r"holds no \.safetensors LoRA file"):
        Trainer(tiny_cfg(tmp_path / "a", f"lora.init_path={tmp_path / 'empty'}"))
    lora = tmp_path / "lora"
    lora.mkdir()
    f = lora / "pytorch_lora_weights.safetensors"
    save_file({"x.lora_A.weight": torch.zeros(8, 64)}, f)
    f.write_bytes(f.read_bytes()[:-100])  # truncated
    with pytest.raises(PreflightError, match=rf"{f} is not a readable safetensors file \(corrupt or truncated"):
        Trainer(tiny_cfg(tmp_path / "a", f"lora.init_path={lora}"))


def test_lora_init_path_takes_a_checkpoint_the_named_file_or_the_only_one(tmp_path):
    """The file a lora.init_path directory means: a run's checkpoint's exported lora/, diffusers' or peft's file
    name, or the only .safetensors file; several others are one line listing them (the first had been taken
    silently); a pickled LoRA (.bin) is named as such, not as a corrupt file."""
    from safetensors.torch import save_file

    from flowrl.preflight import PreflightError, lora_init_file

    tensors = {"x.lora_A.weight": torch.zeros(8, 64)}
    ckpt = tmp_path / "ckpt-000003"
    (ckpt / "lora").mkdir(parents=True)
    (ckpt / "state.json").write_text("{}")
    for name in ("optimizer.safetensors", "ema.safetensors", "lora/pytorch_lora_weights.safetensors"):
        save_file(tensors, str(ckpt / name))
    assert lora_init_file(str(ckpt))[0] == ckpt / "lora" / "pytorch_lora_weights.safetensors"
    epochs = tmp_path / "epochs"
    epochs.mkdir()
    for name in ("my_lora-000001.safetensors", "my_lora-000002.safetensors", "my_lora.safetensors"):
        save_file(tensors, str(epochs / name))
    with pytest.raises(PreflightError, match=r"holds 3 \.safetensors files \(my_lora-000001.safetensors, "):
        lora_init_file(str(epochs))
    assert lora_init_file(str(epochs / "my_lora.safetensors"))[0] == epochs / "my_lora.safetensors"
    save_file(tensors, str(epochs / "adapter_model.safetensors"))
    assert lora_init_file(str(epochs))[0].name == "adapter_model.safetensors"
    only = tmp_path / "only"
    only.mkdir()
    save_file(tensors, str(only / "style.safetensors"))
    assert lora_init_file(str(only))[0] == only / "style.safetensors"
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_lora_weights.bin").write_bytes(b"not read")
    for given in (pickled, pickled / "pytorch_lora_weights.bin"):
        with pytest.raises(PreflightError, match=r"is a pickled LoRA \(\.bin / \.pt\), which flowrl does not read"):
            lora_init_file(str(given))


def test_a_lora_init_path_of_another_rank_or_other_modules_is_one_line_naming_them(tmp_path, capsys):
    """A LoRA of rank 4 into a rank-8 adapter, or a LoRA of fewer modules: a ConfigError naming the file's rank and
    lora.rank, or the keys that differ, not peft's size-mismatch traceback (the command line prints one line)."""
    from flowrl.cli import main
    from flowrl.config import ConfigError

    small = Trainer(tiny_cfg(tmp_path / "r4", "lora.rank=4"))
    small.policy.export(tmp_path / "r4" / "lora")
    targets = list(small.policy.backend.lora_targets)
    with pytest.raises(ConfigError, match=r"holds a LoRA of rank 4, this config's lora\.rank is 8: set lora\.rank=4"):
        Trainer(tiny_cfg(tmp_path / "b", f"lora.init_path={tmp_path / 'r4' / 'lora'}"))
    fewer = Trainer(tiny_cfg(tmp_path / "few", f"lora.target_modules=[{targets[0]}]"))
    fewer.policy.export(tmp_path / "few" / "lora")
    with pytest.raises(
        ConfigError, match=r"LoRA of other modules .* of the adapter's keys are not in it \(.*lora_A"
    ) as e:
        Trainer(tiny_cfg(tmp_path / "c", f"lora.init_path={tmp_path / 'few' / 'lora'}"))
    assert f"its modules are lora.target_modules=[{targets[0]}]: set that" in str(e.value)
    # the setting it names is the one that takes it
    Trainer(
        tiny_cfg(tmp_path / "c", f"lora.init_path={tmp_path / 'few' / 'lora'}", f"lora.target_modules=[{targets[0]}]")
    )
    args = ["eval", *TINY, f"lora.init_path={tmp_path / 'r4' / 'lora'}", "eval.num_prompts=1"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flowrl eval: lora.init_path:") and "rank 4" in err[0]


def test_a_lora_init_path_of_another_alpha_or_format_is_refused_naming_the_setting(tmp_path, monkeypatch):
    """The same A and B under another alpha are another function (scale alpha / r): a LoRA exported with alpha 16
    into a config of lora.alpha 8 is refused before the model loads, naming lora.alpha=16; a kohya-format file
    (lora_down / lora_up) is named as such, not as a LoRA of other modules."""
    from safetensors.torch import save_file

    import flowrl.policies
    from flowrl.preflight import PreflightError

    made = Trainer(tiny_cfg(tmp_path / "a16", "lora.alpha=16"))
    made.policy.export(tmp_path / "a16" / "lora")
    load = flowrl.policies.build_policy

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before lora.init_path's alpha was checked")

    monkeypatch.setattr(flowrl.policies, "build_policy", no_load)
    init = f"lora.init_path={tmp_path / 'a16' / 'lora'}"
    with pytest.raises(
        PreflightError,
        match=r"made with lora alpha 16 \(rank 8: a scale of 2\), this config's lora\.alpha is 8: set lora\.alpha=16",
    ):
        Trainer(tiny_cfg(tmp_path / "b", init, "lora.alpha=8"))
    monkeypatch.setattr(flowrl.policies, "build_policy", load)
    same = Trainer(tiny_cfg(tmp_path / "c", init, "lora.alpha=16"))  # the alpha it names: loads
    for n, p in same.named_params.items():
        torch.testing.assert_close(p.detach(), made.named_params[n].detach(), rtol=0, atol=0)

    kohya = tmp_path / "kohya.safetensors"
    save_file(
        {
            "lora_unet_blocks_0_attn_to_q.lora_down.weight": torch.zeros(8, 32),
            "lora_unet_blocks_0_attn_to_q.lora_up.weight": torch.zeros(32, 8),
        },
        kohya,
    )
    with pytest.raises(  # (named before the model loads, as the other formats are)
        PreflightError, match=r"is a LoRA in kohya's \(lora_down / lora_up\) format .* pipe\.load_lora_weights"
    ):
        Trainer(tiny_cfg(tmp_path / "d", f"lora.init_path={kohya}"))


@pytest.fixture
def redness_reward():
    """A test-only image reward: mean of R - (G + B) / 2 over pixels, in [-1, 1] (a direction every image can move)."""
    import numpy as np

    from rewards.registry import REWARDS, register

    name = "test_redness"  # no leading underscore: matplotlib hides such labels from the legend

    @register(name, kind="image")
    def factory(**kwargs):
        def fn(images, prompts, **metadata):
            a = np.stack([np.asarray(im.convert("RGB"), dtype=np.float32) / 255 for im in images])
            return torch.from_numpy(a[..., 0] - 0.5 * a[..., 1] - 0.5 * a[..., 2]).mean(dim=(1, 2))

        return fn

    yield name
    REWARDS._items.pop(name, None)


def test_grpo_raises_the_reward_it_is_given(tmp_path, redness_reward):
    """The whole loop learns: 20 epochs of GRPO on a reward the tiny model can move raise it, in the training
    rollouts and in the deterministic eval (same seeds before and after)."""
    run = tmp_path / "run"
    cfg = tiny_cfg(
        run,
        "train.epochs=20",
        "train.lr=1e-2",
        "train.minibatch_size=8",
        "sample.group_size=8",
        "eval.num_steps=4",
        "eval.images_per_prompt=4",
        "checkpoint.every=0",
        f"rewards=[{{name: {redness_reward}}}]",
    )
    Trainer(cfg).fit()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r["reward/total_mean"] for r in rows if "reward/total_mean" in r]
    evals = [r[f"eval/{redness_reward}_mean"] for r in rows if f"eval/{redness_reward}_mean" in r]
    assert len(train) == 20 and len(evals) == 2
    first, last = sum(train[:5]) / 5, sum(train[-5:]) / 5
    print(
        f"threads {torch.get_num_threads()}: train reward first 5 epochs {first:.4f} -> last 5 {last:.4f}; "
        f"eval {evals[0]:.4f} -> {evals[1]:.4f}"
    )
    # measured: 0.0046 -> 0.0134 (train), 0.0061 -> 0.0256 (eval); the random model's images are grey-ish
    assert last > first + 0.004
    assert evals[1] > evals[0] + 0.008


def test_deterministic_steps_run_with_the_lora_merged(tmp_path):
    """The rollout's ODE steps (and the eval) run with W + s B A folded into the base weights: the same function
    as the adapter's three matmuls, up to float rounding. The SDE steps, whose log-probs are trained, run on
    the adapter as training does, so their log-probs and the latents they start from are exactly those of an
    unmerged rollout; and afterwards every base weight is again the very tensor it was."""
    import contextlib

    tr = Trainer(
        tiny_cfg(
            tmp_path, "sample.num_steps=5", "train.grpo.window={kind: fixed, start: 1, size: 2}", "eval.grid=false"
        )
    )
    den = tr.policy.backend.denoiser
    with torch.no_grad():
        for n, p in den.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # lora_B starts at 0: make the adapter do something
    layers = tr.policy._lora_layers()
    base_before = [(m.base_layer.weight, m.base_layer.weight.detach().clone()) for m in layers]
    calls = []
    merged = tr.policy.merged_adapter

    @contextlib.contextmanager
    def counting():
        with merged():
            calls.append(1)
            yield

    prompts, meta = ["a red circle"] * 4, [{}] * 4
    tr.policy.merged_adapter = counting
    a = tr.policy.rollout(prompts, meta, epoch=0, generator=torch.Generator().manual_seed(3)).traj
    assert len(calls) == 3  # steps 0, 3, 4 are ODE steps; 1, 2 are the SDE window
    tr.policy.merged_adapter = contextlib.nullcontext
    b = tr.policy.rollout(prompts, meta, epoch=0, generator=torch.Generator().manual_seed(3)).traj
    tr.policy.merged_adapter = merged
    # step 0 (ODE, merged) gives the window's start: equal up to rounding; from there the window is computed
    # unmerged on both, so recomputing its log-probs (as training does) gives the recorded ones
    assert (a.latents[:, 1] - b.latents[:, 1]).abs().max() <= 1e-5
    assert (a.latents - b.latents).abs().max() <= 1e-4
    out = tr.policy.backend.step_log_prob(a, [1, 2])
    assert (out.log_prob - a.log_probs[:, [1, 2]]).abs().max() <= 1e-5
    for w, before in base_before:
        assert torch.equal(w, before)  # restored exactly
    assert all(not m.merged and not m.disable_adapters for m in layers)
    # the merge really folds in the adapter: a merged forward differs from the adapter switched off
    x, t = a.latents[:, 0], torch.full((4,), 500.0)
    text = dict(
        encoder_hidden_states=torch.zeros(4, 16, den.config.joint_attention_dim),
        pooled_projections=torch.zeros(4, den.config.pooled_projection_dim),
    )
    with torch.no_grad():
        with merged():
            assert all(m.disable_adapters for m in layers)  # the adapter is folded in, not added
            assert all(not torch.equal(m.base_layer.weight, before) for m, (_, before) in zip(layers, base_before))
            y_merged = den(hidden_states=x, timestep=t, **text).sample
        y_adapter = den(hidden_states=x, timestep=t, **text).sample
        with tr.policy.reference():
            y_base = den(hidden_states=x, timestep=t, **text).sample
    assert (y_merged - y_adapter).abs().max() <= 1e-5 < (y_adapter - y_base).abs().max()
    # with a gradient the merge does nothing (a trained pass must see the adapter), nor inside the reference
    # policy (the adapter is off there: folding it in would change the function)
    with merged():
        assert all(not m.disable_adapters for m in layers)
    with torch.no_grad(), tr.policy.reference(), merged():
        assert all(torch.equal(m.base_layer.weight, before) for m, (_, before) in zip(layers, base_before))


def test_dropped_norm_minibatch_gives_the_gradient_of_not_dropping(tmp_path):
    """dropped_norm=minibatch divides by all of the minibatch's samples: the gradient of the full computation
    where the dropped group is kept with zero advantages (beta = 0); `kept` divides by the kept ones only, a
    gradient larger by (all / kept)."""

    def grads_of(*extra, keep):
        tr = Trainer(tiny_cfg(tmp_path / "_".join(extra), "eval.grid=false", *extra))
        captured = {}
        step = tr.opt.step

        def capture():
            captured.update({n: p.grad.detach().clone() for n, p in tr.named_params.items()})
            return step()

        tr.opt.step = capture
        batch = tr.rollout(epoch=0)
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0])  # group 1 (4 samples) has no signal
        tr.update(batch, adv, keep, epoch=0)
        return captured

    dropped = torch.tensor([True] * 4 + [False] * 4)
    full = grads_of("train.drop_zero_adv_groups=false", keep=torch.ones(8, dtype=torch.bool))
    by_batch = grads_of("train.drop_zero_adv_groups=true", "train.dropped_norm=minibatch", keep=dropped)
    by_kept = grads_of("train.drop_zero_adv_groups=true", keep=dropped)
    assert max(g.abs().max().item() for g in full.values()) > 0
    for n, g in full.items():
        torch.testing.assert_close(by_batch[n], g, rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(by_kept[n], 2 * g, rtol=1e-4, atol=1e-9)  # 8 samples / 4 kept


def test_model_drop_t5_trains_without_the_t5_encoder(tmp_path):
    tr = Trainer(tiny_cfg(tmp_path, "model.drop_t5=true", "train.epochs=1", "eval.grid=false"))
    pipe = tr.policy.backend.pipe
    assert pipe.text_encoder_3 is None and pipe.tokenizer_3 is None
    metrics = tr.fit()
    assert math.isfinite(metrics["policy/loss"]) and (tmp_path / "ckpt-000001" / "lora").is_dir()
    with pytest.raises(Exception, match="SD3"):
        tiny_cfg(tmp_path / "b", "model.drop_t5=true", "model.family=flux")


def test_keep_best_keeps_the_best_evals_checkpoint_and_names_it(tmp_path, capsys):
    """checkpoint.keep_best: evals scoring 0.10 (before), 0.50, 0.30, 0.20 (final, after epoch 3) keep epoch 1's
    checkpoint through checkpoint.keep=1, holding the weights the eval after epoch 1 saw, and best.json names it;
    the final checkpoint is written as usual. A resumed run knows its best. A metric the eval does not report is
    one error naming those it does."""
    from flowrl.config import ConfigError
    from flowrl.run.checkpoint import read_checkpoint

    run = tmp_path / "run"
    args = ["train.epochs=3", "eval.every=1", "checkpoint.every=0", "checkpoint.keep=1", "checkpoint.keep_best=true"]
    tr = Trainer(tiny_cfg(run, *args))
    scores, seen = iter([0.10, 0.50, 0.30, 0.20]), {}

    def scripted(tag):
        seen[tr.state.epochs_done] = trained_weights(tr)
        return {"eval/jpeg_compressibility_mean": next(scores), "eval/other_mean": 0.9}  # the headline: the first

    tr.evaluate = scripted
    tr.fit()
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-000001", "ckpt-000003"]
    best = json.loads((run / "best.json").read_text())
    assert best == {"metric": "eval/jpeg_compressibility_mean", "value": 0.5, "epochs": 1, "checkpoint": "ckpt-000001"}
    assert "best eval: eval/jpeg_compressibility_mean 0.5000 after 1 epoch" in capsys.readouterr().out
    kept = read_checkpoint(run / "ckpt-000001")["trainable"]
    for n, w in seen[1].items():
        torch.testing.assert_close(kept[n], w, rtol=0, atol=0)
    assert any((seen[1][n] - seen[3][n]).abs().max() > 0 for n in seen[1])  # epochs 2 and 3 trained on
    resumed = Trainer(tiny_cfg(run, *args, "checkpoint.resume=auto", "train.epochs=4"))
    resumed.load(run / "ckpt-000003", read_checkpoint(run / "ckpt-000003"))
    assert (resumed.state.best_eval, resumed.state.best_epoch) == (0.5, 1)

    other = Trainer(tiny_cfg(tmp_path / "b", *args, "checkpoint.best_metric=eval/nope"))
    other.evaluate = lambda tag: {"eval/jpeg_compressibility_mean": 0.1, "eval/x/by_family/a": 0.2}
    with pytest.raises(
        ConfigError, match=r"best_metric='eval/nope' is not a number the eval reports; it reports: eval/jpeg"
    ):
        other.fit()
