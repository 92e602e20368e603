"""FSDP2 for the text backend (train.sharding=fsdp) on 2 CPU processes (gloo), a tiny GPT-2 sharded per block:
the sharded update equals the 1-process update over the same global batch (LoRA and full fine-tuning, reference
KL on), sharded generation (synced_gpus) and recorded log-probs equal the unsharded ones, the exports load, and
`flowrl train` trains, checkpoints and resumes."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launching import accelerate_launch

from flowrl.config import load_config
from flowrl.train import Trainer

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo multi-process tests written for linux")

TESTS = Path(__file__).resolve().parent
TWO_PROCESSES = [
    "--multi_gpu",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(TESTS.parent)}


def text_args(model_dir, run_dir, *extra) -> list[str]:
    return [
        "backend=text",
        f"model.path={model_dir}",
        "model.device=cpu",
        f"data.train_prompts={model_dir / 'prompts.jsonl'}",
        "rewards=[{name: accuracy}]",
        "sample.prompts_per_epoch=2",
        "sample.group_size=4",
        "text.max_new_tokens=5",
        "train.lr=3e-3",
        "train.grpo.beta=0.05",
        "log.progress=false",
        "eval.num_prompts=3",
        f"log.run_dir={run_dir}",
        *extra,
    ]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def recorded_log_probs(policy, rollout: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(the log-probs a rollout recorded, an unsharded policy's log-probs of the same tokens), both masked."""
    ids, attn = torch.tensor(rollout["input_ids"]), torch.tensor(rollout["attention_mask"])
    mask = torch.tensor(rollout["completion_mask"])
    with torch.no_grad():
        lp, _ = policy._forward_log_probs(policy.model, ids, attn, rollout["prompt_len"], policy.text.temperature)
    return torch.tensor(rollout["old_log_probs"]), lp * mask


def load_export(ckpt: Path, model_dir: Path, lora: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's export loaded as a user would (peft / transformers from_pretrained): its weights by name."""
    from transformers import AutoModelForCausalLM

    if lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), ckpt / "lora")
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_sharded_update_generation_and_export_equal_one_process(tiny_lm, tmp_path, lora):
    """2 FSDP processes, each with its half of a recorded global batch, take the weights where 1 process takes them
    over the whole batch: 3 optimizer steps, the reference KL on (LoRA: the adapter switched off; full: the frozen
    copy, sharded too), within 1e-5 relative. One sample of the first half is left out of the loss (LoRA), or the
    whole second half (full: that process runs placeholder passes of weight 0 to join the collectives).
    Before the update, the sharded processes' greedy completions (one process stopping after 2 tokens, the other
    after 6: synced_gpus) and their rollouts' recorded log-probs equal the unsharded model's. The checkpoint's
    export (the peft adapter, or the whole model) loads and holds the trained weights."""
    from safetensors.torch import load_file

    extra = ["train.inner_epochs=3", "eval.grid=false", f"lora.enabled={str(lora).lower()}"]
    one = Trainer(load_config(None, text_args(tiny_lm, tmp_path / "one", *extra)))
    initial = {n: p.detach().clone() for n, p in one.named_params.items()}
    assert initial and all(("lora_" in n) == lora for n in initial)
    assert (one.policy.ref_copy is None) == lora
    batch = one.rollout(epoch=0)
    adv = torch.tensor([1.2, -0.4, 0.3, -1.1, 0.8, -0.9, 0.5, -0.4])
    keep = torch.tensor([True, True, False, True] + [True] * 4) if lora else torch.tensor([True] * 4 + [False] * 4)
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    torch.save({"batch": fields, "adv": adv, "keep": keep}, tmp_path / "batch.pt")

    out = tmp_path / "two"
    proc = run(
        [
            *accelerate_launch(),
            *TWO_PROCESSES,
            str(TESTS / "dist_update_text.py"),
            str(tmp_path / "batch.pt"),
            str(out),
            *text_args(tiny_lm, tmp_path / "two-run", *extra, "train.sharding=fsdp"),
        ]
    )
    assert "sharded True optimizer steps 3" in proc.stdout
    assert "whole parameters 0" in proc.stdout  # the model's and the reference copy's, all sharded

    generated = json.loads(Path(str(out) + ".json").read_text())
    assert len(generated) == 2
    for rank in generated:  # the unsharded model has the initial weights still
        g = rank["greedy"]
        assert one.policy.generate_greedy(g["prompts"], max_new_tokens=g["max_new_tokens"])[0] == g["texts"]
        got, want = recorded_log_probs(one.policy, rank["rollout"])
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    one.update(batch, adv, keep, epoch=0)
    assert one.state.optimizer_steps == 3
    two = load_file(Path(str(out) + ".safetensors"))
    assert set(two) == set(one.named_params)
    top = max(p.detach().abs().max().item() for p in one.named_params.values())
    moved = max((p.detach() - initial[n]).abs().max().item() for n, p in one.named_params.items())
    assert moved > 1e-4 * top, "3 optimizer steps did not move the weights: the comparison would test nothing"
    for name, p in one.named_params.items():
        assert (two[name] - p.detach()).abs().max().item() <= 1e-5 * top, name

    exported = load_export(tmp_path / "two-run" / "ckpt-000001", tiny_lm, lora)
    for name in two:
        torch.testing.assert_close(exported[name], two[name], rtol=0, atol=0, msg=name)


def test_flowrl_train_sharded_trains_checkpoints_and_resumes(tiny_lm, tmp_path):
    """`accelerate launch -m flowrl train` with backend=text, train.sharding=fsdp on 2 processes (the shipped
    config), a LoRA with the reference KL: the first minibatch of every epoch is on-policy (the rollout's recorded
    log-probs, from the sharded model, equal the recomputed ones), the eval runs, the checkpoint's LoRA (gathered
    from the shards) loads with peft, and a resume continues to epoch 3."""
    from safetensors.torch import load_file

    config = TESTS.parent / "configs" / "accelerate" / "cpu_2proc.yaml"
    base = [
        *accelerate_launch(),
        "--config_file",
        str(config),
        "-m",
        "flowrl",
        "train",
        *text_args(
            tiny_lm,
            tmp_path,
            "train.sharding=fsdp",
            "checkpoint.every=1",
            "checkpoint.keep=0",
            "log.completions_every=1",
        ),
    ]
    run([*base, "train.epochs=2"])
    proc = run([*base, "train.epochs=3", "checkpoint.resume=auto"])
    assert "resumed from" in proc.stdout

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "policy/loss" in r]
    assert [r["epoch"] for r in trained] == [1, 2, 3]
    for r in trained:
        assert r["policy/ratio_first_dev"] <= 1e-5 and math.isfinite(r["policy/loss"]) and "policy/kl" in r
    final = next(r for r in rows if r.get("final"))
    assert "eval/accuracy_mean" in final
    assert len((tmp_path / "eval-final.jsonl").read_text().splitlines()) == 3
    completions = (tmp_path / "completions.jsonl").read_text().splitlines()
    assert len(completions) == 3 * 4  # the main process's 4 samples of each epoch

    first, last = (load_file(tmp_path / f"ckpt-{e:06d}" / "trainable.safetensors") for e in (1, 3))
    assert set(first) == set(last) and all("lora_" in k for k in last)
    assert max((last[k] - first[k]).abs().max().item() for k in last) > 0  # the resumed epoch trained
    exported = load_export(tmp_path / "ckpt-000003", tiny_lm, lora=True)
    for name, value in last.items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0, msg=name)
