"""Format reward of DeepSeek-R1-style reasoning: the completion is ``<think>…</think>`` followed by
``<answer>…</answer>`` and nothing else (whitespace around the blocks allowed), each tag exactly once."""

from __future__ import annotations

import re

from rewards._common import completion_text
from rewards.memory import NOTHING
from rewards.registry import TEXT, register

_FORMAT = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def has_think_format(text: str) -> bool:
    """True when ``text`` is one think block then one answer block, and each tag occurs once."""
    return _FORMAT.fullmatch(text) is not None and all(text.count(tag) == 1 for tag in _TAGS)


def think_format_reward(prompts, completions, **columns) -> list[float]:
    """1.0 for completions in the think-then-answer format, else 0.0.

    >>> think_format_reward(["q"], ["<think>2+2</think>\\n<answer>4</answer>", "4"])
    [1.0, 0.0]
    """
    return [float(has_think_format(completion_text(c))) for c in completions]


think_format_reward.kind = TEXT


@register(
    "think_format",
    kind=TEXT,
    memory=NOTHING,
    summary="text: the think-then-answer format (`<think>...</think>` then `<answer>...</answer>`)",
)
def think_format():
    """The think-then-answer format reward (no options)."""
    return think_format_reward
