"""A tiny world where the tool matters: two-digit multiplication with a calculator.

A prompt is ``"34*57="`` with both operands in 10..99; the answer is the product (3 or 4 digits). A completion
either answers directly, ``"1938" + <eos>``, or calls the calculator first,
``"<calc>34*57</calc><out>1938</out>1938" + <eos>``: in a rollout with ``text.tool_env: calculator`` the model's
turn ends at ``</calc>``, the environment appends ``<out>1938</out>`` (context, not trained) and the model goes on.
A tiny model multiplies badly, so its direct answers are often wrong and the tool pays.

Train / held-out split: the 4,095 unordered operand pairs ``{a, b}`` are shuffled once with the fixed `SPLIT_SEED`;
the first `N_TEST_PAIRS` are held out, in both orders, so a held-out product cannot be read off its commuted twin.
That gives 795 held-out and 7,305 training prompts, disjoint by construction.

The tokenizer (`calc_tokenizer`) is `flowrl.worlds.arith`'s, one token per character, plus the four tags
``<calc> </calc> <out> </out>``, each ONE ordinary (not special) token: decoding with ``skip_special_tokens=True``
keeps them, as flowrl's tool rollouts and text rewards need.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from flowrl.worlds.arith import CHARS, EOS, PAD, SPECIALS, write_jsonl

LOW, HIGH = 10, 99
"""Operands are drawn from LOW..HIGH."""
SPLIT_SEED = 20240917
"""Fixes which operand pairs are held out; changing it changes the shipped split."""
N_TEST_PAIRS = 400
"""Unordered operand pairs held out (both orders of each), out of 4,095."""

CALL, CALL_END, OUT, OUT_END = "<calc>", "</calc>", "<out>", "</out>"
TAGS = (CALL, CALL_END, OUT, OUT_END)
MAX_LENGTH = 64
"""The tokenizer's `model_max_length` and the model's `n_positions`."""
MAX_NEW = 24
"""Completion tokens in all (the environment's included): a tool trace is 18 with its eos."""
MAX_TURNS = 4


# ----------------------------------------------------------------------------- tokenizer


def calc_vocab() -> dict[str, int]:
    """Token -> id: the specials (``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3), `CHARS`, `TAGS`."""
    return {tok: i for i, tok in enumerate(SPECIALS + CHARS + TAGS)}


def calc_tokenizer():
    """A `PreTrainedTokenizerFast` built in code: one token per character, and one per tag
    (`flowrl.worlds.arith.char_tokenizer` with `TAGS`; the tags are plain vocabulary entries, a stray ``<`` is
    ``<unk>``). Encoding prepends ``<bos>``; padding is on the left; it saves and loads with `save_pretrained` /
    `AutoTokenizer.from_pretrained`."""
    from flowrl.worlds.arith import char_tokenizer

    return char_tokenizer(calc_vocab(), max_length=MAX_LENGTH, tags=TAGS)


# ----------------------------------------------------------------------------- prompts


def _held_out_pairs() -> set[tuple[int, int]]:
    """The `N_TEST_PAIRS` unordered pairs (a <= b) held out, fixed by `SPLIT_SEED`."""
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(a, HIGH + 1)]
    order = np.random.default_rng(SPLIT_SEED).permutation(len(pairs))
    return {pairs[i] for i in order[:N_TEST_PAIRS]}


def split_rows(split: str) -> list[dict]:
    """Every row of `split` ("train" or "test") in canonical order (a, then b), as {"prompt", "answer"}."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    held = _held_out_pairs()
    want_test = split == "test"
    return [
        {"prompt": f"{a}*{b}=", "answer": str(a * b)}
        for a in range(LOW, HIGH + 1)
        for b in range(LOW, HIGH + 1)
        if ((min(a, b), max(a, b)) in held) == want_test
    ]


def make_prompts(split: str, n: int | None = None, seed: int = 0) -> list[dict]:
    """`n` distinct rows of `split` in an order drawn with `seed` (`n=None`: all); as `flowrl.worlds.arith`."""
    rows = split_rows(split)
    if n is not None and not 0 <= n <= len(rows):
        raise ValueError(f"n must be in [0, {len(rows)}] for split {split!r} (or None for all), got {n}")
    order = np.random.default_rng(seed).permutation(len(rows))
    return [rows[i] for i in order[: len(rows) if n is None else n]]


def write_splits(directory: str | os.PathLike) -> tuple[Path, Path]:
    """Write `train.jsonl` and `test.jsonl` (all rows, canonical order, keys prompt/answer) into `directory`."""
    directory = Path(directory)
    return (
        write_jsonl(split_rows("train"), directory / "train.jsonl"),
        write_jsonl(split_rows("test"), directory / "test.jsonl"),
    )


def tool_trace(prompt: str, answer: str, copy: str | None = None) -> str:
    """The completion text (without eos) that calls the calculator, gets `answer` and writes `copy` (default: the
    answer): ``<calc>34*57</calc><out>1938</out>1938``."""
    expr = prompt.removesuffix("=")
    return f"{CALL}{expr}{CALL_END}{OUT}{answer}{OUT_END}{answer if copy is None else copy}"


# ----------------------------------------------------------------------------- scoring


def final_answer(completion: str) -> str:
    """The text after the last ``</out>`` (the whole completion if none), cut at ``<eos>``, pads dropped, stripped.

    >>> final_answer("<calc>34*57</calc><out>1938</out>1938"), final_answer(" 1938 "), final_answer("12<eos>3")
    ('1938', '1938', '12')
    """
    text = completion.split(EOS, 1)[0].replace(PAD, "")
    return text.rsplit(OUT_END, 1)[-1].strip()


def exact(completion: str, answer) -> float:
    """1.0 when the completion's final answer is exactly `answer` (int or str), else 0.0."""
    return float(final_answer(completion) == str(answer).strip())


