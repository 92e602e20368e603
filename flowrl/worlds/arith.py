"""The arithmetic task of the tiny text default: a character-level tokenizer, prompts, answers, scoring.

A prompt is a two-digit addition such as ``"37+45="``; the completion is the sum and then the end token,
``"82" + <eos>``. Operands run over 0..99, so a prompt is 4 to 6 characters and an answer 1 to 3 digits.

Train / held-out split: the 5,050 unordered operand pairs ``{a, b}`` are shuffled once with the fixed
`SPLIT_SEED`; the first `N_TEST_PAIRS` of them are held out, in both orders (``a+b=`` and ``b+a=``), so a
held-out sum cannot be read off its commuted twin in the training set. That gives 995 held-out prompts and
9,005 training prompts, disjoint by construction. The split never depends on the `seed` of `make_prompts`,
which only draws and orders rows.

The tokenizer is built in code (`arith_tokenizer`): one token per character (digits, ``+ - * =`` and space)
plus the specials ``<pad> <bos> <eos> <unk>``. Encoding prepends ``<bos>``; padding is on the LEFT, so a
batch of prompts ends at the same column and generation continues every row from there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

MAX_OPERAND = 99
"""Operands are drawn from 0..MAX_OPERAND."""
SPLIT_SEED = 20240607
"""Fixes which operand pairs are held out; changing it changes the shipped split."""
N_TEST_PAIRS = 500
"""Unordered operand pairs held out (both orders of each), out of 5,050."""

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
CHARS = tuple("0123456789") + ("+", "-", "*", "=", " ")
MAX_LENGTH = 32
"""The tokenizer's `model_max_length` and the model's `n_positions`."""


# ----------------------------------------------------------------------------- tokenizer


def arith_vocab() -> dict[str, int]:
    """Token -> id: the specials first (``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3), then `CHARS`."""
    return {tok: i for i, tok in enumerate(SPECIALS + CHARS)}


def arith_tokenizer():
    """A `PreTrainedTokenizerFast` with one token per character, built in code (no files needed): `char_tokenizer`
    over `arith_vocab()`."""
    return char_tokenizer(arith_vocab(), max_length=MAX_LENGTH)


def char_tokenizer(vocab: dict[str, int], *, max_length: int, tags: tuple[str, ...] = ()):
    """A character-level `PreTrainedTokenizerFast` over `vocab` (the specials first), plus `tags`: whole strings
    that are one token each (plain vocabulary entries, kept by decoding).

    `tokenizers` pieces: a WordLevel model over `vocab`, a pre-tokenizer that isolates each tag, else every
    character, a template that prepends ``<bos>``, and a Fuse decoder (tokens are joined without spaces). Pad, bos,
    eos and unk are set; padding is on the left (for batched generation). It saves and loads with `save_pretrained`
    / `AutoTokenizer.from_pretrained`.
    """
    import re

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    pattern = "|".join([*(re.escape(t) for t in tags), "."])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


# ----------------------------------------------------------------------------- prompts


def _held_out_pairs() -> set[tuple[int, int]]:
    """The `N_TEST_PAIRS` unordered pairs (a <= b) held out, fixed by `SPLIT_SEED`."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(a, MAX_OPERAND + 1)]
    order = np.random.default_rng(SPLIT_SEED).permutation(len(pairs))
    return {pairs[i] for i in order[:N_TEST_PAIRS]}


def split_rows(split: str) -> list[dict]:
    """Every row of `split` ("train" or "test") in canonical order (a, then b), as {"prompt", "answer"}."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    held = _held_out_pairs()
    want_test = split == "test"
    rows = []
    for a in range(MAX_OPERAND + 1):
        for b in range(MAX_OPERAND + 1):
            if ((min(a, b), max(a, b)) in held) == want_test:
                rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def make_prompts(split: str, n: int | None = None, seed: int = 0) -> list[dict]:
    """`n` rows of `split` ("train" | "test") in an order drawn with `seed`; `n=None` gives them all.

    Each row is ``{"prompt": "37+45=", "answer": "82"}`` (the answer as a string, without the end
    token). Same (split, n, seed) -> same rows; rows within one call are distinct; the train and test
    prompts never overlap.
    """
    rows = split_rows(split)
    if n is not None and not 0 <= n <= len(rows):
        raise ValueError(f"n must be in [0, {len(rows)}] for split {split!r} (or None for all), got {n}")
    order = np.random.default_rng(seed).permutation(len(rows))
    return [rows[i] for i in order[: len(rows) if n is None else n]]


def write_jsonl(rows: list[dict], path: str | os.PathLike) -> Path:
    """Write `rows` as JSON lines, atomically (a temporary file, then rename); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return path


def write_splits(directory: str | os.PathLike) -> tuple[Path, Path]:
    """Write `train.jsonl` and `test.jsonl` (all rows, canonical order, keys prompt/answer) into `directory`."""
    directory = Path(directory)
    return (
        write_jsonl(split_rows("train"), directory / "train.jsonl"),
        write_jsonl(split_rows("test"), directory / "test.jsonl"),
    )


# ----------------------------------------------------------------------------- scoring


def exact_match(completion: str, answer) -> float:
    """1.0 when the completion is exactly the answer, else 0.0.

    The completion is cut at the first ``<eos>`` if its text still holds one (decoded without skipping
    special tokens), then pad tokens and surrounding whitespace are dropped. `answer`: int or str.

    >>> exact_match("82", 82), exact_match(" 82<eos>7", "82"), exact_match("821", "82"), exact_match("", "0")
    (1.0, 1.0, 0.0, 0.0)
    """
    text = completion.split(EOS, 1)[0].replace(PAD, "").strip()
    return float(text == str(answer).strip())


def greedy_completions(
    model, tokenizer, prompts: list[str], max_new_tokens: int = 4, batch_size: int = 256
) -> list[str | None]:
    """Greedy completions of `prompts`, as text up to (not including) the first eos; None where no eos came.

    Prompts are left-padded in batches of `batch_size`; `max_new_tokens` counts the eos (4 fits "198"+eos).
    """
    import torch

    if tokenizer.padding_side != "left":
        raise ValueError(f"batched generation needs tokenizer.padding_side == 'left', got {tokenizer.padding_side!r}")
    eos_id = tokenizer.eos_token_id
    out: list[str | None] = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True)
            with torch.no_grad():
                gen = model.generate(
                    **enc,
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=eos_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
            new = gen[:, enc["input_ids"].shape[1] :].tolist()  # [B, <= max_new_tokens]
            for ids in new:
                if eos_id in ids:
                    out.append(tokenizer.decode(ids[: ids.index(eos_id)], skip_special_tokens=False))
                else:
                    out.append(None)
    finally:
        model.train(was_training)
    return out


def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int = 4, batch_size: int = 256) -> float:
    """Share of `rows` whose greedy completion is exactly the answer followed by eos (no eos: wrong)."""
    if not rows:
        raise ValueError("greedy_accuracy needs at least one row")
    completions = greedy_completions(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens, batch_size)
    hits = [0.0 if c is None else exact_match(c, r["answer"]) for c, r in zip(completions, rows)]
    return sum(hits) / len(hits)
