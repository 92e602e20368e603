"""Multi-turn text rollouts with a tool environment (flowrl.tools, text.tool_env): the environment's replies are in
the completion and its context but out of the loss, the KL and the entropy; the recorded log-probs of the model's
tokens are the trainer's forward's (the first minibatch on policy); the turns go to completions.jsonl."""

import json
import warnings

import pytest
import torch
from test_trainer_text import text_cfg

from flowrl.errors import ConfigError
from flowrl.tools import calculator, evaluate, load_tool_env

torch.set_num_threads(1)


def test_the_calculator_evaluates_integer_expressions_and_nothing_else():
    assert evaluate("12*34") == 408 and evaluate("(7+5)*3-4") == 32 and evaluate("-3*-3") == 9
    assert evaluate("123456789*987654321") == 121932631112635269  # exact, however large
    assert calculator("so <calc>12*34</calc>") == "<out>408</out>"
    assert calculator("<calc>1+1</calc> then <calc>6*7</calc>") == "<out>42</out>"  # the last call
    for bad in ("<calc>__import__('os')</calc>", "<calc>2**10</calc>", "<calc>1/0</calc>", "<calc>1.5*2</calc>"):
        assert calculator(bad) == "<out>?</out>", bad
    assert calculator("no call here") is None


def test_a_tool_environment_by_name_file_or_module_and_its_errors(tmp_path):
    assert load_tool_env("calculator").stop == ["</calc>"]
    f = tmp_path / "env.py"
    f.write_text("def reply(turn, *, metadata):\n    return f\"[{turn}|{metadata['k']}]\"\n")
    env = load_tool_env(f"{f}:reply")
    assert env("hi", {"prompt": "p", "transcript": "t", "metadata": {"k": 3}}) == "[hi|3]"  # only what it names
    assert env.stop == []
    with pytest.raises(ConfigError, match="not a registered tool environment \\(calculator\\)"):
        load_tool_env("calculater")
    with pytest.raises(ConfigError, match="file 'nope.py' not found"):
        load_tool_env("nope.py:f")
    with pytest.raises(ConfigError, match="has no function 'answer'; its functions: \\['reply'\\]"):
        load_tool_env(f"{f}:answer")
    g = tmp_path / "bad.py"
    g.write_text(
        "import json\n"
        "def two(turn, foo):\n    return ''\n"
        "def none():\n    return ''\n"
        "def parse(turn):\n    return json.loads(turn)\n"
    )
    for name in ("two", "none"):  # refused when loaded (before the model), not at the first tool call
        with pytest.raises(ConfigError, match=rf"is called as f\(turn, \*, prompt, transcript, metadata\).*{name}\("):
            load_tool_env(f"{g}:{name}")
    from flowrl.tools import ToolEnvError

    with pytest.raises(ToolEnvError, match=rf"raised JSONDecodeError: .*\({g} line 7\)"):  # the user's line
        load_tool_env(f"{g}:parse")("not json", {"prompt": "", "transcript": "", "metadata": {}})


def test_tool_env_without_stop_strings_or_for_images_is_refused_before_the_model_loads(tmp_path, no_model_load):
    from flowrl.config import load_config
    from flowrl.preflight import check_tool_env

    f = tmp_path / "env.py"
    f.write_text("def reply(turn):\n    return '1'\n")
    with pytest.raises(ConfigError, match="text.tool_env answers a language model's turns, and backend=image"):
        load_config(None, [f"text.tool_env={f}:reply"])
    cfg = load_config(None, ["backend=text", f"text.tool_env={f}:reply"])
    with pytest.raises(ConfigError, match="declares no stop strings"):
        check_tool_env(cfg)
    check_tool_env(load_config(None, ["backend=text", f"text.tool_env={f}:reply", "text.tool_stop=['7']"]))


REPLIES = []


def echo_env(turn, *, transcript):
    """The tiny model's turn ends at a '7' (its digits come often); the environment answers '=1=' and
    remembers what it saw."""
    REPLIES.append((turn, transcript))
    return "=1="


def multi_turn_cfg(tiny_lm, tmp_path, *extra):
    return text_cfg(
        tiny_lm,
        tmp_path,
        "text.tool_env=test_text_tools:echo_env",
        "text.tool_stop=['7']",
        "text.max_turns=3",
        "text.max_new_tokens=14",
        "text.temperature=1.5",  # more digits, more 7s
        *extra,
    )


