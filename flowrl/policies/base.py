"""What the training loop needs from a policy, and the data it passes.

A policy rolls out a batch without gradients, recomputes the log-probs of chosen recorded steps of a minibatch
with gradients (a "unit" of steps, evaluated in one model call), gives the reference policy (its LoRA adapter
switched off, or a frozen copy for full fine-tuning), scores batches with the rewards, samples the held-out
eval, and exports its weights. The trainer talks to a policy only through `Policy`; `flowrl.policies` holds the
image (diffusers) and text (causal LM) ones.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import Tensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ReferenceCache(dict):
    """train.cache_reference: the reference policy's outputs for one epoch's update, one row per key (a trained
    point: GRPO's sample and denoising step, a forward-process objective's sample, slot and time). The first pass
    computes them and the later passes (train.inner_epochs > 1), which evaluate the same points, read them: the
    reference is frozen and a key fixes its row's input, so a row is the same value up to the rounding of the batch
    it was computed in. `hits`: rows read instead of computed."""

    def __init__(self):
        super().__init__()
        self.hits = 0

    def rows(self, keys: list, compute: Callable[[], Tensor]) -> Tensor:
        """[len(keys), ...]: the kept rows when every key is kept, else `compute()`'s rows (one per key, in the
        keys' order, no gradient), kept for the later passes."""
        if keys and all(key in self for key in keys):
            self.hits += len(keys)
            return torch.stack([self[key] for key in keys])
        value = compute()
        if len(value) != len(keys):
            raise ValueError(f"reference cache: {len(value)} rows computed for {len(keys)} keys")
        self.update(zip(keys, value.detach().clone()))
        return value


def full_tensor(t: Tensor) -> Tensor:
    """A DTensor shard's whole tensor (a collective: every process calls it; FSDP2), a ZeRO-3 partitioned trained
    weight's whole float32 weight (as well), any other tensor as it is."""
    if hasattr(t, "ds_id"):
        from deepspeed.utils import safe_get_full_fp32_param

        return safe_get_full_fp32_param(t)
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@dataclass
class UnitOutput:
    """One unit of steps of a minibatch of b samples, K steps (denoising steps or tokens)."""

    log_prob: Tensor  # [b, K] with grad
    old_log_prob: Tensor  # [b, K] recorded at rollout
    mask: Tensor  # [b, K] 1 = the step counts
    weight: Tensor | None = None  # [K] or [b, K] per-step loss weight
    kl: Tensor | None = None  # [b, K] KL to the reference (with grad)
    log_ratio: Tensor | None = None  # [b, K] a replacement log-ratio (GRPO-Guard's RatioNorm)
    entropy: Tensor | None = None  # [b, K] policy entropy per step (text: for the entropy bonus)
    step_kl: Tensor | None = None  # [b, K] KL(current || sampling policy) of each Gaussian step (policy_loss=dppo)


@dataclass
class ImageBatch:
    """One epoch's rollout of this process: B images (a prompt repeats over its group)."""

    traj: Any  # flowrl.sampling.Trajectory (None for eval samples)
    prompts: list[str]  # [B]
    metadata: list[dict]  # [B] the prompt rows' other columns
    images: list  # [B] PIL images
    group_ids: Tensor | None = None  # [B] set by the trainer
    epoch_prompts: list[str] = field(default_factory=list)
    #: rollout.async: the trained weights (named_trainable_parameters' names, on the CPU) that sampled the batch when
    #: they are older than the trained ones (a version lag); None when the trained weights sampled it
    sampled_with: dict[str, Tensor] | None = None


@dataclass
class TextBatch:
    """One epoch's rollout of this process: B completions (a prompt repeats over its group), T tokens."""

    prompts: list[str]  # [B] the raw prompts (before any chat template)
    metadata: list[dict]  # [B] the prompt rows' other columns (answer, solution, ...)
    input_ids: Tensor  # [B, Lp + T] left-padded prompt, then the completion (right-padded)
    attention_mask: Tensor  # [B, Lp + T]
    prompt_len: int  # Lp
    completion_ids: Tensor  # [B, T]
    completion_mask: Tensor  # [B, T] 1 through the first EOS (inclusive)
    truncated: Tensor  # [B] bool: no EOS within max_new_tokens
    old_log_probs: Tensor  # [B, T] float32 under the sampling temperature
    completions: list[str]  # [B] decoded completions (up to the EOS)
    completion_id_lists: list[list[int]]  # [B] completion token ids through the EOS (TRL's completion_ids)
    ref_log_probs: Tensor | None = None  # [B, T] when the KL goes into the reward
    kl_penalty: Tensor | None = None  # [B] beta * sum_t KL_t, subtracted from the reward
    engine_log_probs: Tensor | None = None  # [B, T] the engine's log-probs of its tokens (an engine not the trainer)
    loss_weights: Tensor | None = None  # [B, T] per-token loss weights (text.engine_correction's IS weights)
    rollout_metrics: dict = field(default_factory=dict)  # the rollout's own metrics (engine mismatch, version)
    turns: list[list[dict]] | None = None  # [B] a multi-turn rollout's turns: {"model": text, "tool": reply}
    group_ids: Tensor | None = None
    epoch_prompts: list[str] = field(default_factory=list)


