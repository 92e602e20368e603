"""What DiffusionNFT, AWM and online Diffusion-DPO share: training on the forward (noising) process.

The rollout samples with the deterministic ODE (at sample.guidance_scale) and keeps only each image's final latents
x0. At update time every sample is noised again at T *training times* t taken from the rollout's own schedule, with
fresh noise eps each, and the model's velocity there (`ImagePolicy.flow_prediction`: one CFG-free forward pass,
every family) enters the objective's loss (the formulas are flowrl.core.objectives'). The training times are the
units of the update, so the trainer's machinery (minibatches, micro-batches, gradient sync over processes,
optimizer steps, EMA, checkpoints, the non-finite guard) is the same as GRPO's.

The randomness (which times, which noise) follows from train.seed, the epoch, the process and the sample, so
micro-batching does not change it and a resumed run draws what the uninterrupted one drew.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from flowrl import core
from flowrl.policies.base import ReferenceCache, full_tensor
from flowrl.seeding import derive_seed

from ._base import MemoryTerms, Objective

#: seed tags: the training times, the noise of a (sample, time slot) and the times' places within their steps
#: (continuous_times) are drawn from separate streams
_TIMES_TAG, _NOISE_TAG, _WITHIN_TAG = 0x71AE, 0x0A15E, 0x57A7


@dataclass
class TrainingTimes:
    """The epoch's draw of a forward-process objective: for each of the B samples, T indices into the rollout's
    schedule (`steps` [B, T] long) whose flow times (`times` [S]) it is trained at, one per time slot; with
    `within` [B, T] in [0, 1), each slot's time is that far into its step's interval (core.stratified_times)."""

    epoch: int
    process_index: int
    times: Tensor  # [S] float32
    steps: Tensor  # [B, T] long
    within: Tensor | None = None  # [B, T] float32, or None: the steps' own times

    def flow_times(self, rows: Tensor, slots: Tensor) -> Tensor:
        """[N] float32: the flow times of the (sample, slot) pairs `rows`, `slots` [N]."""
        steps = self.steps[rows, slots]
        if self.within is None:
            return self.times[steps]
        return core.stratified_times(self.times, steps, self.within[rows, slots])


def random_order(n: int, num_steps: int, count: int, generator: torch.Generator) -> Tensor:
    """[n, count] long: for each of n samples, `count` distinct schedule indices in a random order."""
    if not 1 <= count <= num_steps:
        raise ValueError(f"{count} training times per sample from a schedule of {num_steps} steps: need 1..{num_steps}")
    return torch.stack([torch.randperm(num_steps, generator=generator)[:count] for _ in range(n)])


class ForwardProcessObjective(Objective):
    """The ODE rollout of final latents, the training times drawn per sample from the rollout's schedule, fresh
    noise per (sample, time), and the per-entry loss aggregated as GRPO's (the mean over the kept samples and their
    times). Subclasses say how many times and which (`times_per_sample`, `draw_steps`) and the loss of a unit's rows
    (`row_losses`)."""

    #: a shadow policy (`ImagePolicy.add_shadow`) that samples the rollouts instead of the trained one (NFT)
    sampling_shadow: str | None = None
    #: images a trained sample brings to a forward pass (DPO: its loser too)
    images_per_sample: int = 1
    #: whether `times_per_sample` draws distinct steps of the schedule (so at most sample.num_steps of them)
    distinct_times: bool = True
    noises_afresh = True

    def __init__(self, cfg, policy, num_processes: int = 1):
        super().__init__(cfg, policy, num_processes)
        self.plan: TrainingTimes | None = None
        self.pass_index = 0  # the update's pass over the epoch's batch (begin_pass)

    def begin_pass(self, index: int) -> None:
        self.pass_index = index

    # ---- before the model loads

    @classmethod
    def times_per_sample(cls, settings, num_steps: int) -> int:
        """Training times per sample with these settings and a rollout of `num_steps` steps."""
        raise NotImplementedError

    @classmethod
    def reference_note(cls, settings) -> tuple[bool, str]:
        """(whether the loss needs the reference policy's forward pass, how the plan names its coefficient)."""
        raise NotImplementedError

    @classmethod
    def shadow_names(cls, settings) -> tuple[str, ...]:
        """The shadow policies it keeps (NFT's "old", AWM's "ema")."""
        return ()

    @classmethod
    def check(cls, cfg) -> list[str]:
        problems = super().check(cfg)
        times, steps = getattr(cfg.train, cls.name).timesteps, cfg.sample.num_steps
        if cls.distinct_times and times > steps:
            problems.append(
                f"train.{cls.name}.timesteps={times} exceeds sample.num_steps={steps}: the training "
                f"times are distinct steps of the rollout's schedule; use at most {steps} (0 = the "
                f"default)"
            )
        return problems

    @classmethod
    def memory_terms(cls, cfg, cfg_rows: int, true_cfg: bool | None = None) -> MemoryTerms:
        settings = getattr(cfg.train, cls.name)
        times = min(cfg.train.steps_per_forward, cls.times_per_sample(settings, cfg.sample.num_steps))
        reference, note = cls.reference_note(settings)
        rows = times * cls.images_per_sample
        # a DPO batch of B samples holds at most B / 2 pairs, 2 images each: B x T cached rows, as the others
        cached = cls.times_per_sample(settings, cfg.sample.num_steps) if reference and cls.keeps_reference(cfg) else 0
        return MemoryTerms(
            reference_cached=cached,
            reference=reference,
            reference_note=note,
            rows=rows,
            shadows=cls.shadow_names(settings),
            rows_note=f"objective {cls.name}: {rows} model rows: {times} time(s)"
            + (" x 2 (winner and loser)" if cls.images_per_sample == 2 else "")
            + ", without CFG",
        )

    # ---- the rollout and the epoch's draw

    def rollout(self, prompts, metadata, *, epoch, generator, stop=None, on_chunk=None):
        with self.policy.shadow(self.sampling_shadow) if self.sampling_shadow else contextlib.nullcontext():
            return self.policy.rollout(
                prompts, metadata, epoch=epoch, generator=generator, final_only=True, stop=stop, on_chunk=on_chunk
            )

    def draw_steps(self, n: int, times: Tensor, generator: torch.Generator) -> Tensor:
        """[n, T] long: the indices into the rollout's schedule (its flow times `times` [S]) each of n samples is
        trained at (default: T distinct ones in a random order per sample)."""
        return random_order(n, len(times), self.times_per_sample(self.settings, len(times)), generator)

    def prepare(self, batch, adv, keep, *, epoch, process_index):
        times = self.policy.flow_times(batch)
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.train.seed, epoch, process_index, _TIMES_TAG))
        steps = self.draw_steps(len(batch.prompts), times, gen)
        within = None
        if getattr(self.settings, "continuous_times", False):
            gen = torch.Generator().manual_seed(derive_seed(self.cfg.train.seed, epoch, process_index, _WITHIN_TAG))
            within = torch.rand(steps.shape, generator=gen)
        self.plan = TrainingTimes(epoch, process_index, times, steps, within)
        # reference velocities by row key (`row_keys`); a new batch: a new cache
        self.reference_cache = ReferenceCache() if self.keeps_reference(self.cfg) else None
        return keep

    def train_units(self, batch, steps_per_forward):
        slots = self.plan.steps.shape[1]
        return [list(range(i, min(i + steps_per_forward, slots))) for i in range(0, slots, steps_per_forward)]

    def step_mask(self, batch, idx, unit):
        return torch.ones(len(idx), len(unit))  # every training time counts

    # ---- a unit's inputs and loss

    def noise(self, sample: int, slot: int, shape: tuple[int, ...]) -> Tensor:
        """The fresh noise eps of `sample`'s time slot `slot` this epoch: float32 [*shape] on the CPU, from its own
        seed, so any micro-batching draws the same; with train.fresh_noise_per_pass, each pass after the first has
        its own (the first pass's is the same either way)."""
        p = self.plan
        fresh = (self.pass_index,) if self.cfg.train.fresh_noise_per_pass and self.pass_index > 0 else ()
        gen = torch.Generator().manual_seed(
            derive_seed(self.cfg.train.seed, p.epoch, p.process_index, sample, slot, _NOISE_TAG, *fresh)
        )
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    def inputs(self, batch, idx: Tensor, unit: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """The unit's K x b rows, slot-major (slot unit[0] for every sample of `idx`, then unit[1], ...): (samples
        [K*b] long, their flow times [K*b] float32, their noise [K*b, ...] float32 on the latents' device)."""
        idx = idx.cpu()
        rows = idx.repeat(len(unit))
        slots = torch.tensor(unit, dtype=torch.long).repeat_interleave(len(idx))
        t = self.plan.flow_times(rows, slots)
        shape = self.policy.sample_shape(batch)
        noise = torch.stack([self.noise(int(s), int(k), shape) for s, k in zip(rows, slots)])
        return rows, t, noise.to(batch.traj.latents.device)

    def row_keys(self, idx: Tensor, unit: list[int], noise_of: Tensor | None = None) -> list[tuple[int, int, int]]:
        """The unit's K x b rows' identities in the epoch (slot-major, as `inputs`): (the sample whose noise and time
        the row takes, its time slot, the sample it evaluates): `noise_of` [b] names, per sample of `idx`, the one
        whose noise it is noised with (DPO's losers take their winner's; default: its own). A key fixes the row's
        input x_t = (1 - t) x0 + t eps for the epoch, so the reference's velocity there is the same in every pass."""
        idx = idx.cpu()
        owners = idx if noise_of is None else noise_of.cpu()
        return [(int(o), k, int(s)) for k in unit for o, s in zip(owners, idx)]

    def clean(self, batch, rows: Tensor) -> Tensor:
        """The clean latents x0 of `rows` [N] in float32 [N, ...] on the model's device."""
        return batch.traj.final_latents[rows.to(batch.traj.latents.device)].float()

    def row_losses(self, batch, idx: Tensor, unit: list[int], adv: Tensor) -> tuple[Tensor, dict]:
        """The loss of each of the unit's K x b rows (slot-major, see `inputs`) [K*b], and the core's stats."""
        raise NotImplementedError

    def unit_loss(self, batch, idx, unit, adv, keep, normalizer):
        loss, core_stats = self.row_losses(batch, idx, unit, adv)
        b, k = len(idx), len(unit)
        loss = loss.view(k, b).transpose(0, 1)  # [b, K]
        mask = keep[idx.cpu()].to(loss.device, torch.float32)[:, None].expand(b, k)
        if normalizer is not None:
            normalizer = normalizer.to(loss.device)
        total = core.aggregate_loss(loss, mask, self.policy.aggregation, normalizer=normalizer)
        stats = {f"{self.name}_{key}": value for key, value in core_stats.items()}
        stats["loss"] = total.detach()
        return total, stats

    def reference_velocity(self, batch, rows, t, noise, guidance_scale: float = 1.0, keys=None) -> Tensor:
        """The reference policy's velocity (the adapter off, or the frozen copy) at the same points, no gradient;
        guided at `guidance_scale` when it is above 1 (a CFG-guided teacher), else the CFG-free pass.

        With train.cache_reference (and inner_epochs > 1) and the rows' `keys` (`row_keys`), the first pass keeps
        each row's velocity for the epoch and the later passes read it instead of running the reference again: the
        reference is frozen and a key fixes the row's input, so it is the same velocity, up to the rounding of the
        batch it was computed in (a batched forward's last bits depend on the batch)."""
        guided = {"guidance_scale": guidance_scale} if guidance_scale > 1 else {}

        def velocity() -> Tensor:
            with torch.no_grad(), self.reference_policy():
                return self.policy.flow_prediction(batch, rows, t, noise, **guided).velocity

        if self.reference_cache is None or keys is None:
            return velocity()
        return self.reference_cache.rows([(*key, float(guidance_scale)) for key in keys], velocity)

    def reference_policy(self):
        """The context the reference's forward passes run in: the adapter off, or the frozen copy (an objective may
        measure against a shadow policy instead: DPO's reference_decay)."""
        return self.policy.reference()

    def slot_groups(self, batch, idx: Tensor, unit: list[int]) -> Tensor:
        """[K*b] long: for each of the unit's rows (slot-major, as `inputs`), an id of its sample's group at its time
        slot: rows share an id iff they are one prompt's samples at one training time (the groups of CRD's centring
        and DGPO's preference)."""
        groups = batch.group_ids.cpu()[idx.cpu().repeat(len(unit))]
        slots = torch.arange(len(unit)).repeat_interleave(len(idx))
        return groups * len(unit) + slots

    def shadow_velocity(self, name: str, batch, rows, t, noise) -> Tensor:
        """Shadow policy `name`'s velocity at the same points, no gradient."""
        with torch.no_grad(), self.policy.shadow(name):
            return self.policy.flow_prediction(batch, rows, t, noise).velocity

    # ---- shadow policies in checkpoints

    def soft_update(self, shadow: str, decay: float) -> None:
        """shadow <- decay shadow + (1 - decay) theta (core.soft_update_), parameter by parameter."""
        weights = self.policy.shadow_parameters(shadow)
        trained = self.policy.named_trainable_parameters()
        core.soft_update_([weights[n] for n, _ in trained], [p for _, p in trained], decay)

    def load_shadow(self, shadow: str, weights: dict[str, Tensor]) -> None:
        """shadow <- `weights` (by named_trainable_parameters' names, whole tensors: one process)."""
        own = self.policy.shadow_parameters(shadow)
        if own.keys() != weights.keys():
            raise KeyError(f"shadow {shadow!r}: weights for {sorted(set(own) ^ set(weights))[:3]} do not match")
        with torch.no_grad():
            for n, w in own.items():
                w.copy_(weights[n].to(w.device, w.dtype))

    def state_dict(self):
        return {
            f"{name}/{n}": full_tensor(w.detach()).cpu().contiguous()
            for name in self.policy.shadows
            for n, w in self.policy.shadow_parameters(name).items()
        }

    def load_state_dict(self, state, place=None):
        for name in self.policy.shadows:
            weights = self.policy.shadow_parameters(name)
            missing = [n for n in weights if f"{name}/{n}" not in state]
            if missing:
                warnings.warn(
                    f"the checkpoint holds no {name!r} policy of train.objective={self.name} (it was written by "
                    f"another objective, or with the setting that keeps {name!r} off, e.g. "
                    f"train.dpo.reference_decay=1): {name!r} starts from the checkpoint's trained weights, not from "
                    "the base model as in a new run",
                    stacklevel=2,
                )
                self.soft_update(name, 0.0)
                continue
            with torch.no_grad():
                for n, w in weights.items():
                    value = state[f"{name}/{n}"].to(w.dtype)
                    w.copy_(place(value, w) if place is not None else value)


def guided_teacher(backend, scale: float) -> bool:
    """Whether the family's model can make a guided prediction at `scale`: true CFG, or a guidance embedding (whose
    CFG-free pass keeps the rollout's guidance value)."""
    return bool(backend.uses_cfg_encodings) or backend.training_guidance_scale(scale) == scale