def test_a_multi_turn_rollout_keeps_the_tool_tokens_out_of_the_loss(tiny_lm, tmp_path):
    from flowrl.train import Trainer

    tr = Trainer(multi_turn_cfg(tiny_lm, tmp_path))
    tr.policy.weights_version = 0
    prompts = [p for p in tr.train_set.prompts[:3] for _ in range(4)]
    meta = [m for m in tr.train_set.metadata[:3] for _ in range(4)]
    REPLIES.clear()
    batch = tr.policy.rollout(prompts, meta, epoch=0, generator=torch.Generator().manual_seed(0))
    tool = [i for i, turns in enumerate(batch.turns) if any("tool" in t for t in turns)]
    assert tool and REPLIES, batch.turns  # some rows called the tool
    tok = tr.policy.tokenizer
    reply_ids = tok("=1=", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        trainer_lp, _ = tr.policy._forward_log_probs(
            tr.policy.model, batch.input_ids, batch.attention_mask, batch.prompt_len, tr.policy.text.temperature
        )
    for i in tool:
        turns = batch.turns[i]
        assert turns[0]["model"].endswith("7") and turns[0]["tool"] == "=1="
        ids = batch.completion_ids[i].tolist()
        k = batch.completion_mask[i].tolist().index(0.0)  # the first token that is not the model's
        assert ids[k - 1] == tok.convert_tokens_to_ids("7") and ids[k : k + 3] == reply_ids  # the reply follows
        assert batch.completion_mask[i, k : k + 3].sum() == 0  # ... outside the loss
        assert batch.attention_mask[i, batch.prompt_len + k : batch.prompt_len + k + 3].sum() == 3  # ... in context
        assert batch.old_log_probs[i, k : k + 3].abs().sum() == 0
        assert "=1=" in batch.completions[i]  # the reward sees the whole exchange
    # the recorded log-probs of the model's own tokens are the trainer's forward's, the replies in the context
    lp = trainer_lp * batch.completion_mask
    diff = (lp - batch.old_log_probs).abs().max().item()
    print(f"multi-turn: {len(tool)} of {len(prompts)} rows called the tool; max |recorded - forward| = {diff:.3g}")
    assert diff <= 1e-5
    unit = tr.policy.train_units(batch, 1)[0]
    out = tr.policy.unit_log_probs(batch, torch.tensor(tool), unit, with_reference=True)
    assert torch.equal(out.mask, batch.completion_mask[tool])  # KL and entropy aggregate over this mask too
    transcript = REPLIES[0][1]
    assert transcript.endswith("7")  # the environment saw the completion so far


def test_the_environment_does_not_answer_the_last_turn(tiny_lm, tmp_path):
    """A reply after text.max_turns model turns is one the model never reads: the completion ends with the model's
    own turn, so a reward scores what the model said, not the tool's answer."""
    from flowrl.train import Trainer

    for max_turns in (1, 2):
        tr = Trainer(multi_turn_cfg(tiny_lm, tmp_path / str(max_turns), f"text.max_turns={max_turns}"))
        tr.policy.weights_version = 0
        prompts = [p for p in tr.train_set.prompts[:3] for _ in range(4)]
        meta = [m for m in tr.train_set.metadata[:3] for _ in range(4)]
        REPLIES.clear()
        batch = tr.policy.rollout(prompts, meta, epoch=0, generator=torch.Generator().manual_seed(0))
        assert all(len(turns) <= max_turns for turns in batch.turns)
        last = [turns for turns in batch.turns if len(turns) == max_turns and turns[-1]["model"].endswith("7")]
        assert last or max_turns > 1, batch.turns  # some row's last allowed turn asked for the tool ...
        assert all("tool" not in turns[-1] for turns in last), last  # ... and got no reply
        assert len(REPLIES) == sum("tool" in turn for turns in batch.turns for turn in turns)
        if max_turns == 1:
            assert not REPLIES and not any("=1=" in c for c in batch.completions)


def test_flowrl_sample_gives_the_environment_each_rows_metadata(tiny_lm, tmp_path, capsys):
    """`flowrl sample --prompts FILE` of a tool config: the environment sees each row's columns (as in training), so
    a tool that reads metadata['answer'] works there too (it saw {} and raised); --greedy as well."""
    from conftest import tiny_gpt2_overrides

    from flowrl.cli import main

    seen = tmp_path / "seen.jsonl"
    env = tmp_path / "env.py"
    env.write_text(
        "import json\n"
        "def reply(turn, *, metadata):\n"
        f"    open({str(seen)!r}, 'a').write(json.dumps(metadata['answer']) + '\\n')\n"
        "    return '=1='\n"
    )
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(10, 16)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "c.yaml").write_text("backend: text\n")
    run = [*tiny_gpt2_overrides(tiny_lm), f"text.tool_env={env}:reply", "text.tool_stop=['7']", "text.max_turns=3"]
    run += ["text.max_new_tokens=14", "text.temperature=1.5", "log.progress=false"]
    for extra in (["--num", "2"], ["--greedy"]):
        seen.unlink(missing_ok=True)
        out = tmp_path / f"out{len(extra)}"
        assert (
            main(["sample", str(tmp_path / "c.yaml"), "--prompts", str(prompts), *extra, "--out", str(out), *run]) == 0
        )
        if extra == ["--num", "2"]:  # sampled at 1.5: some turn ends at a 7
            answers = [json.loads(line) for line in seen.read_text().splitlines()]
            assert answers and set(answers) <= {r["answer"] for r in rows}
        listed = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        assert len(listed) == len(rows) * (2 if extra[0] == "--num" else 1)


