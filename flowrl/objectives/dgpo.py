"""Direct Group Preference Optimization (DGPO; Luo et al., arXiv 2510.08425, ICLR 2026): group-level DPO on the
forward process of ODE rollouts.

The loss is core.dgpo_loss: each sample's flow-matching error weighted by its advantage and by its group's preference
weight sigmoid(s_g), s_g = sum_i A_i beta (l_i - l_i^ref) / G. The group sum runs inside a micro-batch, so the
objective takes whole groups (`group_batches`: the update shuffles groups and cuts micro-batches at group
boundaries). As in Flow-Factory's DGPO trainer (X-GenGroup/Flow-Factory, trainers/dgpo.py), whose defaults these
are:

- the training times are shared by every sample of the epoch (one stratified draw from the noisiest part of the
  rollout's schedule, from train.seed and the epoch), and a group's samples share the noise of each time slot;
- the DGPO term's reference is the frozen base (the adapter off, or a frozen copy) or, with use_ema_ref, an EMA
  "old" policy, soft-updated after every optimizer step with lambda = min(ema_decay_cap, ema_decay_rate x steps
  before this one); the old policy also drives the PPO-style DSM clip (clip_dsm) and, after switch_ema_ref
  optimizer steps, samples the rollouts;
- an optional penalty kl_coef ||v_theta - v_ref||^2 toward the frozen base, guided at kl_cfg (with the frozen base
  as the DGPO reference, that guided pass is the reference of both terms).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from flowrl import core
from flowrl.errors import ConfigError
from flowrl.ranges import AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, Range
from flowrl.seeding import derive_seed

from . import register
from ._forward import ForwardProcessObjective, TrainingTimes, guided_teacher

#: seed tags of the epoch's shared times and of a group's shared noise
_SHARED_TIMES_TAG, _GROUP_NOISE_TAG = 0xD690, 0xD6E5


@dataclass
class DGPOSettings:
    RANGES: ClassVar[dict[str, Range]] = {
        "beta": POSITIVE,
        "adv_clip": POSITIVE,
        "clip_range": AT_LEAST_0,
        "kl_coef": AT_LEAST_0,
        "kl_cfg": AT_LEAST_0,
        "ema_decay_rate": AT_LEAST_0,
        "ema_decay_cap": Range(0, 1),
        "switch_ema_ref": AT_LEAST_0,
        "timesteps": AT_LEAST_1,
        "timestep_fraction": FRACTION,
    }

    beta: float = 100.0
    """DGPO's beta in the group logit s_g = sum_i A_i beta (l_i - l_i^ref) / G (the reference: Flow-Factory's
    dpo_beta default 100, the paper's code's base config; its GenEval config 101, its SD3.5 PickScore example 10)."""
    adv_clip: float = 5.0
    """Advantages are clipped to +- this (the reference: adv_clip_range 5)."""
    clip_dsm: bool = True
    """PPO-style clip of the DSM term against the EMA old policy: a sample with A > 0 whose ratio exp(l_old - l)
    exceeds 1 + clip_range, or with A < 0 below 1 - clip_range, gets no gradient from its DSM term (the reference:
    on)."""
    clip_range: float = 0.05
    """The DSM clip's range (the reference: 5e-2 in its SD3.5 example and the paper's code's base config; 1e-2 for
    GenEval and OCR)."""
    kl_coef: float = 1e-3
    """Velocity-space penalty kl_coef ||v_theta - v_ref||^2 toward the frozen base (guided at kl_cfg); 0 = off (the
    reference: kl_beta 1e-3 in its SD3.5 PickScore example; the paper's code's GenEval and OCR configs: 0.02)."""
    kl_cfg: float = 1.0
    """The guidance scale of the frozen base's pass (the family's guidance scale, as sample.guidance_scale); 1 or
    less = its CFG-free pass. Above 1 the base is a CFG-guided teacher: true CFG (two rows per sample), or FLUX dev's
    guidance embedding; a model with neither (FLUX.1 schnell, a distilled FLUX.2 klein) is refused when it loads
    (the reference: 1)."""
    use_ema_ref: bool = False
    """The DGPO term's reference is the EMA old policy instead of the frozen base (the reference: off; TDM-R1's
    dynamic reference)."""
    ema_decay_rate: float = 1e-3
    """After optimizer step k the EMA old policy moves toward the trained one: old <- lambda old + (1 - lambda)
    theta, lambda = min(ema_decay_rate (k - 1), ema_decay_cap) (the reference: ema_ref_ramp_rate 1e-3)."""
    ema_decay_cap: float = 0.3
    """The largest lambda (the reference: ema_ref_max_decay 0.3)."""
    switch_ema_ref: int = 200
    """The EMA old policy samples the rollouts once more than this many optimizer steps were taken (with clip_dsm or
    use_ema_ref; the reference: 200; the paper's code's GenEval config 500)."""
    shared_noise: bool = True
    """A group's samples are noised with the same noise at each training time (the reference: use_shared_noise);
    false: fresh noise per sample and time."""
    timesteps: int = 4
    """Training times per sample, shared by the epoch's samples: one per stratum of the schedule's steps whose flow
    time is at least 1 - timestep_fraction (the reference: num_train_timesteps 4, its discrete strategy)."""
    timestep_fraction: float = 0.6
    """The noisiest share of the flow times the training times come from: steps with t >= 1 - timestep_fraction
    (the reference: timestep_range 0.6, 4 of the 7 noisiest of 10 steps)."""


@register
class DGPO(ForwardProcessObjective):
    """Direct Group Preference Optimization (see the module docstring)."""

    name = "dgpo"
    title = "DGPO"
    Settings = DGPOSettings
    group_batches = True
    distinct_times = False  # strata repeat steps when there are more times than steps in the range

    def __init__(self, cfg, policy, num_processes=1):
        super().__init__(cfg, policy, num_processes)
        s = self.settings
        if s.kl_cfg > 1 and not guided_teacher(policy.backend, s.kl_cfg):
            raise ConfigError(
                f"train.dgpo.kl_cfg={s.kl_cfg:g}: model.path={cfg.model.path} has neither true CFG nor a guidance "
                f"embedding, so its reference cannot be guided; use train.dgpo.kl_cfg=1"
            )
        if self.has_old(s):
            policy.add_shadow("old")
        if self.reference_note(s)[0]:
            policy.ensure_reference()
        self.optimizer_steps = 0  # taken so far: when the old policy starts to sample (switch_ema_ref)
        self.groups: torch.Tensor | None = None
        self.keep: torch.Tensor | None = None

    @staticmethod
    def has_old(settings) -> bool:
        return settings.clip_dsm or settings.use_ema_ref

    @classmethod
    def times_per_sample(cls, settings, num_steps):
        return settings.timesteps

    @classmethod
    def reference_note(cls, settings):
        """The frozen base runs when it is the DGPO reference or the KL's target."""
        return settings.kl_coef > 0 or not settings.use_ema_ref, f"dgpo beta {settings.beta:g}"

    @classmethod
    def shadow_names(cls, settings):
        return ("old",) if cls.has_old(settings) else ()

    # ---- the rollout and the epoch's draw

    def rollout(self, prompts, metadata, *, epoch, generator, stop=None, on_chunk=None):
        """The trained policy samples, the EMA old policy once more than switch_ema_ref optimizer steps were taken."""
        use_old = self.has_old(self.settings) and self.optimizer_steps > self.settings.switch_ema_ref
        with self.policy.shadow("old") if use_old else contextlib.nullcontext():
            return self.policy.rollout(
                prompts, metadata, epoch=epoch, generator=generator, final_only=True, stop=stop, on_chunk=on_chunk
            )

    def shared_steps(self, times: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """[T] long: one schedule index per stratum of [0, hi], hi the last step whose flow time is at least
        1 - timestep_fraction (Flow-Factory's discrete strategy: strata of linspace(0, hi, T + 1), floored)."""
        s = self.settings
        inside = (times >= 1 - s.timestep_fraction - 1e-6).nonzero().flatten()
        hi = int(inside.max()) if len(inside) else 0
        bounds = torch.linspace(0, hi, s.timesteps + 1)
        lower, upper = bounds[:-1].long(), bounds[1:].long()
        return lower + (torch.rand(s.timesteps, generator=generator) * (upper - lower)).long()

    def prepare(self, batch, adv, keep, *, epoch, process_index):
        """The epoch's shared times (from train.seed and the epoch: every process, sample and micro-batch the same)."""
        times = self.policy.flow_times(batch)
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.train.seed, epoch, _SHARED_TIMES_TAG))
        steps = self.shared_steps(times, gen).expand(len(batch.prompts), -1).clone()
        self.plan = TrainingTimes(epoch, process_index, times, steps)
        self.groups, self.keep = batch.group_ids.cpu(), keep.cpu()
        return keep

    def noise(self, sample, slot, shape):
        """With shared_noise, the noise of `sample`'s group at time slot `slot` (from train.seed, the epoch, the
        group and the slot); otherwise the sample's own."""
        if not self.settings.shared_noise:
            return super().noise(sample, slot, shape)
        group = int(self.groups[sample])
        seed = derive_seed(self.cfg.train.seed, self.plan.epoch, group, slot, _GROUP_NOISE_TAG)
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)

    # ---- the loss

    def row_losses(self, batch, idx, unit, adv):
        s = self.settings
        rows, t, noise = self.inputs(batch, idx, unit)
        old = self.shadow_velocity("old", batch, rows, t, noise) if self.has_old(s) else None
        pred = self.policy.flow_prediction(batch, rows, t, noise)
        base = (
            self.reference_velocity(batch, rows, t, noise, s.kl_cfg, self.row_keys(idx, unit))
            if self.reference_note(s)[0]
            else None
        )
        a = adv.detach().float().cpu()[rows].clamp(-s.adv_clip, s.adv_clip)
        a = torch.where(self.keep[rows], a, torch.zeros_like(a)).to(noise.device)  # left-out samples: no term
        group_of_row = self.slot_groups(batch, idx, unit)  # a group at one time slot: one preference
        return core.dgpo_loss(
            pred.velocity,
            old if s.use_ema_ref else base,
            self.clean(batch, rows),
            noise,
            pred.t,
            a,
            group_of_row.to(noise.device),
            beta=s.beta,
            group_size=self.cfg.sample.group_size,
            old_velocity=old if s.clip_dsm else None,
            clip_low=s.clip_range,
            clip_high=s.clip_range,
            kl_velocity=base if s.kl_coef > 0 else None,
            kl_coef=s.kl_coef,
        )

    def after_optimizer_step(self, optimizer_steps):
        """old <- lambda old + (1 - lambda) theta, lambda = min(ema_decay_rate (k - 1), ema_decay_cap) after step k
        (Flow-Factory's decay at its 0-based step)."""
        self.optimizer_steps = optimizer_steps
        s = self.settings
        if self.has_old(s):
            decay = core.soft_update_decay(optimizer_steps, rate=s.ema_decay_rate, cap=s.ema_decay_cap, start=1)
            self.soft_update("old", decay)

    # ---- what is kept

    def state_dict(self):
        state = super().state_dict()
        if self.has_old(self.settings):  # when the old policy starts to sample
            state["dgpo/optimizer_steps"] = torch.tensor(self.optimizer_steps)
        return state

    def load_state_dict(self, state, place=None):
        super().load_state_dict(state, place)
        if "dgpo/optimizer_steps" in state:
            self.optimizer_steps = int(state["dgpo/optimizer_steps"])
