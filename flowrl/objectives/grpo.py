"""GRPO: the policy loss on the sampler's own stochastic transitions (Flow-GRPO, arXiv 2505.05470; DDPO, arXiv
2305.13301; for text DeepSeekMath's GRPO, arXiv 2402.03300, and its variants).

The rollout records every stochastic step's latents (or token) and log-prob; the units of the update are those
steps; for each, the policy's log-prob is recomputed with gradients and the loss is

    L = agg_{i,k} [ w_k max(-A_i r_ik, -A_i clip(r_ik, 1 - eps_low, 1 + eps_high)) ] + beta agg KL_ik - c agg H_ik,

r_ik = exp(log pi(step k of i) - log pi_old(step k of i)), w_k the per-step weight (`step_weighting`), agg the
policy's aggregation (core.aggregate_loss), KL to the reference (the adapter off, or a frozen copy) and the entropy
bonus H for text. The first minibatch of an epoch is on-policy: r = 1 there (the trainer checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

from torch import Tensor

from flowrl import core
from flowrl.policies.base import ReferenceCache
from flowrl.ranges import AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, Range

from . import register
from ._base import MemoryTerms, Objective


@dataclass
class WindowConfig:
    RANGES: ClassVar[dict[str, Range]] = {
        "start": AT_LEAST_0,
        "size": AT_LEAST_0,
        "every": AT_LEAST_1,
        "stride": AT_LEAST_1,
    }

    kind: Literal["all", "fixed", "sliding"] = "all"
    """Which denoising steps are stochastic (SDE) and trained: `all`; a `fixed` window [start, start+size)
    (Flow-GRPO-Fast); a `sliding` window that moves with the epoch (MixGRPO). Steps outside are ODE."""
    start: int = 0
    """First step of the window (fixed) or of the slide (sliding)."""
    size: int = 0
    """Window length in steps (0 with kind=all)."""
    every: int = 1
    """sliding: move the window by `stride` steps every this many epochs."""
    stride: int = 1
    """sliding: steps the window moves per shift (it rolls back to `start` past the last step)."""


@dataclass
class GRPOSettings:
    RANGES: ClassVar[dict[str, Range]] = {
        "clip_low": FRACTION,
        "clip_high": POSITIVE,
        "dual_clip": Range(1, lo_open=True),
        "beta": AT_LEAST_0,
        "noise_level": Range(0, 10, lo_open=True),
        "trust_region_kl": POSITIVE,
    }

    policy_loss: str = "ppo_clip"
    """Policy loss from the core's registry: `ppo_clip`, `gspo` (text), `dppo` (images: Flow-DPPO's trust-region mask
    on each step's Gaussian KL in place of the clip; see trust_region_kl)."""
    trust_region_kl: float = 1e-5
    """policy_loss=dppo: a step whose KL(current || sampling policy), mean over the latent of (mu - mu_old)^2 /
    (2 std^2), reaches this while its ratio already moves the way its advantage pushes is masked out."""
    clip_low: float = 1e-4
    """Lower clip range epsilon (ratio >= 1 - clip_low); Flow-GRPO uses 1e-4."""
    clip_high: Optional[float] = None
    """Upper clip range (None = clip_low; DAPO's clip-higher sets it larger)."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages (None = off)."""
    beta: float = 0.0
    """KL coefficient; the reference is the base model (LoRA off). 0 skips the reference forward."""
    kl_std: Literal["step", "sigma"] = "step"
    """Images: the std in the Gaussian KL: the transition std (`step`), or Flow-GRPO's convention leaving sqrt(dt)
    out."""
    step_weighting: Literal["none", "noise", "ratio_norm"] = "none"
    """Images: per-step loss weight: none; `noise` = the step's transition std normalised to mean 1 over the trained
    steps (TempFlow-GRPO); `ratio_norm` = GRPO-Guard's RatioNorm of the per-step log-ratio."""
    sde_type: Literal["auto", "sde", "cps", "dance", "ddim"] = "auto"
    """Images: the stochastic step kernel of the rollout: Flow-GRPO `sde`, coefficients-preserving `cps`, DanceGRPO
    `dance`; `ddim` for epsilon-prediction UNets (SD1.5/SDXL); `auto` = the family's default (sde / ddim)."""
    noise_level: Optional[float] = None
    """Images: the SDE noise level: Flow-GRPO's `a` (sigma_t = a sqrt(sigma / (1 - sigma))), CPS's angle fraction,
    DanceGRPO's / DDIM's eta; null = the kernel's default (0.7, 0.7, 0.3, 1.0)."""
    window: WindowConfig = field(default_factory=WindowConfig)
    """Images: which steps are stochastic and trained."""
    same_noise_per_group: bool = False
    """Images: one initial noise for every image of a group (the group then differs only by the SDE noise)."""


