"""The arithmetic task of the tiny text default: tokenizer, split, scoring, and the shipped model."""

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flowrl.worlds.arith import (  # noqa: E402
    BOS,
    EOS,
    MAX_OPERAND,
    N_TEST_PAIRS,
    PAD,
    arith_tokenizer,
    exact_match,
    greedy_accuracy,
    greedy_completions,
    make_prompts,
    split_rows,
)

SAMPLES = Path(__file__).resolve().parents[1] / "samples" / "arith"


@pytest.fixture(scope="module")
def tok():
    return arith_tokenizer()


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_one_token_per_char_round_trip(tok):
    ids = tok("37+45=82")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len("37+45=82")
    assert tok.convert_ids_to_tokens(ids[1:]) == list("37+45=82")
    assert tok.decode(ids, skip_special_tokens=True) == "37+45=82"
    assert tok.decode(ids) == BOS + "37+45=82"
    for text in ("0 - 9 * 12", "99+99=198"):
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text


def test_tokenizer_specials(tok):
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (PAD, BOS, EOS)
    ids = {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}
    assert None not in ids and len(ids) == 4
    assert len(tok) == 4 + 10 + 5  # specials, digits, "+-*= "
    assert tok.convert_ids_to_tokens(tok("7\n", add_special_tokens=False)["input_ids"]) == ["7", tok.unk_token]
    batch = tok(["3+5=", "99+99="], padding=True)
    assert tok.padding_side == "left"
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2 and batch["attention_mask"][0][:3] == [0, 0, 1]
    assert batch["input_ids"][0][-1] == batch["input_ids"][1][-1] == tok.convert_tokens_to_ids("=")


def test_tokenizer_save_load(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (
        tok.pad_token_id,
        tok.bos_token_id,
        tok.eos_token_id,
    )
    assert loaded.padding_side == "left"
    text = "12+7=19"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text


# ----------------------------------------------------------------------------- prompts


def test_split_sizes_and_disjointness():
    train, test = split_rows("train"), split_rows("test")
    assert len(train) + len(test) == (MAX_OPERAND + 1) ** 2
    train_p, test_p = {r["prompt"] for r in train}, {r["prompt"] for r in test}
    assert len(train_p) == len(train) and len(test_p) == len(test)
    assert not train_p & test_p
    # both orders of a held-out pair are held out, so no commuted twin leaks into training
    for p in test_p:
        a, b = p[:-1].split("+")
        assert f"{b}+{a}=" in test_p
    unordered = {tuple(sorted(map(int, p[:-1].split("+")))) for p in test_p}
    assert len(unordered) == N_TEST_PAIRS


def test_rows_are_correct_sums():
    for row in make_prompts("train", 50, seed=3) + make_prompts("test", 50, seed=3):
        a, b = row["prompt"].removesuffix("=").split("+")
        assert row["answer"] == str(int(a) + int(b))
        assert 0 <= int(a) <= MAX_OPERAND and 0 <= int(b) <= MAX_OPERAND


def test_make_prompts_deterministic_and_seeded():
    assert make_prompts("train", 100, seed=1) == make_prompts("train", 100, seed=1)
    assert make_prompts("train", 100, seed=1) != make_prompts("train", 100, seed=2)
    rows = make_prompts("test", None, seed=5)
    assert len({r["prompt"] for r in rows}) == len(rows) == len(split_rows("test"))
    assert sorted(rows, key=lambda r: r["prompt"]) == sorted(split_rows("test"), key=lambda r: r["prompt"])
    with pytest.raises(ValueError, match="train"):
        make_prompts("valid", 10, seed=0)
    with pytest.raises(ValueError, match=r"\[0, 995\]"):
        make_prompts("test", 10_000, seed=0)


# ----------------------------------------------------------------------------- scoring


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("82", "82", 1.0),
        ("82", 82, 1.0),
        (" 82 ", "82", 1.0),
        ("82<eos>", "82", 1.0),
        ("82<eos>31", "82", 1.0),
        ("<pad>82", "82", 1.0),
        ("8", "82", 0.0),
        ("821", "82", 0.0),
        ("28", "82", 0.0),
        ("", "0", 0.0),
        ("0", 0, 1.0),
        ("<eos>82", "82", 0.0),
    ],
)
def test_exact_match_cases(completion, answer, expected):
    assert exact_match(completion, answer) == expected


# ----------------------------------------------------------------------------- the shipped model


def _shipped():
    if not (SAMPLES / "model.safetensors").exists():
        pytest.skip(f"no pre-trained model in {SAMPLES} yet (scripts/pretrain_arith.py writes it)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(SAMPLES), AutoTokenizer.from_pretrained(SAMPLES)


def test_shipped_jsonl_matches_split():
    for split in ("train", "test"):
        path = SAMPLES / f"{split}.jsonl"
        if not path.exists():
            pytest.skip(f"{path} not written yet")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert rows == split_rows(split)


def test_shipped_model_loads_offline_and_is_imperfect():
    model, tok = _shipped()
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert tok.get_vocab() == arith_tokenizer().get_vocab() and tok.padding_side == "left"
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    assert sum(f.stat().st_size for f in SAMPLES.iterdir()) <= 10 * 2**20
    rows = make_prompts("test", 400, seed=0)
    acc = greedy_accuracy(model, tok, rows, max_new_tokens=4, batch_size=200)
    assert 0.3 <= acc <= 0.7, f"held-out greedy exact match {acc:.3f} is outside [0.3, 0.7]"


def test_batched_left_padded_greedy_equals_one_by_one():
    """Left padding must not change a greedy completion (position ids follow the attention mask)."""
    model, tok = _shipped()
    prompts = ["3+5=", "99+99=", "12+7=", "40+61=", "0+0=", "8+93="]
    batched = greedy_completions(model, tok, prompts, max_new_tokens=4, batch_size=len(prompts))
    single = [greedy_completions(model, tok, [p], max_new_tokens=4)[0] for p in prompts]
    assert batched == single


def test_greedy_accuracy_counts_what_it_decodes():
    """greedy_accuracy equals the share of greedy completions that match, recomputed by hand here."""
    model, tok = _shipped()
    rows = make_prompts("train", 64, seed=7)
    enc = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    with torch.no_grad():
        gen = model.generate(
            **enc, do_sample=False, max_new_tokens=4, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
        )
    hits = 0
    for row, ids in zip(rows, gen[:, enc["input_ids"].shape[1] :].tolist()):
        text = "".join(tok.convert_ids_to_tokens(ids))
        hits += text.startswith(row["answer"] + EOS)
    assert greedy_accuracy(model, tok, rows, max_new_tokens=4, batch_size=16) == pytest.approx(hits / len(rows))


# ----------------------------------------------------------------------------- the pre-training script


def test_pretraining_trains_on_the_answer_and_eos_only(tok):
    from repo_files import load_module

    script = load_module("scripts/pretrain_arith.py", "pretrain_arith")
    ids, mask = script.encode_rows(tok, [{"prompt": "37+45=", "answer": "82"}, {"prompt": "9+1=", "answer": "10"}])
    assert ids.shape == (2, 10) and mask.shape == (2, 9)
    assert ids[1, -2:].tolist() == [tok.pad_token_id] * 2  # right-padded
    trained = [tok.convert_ids_to_tokens([int(ids[i, t + 1]) for t in range(9) if mask[i, t]]) for i in (0, 1)]
    assert trained == [["8", "2", EOS], ["1", "0", EOS]]
