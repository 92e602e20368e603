"""Training objectives: what a rollout records and what loss a minibatch takes, a registry beside the policy losses.

`train.objective` names one of `OBJECTIVES`:

- ``grpo`` (the default): the sampler's own stochastic transitions. The rollout records every step's latents and
  log-prob; the units of the update are denoising steps; the loss is the trainer's `unit_loss` on recomputed
  log-probs (the policy losses of flowrl.core).
- ``nft``, ``awm``, ``dpo``: the forward (noising) process (DiffusionNFT, Advantage Weighted Matching, online
  Diffusion-DPO; the formulas are flowrl.core.objectives'). The rollout samples with the deterministic ODE and keeps
  only each image's final latents x0. At update time every sample is noised again at T *training times* t taken
  from the rollout's own schedule, with fresh noise eps each, and the model's velocity there
  (`ImagePolicy.flow_prediction`: one CFG-free forward pass, every family) enters the core's loss. The training
  times are the units of the update, so the trainer's machinery (minibatches, micro-batches, gradient sync over
  processes, optimizer steps, EMA, checkpoints, the non-finite guard) is the same as GRPO's.

An objective knows policies (`flowrl.policy`), not diffusers. Its randomness (which times, which noise) follows
from train.seed, the epoch, the process and the sample, so micro-batching does not change it and a resumed run
draws what the uninterrupted one drew.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from . import core
from .core.registry import Registry
from .policy import full_tensor
from .seeding import derive_seed

OBJECTIVES: Registry = Registry("training objective")

#: seed tags: the training times and the noise of a (sample, time slot) are drawn from separate streams
_TIMES_TAG, _NOISE_TAG = 0x71AE, 0x0A15E


def build_objective(cfg, policy, num_processes: int = 1) -> Objective:
    """The objective `cfg.train.objective` names, attached to `policy` (it adds what the objective keeps, e.g.
    NFT's "old" adapter; call before the policy is wrapped for DDP or sharded)."""
    return OBJECTIVES.get(cfg.train.objective)(cfg, policy, num_processes)


class Objective:
    """What the trainer asks of an objective; this base is GRPO. Shapes: B samples of this process, b samples of a
    micro-batch, K entries of a unit (denoising steps for GRPO, training times for the others)."""

    name = "grpo"
    #: how reports and the demo's banner name the objective
    title = "GRPO"
    #: True: the trainer recomputes the unit's log-probs (policy.unit_log_probs) and takes its unit_loss (GRPO);
    #: False: `unit_loss` below is the loss.
    uses_log_probs = True

    def __init__(self, cfg, policy, num_processes: int = 1):
        self.cfg, self.policy, self.num_processes = cfg, policy, num_processes

    def rollout(self, prompts: list[str], metadata: list[dict], *, epoch: int, generator: torch.Generator):
        """This process's samples of the epoch, recorded as the objective needs them."""
        return self.policy.rollout(prompts, metadata, epoch=epoch, generator=generator)

    def prepare(self, batch, adv: Tensor, keep: Tensor, *, epoch: int, process_index: int) -> Tensor:
        """Before the epoch's update: draw what the update uses (times, noise seeds, pairs); returns which samples
        the loss takes ([B] bool: `keep`, narrowed by the objective, e.g. DPO's winners)."""
        return keep

    def train_units(self, batch, steps_per_forward: int) -> list[list[int]]:
        """The entries of the update in units of `steps_per_forward`, each evaluated in one model call."""
        return self.policy.train_units(batch, steps_per_forward)

    def step_mask(self, batch, idx: Tensor, unit: list[int]) -> Tensor:
        """[b, K] 1 where an entry of `unit` counts for samples `idx` (for the minibatch's loss normalizer)."""
        return self.policy.step_mask(batch, idx, unit)

    def unit_loss(self, batch, idx: Tensor, unit: list[int], adv: Tensor, keep: Tensor,
                  normalizer: Tensor | None) -> tuple[Tensor, dict]:
        """The aggregated loss of `unit` for samples `idx` [b] (with grad) and its stats."""
        raise NotImplementedError("GRPO's loss is the trainer's unit_loss on policy.unit_log_probs")

    def after_optimizer_step(self, optimizer_steps: int) -> None:
        """After each optimizer step (`optimizer_steps` taken so far)."""

    def after_update(self, optimizer_steps: int) -> dict[str, float]:
        """After the epoch's update; returns metrics to log."""
        return {}

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors a checkpoint keeps for the objective (whole tensors: a collective when sharded)."""
        return {}

    def load_state_dict(self, state: dict[str, Tensor], place: Callable[[Tensor, Tensor], Tensor] | None = None
                        ) -> None:
        """Restore `state_dict()`'s tensors; `place(value, param)` lays a whole tensor out as `param` is."""


OBJECTIVES.register("grpo")(Objective)


@dataclass
class TrainingTimes:
    """The epoch's draw of a forward-process objective: for each of the B samples, T indices into the rollout's
    schedule (`steps` [B, T] long) whose flow times (`times` [S]) it is trained at, one per time slot."""

    epoch: int
    process_index: int
    times: Tensor  # [S] float32
    steps: Tensor  # [B, T] long


class ForwardProcessObjective(Objective):
    """What NFT, AWM and DPO share: the ODE rollout of final latents, the training times drawn per sample from
    the rollout's schedule, fresh noise per (sample, time), and the per-entry loss aggregated as GRPO's (the mean
    over the kept samples and their times). Subclasses say how many times and which (`draw_steps`) and the loss of
    a unit's rows (`row_losses`)."""

    uses_log_probs = False
    #: a shadow policy (`ImagePolicy.add_shadow`) that samples the rollouts instead of the trained one (NFT)
    sampling_shadow: str | None = None

    def __init__(self, cfg, policy, num_processes: int = 1):
        super().__init__(cfg, policy, num_processes)
        if cfg.backend != "image":
            raise ValueError(f"train.objective={self.name} trains image generators only for now (backend=image); "
                             "use train.objective=grpo with backend=text")
        self.settings = getattr(cfg.train, self.name)
        self.plan: TrainingTimes | None = None

    # ---- the rollout and the epoch's draw

    def rollout(self, prompts, metadata, *, epoch, generator):
        with self.policy.shadow(self.sampling_shadow) if self.sampling_shadow else contextlib.nullcontext():
            return self.policy.rollout(prompts, metadata, epoch=epoch, generator=generator, final_only=True)

    def draw_steps(self, n: int, num_steps: int, generator: torch.Generator) -> Tensor:
        """[n, T] long: the schedule indices each of n samples is trained at."""
        raise NotImplementedError

    def prepare(self, batch, adv, keep, *, epoch, process_index):
        times = self.policy.flow_times(batch)
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.train.seed, epoch, process_index, _TIMES_TAG))
        self.plan = TrainingTimes(epoch, process_index, times, self.draw_steps(len(batch.prompts), len(times), gen))
        return keep

    def train_units(self, batch, steps_per_forward):
        slots = self.plan.steps.shape[1]
        return [list(range(i, min(i + steps_per_forward, slots))) for i in range(0, slots, steps_per_forward)]

    def step_mask(self, batch, idx, unit):
        return torch.ones(len(idx), len(unit))  # every training time counts

    # ---- a unit's inputs and loss

    def noise(self, sample: int, slot: int, shape: tuple[int, ...]) -> Tensor:
        """The fresh noise eps of `sample`'s time slot `slot` this epoch: float32 [*shape] on the CPU, from its own
        seed, so any micro-batching draws the same."""
        p = self.plan
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.train.seed, p.epoch, p.process_index, sample, slot,
                                                        _NOISE_TAG))
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    def inputs(self, batch, idx: Tensor, unit: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """The unit's K x b rows, slot-major (slot unit[0] for every sample of `idx`, then unit[1], ...): (samples
        [K*b] long, their flow times [K*b] float32, their noise [K*b, ...] float32 on the latents' device)."""
        idx = idx.cpu()
        rows = idx.repeat(len(unit))
        slots = torch.tensor(unit, dtype=torch.long).repeat_interleave(len(idx))
        t = self.plan.times[self.plan.steps[rows, slots]]
        shape = self.policy.sample_shape(batch)
        noise = torch.stack([self.noise(int(s), int(k), shape) for s, k in zip(rows, slots)])
        return rows, t, noise.to(batch.traj.latents.device)

    def clean(self, batch, rows: Tensor) -> Tensor:
        """The clean latents x0 of `rows` [N] in float32 [N, ...] on the model's device."""
        return batch.traj.final_latents[rows.to(batch.traj.latents.device)].float()

    def row_losses(self, batch, idx: Tensor, unit: list[int], adv: Tensor) -> tuple[Tensor, dict]:
        """The loss of each of the unit's K x b rows (slot-major, see `inputs`) [K*b], and the core's stats."""
        raise NotImplementedError

    def unit_loss(self, batch, idx, unit, adv, keep, normalizer):
        loss, core_stats = self.row_losses(batch, idx, unit, adv)
        b, k = len(idx), len(unit)
        loss = loss.view(k, b).transpose(0, 1)                                                    # [b, K]
        mask = keep[idx.cpu()].to(loss.device, torch.float32)[:, None].expand(b, k)
        if normalizer is not None:
            normalizer = normalizer.to(loss.device)
        total = core.aggregate_loss(loss, mask, self.policy.aggregation, normalizer=normalizer)
        stats = {f"{self.name}_{key}": value for key, value in core_stats.items()}
        stats["loss"] = total.detach()
        return total, stats

    def _reference_velocity(self, batch, rows, t, noise) -> Tensor:
        """The reference policy's velocity (the adapter off, or the frozen copy) at the same points, no gradient."""
        with torch.no_grad(), self.policy.reference():
            return self.policy.flow_prediction(batch, rows, t, noise).velocity

    def _shadow_velocity(self, name: str, batch, rows, t, noise) -> Tensor:
        with torch.no_grad(), self.policy.shadow(name):
            return self.policy.flow_prediction(batch, rows, t, noise).velocity

    # ---- shadow policies in checkpoints

    def _soft_update(self, shadow: str, decay: float) -> None:
        """shadow <- decay shadow + (1 - decay) theta (core.soft_update_), parameter by parameter."""
        weights = self.policy.shadow_parameters(shadow)
        trained = self.policy.named_trainable_parameters()
        core.soft_update_([weights[n] for n, _ in trained], [p for _, p in trained], decay)

    def state_dict(self):
        return {f"{name}/{n}": full_tensor(w.detach()).cpu().contiguous()
                for name in self.policy.shadows for n, w in self.policy.shadow_parameters(name).items()}

    def load_state_dict(self, state, place=None):
        for name in self.policy.shadows:
            weights = self.policy.shadow_parameters(name)
            missing = [n for n in weights if f"{name}/{n}" not in state]
            if missing:
                warnings.warn(f"the checkpoint holds no {name!r} policy of train.objective={self.name} (written by "
                              f"another objective?): {name!r} starts again as a copy of the trained weights",
                              stacklevel=2)
                self._soft_update(name, 0.0)
                continue
            with torch.no_grad():
                for n, w in weights.items():
                    value = state[f"{name}/{n}"].to(w.dtype)
                    w.copy_(place(value, w) if place is not None else value)


def training_times(objective: str, settings, num_steps: int) -> int:
    """Training times per sample of a forward-process objective with its `train.<objective>` settings and a rollout
    of `num_steps` steps: the `timesteps` setting, or its default (NFT: int(0.99 x steps), the reference's
    timestep_fraction; DPO: every step; AWM has no 0 default)."""
    if settings.timesteps:
        return settings.timesteps
    return max(1, int(num_steps * 0.99)) if objective == "nft" else num_steps


def _random_order(n: int, num_steps: int, count: int, generator: torch.Generator) -> Tensor:
    """[n, count] long: for each of n samples, `count` distinct schedule indices in a random order."""
    if not 1 <= count <= num_steps:
        raise ValueError(f"{count} training times per sample from a schedule of {num_steps} steps: "
                         f"need 1..{num_steps}")
    return torch.stack([torch.randperm(num_steps, generator=generator)[:count] for _ in range(n)])


@OBJECTIVES.register("nft")
class NFT(ForwardProcessObjective):
    """DiffusionNFT (Zheng et al., arXiv 2509.16117): the old policy (a second LoRA adapter "old", or a frozen copy
    in full fine-tuning, starting as the trained weights) samples the rollouts; the loss is core.nft_loss with
    r = optimality_probability(advantage); after each epoch's update the old policy moves toward the trained one,
    old <- lambda old + (1 - lambda) theta with lambda = core.soft_update_decay(optimizer steps so far)."""

    name = "nft"
    title = "DiffusionNFT"
    sampling_shadow = "old"

    def __init__(self, cfg, policy, num_processes=1):
        super().__init__(cfg, policy, num_processes)
        policy.add_shadow("old")
        if self.settings.kl_coef > 0:
            policy.ensure_reference()

    def draw_steps(self, n, num_steps, generator):
        return _random_order(n, num_steps, training_times("nft", self.settings, num_steps), generator)

    def row_losses(self, batch, idx, unit, adv):
        s = self.settings
        rows, t, noise = self.inputs(batch, idx, unit)
        old = self._shadow_velocity("old", batch, rows, t, noise)
        pred = self.policy.flow_prediction(batch, rows, t, noise)
        ref = self._reference_velocity(batch, rows, t, noise) if s.kl_coef > 0 else None
        r = core.optimality_probability(adv[rows].to(noise.device), clip=s.adv_clip)
        return core.nft_loss(pred.velocity, old, self.clean(batch, rows), noise, pred.t, r, beta=s.beta,
                             adaptive_weight=s.adaptive_weight, ref_velocity=ref, kl_coef=s.kl_coef,
                             policy_scale=s.policy_scale)

    def after_update(self, optimizer_steps):
        s = self.settings
        decay = core.soft_update_decay(optimizer_steps, rate=s.decay_rate, cap=s.decay_cap, start=s.decay_start)
        self._soft_update("old", decay)
        return {"objective/nft_old_decay": decay}


@OBJECTIVES.register("awm")
class AWM(ForwardProcessObjective):
    """Advantage Weighted Matching (Xue et al., arXiv 2509.25050): the trained policy samples the rollouts and the
    loss is core.awm_loss, on-policy (ratio 1: the gradient is the advantage-weighted flow-matching loss's), with a
    reference penalty and, with ema_kl_coef > 0, a penalty toward an EMA of the policy (a shadow "ema", soft-updated
    after every optimizer step with lambda = min(ema_decay_rate x step, ema_decay_cap))."""

    name = "awm"
    title = "AWM"

    def __init__(self, cfg, policy, num_processes=1):
        super().__init__(cfg, policy, num_processes)
        if self.settings.ema_kl_coef > 0:
            policy.add_shadow("ema")
        if self.settings.kl_coef > 0:
            policy.ensure_reference()

    def draw_steps(self, n, num_steps, generator):
        """One index per stratum of [lo, hi): lo = 1 (the first step, pure noise, left out) and hi =
        int(timestep_fraction x S), as the reference's discrete times; strata repeat indices when T > hi - lo."""
        count = self.settings.timesteps
        lo = 1 if num_steps > 1 else 0
        hi = max(lo + 1, int(num_steps * self.settings.timestep_fraction))
        u = torch.rand(n, count, generator=generator)
        strata = (torch.arange(count)[None, :] + u) / count                                     # [n, T] in [0, 1)
        return (lo + (strata * (hi - lo)).long()).clamp(max=hi - 1)

    def row_losses(self, batch, idx, unit, adv):
        s = self.settings
        rows, t, noise = self.inputs(batch, idx, unit)
        pred = self.policy.flow_prediction(batch, rows, t, noise)
        ref = self._reference_velocity(batch, rows, t, noise) if s.kl_coef > 0 else None
        ema = self._shadow_velocity("ema", batch, rows, t, noise) if s.ema_kl_coef > 0 else None
        return core.awm_loss(pred.velocity, self.clean(batch, rows), noise, pred.t, adv[rows].to(noise.device),
                             weighting=s.weighting, ghuber_power=s.ghuber_power, advantage_clip=s.advantage_clip,
                             ref_velocity=ref, kl_coef=s.kl_coef, ema_velocity=ema, ema_kl_coef=s.ema_kl_coef)

    def after_optimizer_step(self, optimizer_steps):
        s = self.settings
        if s.ema_kl_coef > 0:
            self._soft_update("ema", core.soft_update_decay(optimizer_steps, rate=s.ema_decay_rate,
                                                            cap=s.ema_decay_cap))


@OBJECTIVES.register("dpo")
class DPO(ForwardProcessObjective):
    """Online Diffusion-DPO (Wallace et al., arXiv 2311.12908): in each group the best image (highest advantage)
    wins over the worst; the pair is noised with the SAME noise and time, the trained model and the reference (the
    adapter off, or the frozen copy) evaluated on both, and the loss is core.dpo_loss. The loss's samples are the
    winners (each brings its loser). train.minibatch_size counts samples, of which only the winners are computed;
    train.micro_batch_size counts winners, that is pairs: a forward pass takes two images per pair."""

    name = "dpo"
    title = "online Diffusion-DPO"

    def __init__(self, cfg, policy, num_processes=1):
        super().__init__(cfg, policy, num_processes)
        policy.ensure_reference()
        s = cfg.sample
        local = s.prompts_per_epoch * s.group_size // max(num_processes, 1)
        if num_processes > 1 and local % s.group_size:
            raise ValueError(f"train.objective=dpo pairs the best and worst image of a group on one process, but the "
                             f"per-process batch {local} (prompts_per_epoch x group_size / {num_processes} processes) "
                             f"splits groups of sample.group_size={s.group_size}; make prompts_per_epoch a multiple "
                             f"of the process count")
        self.partner: Tensor | None = None
        self.pairs = 0

    def draw_steps(self, n, num_steps, generator):
        return _random_order(n, num_steps, training_times("dpo", self.settings, num_steps), generator)

    def prepare(self, batch, adv, keep, *, epoch, process_index):
        """The pairs of this process's whole groups from their advantages (the configured reward combination;
        within a group they order the samples as the total reward does), samples without a finite reward left
        out. Returns the winners as the samples the loss takes."""
        super().prepare(batch, adv, keep, epoch=epoch, process_index=process_index)
        valid = keep.nonzero().flatten()
        partner = torch.full((len(keep),), -1, dtype=torch.long)
        if len(valid):
            w, l = core.best_worst_pairs(adv[valid].float(), batch.group_ids[valid])
            partner[valid[w]] = valid[l]
        self.partner, self.pairs = partner, int((partner >= 0).sum())
        return partner >= 0

    def row_losses(self, batch, idx, unit, adv):
        idx = idx.cpu()
        losers = torch.where(self.partner[idx] >= 0, self.partner[idx], idx)  # a placeholder pass: itself
        rows_w, t, noise = self.inputs(batch, idx, unit)  # the winner's times and noise serve its loser too
        rows_l = losers.repeat(len(unit))
        both, t2, noise2 = torch.cat([rows_w, rows_l]), torch.cat([t, t]), torch.cat([noise, noise])
        pred = self.policy.flow_prediction(batch, both, t2, noise2)
        ref = self._reference_velocity(batch, both, t2, noise2)
        v_w, v_l = pred.velocity.chunk(2)
        r_w, r_l = ref.chunk(2)
        t_used = pred.t.chunk(2)[0]
        weight = (1 - t_used) ** 2 if self.settings.weighting == "noise" else None
        loss, stats = core.dpo_loss(v_w, v_l, r_w, r_l, self.clean(batch, rows_w), self.clean(batch, rows_l),
                                    noise, t_used, beta=self.settings.beta, weight=weight)
        stats.pop("num_pairs")
        return loss, stats

    def after_update(self, optimizer_steps):
        return {"objective/dpo_pairs": float(self.pairs)}
