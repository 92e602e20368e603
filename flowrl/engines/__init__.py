"""Text rollout engines (`text.engine`): what samples a text rollout's completions, with the log-prob of every
sampled token under the tempered distribution (the quantity the update computes), and takes the trained weights
with a version number before each rollout that follows an update.

- `hf`: transformers' generate() on the trained model itself (the weights are always current);
- `vllm`: a vLLM server of its own environment (`flowrl.engines.vllm_server`), to which the trainer pushes the
  weights (a LoRA merged into them) after each update.

The engine's numerics are not the trainer's: with `text.engine_correction` the update takes its old log-probs from
its own forward and reweights each token's loss by truncated importance sampling (flowrl.core.mismatch)."""

from .base import ENGINES, Generation, TextEngine


def engine_names() -> list[str]:
    """The registered engines: each module of this package registers its own (`hf`, `vllm`)."""
    ENGINES.discover(__name__, __path__)
    return ENGINES.names()


def build_engine(name: str, policy) -> TextEngine:
    engine_names()
    return ENGINES.get(name)(policy)


__all__ = ["ENGINES", "Generation", "TextEngine", "build_engine", "engine_names"]
