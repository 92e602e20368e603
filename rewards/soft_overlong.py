"""DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): with ``L = |y|`` the completion length in
tokens, ``L_max`` the maximum length and ``L_cache`` the punishment interval,

    R(y) = 0                                  if L <= L_max - L_cache
           ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
           -1                                 if L > L_max
"""

from __future__ import annotations

from typing import Any

from rewards._common import completion_text
from rewards.memory import NOTHING
from rewards.registry import TEXT, register


def soft_overlong_punishment(length: int, max_length: int, cache_length: int) -> float:
    """``R(y)`` above for a completion of ``length`` tokens."""
    threshold = max_length - cache_length
    if length <= threshold:
        return 0.0
    if length <= max_length:
        return (threshold - length) / cache_length
    return -1.0


class SoftOverlong:
    """The punishment per completion. Lengths come from the ``completion_ids`` column that TRL passes
    to reward functions, else from ``tokenizer`` (a tokenizer, or a hub id / local dir to load one)."""

    kind = TEXT
    __name__ = "soft_overlong"

    def __init__(self, max_length: int, cache_length: int, tokenizer: Any = None):
        if not 0 < cache_length <= max_length:
            raise ValueError(
                f"soft_overlong needs 0 < cache_length <= max_length, "
                f"got cache_length={cache_length}, max_length={max_length}"
            )
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.max_length, self.cache_length, self.tokenizer = max_length, cache_length, tokenizer

    def lengths(self, completions, completion_ids) -> list[int]:
        if completion_ids is not None:
            return [len(ids) for ids in completion_ids]
        if self.tokenizer is None:
            raise ValueError(
                "soft_overlong needs token counts: pass the 'completion_ids' column (TRL does) "
                "or build the reward with tokenizer=<tokenizer or its hub id/path>"
            )
        texts = [completion_text(c) for c in completions]
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def __call__(self, prompts, completions, completion_ids=None, **columns) -> list[float]:
        return [
            soft_overlong_punishment(n, self.max_length, self.cache_length)
            for n in self.lengths(completions, completion_ids)
        ]


@register("soft_overlong", kind=TEXT, memory=NOTHING, summary="text: DAPO's soft overlong punishment")
def soft_overlong(max_length: int, cache_length: int, tokenizer: Any = None) -> SoftOverlong:
    """DAPO's soft overlong punishment with ``L_max = max_length`` and ``L_cache = cache_length``."""
    return SoftOverlong(max_length, cache_length, tokenizer)


def _check_options(kwargs: dict, kind: str) -> str:
    """``rewards.check``'s hook (before any model loads): 0 < cache_length <= max_length, as the reward needs."""
    from rewards.registry import RewardConfigError

    max_length, cache_length = kwargs.get("max_length"), kwargs.get("cache_length")
    if isinstance(max_length, int) and isinstance(cache_length, int) and not 0 < cache_length <= max_length:
        raise RewardConfigError(
            f"reward 'soft_overlong' needs 0 < cache_length <= max_length, got cache_length={cache_length}, "
            f"max_length={max_length}"
        )
    return TEXT


soft_overlong.check_options = _check_options
