"""OCR reward: our Levenshtein, Flow-GRPO's rule, and a real Tesseract run on text rendered with PIL."""

from __future__ import annotations

import functools
import importlib.util
import random
import shutil

import pytest
from rewardtiny import block_non_loopback, render_text

import rewards
from rewards.ocr import levenshtein, ocr_distance, ocr_score, quoted_target


def recursive_edit_distance(a: str, b: str) -> int:
    """The textbook recursion, memoised: an independent derivation to check the two-row DP against."""

    @functools.lru_cache(maxsize=None)
    def d(i: int, j: int) -> int:
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))

    return d(len(a), len(b))


@pytest.mark.parametrize(
    "a, b, d",
    [
        ("kitten", "sitting", 3),  # k->s, e->i, +g
        ("flaw", "lawn", 2),  # -f, +n
        ("", "abc", 3),
        ("abc", "", 3),
        ("same", "same", 0),
        ("ab", "ba", 2),
    ],
)
def test_levenshtein_by_hand(a, b, d):
    assert levenshtein(a, b) == d


def test_levenshtein_matches_the_recursive_definition():
    rng = random.Random(0)
    for _ in range(200):
        a = "".join(rng.choice("abc") for _ in range(rng.randint(0, 7)))
        b = "".join(rng.choice("abc") for _ in range(rng.randint(0, 7)))
        assert levenshtein(a, b) == recursive_edit_distance(a, b), (a, b)


def test_quoted_target():
    assert quoted_target('A neon sign that reads "Open 24h" on a wall, "no"') == "Open 24h"
    assert quoted_target("a poster saying \u201cHELLO\u201d") == "HELLO"
    with pytest.raises(ValueError, match="double quotes"):
        quoted_target("a cat")


@pytest.mark.parametrize(
    "recognised, target, score",
    [
        ("0PEN", "OPEN", 0.75),  # d = 1 (O->0), n = 4: 1 - 1/4
        ("the open\nsign", "Open", 1.0),  # case and whitespace ignored, substring -> d = 0
        ("Hel lo Wor ld", "Hello World", 1.0),  # spaces removed on both sides
        ("flow", "flowrl", 1 - 2 / 6),  # two insertions
        ("", "abc", 0.0),  # d = 3 = n
        ("zzzzzzzzzz", "abc", 0.0),  # d = 10 > n = 3: clipped to n
    ],
)
def test_ocr_score_rule(recognised, target, score):
    assert ocr_score(recognised, target) == pytest.approx(score, abs=1e-12)


def test_ocr_distance_is_zero_for_substrings_only():
    assert ocr_distance("xxOPENxx", "open") == 0
    assert ocr_distance("OPN", "open") == 1


@pytest.mark.skipif(
    shutil.which("tesseract") is None or importlib.util.find_spec("pytesseract") is None,
    reason="needs tesseract-ocr and pytesseract (the ocr extra)",
)
def test_tesseract_reads_rendered_text(monkeypatch):
    block_non_loopback(monkeypatch)
    reward = rewards.get("ocr")
    images = [render_text("HELLO WORLD"), render_text("FLOW"), render_text("")]
    prompts = ['a sign that says "Hello World"', 'a logo reading "FLOWRL"', 'a blank page with "abc"']
    scores = reward(images, prompts)
    # 1: exact match; 2: "flow" vs "flowrl" -> d = 2, 1 - 2/6; 3: nothing read -> 0
    assert scores.tolist() == pytest.approx([1.0, 1 - 2 / 6, 0.0], abs=1e-6), reward.last_texts
    assert reward.last_components["edit_distance"].tolist() == [0.0, 2.0, 3.0]


def test_unknown_engine_and_missing_paddle_are_clear_errors():
    with pytest.raises(ValueError, match="valid: tesseract, paddle"):
        rewards.get("ocr", engine="easyocr")
    if importlib.util.find_spec("paddleocr") is None:
        with pytest.raises(ImportError, match=r"flowrl\[paddleocr\]"):
            rewards.get("ocr", engine="paddle")
