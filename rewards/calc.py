"""Rewards of the calculator world (`flowrl.worlds.calc`): ``calc_answer``, whether the final answer (the text
after the last ``</out>``, or the whole completion) is exactly the row's ``answer``; ``tool_used``, whether the
completion called the calculator (``<calc>``), meant to be logged with weight 0."""

from __future__ import annotations

from rewards._common import completion_text
from rewards.memory import NOTHING
from rewards.registry import TEXT, register


def calc_answer_reward(prompts, completions, **columns) -> list[float]:
    """1.0 where the completion's final answer is exactly the ``answer`` column's, else 0.0.

    >>> calc_answer_reward(["34*57="] * 2, ["<calc>34*57</calc><out>1938</out>1938", "1988"], answer=["1938"] * 2)
    [1.0, 0.0]
    """
    from flowrl.worlds.calc import exact

    if "answer" not in columns:
        raise KeyError(f"the calc_answer reward needs an 'answer' column; got columns {sorted(columns) or '(none)'}")
    answers = columns["answer"]
    if len(answers) != len(completions):
        raise ValueError(f"calc_answer: {len(completions)} completions but {len(answers)} 'answer' values")
    return [exact(completion_text(c), a) for c, a in zip(completions, answers)]


def tool_used_reward(prompts, completions, **columns) -> list[float]:
    """1.0 where the completion called the calculator, else 0.0."""
    from flowrl.worlds.calc import used_tool

    return [float(used_tool(completion_text(c))) for c in completions]


calc_answer_reward.kind = tool_used_reward.kind = TEXT


@register(
    "calc_answer",
    kind=TEXT,
    memory=NOTHING,
    columns=("answer",),
    summary="text: the calculator world's final answer (after the last `</out>`) is exactly the row's `answer`",
)
def calc_answer():
    """The calculator world's exact final-answer reward (no options)."""
    return calc_answer_reward


@register(
    "tool_used",
    kind=TEXT,
    memory=NOTHING,
    summary="text: 1 where the completion called the calculator (`<calc>`); log it with weight 0",
)
def tool_used():
    """Whether the completion called the calculator (no options)."""
    return tool_used_reward