def used_tool(completion: str) -> bool:
    """Whether the completion calls the calculator (holds ``<calc>``)."""
    return CALL in completion


def tool_value(completion: str) -> str | None:
    """The last ``<out>VALUE</out>`` the completion holds (the environment's reply), or None."""
    found = re.findall(re.escape(OUT) + r"(.*?)" + re.escape(OUT_END), completion, re.S)
    return found[-1] if found else None


# ----------------------------------------------------------------------------- evaluation


def generate_completions(
    model,
    tokenizer,
    prompts: list[str],
    tool: bool = True,
    calls: bool = True,
    temperature: float = 0.0,
    seed: int = 0,
    max_new: int = MAX_NEW,
    batch_size: int = 256,
) -> tuple[list[str], list[bool]]:
    """Completions of `prompts` -> (their texts, up to and not including the eos; whether an eos came).

    Greedy, or sampled at `temperature` > 0 with the seed `seed` (the global torch RNG is left as it was).
    `tool=True`: a turn ends at ``</calc>`` or the eos; after ``</calc>`` `flowrl.tools.calculator`'s reply to the
    turn is appended as tokens and the model goes on, `MAX_TURNS` turns and `max_new` tokens in all (replies count),
    as flowrl's tool rollouts do. `tool=False`: one turn of `max_new` tokens with no environment (what the model
    writes after a call is its own). `calls=False` forbids the ``<calc>`` token (direct answers only).
    """
    import torch

    if tokenizer.padding_side != "left":
        raise ValueError(f"batched generation needs tokenizer.padding_side == 'left', got {tokenizer.padding_side!r}")
    heads = [tokenizer(p)["input_ids"] for p in prompts]
    comp: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    options = {"do_sample": temperature > 0, "max_turns": MAX_TURNS if tool else 1, "max_new": max_new}
    if temperature > 0:
        options.update(temperature=temperature, top_k=0)
    if not calls:
        options["bad_words_ids"] = [[tokenizer.convert_tokens_to_ids(CALL)]]
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            for start in range(0, len(prompts), batch_size):
                rows = range(start, min(start + batch_size, len(prompts)))
                _turns(model, tokenizer, heads, comp, done, list(rows), tool=tool, **options)
    finally:
        model.train(was_training)
    return [tokenizer.decode(c[:-1] if d else c, skip_special_tokens=False) for c, d in zip(comp, done)], done


def _turns(model, tokenizer, heads, comp, done, active, *, tool, max_turns, max_new, **options) -> None:
    """The turns of `generate_completions` for the rows `active`: extends `comp[i]` and sets `done[i]` in place."""
    import torch

    from flowrl.tools import calculator

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    stop = [eos, tokenizer.convert_tokens_to_ids(CALL_END)] if tool else [eos]
    for k in range(max_turns):
        seqs = [heads[i] + comp[i] for i in active]
        width = max(len(q) for q in seqs)
        gen = model.generate(  # left-padded: the rows end at the same column
            input_ids=torch.tensor([[pad] * (width - len(q)) + q for q in seqs]),
            attention_mask=torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in seqs]),
            max_new_tokens=max(max_new - len(comp[i]) for i in active),
            eos_token_id=stop,
            pad_token_id=pad,
            **options,
        )
        still = []
        for i, row in zip(active, gen[:, width:].tolist()):
            row = row[: max_new - len(comp[i])]
            end = next((k for k, t in enumerate(row) if t in stop), None)
            turn = row if end is None else row[: end + 1]
            comp[i] += turn
            if end is None:
                continue  # out of tokens
            if row[end] == eos:
                done[i] = True
                continue
            if k + 1 == max_turns:  # the last turn: no reply the model could read
                continue
            reply = calculator(tokenizer.decode(turn, skip_special_tokens=True))
            if reply is None:  # "</calc>" with no call in the turn: the episode ends, as in flowrl
                continue
            comp[i] += tokenizer(reply, add_special_tokens=False)["input_ids"][: max_new - len(comp[i])]
            if len(comp[i]) < max_new:
                still.append(i)
        active = still
        if not active:
            return


def evaluate(model, tokenizer, rows: list[dict], **options) -> dict:
    """Figures of `generate_completions(..., **options)` on `rows` ({"prompt", "answer"}): `accuracy` (a completion
    with no eos is wrong), `tool_use` (share that call the calculator), `wrong_copy` (among completions that end and
    hold an ``<out>`` reply: share whose final answer is not the reply; None when there are none), and `n`."""
    if not rows:
        raise ValueError("evaluate needs at least one row")
    texts, ended = generate_completions(model, tokenizer, [r["prompt"] for r in rows], **options)
    hits = [e and exact(c, r["answer"]) for c, e, r in zip(texts, ended, rows)]
    replied = [(c, tool_value(c)) for c, e in zip(texts, ended) if e and tool_value(c) is not None]
    wrong = [final_answer(c) != v for c, v in replied]
    return {
        "accuracy": sum(hits) / len(rows),
        "tool_use": sum(map(used_tool, texts)) / len(rows),
        "wrong_copy": sum(wrong) / len(wrong) if wrong else None,
        "n": len(rows),
    }
