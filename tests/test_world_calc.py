"""The calculator world: tokenizer with tag tokens, split, scoring, rewards, the eval loop, the pre-training script
and the shipped model (samples/calc)."""

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import rewards  # noqa: E402
from flowrl.tools import evaluate as calc_eval  # noqa: E402
from flowrl.worlds.calc import (  # noqa: E402
    HIGH,
    LOW,
    N_TEST_PAIRS,
    TAGS,
    calc_tokenizer,
    evaluate,
    exact,
    final_answer,
    generate_completions,
    make_prompts,
    split_rows,
    tool_trace,
    tool_value,
    used_tool,
)

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples" / "calc"
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.fixture(scope="module")
def tok():
    return calc_tokenizer()


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_ids_and_tags(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 4 + 15 + 4
    for tag in TAGS:
        ids = tok(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids) == [tag]
        assert ids[0] not in tok.all_special_ids
    ids = tok("<out>1938</out>", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<out>", "1", "9", "3", "8", "</out>"]
    assert tok.convert_ids_to_tokens(tok("<calc <x>")["input_ids"])[:3] == ["<bos>", "<unk>", "<unk>"]


def test_decode_keeps_tags_and_skips_specials(tok):
    text = "34*57=<calc>34*57</calc><out>1938</out>1938"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + 6 + 7 + 6 + 4
    assert tok.decode(ids, skip_special_tokens=True) == text  # the tags are not special: kept
    assert tok.decode(ids) == "<bos>" + text
    with_eos = ids + [tok.eos_token_id, tok.pad_token_id]
    assert tok.batch_decode([with_eos], skip_special_tokens=True) == [text]


def test_left_padding_and_save_load(tok, tmp_path):
    from transformers import AutoTokenizer

    batch = tok(["10*10=", "<calc>99*99</calc>"], padding=True)
    assert tok.padding_side == "left"
    assert batch["input_ids"][0][:2] == [tok.pad_token_id, tok.bos_token_id]  # 7 tokens, then 8: one pad, left
    assert batch["attention_mask"][0][:2] == [0, 1] and batch["attention_mask"][1][0] == 1
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tok.get_vocab() and loaded.padding_side == "left"
    assert loaded.all_special_ids == tok.all_special_ids
    text = "12*34=<calc>12*34</calc><out>408</out>408"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text


# ----------------------------------------------------------------------------- split


def test_split_is_disjoint_and_holds_out_both_orders():
    train, test = split_rows("train"), split_rows("test")
    assert len(train) + len(test) == (HIGH - LOW + 1) ** 2
    train_p, test_p = {r["prompt"] for r in train}, {r["prompt"] for r in test}
    assert len(train_p) == len(train) and len(test_p) == len(test) and not train_p & test_p
    for p in test_p:
        a, b = p[:-1].split("*")
        assert f"{b}*{a}=" in test_p
    assert len({tuple(sorted(map(int, p[:-1].split("*")))) for p in test_p}) == N_TEST_PAIRS
    for row in make_prompts("train", 50, seed=3) + make_prompts("test", 50, seed=3):
        a, b = map(int, row["prompt"].removesuffix("=").split("*"))
        assert LOW <= a <= HIGH and LOW <= b <= HIGH and row["answer"] == str(a * b)
    assert make_prompts("test", 10, seed=1) == make_prompts("test", 10, seed=1) != make_prompts("test", 10, seed=2)


# ----------------------------------------------------------------------------- scoring and rewards


@pytest.mark.parametrize(
    "completion, final, tool",
    [
        ("1938", "1938", False),
        (" 1938 ", "1938", False),
        ("<calc>34*57</calc><out>1938</out>1938", "1938", True),
        ("<calc>34*57</calc><out>1938</out>1988", "1988", True),
        ("<calc>3*5</calc><out>15</out><calc>34*57</calc><out>1938</out> 1938", "1938", True),
        ("<calc>34*57</calc>", "<calc>34*57</calc>", True),  # no reply: the whole text
        ("1938<eos>12", "1938", False),
        ("<pad>1938", "1938", False),
        ("", "", False),
    ],
)
def test_final_answer_exact_used_tool(completion, final, tool):
    assert final_answer(completion) == final
    assert used_tool(completion) is tool
    assert exact(completion, 1938) == float(final == "1938")
    assert exact(completion, "1938") == exact(completion, 1938)


def test_tool_trace_and_tool_value():
    assert tool_trace("34*57=", "1938") == "<calc>34*57</calc><out>1938</out>1938"
    assert tool_trace("34*57=", "1938", "1988") == "<calc>34*57</calc><out>1938</out>1988"
    assert tool_value("<calc>3*5</calc><out>15</out><calc>34*57</calc><out>1938</out>1") == "1938"
    assert tool_value("1938") is None


def test_rewards_as_a_config_names_them():
    completions = ["<calc>34*57</calc><out>1938</out>1938", "<calc>34*57</calc><out>1938</out>1988", "1938", "17"]
    answer = ["1938"] * 4
    assert {"calc_answer", "tool_used"} <= set(rewards.available("text"))
    calc_answer = rewards.build("calc_answer", {}, "text")
    tool_used = rewards.build("tool_used", {}, "text")
    assert calc_answer(["34*57="] * 4, completions, answer=answer) == [1.0, 0.0, 1.0, 0.0]
    assert tool_used(["34*57="] * 4, completions, answer=answer) == [1.0, 1.0, 0.0, 0.0]
    chat = [{"role": "assistant", "content": completions[0]}]
    assert calc_answer(["34*57="], [chat], answer=[1938]) == [1.0]
    with pytest.raises(Exception, match="answer"):
        calc_answer(["34*57="], ["1938"], solution=["1938"])


# ----------------------------------------------------------------------------- the pre-training script


def test_trace_mixture_and_loss_mask(tok):
    from pretrain_calc import draw_completion, encode_traces

    rng = np.random.default_rng(0)
    row = {"prompt": "34*57=", "answer": "1938"}
    drawn = [draw_completion(row, rng, 0.4, 0.25) for _ in range(4000)]
    tools = [c for c in drawn if used_tool(c)]
    assert set(drawn) - set(tools) == {"1938"}  # direct traces are right
    assert 0.37 < len(tools) / len(drawn) < 0.43
    wrong = [final_answer(c) for c in tools if final_answer(c) != "1938"]
    assert 0.21 < len(wrong) / len(tools) < 0.29
    for w in wrong:  # one digit changed, no leading zero
        assert len(w) == 4 and sum(x != y for x, y in zip(w, "1938")) == 1 and w[0] != "0"
    assert all(tool_value(c) == "1938" for c in tools)

    ids, mask = encode_traces(tok, ["34*57=", "34*57="], ["1938", tool_trace("34*57=", "1938", "1988")])
    trained = [
        tok.convert_ids_to_tokens([int(ids[i, t + 1]) for t in range(mask.shape[1]) if mask[i, t]]) for i in (0, 1)
    ]
    assert trained[0] == ["1", "9", "3", "8", "<eos>"]
    assert trained[1] == [
        "<calc>",
        "3",
        "4",
        "*",
        "5",
        "7",
        "</calc>",
        "1",
        "9",
        "8",
        "8",
        "<eos>",
    ]  # not <out>..</out>


def test_pretrain_script_runs_a_few_steps(tmp_path):
    from pretrain_calc import main

    torch.set_num_threads(1)
    out = tmp_path / "out"
    args = ["--workdir", str(tmp_path / "work"), "--out", str(out), "--n-embd", "32", "--n-head", "1"]
    args += ["--steps", "4", "--eval-every", "2", "--batch", "8", "--min-steps", "0"]
    args += ["--low", "0", "--high", "1", "--tool-low", "0", "--tool-high", "1", "--target", "2"]
    assert main(args) == 0
    summary = json.loads((out / "pretrain_summary.json").read_text())
    assert summary["stopped_at_step"] == 4 and summary["kept"]["step"] in (2, 4)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "train.jsonl", "test.jsonl"):
        assert (out / name).exists()
    assert [json.loads(x) for x in (out / "test.jsonl").read_text().splitlines()] == split_rows("test")
    figures = summary["figures"]["held_out_with_tool"]
    assert figures["n"] == len(split_rows("test")) and 0 <= figures["accuracy"] <= 1


# ----------------------------------------------------------------------------- the shipped model


def _shipped():
    if not (SAMPLES / "model.safetensors").exists():
        pytest.skip(f"no pre-trained model in {SAMPLES} yet (scripts/pretrain_calc.py writes it)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(SAMPLES), AutoTokenizer.from_pretrained(SAMPLES)


def test_shipped_files():
    model, tok = _shipped()
    assert tok.get_vocab() == calc_tokenizer().get_vocab() and tok.padding_side == "left"
    cfg = model.config
    assert cfg.n_embd // cfg.n_head >= 32 and cfg.tie_word_embeddings and cfg.n_positions >= 7 + 24
    assert sum(f.stat().st_size for f in SAMPLES.iterdir()) <= 5 * 2**20 + (SAMPLES / "train.jsonl").stat().st_size
    for split in ("train", "test"):
        rows = [json.loads(line) for line in (SAMPLES / f"{split}.jsonl").read_text().splitlines()]
        assert rows == split_rows(split)


def test_shipped_model_eval_with_and_without_the_tool():
    torch.set_num_threads(1)
    model, tok = _shipped()
    rows = make_prompts("test", 48, seed=0)
    with_tool = evaluate(model, tok, rows, batch_size=16)
    without = evaluate(model, tok, rows, tool=False)
    direct = evaluate(model, tok, rows, calls=False)
    for fig in (with_tool, without, direct):
        assert fig["n"] == 48 and all(math.isfinite(fig[k]) for k in ("accuracy", "tool_use"))
    assert with_tool["tool_use"] > 0 and direct["tool_use"] == 0
    assert with_tool["accuracy"] > direct["accuracy"]  # the tool matters
    texts, ended = generate_completions(model, tok, [r["prompt"] for r in rows])
    for text, row in zip(texts, rows):  # every reply is the calculator's, in the token stream
        if tool_value(text) is not None:
            expr = text[text.index("<calc>") + 6 : text.index("</calc>")]
            assert tool_value(text) == str(calc_eval(expr))
    one_by_one = [generate_completions(model, tok, [r["prompt"]])[0][0] for r in rows[:8]]
    assert one_by_one == texts[:8]  # left padding does not change a completion


def test_sampled_eval_is_seeded_and_leaves_the_global_rng():
    model, tok = _shipped()
    rows = make_prompts("test", 32, seed=1)
    torch.manual_seed(123)
    a = generate_completions(model, tok, [r["prompt"] for r in rows], temperature=1.0, seed=5)
    after = torch.rand(1)
    torch.manual_seed(123)
    b = generate_completions(model, tok, [r["prompt"] for r in rows], temperature=1.0, seed=5)
    assert a == b and torch.equal(after, torch.rand(1))
