"""Accuracy of a final numeric answer (RLVR on GSM8K / MATH-style data, e.g. DeepSeek-R1, DAPO).

The answer is, in this order of preference: the content of the last ``\\boxed{...}``, the text after
the last ``####`` (GSM8K), or the last number in the text. The reference comes from the ``solution``
or ``answer`` column, read the same way (so a full GSM8K solution ending in ``#### 72`` works). Both are
compared as numbers (``1,000``, ``$5``, ``50%``, ``3/4``, ``\\frac{3}{4}``, ``-2.5``, ``1e3`` parse) with a
relative tolerance. Returns 1.0 / 0.0, or None where the reference is not a number."""

from __future__ import annotations

import math
import re
from fractions import Fraction

from rewards._common import completion_text
from rewards.memory import NOTHING
from rewards.registry import TEXT, register

_NUMBER = re.compile(
    r"-?\d+\s*/\s*\d+(?![\d.,])"  # a fraction 3/4
    r"|-?\d{1,3}(?:,\d{3})+(?:\.\d+)?"  # thousands separators 1,234.5
    r"|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"  # 12, -2.5, 1e3
    r"|-?\.\d+"  # .5
)
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent."""
    starts = [(text.rfind(cmd), cmd) for cmd in ("\\boxed", "\\fbox")]
    start, cmd = max(starts)
    if start < 0:
        return None
    rest = text[start + len(cmd) :]
    if rest.startswith(" "):  # \boxed 5
        return rest.split()[0] if rest.split() else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:i]
    return None  # unbalanced


def extract_answer(text: str) -> str | None:
    """The final answer of ``text``: last ``\\boxed{}``, else after the last ``####``, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return after.splitlines()[0].strip() if after else None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(answer: str | None) -> float | None:
    """A float from an answer string, or None when it is not a single number."""
    if answer is None:
        return None
    s = answer.strip().rstrip(".").replace("\\!", "").replace("\\,", "").replace("\\$", "").replace("$", "")
    s = re.sub(r"\\text\{[^{}]*\}", "", s).replace("\\%", "").replace("%", "").replace(" ", "")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    frac = _FRAC.match(s)
    try:
        if frac:
            value = Fraction(frac.group(2)) / Fraction(frac.group(3))
            return float(-value if frac.group(1) else value)
        if re.fullmatch(r"-?\d+/\d+", s):
            return float(Fraction(s))
        return float(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: float, reference: float, rel_tol: float = 1e-6) -> bool:
    """``|p - r| <= rel_tol · max(|p|, |r|)``, or both within 1e-12 of zero."""
    return math.isclose(predicted, reference, rel_tol=rel_tol, abs_tol=1e-12)


def _reference(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    value = str(value)
    direct = parse_number(value)
    return direct if direct is not None else parse_number(extract_answer(value))


class Accuracy:
    """1.0 when the completion's final answer equals the reference numerically, 0.0 when not
    (or when the completion has no answer), None when the reference is not a number."""

    kind = TEXT
    __name__ = "accuracy"

    def __init__(self, rel_tol: float = 1e-6):
        self.rel_tol = rel_tol

    def __call__(self, prompts, completions, **columns) -> list[float | None]:
        column = next((c for c in ("solution", "answer") if c in columns), None)
        if column is None:
            raise KeyError(
                f"the accuracy reward needs a 'solution' or 'answer' column; got columns {sorted(columns) or '(none)'}"
            )
        references = columns[column]
        if len(references) != len(completions):
            raise ValueError(f"accuracy: {len(completions)} completions but {len(references)} {column!r} values")
        scores: list[float | None] = []
        for completion, reference in zip(completions, references):
            ref = _reference(reference)
            if ref is None:
                scores.append(None)
                continue
            predicted = parse_number(extract_answer(completion_text(completion)))
            scores.append(float(predicted is not None and answers_match(predicted, ref, self.rel_tol)))
        return scores


@register(
    "accuracy",
    kind=TEXT,
    memory=NOTHING,
    columns=(("solution", "answer"),),
    summary="text: the accuracy of the final numeric answer against the row's `answer`",
)
def accuracy(rel_tol: float = 1e-6) -> Accuracy:
    """The numeric final-answer accuracy reward (see the module docstring)."""
    return Accuracy(rel_tol)
