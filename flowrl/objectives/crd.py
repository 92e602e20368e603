"""Centered Reward Distillation (Zhu et al., arXiv 2603.14128): centred reward matching on the forward process.

A "sampling" snapshot of the policy (a second LoRA adapter, or a frozen copy in full fine-tuning) samples the
rollouts; an "old" snapshot is the baseline of the implicit reward r_theta (the trained policy's flow-matching error
against the old one's, at the same x_t). Within each prompt's group (and training-time slot) both r_theta and the
external reward r = 1/2 + 1/2 clip(A / adv_clip, -1, 1) are centred, and the loss (core.crd_loss) matches
beta R_theta_c to R_c, plus a KL toward the base model guided at kl_cfg, its weight growing with r. After each
epoch's update both snapshots move toward the trained policy on their own schedule (core.crd_decay). Micro-batches
hold whole groups (`group_batches`), so the group means are taken within one; the released code (Flow-Factory's
trainers/crd.py) centres over its micro-batch instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal

from flowrl import core
from flowrl.ranges import AT_LEAST_0, POSITIVE, Range

from . import register
from ._forward import ForwardProcessObjective

DECAY = Range(0, 1)


@dataclass
class CRDSettings:
    RANGES: ClassVar[dict[str, Range]] = {
        "beta": POSITIVE,
        "adv_clip": POSITIVE,
        "weight_temp": Range(),
        "kl_beta": AT_LEAST_0,
        "kl_cfg": AT_LEAST_0,
        "old_decay_start": AT_LEAST_0,
        "old_decay_initial": DECAY,
        "old_decay_rate": AT_LEAST_0,
        "old_decay_cap": DECAY,
        "sampling_decay_start": AT_LEAST_0,
        "sampling_decay_initial": DECAY,
        "sampling_decay_rate": AT_LEAST_0,
        "sampling_decay_cap": DECAY,
        "timesteps": AT_LEAST_0,
    }

    beta: float = 1.0
    """CRD's beta: the implicit reward's scale, the loss matches beta R_theta_c to R_c and is multiplied by
    adv_clip / beta (the reference: crd_beta 1)."""
    loss: Literal["mse", "bce"] = "mse"
    """The matching loss: mse (beta R_theta_c - R_c)^2, or bce with logit beta R_theta_c and target sigmoid(R_c)
    (the reference: crd_loss_type mse)."""
    adaptive_weight: bool = True
    """Divide each squared velocity error of r_theta by its own detached mean absolute error, floored at 1e-5 (the
    reference: adaptive_logp true)."""
    weight_temp: float = -1.0
    """The centring weights within a group: negative = uniform (the group mean); T > 0 = the mean of two centrings,
    under softmax(r / T) and softmax(-r / T) (toward the group's best and its worst); 0 is refused (the reference:
    weight_temp -1)."""
    adv_clip: float = 5.0
    """r = 1/2 + 1/2 clip(A / adv_clip, -1, 1) in [0, 1] (the reference: adv_clip_range 5; it normalises by the
    batch's std, train.adv_scale=batch)."""
    kl_beta: float = 0.1
    """Velocity-space KL kl_beta ||v_theta - v_ref||^2 toward the base model (the adapter off; a frozen copy in
    full fine-tuning); 0 skips the reference's forward pass (the reference: 0.1)."""
    kl_cfg: float = 4.5
    """The reference's guidance in the KL: above 1 the base model's CFG-guided velocity (true-CFG families: one
    batched pass over [uncond, cond]; FLUX.1/FLUX.2 dev: the guidance embedding set to it; a family with neither,
    FLUX.1 schnell or FLUX.2 klein distilled, ignores it); 1 or below: the CFG-free pass (the reference: 4.5)."""
    adaptive_kl: bool = True
    """Reward-adaptive KL: a sample's KL weight is kl_beta (m + r (1 - m)) with m = 1e-4 / kl_beta, from 1e-4 at
    r = 0 to kl_beta at r = 1 (the reference: reward_adaptive_kl true)."""
    old_decay_start: int = 0
    """The old snapshot's soft update after each epoch, old <- lambda old + (1 - lambda) theta with lambda =
    old_decay_initial before this many optimizer steps, else min(old_decay_initial + old_decay_rate x (steps -
    old_decay_start), old_decay_cap) (the reference: "0-0.25-0.005-0.999")."""
    old_decay_initial: float = 0.25
    """The old snapshot's lambda before old_decay_start (and where its ramp starts)."""
    old_decay_rate: float = 0.005
    """The old snapshot's lambda grows by this per optimizer step after old_decay_start."""
    old_decay_cap: float = 0.999
    """The old snapshot's largest lambda."""
    sampling_decay_start: int = 75
    """The sampling snapshot's schedule, as the old one's (the reference: "75-0.0-0.0075-0.999": a copy of the
    trained policy for 75 steps, then lagging more and more)."""
    sampling_decay_initial: float = 0.0
    """The sampling snapshot's lambda before sampling_decay_start."""
    sampling_decay_rate: float = 0.0075
    """The sampling snapshot's lambda grows by this per optimizer step after sampling_decay_start."""
    sampling_decay_cap: float = 0.999
    """The sampling snapshot's largest lambda."""
    timesteps: int = 0
    """Training times per sample: that many distinct steps of the rollout's schedule, a random order per sample,
    each with fresh noise; 0 = int(0.99 x sample.num_steps) (the reference's timestep_range 0.99)."""


@register
class CRD(ForwardProcessObjective):
    """Centered Reward Distillation (see the module docstring)."""

    name = "crd"
    title = "CRD"
    Settings = CRDSettings
    sampling_shadow = "sampling"
    group_batches = True

    def __init__(self, cfg, policy, num_processes=1):
        super().__init__(cfg, policy, num_processes)
        policy.add_shadow("old")
        policy.add_shadow("sampling")
        if self.settings.kl_beta > 0:
            policy.ensure_reference()

    @classmethod
    def check(cls, cfg):
        problems = super().check(cfg)
        if cfg.train.crd.weight_temp == 0:
            problems.append(
                "train.crd.weight_temp=0: hard selection is not supported; use a negative value (uniform centring, "
                "the default -1) or a positive temperature"
            )
        return problems

    @classmethod
    def memory_terms(cls, cfg, cfg_rows, true_cfg=None):
        terms = super().memory_terms(cfg, cfg_rows, true_cfg)
        s = cfg.train.crd
        if s.kl_beta > 0 and s.kl_cfg > 1:  # the guided reference runs without grad: no activations kept
            terms = replace(
                terms, rows_note=terms.rows_note + f"; the reference's pass (no grad) guided at {s.kl_cfg:g}"
            )
        return terms

    @classmethod
    def times_per_sample(cls, settings, num_steps):
        """The `timesteps` setting, or int(0.99 x steps) (the reference's timestep_range)."""
        return settings.timesteps or max(1, int(num_steps * 0.99))

    @classmethod
    def reference_note(cls, settings):
        return settings.kl_beta > 0, f"crd kl_beta {settings.kl_beta:g} at CFG {settings.kl_cfg:g}"

    @classmethod
    def shadow_names(cls, settings):
        return ("old", "sampling")

    def row_losses(self, batch, idx, unit, adv):
        s = self.settings
        rows, t, noise = self.inputs(batch, idx, unit)
        old = self.shadow_velocity("old", batch, rows, t, noise)
        pred = self.policy.flow_prediction(batch, rows, t, noise)
        ref = (
            self.reference_velocity(batch, rows, t, noise, s.kl_cfg, self.row_keys(idx, unit))
            if s.kl_beta > 0
            else None
        )
        r = core.optimality_probability(adv[rows].to(noise.device), clip=s.adv_clip)
        return core.crd_loss(
            pred.velocity,
            old,
            pred.target,
            r,
            self.slot_groups(batch, idx, unit),  # centred within a prompt's group at one training time
            beta=s.beta,
            loss_type=s.loss,
            weight_temp=s.weight_temp,
            adaptive_weight=s.adaptive_weight,
            scale=s.adv_clip,
            ref_velocity=ref,
            kl_beta=s.kl_beta,
            adaptive_kl=s.adaptive_kl,
        )

    def after_update(self, optimizer_steps):
        s = self.settings
        decays = {
            "old": core.crd_decay(
                optimizer_steps,
                start=s.old_decay_start,
                initial=s.old_decay_initial,
                rate=s.old_decay_rate,
                cap=s.old_decay_cap,
            ),
            "sampling": core.crd_decay(
                optimizer_steps,
                start=s.sampling_decay_start,
                initial=s.sampling_decay_initial,
                rate=s.sampling_decay_rate,
                cap=s.sampling_decay_cap,
            ),
        }
        for name, decay in decays.items():
            self.soft_update(name, decay)
        return {f"objective/crd_{name}_decay": decay for name, decay in decays.items()}