@runtime_checkable
class Policy(Protocol):
    """What the loop needs from a policy (image or text). Shapes: B samples of this process, b of a minibatch,
    K steps of a unit (denoising steps or tokens)."""

    reward_kind: str  # "image" | "text": the kind of reward it calls (rewards.registry)
    aggregation: str  # how the loss over [b, K] becomes a number (core.aggregate_loss mode)
    entropy_coef: float  # the entropy bonus's weight (text)
    can_export: bool  # whether `export` writes something loadable
    reward_state: Any  # TRL's `trainer_state` for rewards that ask for it (the trainer keeps it current)

    def named_trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]: ...

    def wrap_trained(self, prepare: Callable) -> None:
        """Route the forward passes with grad through `prepare(module)` (accelerate.prepare: DDP), whose backward
        passes average the gradients over the processes."""

    trained_module: torch.nn.Module  # what those forward passes run through (for accelerate's no_sync)
    sharded: bool  # FSDP2: its weights are DTensor shards (`shard()`), gathered to be saved

    def trainable_parameters(self) -> list[torch.nn.Parameter]: ...

    def rollout(
        self, prompts: list[str], metadata: list[dict], *, epoch: int, generator: torch.Generator, stop=None
    ) -> ImageBatch | TextBatch:
        """One sample per entry of `prompts` (a group's prompt repeats), recorded for training. `stop()`: called
        between its batches; it raises to abandon the rollout (a stop signal)."""

    def call_reward(self, fn: Callable, batch, columns: dict) -> Tensor:
        """One reward's scores [B] float32 for a batch (NaN: does not apply)."""

    def reward_penalty(self, batch) -> Tensor | None:
        """[B] subtracted from the total reward (the KL-in-reward term), or None."""

    def pop_reward_logs(self) -> dict[str, float]:
        """What the rewards logged since the last call (`reward_log/<name>` -> mean)."""

    def pop_reward_extra(self) -> dict[str, list]:
        """Per-sample columns the rewards logged since the last call."""

    def train_units(self, batch, steps_per_forward: int) -> list[list[int]]:
        """The trained steps of a batch, grouped into units evaluated in one model call each."""

    def step_mask(self, batch, idx: Tensor, unit: list[int]) -> Tensor:
        """Which steps of `unit` count for samples `idx` [b, K] (1/0), known without a forward pass: what the loss's
        normalizer of a minibatch is computed from before its micro-batches run."""

    def unit_log_probs(
        self,
        batch,
        idx: Tensor,
        unit: list[int],
        *,
        with_reference: bool,
        reference_cache: ReferenceCache | None = None,
    ) -> UnitOutput:
        """The log-probs (with grad) of steps `unit` of samples `idx` [b], beside the recorded ones, and with
        `with_reference` the KL to the reference policy, whose outputs `reference_cache` keeps across the epoch's
        passes (train.cache_reference)."""

    def reference(self) -> contextlib.AbstractContextManager:
        """A context in which the policy is the reference policy."""

    def ensure_reference(self) -> None:
        """Make the reference policy available (full fine-tuning: a frozen copy of the starting weights; a LoRA's is
        the adapter off). Called by the objectives that need one, before the model is wrapped or sharded."""

    def evaluate_prompts(
        self,
        prompts: list[str],
        metadata: list[dict],
        reward_fns: list,
        eval_cfg,
        part: slice | None = None,
        stop=None,
        *,
        per_call: int = 0,
        on_batch=None,
    ) -> tuple[list, list[Tensor], dict[str, Tensor]]:
        """Held-out eval of `prompts[part]` (deterministic): (outputs, per-reward scores, components). `stop()`:
        called between its batches and rewards; it raises to abandon the eval (a stop signal). `per_call`: the
        images sampled per model call (0: the policy's own choice; text generates in batches of its own);
        `on_batch(n)`: called after each batch with the number of outputs it made (a progress bar)."""

    def save_eval_outputs(self, outputs: list, prompts: list[str], path: Path, scores=None) -> Path:
        """Write eval outputs next to `path` (an image grid, a JSONL of completions); returns the file."""

    def describe_outputs(self, batch) -> list[str] | None:
        """Text for the completions table (None: outputs are not text)."""

    def export_state(self) -> dict[str, Tensor]:
        """The weights `export` writes, whole (gathered from the shards: a collective when sharded)."""

    def export(self, directory: Path, state: dict[str, Tensor] | None = None) -> None:
        """The trained weights in the format their library loads (diffusers LoRA, peft adapter, model); `state`:
        `export_state()`'s, needed when sharded."""


def shard_blocks(model: torch.nn.Module, *, offload: bool = False) -> None:
    """torch's FSDP2 `fully_shard` on every block of `model` (the classes its `_no_split_modules` names),
    innermost first, then on `model`: its parameters become DTensor shards over the processes, each block
    gathered for its forward and its gradients reduce-scattered in the backward. `offload`: the shards, their
    gradients and the optimizer step live in CPU memory (FSDP2's CPUOffloadPolicy)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())} if offload else {}
    trained = [p for p in model.parameters() if p.requires_grad]
    low = {p.dtype for p in trained} - {torch.float32}
    if low and len(trained) == len(list(model.parameters())):
        # full fine-tuning in bf16/fp16: the shards are float32 master weights (so the optimizer's states are
        # float32), gathered in the model's dtype for the forward, gradients reduced in float32
        for p in trained:
            p.data = p.data.float()
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=low.pop(), reduce_dtype=torch.float32, cast_forward_inputs=False
        )  # as the plain model gets them
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in reversed(list(model.modules())) if m is not model and type(m).__name__ in blocks]
    if not layers:
        raise ValueError(
            f"train.sharding=fsdp: {type(model).__name__} names no block class in _no_split_modules "
            f"({sorted(blocks)}) to shard by; use train.sharding=none (DDP)"
        )
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
