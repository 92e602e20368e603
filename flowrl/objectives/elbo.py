"""ELBO-likelihood RL (Choi et al., arXiv 2602.04663): policy gradient with the final sample's ELBO as its
log-likelihood.

The rollout is the deterministic ODE's (any sampler would do: only the final latents x0 enter); each x0 is noised
again at the epoch's training times with fresh noise (ForwardProcessObjective), and at each (t, eps) the ELBO
estimate of the trained policy and of the old policy (the one that sampled the batch) give the ratio
rho = exp(ELBO_theta - ELBO_old) of core.elbo_loss (EPG, PEPG, PAR or PPO-clip), plus a velocity penalty toward
the reference. As in the authors' code, a ratio belongs to one (sample, time) pair, so a unit of
train.steps_per_forward times needs only its own times.

The old policy is a shadow "old" (a second adapter, or a frozen copy in full fine-tuning). By default
(old_decay_rate 0) the trained weights sample and "old" is set to them when the epoch's update starts: before the
first optimizer step of the epoch old = theta, so the loss takes theta's own detached estimate (no second forward
pass) and the ratio is exactly 1, which the trainer's on-policy check (`policy/ratio_first`) sees; after a step, old
is evaluated without gradient. With rollout.async the batch was sampled by the previous version of the trained
weights (a lag of one epoch): "old" is set to that version, so the ratio is the trained policy's against the one
that sampled, not 1, from the first step. With old_decay_rate > 0 (the authors' runs: 1e-3, cap 0.5) "old"
samples the rollouts and follows the trained weights as DiffusionNFT's does, old <- lambda old + (1 - lambda) theta
after each epoch's update; its ratio is then not 1 by design and is not reported to the on-policy check (with
rollout.async the worker samples with "old" as it was one update earlier).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from flowrl import core
from flowrl.ranges import AT_LEAST_0, POSITIVE, Range

from . import register
from ._forward import ForwardProcessObjective


@dataclass
class ELBOSettings:
    RANGES: ClassVar[dict[str, Range]] = {
        "clip_range": POSITIVE,
        "kl_coef": AT_LEAST_0,
        "old_decay_rate": AT_LEAST_0,
        "old_decay_cap": Range(0, 1),
        "old_decay_start": AT_LEAST_0,
        "timesteps": AT_LEAST_0,
    }

    loss: Literal["epg", "pepg", "par", "ppo_clip"] = "pepg"
    """The policy loss on rho = exp(ELBO_theta - ELBO_old) (core.elbo_loss): `epg` -sg(rho) A ELBO; `pepg` (the
    paper's headline runs) -sg(rho) (A - sg(log rho)) ELBO; `par` 1/2 sg(rho) (A - (ELBO_theta - ELBO_old))^2;
    `ppo_clip` the clipped surrogate (clip_range). The paper finds the choice matters little next to the ELBO
    estimator."""
    weighting: Literal["adaptive", "uniform", "t", "exact"] = "adaptive"
    """The ELBO's weighting of the flow-matching error (core.elbo_estimate): `adaptive` (the reference's runs) the
    x0-space error over its own detached mean absolute value; `t` the x0-space error; `uniform` the velocity error;
    `exact` (1 - t) / (t + 1e-3) x the velocity error."""
    clip_range: float = 1e-3
    """loss=ppo_clip: rho is clipped to [1 - clip_range, 1 + clip_range] (the reference's 1e-3)."""
    kl_coef: float = 1e-4
    """Velocity penalty kl_coef ||v_theta - v_ref||^2 toward the reference (the adapter off; a frozen copy in full
    fine-tuning), the reference's "girsanov" KL; 0 skips the reference's forward pass (the reference: 1e-4)."""
    old_decay_rate: float = 0.0
    """0: the trained weights sample and the old policy is them at each epoch's start (on-policy). > 0: the old
    policy samples and moves after each epoch's update, old <- lambda old + (1 - lambda) theta with lambda =
    min(old_decay_rate (step - old_decay_start), old_decay_cap), step = optimizer steps so far (the reference's
    runs: 1e-3, cap 0.5, DiffusionNFT's schedule)."""
    old_decay_cap: float = 0.5
    """The largest lambda (see old_decay_rate)."""
    old_decay_start: int = 0
    """Optimizer steps before which lambda = 0 (see old_decay_rate)."""
    timesteps: int = 0
    """Training times per sample (Monte Carlo points of the ELBO), each with fresh noise: that many steps of the
    rollout's schedule in a random order per sample; 0 = int(0.99 x sample.num_steps) (the reference's
    timestep_fraction 0.99: 9 of its 10 steps)."""


@register
class ELBO(ForwardProcessObjective):
    """ELBO-likelihood policy gradient (see the module docstring)."""

    name = "elbo"
    title = "ELBO policy gradient"
    Settings = ELBOSettings

    def __init__(self, cfg, policy, num_processes=1):
        super().__init__(cfg, policy, num_processes)
        policy.add_shadow("old")
        if self.settings.kl_coef > 0:
            policy.ensure_reference()
        self.lagging = self.settings.old_decay_rate > 0
        self.sampling_shadow = "old" if self.lagging else None
        #: whether "old" holds the trained weights now (no optimizer step since it was set): its ELBO is theta's
        self.old_is_theta = True

    @classmethod
    def times_per_sample(cls, settings, num_steps):
        """The `timesteps` setting, or int(0.99 x steps) (the reference's timestep_fraction)."""
        return settings.timesteps or max(1, int(num_steps * 0.99))

    @classmethod
    def reference_note(cls, settings):
        return settings.kl_coef > 0, f"elbo kl_coef {settings.kl_coef:g}"

    @classmethod
    def shadow_names(cls, settings):
        return ("old",)

    def prepare(self, batch, adv, keep, *, epoch, process_index):
        """The training times; on-policy (old_decay_rate 0), "old" becomes the weights that sampled the batch: the
        trained ones, or with rollout.async the older version that sampled it (`batch.sampled_with`), whose ratio
        to the trained weights is then not 1 at the first step."""
        keep = super().prepare(batch, adv, keep, epoch=epoch, process_index=process_index)
        older = batch.sampled_with
        if not self.lagging:
            if older is not None:
                self.load_shadow("old", older)
            else:
                self.soft_update("old", 0.0)
        self.old_is_theta = not self.lagging and older is None
        return keep

    def row_losses(self, batch, idx, unit, adv):
        s = self.settings
        rows, t, noise = self.inputs(batch, idx, unit)
        old = None if self.old_is_theta else self.shadow_velocity("old", batch, rows, t, noise)
        pred = self.policy.flow_prediction(batch, rows, t, noise)
        ref = self.reference_velocity(batch, rows, t, noise, keys=self.row_keys(idx, unit)) if s.kl_coef > 0 else None
        return core.elbo_loss(
            pred.velocity,
            self.clean(batch, rows),
            noise,
            pred.t,
            adv[rows].to(noise.device),
            old_velocity=old,
            loss=s.loss,
            weighting=s.weighting,
            clip_range=s.clip_range,
            ref_velocity=ref,
            kl_coef=s.kl_coef,
        )

    def unit_loss(self, batch, idx, unit, adv, keep, normalizer):
        """ForwardProcessObjective's, with the ratio's range as `ratio_min` / `ratio_max` for the trainer's
        on-policy check when the trained weights sampled the batch."""
        total, stats = super().unit_loss(batch, idx, unit, adv, keep, normalizer)
        if not self.lagging:
            stats["ratio_min"], stats["ratio_max"] = stats["elbo_ratio_min"], stats["elbo_ratio_max"]
        return total, stats

    def after_optimizer_step(self, optimizer_steps):
        self.old_is_theta = False

    def after_update(self, optimizer_steps):
        if not self.lagging:
            return {}
        s = self.settings
        decay = core.soft_update_decay(
            optimizer_steps, rate=s.old_decay_rate, cap=s.old_decay_cap, start=s.old_decay_start
        )
        self.soft_update("old", decay)
        return {"objective/elbo_old_decay": decay}