def test_a_multi_turn_run_trains_on_policy_and_logs_its_turns(tiny_lm, tmp_path):
    from flowrl.train import Trainer

    tr = Trainer(multi_turn_cfg(tiny_lm, tmp_path, "train.epochs=2", "train.grpo.beta=0.05", "text.entropy_coef=0.01"))
    before = {n: p.detach().clone() for n, p in tr.named_params.items()}
    tr.fit()
    assert max((p.detach() - before[n]).abs().max().item() for n, p in tr.named_params.items()) > 1e-6
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "policy/ratio_first" in r]
    assert len(trained) == 2 and all(r["policy/ratio_first_dev"] <= 1e-5 for r in trained)
    table = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert all("turns" in r and r["turns"] and "model" in r["turns"][0] for r in table)
    assert any(len(r["turns"]) > 1 or "tool" in r["turns"][0] for r in table)


def test_the_eval_answers_tool_calls_greedily(tiny_lm, tmp_path):
    """flowrl eval and the run's evals go through the same environment: greedy turns, the replies in the text the
    rewards score; the same twice (greedy)."""
    from flowrl.train import Trainer

    tr = Trainer(multi_turn_cfg(tiny_lm, tmp_path, "text.tool_stop=['9']"))  # its greedy turn writes 9s
    prompts = list(tr.train_set.prompts[:6])
    meta = list(tr.train_set.metadata[:6])
    texts, ids = tr.policy.generate_greedy(prompts, metadata=meta)
    again, _ = tr.policy.generate_greedy(prompts, metadata=meta)
    assert texts == again and any("=1=" in t for t in texts), texts
    completions, scores, _ = tr.policy.evaluate_prompts(prompts, meta, [], tr.cfg.eval)
    assert completions == texts and len(ids) == 6


def test_the_tool_preset_trains_the_calculator_world(tmp_path, capfd):
    """configs/text_tool.yaml, shrunk: the shipped calculator model calls the tool in its rollouts, the calls are
    answered, the eval (greedy, with the calculator) scores the final answers, and the model changes; transformers'
    false alarm of a missing attention mask (it drops an all-ones one itself) is not printed."""
    from pathlib import Path

    from flowrl.config import load_config
    from flowrl.train import Trainer

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(
        root / "configs" / "text_tool.yaml",
        [
            f"model.path={root / 'samples' / 'calc'}",
            f"data.train_prompts={root / 'samples' / 'calc' / 'train.jsonl'}",
            f"data.eval_prompts={root / 'samples' / 'calc' / 'test.jsonl'}",
            "train.epochs=2",
            "sample.prompts_per_epoch=4",
            "eval.num_prompts=16",
            "log.completions_every=1",
            "log.progress=false",
            "checkpoint.every=0",
            f"log.run_dir={tmp_path}",
        ],
    )
    tr = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in tr.named_params.items()}
    tr.fit()
    assert max((p.detach() - before[n]).abs().max().item() for n, p in tr.named_params.items()) > 0
    table = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    answered = [r for r in table if any(t.get("tool", "").startswith("<out>") for t in r["turns"])]
    assert answered and all("<calc>" in r["completion"] and "</out>" in r["completion"] for r in answered)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/calc_answer_mean" in r]
    assert len(evals) == 2 and evals[0]["eval/tool_used_mean"] > 0.1 and evals[0]["eval/calc_answer_mean"] > 0.1
    assert "passing in an `attention_mask`" not in capfd.readouterr().err


def test_an_environment_that_fails_or_answers_no_text_is_one_line(tmp_path):
    from flowrl.errors import FlowrlError

    f = tmp_path / "bad.py"
    f.write_text("def boom(turn):\n    return {'x': 1}[turn]\n\ndef number(turn):\n    return 42\n")
    with pytest.raises(FlowrlError) as e:
        load_tool_env(f"{f}:boom")("<calc>1</calc>", {"prompt": "", "transcript": "", "metadata": {}})
    msg = str(e.value)
    assert "\n" not in msg and "raised KeyError" in msg and "bad.py line 2" in msg and "<calc>1</calc>" in msg
    with pytest.raises(FlowrlError, match="returned int 42; it must return the text to append"):
        load_tool_env(f"{f}:number")("x", {"prompt": "", "transcript": "", "metadata": {}})


def letters_env(turn, *, transcript):
    """Answers in words the arithmetic tokenizer has no tokens for."""
    return "=one="


def test_a_tool_reply_the_tokenizer_cannot_read_back_is_warned_once(tiny_lm, tmp_path):
    from flowrl.train import Trainer

    tr = Trainer(multi_turn_cfg(tiny_lm, tmp_path, "text.tool_env=test_text_tools:letters_env"))
    tr.policy.weights_version = 0
    prompts = [p for p in tr.train_set.prompts[:3] for _ in range(4)]
    meta = [m for m in tr.train_set.metadata[:3] for _ in range(4)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        batch = tr.policy.rollout(prompts, meta, epoch=0, generator=torch.Generator().manual_seed(0))
    assert any("tool" in t for turns in batch.turns for t in turns), batch.turns  # some rows called the tool
    said = [str(w.message) for w in seen if "does not read back" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("a tool reply does not read back whole"), said
    assert "'=one=' is given to the model as '=" in said[0]
