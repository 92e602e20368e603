"""What the trainer asks of an objective, and what the planner asks of it.

An objective is one module of `flowrl.objectives` holding one `Objective` subclass: its config section (`Settings`,
a dataclass read from `train.<name>`), its checks of a config (`check`), what its rollout records (`rollout`), how
it uses the advantages (`prepare`), the units of its update and their loss (`train_units`, `step_mask`,
`unit_loss`), what it does after an optimizer step and after the epoch's update, what the progress bar shows of it
(`progress`), what a checkpoint keeps of it (`state_dict`) and what it adds to the memory of a run
(`memory_terms`, for `flowrl plan`); an objective that reads its own training data says so (`training_prompts`,
`check_data`, `scores_batch`). The trainer calls these and nothing else: it never asks which objective runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from torch import Tensor


@dataclass(frozen=True)
class MemoryTerms:
    """What an objective adds to the memory of an image run (flowrl.plan asks `Objective.memory_terms`).

    rows: model rows of one trained sample in one forward pass of the update (trained steps x CFG rows for GRPO;
    re-noised times x images per sample for the forward-process objectives); rows_note says what they are."""

    reference: bool  # a reference pass (the adapter off, or a frozen copy in full fine-tuning)
    reference_note: str  # e.g. "beta 0.01", "nft kl_coef 0.0001"
    rows: int
    rows_note: str
    shadows: tuple[str, ...] = ()  # shadow policies: a second adapter or a frozen copy each (NFT's "old")
    latents_kept: int = 1  # latents per sample the trajectory keeps for the update (GRPO: every step's, S + 1)
    means_kept: int = 0  # float32 transition means per sample the trajectory keeps (GRPO-Guard's ratio_norm)
    reference_cached: int = 0  # float32 reference outputs per sample kept for the epoch (train.cache_reference)
    reference_cached_what: tuple[str, str] = ("velocities", "times")  # what they are, and what a sample has n of
    unit: str = "samples"  # what train.micro_batch_size counts ("pairs": DPO's winners, each with its loser)
    whole_groups: bool = False  # the rollout runs whole groups per call (one initial noise per group)


class Objective:
    """The base of every objective (see the module docstring). Shapes: B samples of this process, b samples of a
    micro-batch, K entries of a unit (denoising steps or tokens for GRPO, training times for the others)."""

    #: the registered name (train.objective)
    name: ClassVar[str] = ""
    #: names users may give train.objective for a variant of this objective, and the settings that select it
    #: (GRPO: {"dppo": "train.grpo.policy_loss=dppo"}): a wrong name's error then says what to write
    variants: ClassVar[dict[str, str]] = {}
    #: how reports and the demo's banner name it
    title: ClassVar[str] = ""
    #: its config section, read from train.<name> (a dataclass with a docstring under each field); None: no settings
    Settings: ClassVar[type | None] = None
    #: True: the rollout's recorded log-probs enter the loss (GRPO-type), so the rollout must stay numerically
    #: on-policy (the first minibatch's ratio is checked); False: the loss needs only the final samples
    coupled: ClassVar[bool] = False
    #: the backends it trains ("image", "text")
    backends: ClassVar[tuple[str, ...]] = ("image",)
    #: True: the loss has group-level terms (a sum or mean over a prompt's samples, e.g. DGPO's group preference),
    #: so every minibatch and micro-batch holds whole groups of sample.group_size: the update shuffles groups, not
    #: samples, and train.minibatch_size / train.micro_batch_size must be multiples of the group size
    group_batches: ClassVar[bool] = False
    #: False: its batch says which sample is preferred (offline DPO's pairs), so no reward scores the epoch's batch
    #: and the advantages are 0 (the evals still score with the configured rewards)
    scores_batch: ClassVar[bool] = True

    def __init__(self, cfg, policy, num_processes: int = 1):
        self.cfg, self.policy, self.num_processes = cfg, policy, num_processes
        self.settings = getattr(cfg.train, self.name) if self.Settings is not None else None
        #: train.cache_reference: the epoch's reference outputs (a ReferenceCache made by `prepare`), None when off
        self.reference_cache = None
        #: entries of this epoch's update (steps x samples) whose loss is a constant the objective did not compute
        #: (DPO's rows at pure noise, of weight 0): left out of `policy/trained_units` (the update resets it)
        self.uncomputed_units = 0

    @staticmethod
    def keeps_reference(cfg) -> bool:
        """Whether train.cache_reference applies: asked for, and more than one pass over each batch to reuse it in."""
        return cfg.train.cache_reference and cfg.train.inner_epochs > 1

    @property
    def reference_hits(self) -> int:
        """Rows of the reference read from train.cache_reference's cache in this epoch instead of computed."""
        return 0 if self.reference_cache is None else self.reference_cache.hits

    def groups_split(self) -> int | None:
        """This process's batch (prompts_per_epoch x group_size / processes) when it does not hold whole groups of
        sample.group_size (a group then spans two processes), else None: what an objective that needs a whole group
        on one process refuses."""
        s = self.cfg.sample
        local = s.prompts_per_epoch * s.group_size // max(self.num_processes, 1)
        return local if local % s.group_size else None

    # ---- before the model loads

    @classmethod
    def needs_free_counts(cls, cfg) -> bool:
        """Whether the update needs a reward that counts what the prompts leave free (`batch.free_counts`, the
        `<reward>/free_<attribute>=<value>` components): checked against the rewards' declarations before the
        model loads (flowrl.preflight.check_reward_counts)."""
        return False

    #: whether the update noises samples afresh (the forward-process objectives): train.fresh_noise_per_pass
    noises_afresh: ClassVar[bool] = False

    @classmethod
    def check(cls, cfg) -> list[str]:
        """What in `cfg` this objective cannot take, one line each naming the fix (nothing is loaded)."""
        if cfg.backend not in cls.backends:
            return [
                f"train.objective={cls.name} trains {' and '.join(cls.backends)} models only "
                f"(backend={'/'.join(cls.backends)}), not backend={cfg.backend}; use train.objective=grpo"
            ]
        problems = []
        if cfg.train.fresh_noise_per_pass and not cls.noises_afresh:
            problems.append(
                f"train.fresh_noise_per_pass: train.objective={cls.name} noises no sample at update time (it "
                f"trains the rollout's own steps); it is for the forward-process objectives, or set it false"
            )
        elif cfg.train.fresh_noise_per_pass and cfg.train.cache_reference and cfg.train.inner_epochs > 1:
            problems.append(
                "train.fresh_noise_per_pass noises each pass afresh, and train.cache_reference reuses the first "
                "pass's points in the later ones: choose one (set train.cache_reference=false, or "
                "train.fresh_noise_per_pass=false)"
            )
        if cls.group_batches:
            g = cfg.sample.group_size
            for key in ("minibatch_size", "micro_batch_size"):
                n = getattr(cfg.train, key)
                if n % g:
                    problems.append(
                        f"train.{key}={n}: train.objective={cls.name} computes group-level terms, so its "
                        f"{'minibatches' if key == 'minibatch_size' else 'micro-batches'} hold whole groups; use a "
                        f"multiple of sample.group_size={g} (or 0)"
                    )
        return problems

    @classmethod
    def training_prompts(cls, cfg):
        """The training set of an objective that reads its own (a flowrl.data.PromptSet, e.g. offline DPO's pairs),
        read and checked before the model loads (a one-line error naming the fix), or None: data.train_prompts."""
        return None

    @classmethod
    def memory_terms(cls, cfg, cfg_rows: int, true_cfg: bool | None = None) -> MemoryTerms:
        """What the objective adds to an image run's memory; `cfg_rows` is the rollout's rows per image (2 when the
        family batches classifier-free guidance and the scale is above 1); `true_cfg`: whether the family batches
        it at all, whatever the rollout's scale (None: cfg_rows > 1)."""
        raise NotImplementedError(f"objective {cls.name!r} declares no memory terms for flowrl plan")

    def begin_pass(self, index: int) -> None:
        """Called by the update before each pass over the epoch's batch (0, 1, ..., train.inner_epochs - 1)."""

    def check_data(self, train_set) -> None:
        """Once the model is loaded, before training: what of the training set only the model can check (offline
        DPO: the shape of its latents files); a one-line error."""

    # ---- the epoch

    def rollout(
        self,
        prompts: list[str],
        metadata: list[dict],
        *,
        epoch: int,
        generator: torch.Generator,
        stop=None,
        on_chunk=None,
    ):
        """This process's samples of the epoch, recorded as the objective needs them (`stop`, `on_chunk`: the
        image policy's; `on_chunk` is only passed to it when given)."""
        chunks = {} if on_chunk is None else {"on_chunk": on_chunk}
        return self.policy.rollout(prompts, metadata, epoch=epoch, generator=generator, stop=stop, **chunks)

    def prepare(self, batch, adv: Tensor, keep: Tensor, *, epoch: int, process_index: int) -> Tensor:
        """Before the epoch's update: draw what the update uses (times, noise seeds, pairs); returns which samples
        the loss takes ([B] bool: `keep`, narrowed by the objective, e.g. DPO's winners)."""
        return keep

    def train_units(self, batch, steps_per_forward: int) -> list[list[int]]:
        """The entries of the update in units of `steps_per_forward`, each evaluated in one model call."""
        raise NotImplementedError

    def step_mask(self, batch, idx: Tensor, unit: list[int]) -> Tensor:
        """[b, K] 1 where an entry of `unit` counts for samples `idx` (for the minibatch's loss normalizer)."""
        raise NotImplementedError

    def unit_loss(
        self, batch, idx: Tensor, unit: list[int], adv: Tensor, keep: Tensor, normalizer: Tensor | None
    ) -> tuple[Tensor, dict]:
        """The aggregated loss of `unit` for samples `idx` [b] (with grad) and its stats. `normalizer`: the
        aggregation's normalizer of the whole minibatch when `idx` is one of its micro-batches (or one process's
        share), so that the parts' losses add up to the minibatch's."""
        raise NotImplementedError

    def after_optimizer_step(self, optimizer_steps: int) -> None:
        """After each optimizer step (`optimizer_steps` taken so far)."""

    def after_update(self, optimizer_steps: int) -> dict[str, float]:
        """After the epoch's update; returns metrics to log."""
        return {}

    # ---- what is shown and kept

    @classmethod
    def progress(cls, metrics: dict) -> dict[str, str]:
        """The progress bar's fields of this objective after an epoch (besides the mean reward)."""
        return {}

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors a checkpoint keeps for the objective (whole tensors: a collective when sharded)."""
        return {}

    def load_state_dict(
        self, state: dict[str, Tensor], place: Callable[[Tensor, Tensor], Tensor] | None = None
    ) -> None:
        """Restore `state_dict()`'s tensors; `place(value, param)` lays a whole tensor out as `param` is."""
