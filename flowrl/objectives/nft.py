"""DiffusionNFT (Zheng et al., arXiv 2509.16117): negative-aware fine-tuning on the forward process.

The old policy (a second LoRA adapter "old", or a frozen copy in full fine-tuning, starting as the trained weights)
samples the rollouts; the loss is core.nft_loss with r = core.optimality_probability(advantage); after each epoch's
update the old policy moves toward the trained one, old <- lambda old + (1 - lambda) theta with
lambda = core.soft_update_decay(optimizer steps so far).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from flowrl import core
from flowrl.ranges import AT_LEAST_0, POSITIVE, Range

from . import register
from ._forward import ForwardProcessObjective


@dataclass
class NFTSettings:
    RANGES: ClassVar[dict[str, Range]] = {
        "beta": POSITIVE,
        "adv_clip": POSITIVE,
        "policy_scale": POSITIVE,
        "kl_coef": AT_LEAST_0,
        "decay_rate": AT_LEAST_0,
        "decay_cap": Range(0, 1),
        "decay_start": AT_LEAST_0,
        "timesteps": AT_LEAST_0,
    }

    beta: float = 1.0
    """DiffusionNFT's beta: the implicit policies v+- = v_old +- beta (v_theta - v_old) (the reference: 1; 0.1 for OCR
    and its multi-reward run)."""
    adaptive_weight: bool = True
    """Weigh each squared error by its own detached mean absolute error in x0-space (the reference's default)."""
    adv_clip: float = 5.0
    """r = 1/2 + 1/2 clip(A / adv_clip, -1, 1), the optimality probability of a sample with advantage A (the
    reference: 5, its adv_clip_max; it normalises by the batch's std: train.adv_scale=batch)."""
    policy_scale: float = 5.0
    """The policy term's factor before the KL term is added (the reference multiplies it by its adv_clip_max, 5)."""
    kl_coef: float = 1e-4
    """Velocity-space penalty kl_coef ||v_theta - v_ref||^2 toward the reference (the adapter off; a frozen copy in
    full fine-tuning); 0 skips the reference's forward pass (the reference: 1e-4)."""
    decay_rate: float = 1e-3
    """After each epoch's update the old (sampling) policy moves toward the trained one: old <- lambda old +
    (1 - lambda) theta with lambda = min(decay_rate (step - decay_start), decay_cap), step = optimizer steps so far
    (the reference: 1e-3, cap 0.5, start 0; OCR: 7.5e-3, cap 0.999, start 75)."""
    decay_cap: float = 0.5
    """The largest lambda (see decay_rate)."""
    decay_start: int = 0
    """Optimizer steps before which lambda = 0 (the old policy is a copy of the trained one)."""
    timesteps: int = 0
    """Training times per sample: that many steps of the rollout's schedule, a random order per sample, each with
    fresh noise; 0 = int(0.99 x sample.num_steps) (the reference's timestep_fraction 0.99: 9 of its 10 steps)."""


@register
class NFT(ForwardProcessObjective):
    """DiffusionNFT (see the module docstring)."""

    name = "nft"
    title = "DiffusionNFT"
    Settings = NFTSettings
    sampling_shadow = "old"

    def __init__(self, cfg, policy, num_processes=1):
        super().__init__(cfg, policy, num_processes)
        policy.add_shadow("old")
        if self.settings.kl_coef > 0:
            policy.ensure_reference()

    @classmethod
    def times_per_sample(cls, settings, num_steps):
        """The `timesteps` setting, or int(0.99 x steps) (the reference's timestep_fraction)."""
        return settings.timesteps or max(1, int(num_steps * 0.99))

    @classmethod
    def reference_note(cls, settings):
        return settings.kl_coef > 0, f"nft kl_coef {settings.kl_coef:g}"

    @classmethod
    def shadow_names(cls, settings):
        return ("old",)

    def row_losses(self, batch, idx, unit, adv):
        s = self.settings
        rows, t, noise = self.inputs(batch, idx, unit)
        old = self.shadow_velocity("old", batch, rows, t, noise)
        pred = self.policy.flow_prediction(batch, rows, t, noise)
        ref = self.reference_velocity(batch, rows, t, noise, keys=self.row_keys(idx, unit)) if s.kl_coef > 0 else None
        r = core.optimality_probability(adv[rows].to(noise.device), clip=s.adv_clip)
        return core.nft_loss(
            pred.velocity,
            old,
            self.clean(batch, rows),
            noise,
            pred.t,
            r,
            beta=s.beta,
            adaptive_weight=s.adaptive_weight,
            ref_velocity=ref,
            kl_coef=s.kl_coef,
            policy_scale=s.policy_scale,
        )

    def after_update(self, optimizer_steps):
        s = self.settings
        decay = core.soft_update_decay(optimizer_steps, rate=s.decay_rate, cap=s.decay_cap, start=s.decay_start)
        self.soft_update("old", decay)
        return {"objective/nft_old_decay": decay}
