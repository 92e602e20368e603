"""Text rewards (TRL signature): accuracy, think_format, soft_overlong; completions as strings or chat."""

from __future__ import annotations

import pytest

import rewards
from rewards._common import completion_text
from rewards.accuracy import extract_answer, last_boxed, parse_number
from rewards.soft_overlong import soft_overlong_punishment
from rewards.think_format import think_format_reward


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def test_completion_text_reads_strings_and_chat_messages():
    assert completion_text("42") == "42"
    assert completion_text(chat("4") + [{"role": "tool", "content": "x"}] + chat("2")) == "42"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]) == "ab"
    with pytest.raises(TypeError, match="role', 'content"):
        completion_text(["not a message"])


@pytest.mark.parametrize("text, answer", [
    (r"so \boxed{\frac{3}{4}} done", r"\frac{3}{4}"),
    (r"\boxed{1} then \boxed{{2}+1}", "{2}+1"),  # the last box, nested braces kept
    (r"\boxed 7", "7"),
    ("work...\n#### 1,234\nmore", "1,234"),  # GSM8K
    ("I got 3 apples and then 12.5 more", "12.5"),  # the last number
    ("half is 1/2", "1/2"),
    ("no digits here", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("text, value", [
    ("1,234", 1234.0), ("$5", 5.0), ("50\\%", 50.0), ("-2.5", -2.5), ("3/4", 0.75),
    (r"\frac{3}{4}", 0.75), (r"-\dfrac{1}{8}", -0.125), ("1e3", 1000.0), (".5", 0.5),
    (r"7 \text{ apples}", 7.0), ("x+1", None), ("1,2,3", None), (None, None), ("1/0", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_last_boxed_unbalanced_is_none():
    assert last_boxed(r"\boxed{1") is None


def test_accuracy_compares_numbers_and_skips_non_numeric_references():
    accuracy = rewards.get("accuracy")
    completions = [
        r"The answer is \boxed{72}.",  # solution has "#### 72" -> 1
        chat("<think>..</think><answer>So 0.75</answer>"),  # 3/4 = 0.75 -> 1
        "Total: 1,000 dollars",  # 1000 vs 1001 -> 0
        "I don't know",  # no number -> 0
        r"\boxed{x}",  # reference is not numeric -> None
    ]
    solutions = ["Natalia sold 48/2 = 24 clips... 48+24 = 72\n#### 72", r"\frac{3}{4}", "1001", "5", r"\pi"]
    assert accuracy(["q"] * 5, completions, solution=solutions) == [1.0, 1.0, 0.0, 0.0, None]
    assert accuracy(["q"], ["it is 2"], answer=[2]) == [1.0]  # GSM8K-style 'answer' column, int value
    assert accuracy.kind == "text" and accuracy.__name__ == "accuracy"


def test_accuracy_tolerance_is_relative():
    tight, loose = rewards.get("accuracy"), rewards.get("accuracy", rel_tol=1e-3)
    # |0.3333 - 1/3| / (1/3) = 1e-4: inside 1e-3, outside 1e-6
    assert tight(["q"], ["0.3333"], solution=["1/3"]) == [0.0]
    assert loose(["q"], ["0.3333"], solution=["1/3"]) == [1.0]


def test_accuracy_without_reference_column_names_what_it_needs():
    with pytest.raises(KeyError, match="'solution' or 'answer'.*got columns \\['label'\\]"):
        rewards.get("accuracy")(["q"], ["1"], label=["1"])


@pytest.mark.parametrize("text, ok", [
    ("<think>reason</think><answer>4</answer>", True),
    ("\n<think>a\nb</think>\n\n<answer>\n4\n</answer>\n", True),
    ("<answer>4</answer><think>r</think>", False),  # wrong order
    ("<think>r</think>", False),  # no answer
    ("<think>r</think><answer>4</answer> trailing", False),
    ("<think>r<think>r</think><answer>4</answer>", False),  # a tag twice
    ("<think>r</think><answer>4</answer><answer>5</answer>", False),
    ("Sure! <think>r</think><answer>4</answer>", False),  # text before
])
def test_think_format(text, ok):
    assert think_format_reward(["q"], [text]) == [float(ok)]
    assert rewards.get("think_format")(["q"], [chat(text)]) == [float(ok)]


@pytest.mark.parametrize("length, expected", [
    (10, 0.0), (15, 0.0),  # <= L_max - L_cache = 20 - 5 = 15
    (16, -0.2),  # (15 - 16) / 5
    (18, -0.6),  # (15 - 18) / 5
    (20, -1.0),  # (15 - 20) / 5, the end of the interval
    (21, -1.0), (100, -1.0),  # over L_max
])
def test_soft_overlong_punishment(length, expected):
    assert soft_overlong_punishment(length, max_length=20, cache_length=5) == pytest.approx(expected, abs=1e-12)


def test_soft_overlong_reads_completion_ids_or_a_tokenizer(tmp_path):
    from rewardtiny import save_tiny_clip

    reward = rewards.get("soft_overlong", max_length=8, cache_length=4)
    ids = [[1] * 3, [1] * 6, [1] * 9]  # threshold 4: 0, (4-6)/4 = -0.5, -1
    assert reward(["q"] * 3, ["", "", ""], completion_ids=ids) == [0.0, -0.5, -1.0]
    with pytest.raises(ValueError, match="completion_ids.*tokenizer="):
        reward(["q"], ["text"])
    save_tiny_clip(tmp_path)  # a character-level tokenizer: one token per character
    by_text = rewards.get("soft_overlong", max_length=8, cache_length=4, tokenizer=str(tmp_path))
    assert by_text(["q"] * 3, ["abc", chat("abcdef"), "abcdefghi"]) == [0.0, -0.5, -1.0]
    with pytest.raises(ValueError, match="0 < cache_length <= max_length"):
        rewards.get("soft_overlong", max_length=4, cache_length=8)