def grpo_loss(
    out,
    adv: Tensor,
    keep: Tensor,
    settings: GRPOSettings,
    aggregation: str,
    entropy_coef: float = 0.0,
    normalizer: Tensor | None = None,
) -> tuple[Tensor, dict]:
    """GRPO's loss of one unit of steps for a minibatch of b samples: the policy loss from the core's registry (or
    the clipped surrogate on GRPO-Guard's normalised log-ratio) x per-step weight, aggregated by `aggregation`,
    plus beta x KL, minus entropy_coef x entropy.

    out: a flowrl.policies.base.UnitOutput ([b, K] tensors); adv: [b]; keep: [b] bool -> (scalar loss, stats).
    `normalizer`: the aggregation's normalizer of the whole minibatch when these b samples are one of its
    micro-batches (core.loss_normalizer), so that the micro-batches' losses add up to the minibatch's.
    """
    device = out.mask.device  # adv and keep come from the scorer, on the CPU
    mask = out.mask * keep[:, None].to(device=device, dtype=out.mask.dtype)  # [b, K]
    adv = adv.to(device)
    clip = dict(clip_low=settings.clip_low, clip_high=settings.clip_high, dual_clip=settings.dual_clip, mask=mask)
    if out.log_ratio is not None:
        loss, stats = core.clipped_surrogate(out.log_ratio, adv, **clip)
    elif settings.policy_loss == "dppo":
        if out.step_kl is None:
            raise ValueError("policy_loss=dppo needs each step's KL to the sampling policy (an image rollout's means)")
        loss, stats = core.dppo_loss(
            out.log_prob, out.old_log_prob, adv, step_kl=out.step_kl, kl_threshold=settings.trust_region_kl, mask=mask
        )
    else:
        loss, stats = core.get_policy_loss(settings.policy_loss)(out.log_prob, out.old_log_prob, adv, **clip)
    if out.weight is not None:
        loss = loss * out.weight  # [b, K]
    total = core.aggregate_loss(loss, mask, aggregation, normalizer=normalizer)
    stats["policy_loss"] = total.detach()
    if out.entropy is not None:
        entropy = core.aggregate_loss(out.entropy, mask, aggregation, normalizer=normalizer)
        if entropy_coef:
            total = total - entropy_coef * entropy
        stats["entropy"] = entropy.detach()
    if settings.beta > 0 and out.kl is not None:
        kl = core.aggregate_loss(out.kl, mask, aggregation, normalizer=normalizer)
        total = total + settings.beta * kl
        stats["kl"] = kl.detach()
    stats["loss"] = total.detach()
    return total, stats


