"""The text engine seam: `TextEngine` and its registry (see flowrl.engines)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from flowrl.core.registry import Registry


@dataclass
class Generation:
    """One rollout's completions.

    completion_ids: [B, n] long, n <= text.max_new_tokens; a row that ended holds its EOS and then anything (the
        policy masks past the first EOS).
    log_probs: [B, n] float32, log softmax(z_t / temperature)[y_t] of each sampled token y_t in the engine's own
        numerics (no top-k / top-p renormalisation, as the update's); None when not asked for."""

    completion_ids: Tensor
    log_probs: Tensor | None


class TextEngine:
    """An engine samples for a policy (`flowrl.policies.text.TextPolicy`): `generate(input_ids, attention_mask,
    seed, record)` for a batch of left-padded prompts [B, Lp], and holds the weights of `version` (the optimizer
    steps they have seen) once `sync(version)` returns."""

    name: ClassVar[str] = ""
    #: its log-probs are the trainer's own numerics (transformers' generate() on the trained model)
    same_numerics: ClassVar[bool] = False

    def __init__(self, policy):
        self.policy = policy
        self.version = -1  # none pushed yet

    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        *,
        seed: int,
        record: bool,
        max_new_tokens: int | None = None,
        stop: list[str] | None = None,
    ) -> Generation:
        """Up to `max_new_tokens` (default text.max_new_tokens) tokens per row, a row ending at its EOS or, with
        `stop`, once its text contains one of those strings (the tokens after it, if any, are the caller's to cut)."""
        raise NotImplementedError

    def push_weights(self, version: int) -> None:
        """Make the policy's current weights (a LoRA merged into the base) the engine's, as `version`."""
        raise NotImplementedError

    def sync(self, version: int) -> bool:
        """Push the weights when the engine's are older than `version`; True when it pushed."""
        if version == self.version:
            return False
        self.push_weights(version)
        self.version = version
        return True

    def close(self) -> None:
        pass


ENGINES: Registry[type[TextEngine]] = Registry("text engine")


def register(cls: type[TextEngine]) -> type[TextEngine]:
    return ENGINES.register(cls.name)(cls)
