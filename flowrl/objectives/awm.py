"""Advantage Weighted Matching (Xue et al., arXiv 2509.25050): the advantage-weighted flow-matching loss.

The trained policy samples the rollouts and the loss is core.awm_loss, on-policy (ratio 1: the gradient is the
advantage-weighted flow-matching loss's), with a reference penalty and, with ema_kl_coef > 0, a penalty toward an
EMA of the policy (a shadow "ema", soft-updated after every optimizer step with
lambda = min(ema_decay_rate x step, ema_decay_cap)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from flowrl import core
from flowrl.ranges import AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, Range

from . import register
from ._forward import ForwardProcessObjective


@dataclass
class AWMSettings:
    RANGES: ClassVar[dict[str, Range]] = {
        "ghuber_power": POSITIVE,
        "advantage_clip": POSITIVE,
        "kl_coef": AT_LEAST_0,
        "ema_kl_coef": AT_LEAST_0,
        "ema_decay_rate": AT_LEAST_0,
        "ema_decay_cap": Range(0, 1),
        "timesteps": AT_LEAST_1,
        "timestep_fraction": FRACTION,
    }

    weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = "ghuber"
    """The weighting m(l, t) of a sample's flow-matching error l (core.awm_matching_loss; the reference: ghuber)."""
    ghuber_power: float = 0.25
    """p of the generalised Huber weighting t / p ((l + d)^p - d^p) (the reference: 0.25)."""
    advantage_clip: float = 5.0
    """Advantages are clipped to +- this, then divided by it (the reference: 5)."""
    kl_coef: float = 1e-3
    """Velocity-space penalty toward the reference (the adapter off; a frozen copy in full fine-tuning); 0 skips its
    forward pass (the reference: 1e-3 GenEval, 3e-3 OCR, 1e-4 PickScore)."""
    ema_kl_coef: float = 0.0
    """Penalty ||v_theta - v_ema||^2 toward an EMA of the policy (a second adapter, soft-updated after every
    optimizer step), one more forward pass per time; 0 = off (the reference's runs use 1)."""
    ema_decay_rate: float = 1e-3
    """The EMA policy's lambda = min(ema_decay_rate x step, ema_decay_cap) (the reference: 1e-3, 0.3)."""
    ema_decay_cap: float = 0.3
    """The EMA policy's largest lambda."""
    timesteps: int = 6
    """Training times per sample: one index per stratum of the rollout's steps [1, int(timestep_fraction x S))
    (the first step, pure noise, is left out), each with fresh noise, drawn per sample (the reference: 6 strata
    shared by its batch)."""
    timestep_fraction: float = 0.9
    """The share of the rollout's S steps the training times come from (the reference: 0.9)."""


@register
class AWM(ForwardProcessObjective):
    """Advantage Weighted Matching (see the module docstring)."""

    name = "awm"
    title = "AWM"
    Settings = AWMSettings
    distinct_times = False  # strata repeat indices when there are more times than steps

    def __init__(self, cfg, policy, num_processes=1):
        super().__init__(cfg, policy, num_processes)
        if self.settings.ema_kl_coef > 0:
            policy.add_shadow("ema")
        if self.settings.kl_coef > 0:
            policy.ensure_reference()

    @classmethod
    def times_per_sample(cls, settings, num_steps):
        return settings.timesteps

    @classmethod
    def reference_note(cls, settings):
        return settings.kl_coef > 0, f"awm kl_coef {settings.kl_coef:g}"

    @classmethod
    def shadow_names(cls, settings):
        return ("ema",) if settings.ema_kl_coef > 0 else ()

    def draw_steps(self, n, times, generator):
        """One index per stratum of [lo, hi): lo = 1 (the first step, pure noise, left out) and hi =
        int(timestep_fraction x S), as the reference's discrete times; strata repeat indices when T > hi - lo."""
        count, num_steps = self.settings.timesteps, len(times)
        lo = 1 if num_steps > 1 else 0
        hi = max(lo + 1, int(num_steps * self.settings.timestep_fraction))
        u = torch.rand(n, count, generator=generator)
        strata = (torch.arange(count)[None, :] + u) / count  # [n, T] in [0, 1)
        return (lo + (strata * (hi - lo)).long()).clamp(max=hi - 1)

    def row_losses(self, batch, idx, unit, adv):
        s = self.settings
        rows, t, noise = self.inputs(batch, idx, unit)
        pred = self.policy.flow_prediction(batch, rows, t, noise)
        ref = self.reference_velocity(batch, rows, t, noise, keys=self.row_keys(idx, unit)) if s.kl_coef > 0 else None
        ema = self.shadow_velocity("ema", batch, rows, t, noise) if s.ema_kl_coef > 0 else None
        return core.awm_loss(
            pred.velocity,
            self.clean(batch, rows),
            noise,
            pred.t,
            adv[rows].to(noise.device),
            weighting=s.weighting,
            ghuber_power=s.ghuber_power,
            advantage_clip=s.advantage_clip,
            ref_velocity=ref,
            kl_coef=s.kl_coef,
            ema_velocity=ema,
            ema_kl_coef=s.ema_kl_coef,
        )

    def after_optimizer_step(self, optimizer_steps):
        s = self.settings
        if s.ema_kl_coef > 0:
            self.soft_update("ema", core.soft_update_decay(optimizer_steps, rate=s.ema_decay_rate, cap=s.ema_decay_cap))