@register
class GRPO(Objective):
    """GRPO (see the module docstring): the rollout records every step; the policy recomputes a unit's log-probs
    with gradients (`policy.unit_log_probs`) and `grpo_loss` takes them."""

    name = "grpo"
    title = "GRPO"
    # Flow-DPPO (arXiv 2606.11025) is GRPO with a KL trust region; Flow-GRPO / DDPO / PPO are GRPO as it is
    variants = {
        **dict.fromkeys(("dppo", "flow_dppo", "flow-dppo", "flowdppo"), "train.grpo.policy_loss=dppo"),
        **dict.fromkeys(("flow_grpo", "flow-grpo", "flowgrpo", "ddpo", "ppo"), ""),
    }
    Settings = GRPOSettings
    coupled = True
    backends = ("image", "text")

    def __init__(self, cfg, policy, num_processes: int = 1):
        super().__init__(cfg, policy, num_processes)
        s = self.settings
        if cfg.backend == "image":
            policy.stochastic_sampler()  # a kernel or window the model cannot train fails before the first rollout
        if s.beta > 0:
            policy.ensure_reference()
        local = self.groups_split()
        if s.same_noise_per_group and local is not None:
            raise ValueError(
                f"train.grpo.same_noise_per_group needs whole groups on each process: the per-process "
                f"batch {local} is not a multiple of group_size {cfg.sample.group_size}"
            )

    @classmethod
    def check(cls, cfg) -> list[str]:
        s, num_steps = cfg.train.grpo, cfg.sample.num_steps
        problems = super().check(cfg)
        if s.policy_loss not in core.POLICY_LOSSES:
            problems.append(
                f"train.grpo.policy_loss {s.policy_loss!r} is not registered; valid: "
                f"{', '.join(core.POLICY_LOSSES.names())}"
            )
        if cfg.backend != "image":
            if s.policy_loss == "dppo":
                problems.append(
                    "train.grpo.policy_loss=dppo masks by each denoising step's Gaussian KL, which a text rollout does "
                    "not have; use ppo_clip or gspo for text"
                )
            return problems
        if s.policy_loss == "dppo" and s.step_weighting == "ratio_norm":
            problems.append(
                "train.grpo.policy_loss=dppo and step_weighting=ratio_norm both replace the ratio; keep one"
            )
        w = s.window
        if w.kind != "all" and (w.size < 1 or w.start < 0 or w.start + w.size > num_steps):
            problems.append(
                f"train.grpo.window: [start, start+size) = [{w.start}, {w.start + w.size}) must lie in "
                f"[0, sample.num_steps={num_steps}) with size >= 1"
            )
        if s.noise_level is not None and s.noise_level > 1 and s.sde_type in ("cps", "ddim"):
            problems.append(
                f"train.grpo.noise_level must be in (0, 1] for sde_type={s.sde_type} (CPS's angle "
                f"fraction, DDIM's eta), got {s.noise_level}"
            )
        if s.step_weighting == "ratio_norm" and s.sde_type not in ("auto", "sde", "dance"):
            problems.append(
                "train.grpo.step_weighting=ratio_norm needs a Gaussian SDE step (train.grpo.sde_type sde or dance)"
            )
        if s.sde_type != "auto" and cfg.model.family != "auto":
            from flowrl.families import FAMILIES, family_names

            if cfg.model.family in family_names():
                kernels = [k for k in FAMILIES.get(cfg.model.family).sde_types if k != "ode"]
                if s.sde_type not in kernels:
                    problems.append(
                        f"train.grpo.sde_type={s.sde_type} does not fit model.family={cfg.model.family}: "
                        f"it takes {', '.join(kernels)} (ddim is for epsilon-prediction UNets, "
                        f"sde/cps/dance for flow models)"
                    )
        return problems

    @classmethod
    def memory_terms(cls, cfg, cfg_rows: int, true_cfg: bool | None = None) -> MemoryTerms:
        s, num_steps = cfg.train.grpo, cfg.sample.num_steps
        trained = num_steps if s.window.kind == "all" else s.window.size
        steps = min(cfg.train.steps_per_forward, trained)
        return MemoryTerms(
            # train.cache_reference: the reference's mean of every trained step of a sample, for the epoch
            reference_cached=trained if s.beta > 0 and cls.keeps_reference(cfg) else 0,
            reference_cached_what=("step means", "steps"),
            reference=s.beta > 0,
            reference_note=f"beta {s.beta:g}",
            rows=steps * cfg_rows,
            rows_note=f"{steps * cfg_rows} model rows: {steps} step(s)" + (" x 2 (CFG)" if cfg_rows == 2 else ""),
            latents_kept=num_steps + 1,
            means_kept=num_steps if s.step_weighting == "ratio_norm" or s.policy_loss == "dppo" else 0,
            whole_groups=s.same_noise_per_group,
        )

    def train_units(self, batch, steps_per_forward):
        return self.policy.train_units(batch, steps_per_forward)

    def step_mask(self, batch, idx, unit):
        return self.policy.step_mask(batch, idx, unit)

    def prepare(self, batch, adv, keep, *, epoch, process_index):
        cached = self.settings.beta > 0 and self.keeps_reference(self.cfg)
        self.reference_cache = ReferenceCache() if cached else None  # a new batch: a new cache
        return keep

    def unit_loss(self, batch, idx, unit, adv, keep, normalizer):
        out = self.policy.unit_log_probs(
            batch, idx, unit, with_reference=self.settings.beta > 0, reference_cache=self.reference_cache
        )
        if normalizer is not None:
            normalizer = normalizer.to(out.log_prob.device)
        return self.loss(out, adv[idx], keep[idx], normalizer)

    def loss(self, out, adv: Tensor, keep: Tensor, normalizer: Tensor | None = None) -> tuple[Tensor, dict]:
        """`grpo_loss` of recomputed log-probs `out` with this run's settings and the policy's aggregation."""
        return grpo_loss(out, adv, keep, self.settings, self.policy.aggregation, self.policy.entropy_coef, normalizer)

    @classmethod
    def progress(cls, metrics):
        """The first minibatch's ratio (1 on policy; "-" when no minibatch trained)."""
        ratio0 = metrics.get("policy/ratio_first")
        return {"on_policy_ratio": "-" if ratio0 is None else f"{ratio0:.5f}"}
