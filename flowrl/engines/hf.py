"""`text.engine: hf`: transformers' generate() on the trained model (see TextPolicy.generate_samples)."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Generation, TextEngine, register


@register
class HFEngine(TextEngine):
    name = "hf"
    same_numerics = True

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
        from flowrl.policies.text import SampledLogProbs

        policy = self.policy
        torch.manual_seed(seed)  # generate() draws from torch's global RNG
        recorder = SampledLogProbs(policy.text.temperature) if record else None
        out = policy.generate_samples(input_ids, attention_mask, recorder, max_new_tokens=max_new_tokens, stop=stop)
        n_new = out.shape[1] - input_ids.shape[1]
        return Generation(
            completion_ids=out[:, input_ids.shape[1] :],
            log_probs=recorder.finish(out, n_new) if recorder is not None else None,
        )

    def push_weights(self, version: int) -> None:
        pass  # it samples with the trained model itself
