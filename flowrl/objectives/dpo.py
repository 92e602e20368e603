"""Online Diffusion-DPO (Wallace et al., arXiv 2311.12908) on each group's best and worst image.

In each group the best image (highest advantage) wins over the worst (with train.dpo.pairing=ranked, also the second
best over the second worst, and so on, while strictly better; with matched, as many pairs, of images that agree on
what the prompt left free); a pair is noised with the SAME noise and
time, the trained model and the reference (the adapter off, or the frozen copy) evaluated on both, and the loss is
core.dpo_loss. The loss's samples are the winners (each brings its loser). train.minibatch_size counts samples, of
which only the winners are computed; train.micro_batch_size counts winners, that is pairs: a forward pass takes two
images per pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from torch import Tensor

from flowrl import core
from flowrl.errors import ConfigError
from flowrl.ranges import AT_LEAST_0, AT_LEAST_1, POSITIVE, Range

from . import register
from ._forward import ForwardProcessObjective, guided_teacher, random_order


@dataclass
class DPOSettings:
    RANGES: ClassVar[dict[str, Range]] = {
        "beta": POSITIVE,
        "timesteps": AT_LEAST_0,
        "kl_coef": AT_LEAST_0,
        "sft_coef": AT_LEAST_0,
        "max_time": Range(0, 1, lo_open=True),
        "free_anchor": AT_LEAST_0,
        "free_anchor_epochs": AT_LEAST_1,
        "reference_decay": Range(0, 1),
        "guidance_scale": AT_LEAST_0,
    }

    beta: float = 5000.0
    """Diffusion-DPO's beta: the loss is -log sigmoid(-beta/2 w(t) D), D the winner's minus the loser's
    (model - reference) error difference. 5000 is the paper's (SD1.5 / SDXL) for noise errors, which the default
    weighting=noise reproduces for every family; with weighting=velocity divide it by about 3 (E[(1-t)^2] for
    uniform t) for the same strength."""
    weighting: Literal["noise", "linear", "velocity"] = "noise"
    """`noise`: w(t) = (1 - t)^2, which turns velocity errors into the paper's noise errors exactly (eps - eps_hat =
    (1 - t)(v - v_hat)); `velocity`: w = 1, Flow-DPO's form on velocity errors; `linear`: w = 1 - t, between the
    two (the noisiest steps weigh more than under `noise`, less than under `velocity`). Under `noise` and `linear`
    a time at t = 1 (pure noise, a flow schedule's first step) weighs 0: its loss is the constant log 2, and with
    kl_coef 0 it is not computed (one forward row of T saved, the same loss and gradient)."""
    pairing: Literal["best_worst", "ranked", "matched"] = "best_worst"
    """The pairs of a group: `best_worst`, its best image over its worst (one pair); `ranked`, the k-th best over
    the k-th worst while strictly better (up to group_size / 2 disjoint pairs, core.ranked_pairs: with 0/1 rewards
    every correct image paired with an incorrect one while both last); `matched`, as many pairs as `ranked`, each
    of two images that agree as far as they can on what the prompt left free (core.matched_pairs, on the
    free-attribute counts the rewards report, e.g. shapes_geneval's free_color=...: a winner and a loser of one
    colour teach nothing about colour, so the model is not pushed toward the winners' colours). More pairs train
    more of each rollout, and cost update time in proportion."""
    free_anchor: float = 0.0
    """pairing=matched: how far the choice of pairs leans toward pulling the free attributes back to the base
    model's distribution (0 = off: the pairs closest in them). A pair's cost becomes ||f_w - f_l||_1 -
    free_anchor (f_w - f_l) . d (core.matched_pairs), d = q_base - q_now per value (core.attribute_shift): q_base
    the distribution of the rollouts of the run's first free_anchor_epochs epochs (the first is the base model's
    exactly), q_now this epoch's. What a pair's two images still differ in (a wrong image's extra object) then
    tends to go against the values drawn too often, not the base model's commonest ones. d sums to 2 TV, so 5
    moves a pair's cost by at most 10 TV per count it differs in: half a count at TV 0.05. The distribution kept
    is in the checkpoint; objective/dpo_free_shift logs TV(q_now, q_base)."""
    free_anchor_epochs: int = 4
    """free_anchor's base distribution: the free-attribute counts of this many first epochs' rollouts."""
    timesteps: int = 0
    """Training times per pair (the same time and noise for winner and loser): that many steps of the rollout's
    schedule in a random order per pair; 0 = all of them (an online batch has one pair per prompt; the paper draws
    one time per pair and step)."""
    continuous_times: bool = False
    """Each training time drawn anywhere in its step's interval of the schedule, uniform in (t_{k+1}, t_k] (the last
    step's down to 0; core.stratified_times), not at the step's own time t_k: as many times as before, in the same
    places on average, and the flow times that a finer schedule visits (the eval's 20 steps against the rollout's
    10) are trained too. Under weighting noise or linear a time at t = 1 is then almost never drawn, so the first
    step's rows are computed (1/T more update work). false = the schedule's own times (the rollout's)."""
    max_time: float = 1.0
    """Train only the schedule's steps at flow time t <= max_time (1 = pure noise): `timesteps` are drawn from them
    (0 = all of them). Under weighting=noise a step's weight is (1 - t)^2, so the noisiest steps carry almost none
    (on a 10-step schedule t = 1, 0.9, 0.8, 0.7 weigh 0, 0.01, 0.04, 0.09, 5% of the total) at a full forward and
    backward each: max_time 0.6 trains the other six at 60% of the cost. 1 = every step."""
    kl_coef: float = 0.0
    """A velocity-space penalty kl_coef ||v_theta - v_ref||^2 toward the reference on both images of each pair (as
    NFT's, AWM's and DGPO's kl_coef; not in the paper): the DPO loss constrains only the difference of the winner's
    and the loser's deviations, so a drift both share goes unchecked. Free to compute (the loss evaluates the
    reference on both images anyway); 0 = off, the paper's loss. The metric policy/dpo_kl reports the deviation
    whatever the coefficient."""
    reference_decay: float = 1.0
    """What the pairs' margins are measured against. 1 = the base model (the adapter off, or the frozen copy), the
    paper's fixed reference. Below 1, a shadow policy that starts as the base model and follows the trained weights
    after each epoch's update, ref <- reference_decay ref + (1 - reference_decay) theta (TR-DPO's soft update of
    the reference, arXiv 2404.09656, once an epoch): a fresh pair's margin then starts near 0 against a recent
    policy instead of growing against the base, so a pair the model already prefers still pulls, at the cost of
    the base as an anchor. 0 = the policy that sampled the epoch (iterative DPO). kl_coef's penalty is toward the
    same reference."""
    guidance_scale: float = 1.0
    """The guidance of the velocities the loss compares: 1 or less, the CFG-free pass (the paper's: what is trained
    is the conditional model); above 1, the policy's and the reference's CFG-guided velocities at this scale (true
    CFG: one batched pass over [uncond, cond], the adapter in both rows; FLUX dev: its guidance embedding), so the
    loss ranks the pairs under the sampler that the eval runs at sample.guidance_scale. A true-CFG pass doubles the
    update's rows; a family with neither true CFG nor a guidance embedding is refused when it loads."""
    sft_coef: float = 0.0
    """The winner's own denoising loss sft_coef w(t) ||v_w - v_theta(x_t^w)||^2 added to each pair's (RPO's NLL term
    on the chosen answer, arXiv 2404.19733, in its diffusion form; core.dpo_loss): the DPO term's pull on the
    winner fades once a pair is ranked, this one's does not. Free to compute (the winner's forward is there); it
    pulls as hard as the DPO term at the reference when sft_coef = beta / 4. 0 = off, the paper's loss."""


@register
class DPO(ForwardProcessObjective):
    """Online Diffusion-DPO (see the module docstring)."""

    name = "dpo"
    title = "online Diffusion-DPO"
    Settings = DPOSettings
    images_per_sample = 2
    REFERENCE = "reference"  # the shadow policy of reference_decay < 1

    def __init__(self, cfg, policy, num_processes=1):
        super().__init__(cfg, policy, num_processes)
        g = self.settings.guidance_scale
        if g > 1 and not guided_teacher(policy.backend, g):
            raise ConfigError(
                f"train.dpo.guidance_scale={g:g}: model.path={cfg.model.path} has neither true CFG nor a guidance "
                f"embedding, so its velocities cannot be guided; use train.dpo.guidance_scale=1"
            )
        if self.settings.reference_decay < 1:
            policy.add_shadow(self.REFERENCE)  # the reference (a full fine-tune needs no frozen copy besides)
        else:
            policy.ensure_reference()
        local = self.groups_split()
        if local is not None:
            raise ValueError(
                f"train.objective={self.name} pairs the images of a group on one process, but the "
                f"per-process batch {local} (prompts_per_epoch x group_size / {num_processes} processes) "
                f"splits groups of sample.group_size={cfg.sample.group_size}; make prompts_per_epoch a multiple "
                f"of the process count"
            )
        self.partner: Tensor | None = None
        self.pairs = 0
        self.pair_distance: float | None = None
        self.anchor_counts: dict[str, float] = {}  # free_anchor: the first epochs' summed counts, by column name
        self.anchor_epochs = 0  # how many epochs they sum
        self.free_shift: float | None = None

    @classmethod
    def check(cls, cfg):
        problems = super().check(cfg)
        s = cfg.train.dpo
        if s.free_anchor > 0 and s.pairing != "matched":
            problems.append(
                f"train.dpo.free_anchor={s.free_anchor:g} weighs how matched pairs are chosen, and "
                f"train.dpo.pairing={s.pairing} does not match them; use train.dpo.pairing=matched, or free_anchor=0"
            )
        return problems

    @classmethod
    def shadow_names(cls, settings):
        return (cls.REFERENCE,) if settings.reference_decay < 1 else ()

    def reference_policy(self):
        """The base model, or (reference_decay < 1) the shadow that follows the trained weights."""
        if self.settings.reference_decay < 1:
            return self.policy.shadow(self.REFERENCE)
        return super().reference_policy()

    @classmethod
    def needs_free_counts(cls, cfg):
        return cls.scores_batch and getattr(cfg.train, cls.name).pairing == "matched"

    @classmethod
    def times_per_sample(cls, settings, num_steps):
        """The `timesteps` setting, or every step of the schedule."""
        return settings.timesteps or num_steps

    def draw_steps(self, n, times, generator):
        """`timesteps` distinct steps per sample in a random order, from those at t <= max_time (all of them when
        `timesteps` is 0)."""
        eligible = (times <= self.settings.max_time + 1e-6).nonzero().flatten()
        count = self.settings.timesteps or len(eligible)
        if not 1 <= count <= len(eligible):
            raise ValueError(
                f"train.{self.name}.max_time={self.settings.max_time:g} leaves {len(eligible)} of the schedule's "
                f"{len(times)} steps (flow times {[round(float(x), 3) for x in times]}), and timesteps={count} are to "
                f"be drawn from them: raise max_time or lower timesteps (0 = all the steps it leaves)"
            )
        return eligible[random_order(n, len(eligible), count, generator)]

    @classmethod
    def reference_note(cls, settings):
        kl = f", kl_coef {settings.kl_coef:g}" if settings.kl_coef > 0 else ""
        sft = f", sft_coef {settings.sft_coef:g}" if settings.sft_coef > 0 else ""
        return True, f"dpo beta {settings.beta:g}{kl}{sft}"

    @classmethod
    def memory_terms(cls, cfg, cfg_rows, true_cfg=None):
        terms = super().memory_terms(cfg, cfg_rows, true_cfg)
        g = cfg.train.dpo.guidance_scale
        batched = cfg_rows > 1 if true_cfg is None else true_cfg
        if g > 1 and batched:  # both passes guided by true CFG (at any rollout scale): the policy's with grad
            rows = terms.rows * 2
            note = terms.rows_note.replace(f"{terms.rows} model rows", f"{rows} model rows")
            terms = replace(terms, rows=rows, rows_note=note.replace("without CFG", f"x 2 (CFG at {g:g})"))
        return replace(terms, unit="pairs")

    def prepare(self, batch, adv, keep, *, epoch, process_index):
        """The pairs of this process's whole groups from their advantages (the configured reward combination;
        within a group they order the samples as the total reward does), samples without a finite reward left
        out. Returns the winners as the samples the loss takes."""
        super().prepare(batch, adv, keep, epoch=epoch, process_index=process_index)
        valid = keep.nonzero().flatten()
        partner = torch.full((len(keep),), -1, dtype=torch.long)
        counts = getattr(batch, "free_counts", None)  # [B, F] the rewards' free-attribute counts, or None
        self.free_shift = None
        if counts is not None and counts.shape[-1] == 0:
            counts = None
        if len(valid):
            order, groups = adv[valid].float(), batch.group_ids[valid]
            if self.settings.pairing == "matched":
                shift, anchor = self.anchor_shift(batch), self.settings.free_anchor
                w, l = core.matched_pairs(order, groups, self.required_counts(counts)[valid], shift, anchor)
            elif self.settings.pairing == "ranked":
                w, l = core.ranked_pairs(order, groups)
            else:
                w, l = core.best_worst_pairs(order, groups)
            partner[valid[w]] = valid[l]
        self.partner, self.pairs = partner, int((partner >= 0).sum())
        self.pair_distance = None  # the pairs' mean L1 distance of their free-attribute counts, when a reward has any
        if counts is not None and self.pairs:
            w = (partner >= 0).nonzero().flatten()
            self.pair_distance = float((counts[w] - counts[partner[w]]).abs().sum(1).mean())
        return partner >= 0

    def anchor_shift(self, batch) -> Tensor | None:
        """free_anchor: d = q_base - q_now [F] over the batch's count columns, the epoch's totals (every process's)
        first added to the base while it sums fewer than free_anchor_epochs epochs; None when free_anchor is 0 or
        no reward counts anything."""
        totals = getattr(batch, "free_count_totals", None)
        if not self.settings.free_anchor or totals is None:
            return None
        names = list(batch.free_count_names)
        totals = totals.double().cpu()
        if self.anchor_epochs < self.settings.free_anchor_epochs:
            for n, v in zip(names, totals.tolist()):
                self.anchor_counts[n] = self.anchor_counts.get(n, 0.0) + v
            self.anchor_epochs += 1
        base = torch.tensor([self.anchor_counts.get(n, 0.0) for n in names], dtype=torch.float64)
        from flowrl.eval.diversity import COUNT_RE  # (here: flowrl.eval imports the config, which imports this)

        attributes = [f"{m['reward']}/{m['attr']}" for m in map(COUNT_RE.match, names)]  # as histograms groups them
        shift = core.attribute_shift(base, totals, attributes)
        self.free_shift = 0.5 * float(shift.abs().sum()) / max(len(set(attributes)), 1)
        return shift

    def state_dict(self):
        state = super().state_dict()
        if self.anchor_epochs:
            state["free_anchor/epochs"] = torch.tensor(float(self.anchor_epochs), dtype=torch.float64)
            for n, v in self.anchor_counts.items():
                state[f"free_anchor/{n}"] = torch.tensor(v, dtype=torch.float64)
        return state

    def load_state_dict(self, state, place=None):
        super().load_state_dict(state, place)
        kept = {k[len("free_anchor/") :]: v for k, v in state.items() if k.startswith("free_anchor/")}
        self.anchor_epochs = int(kept.pop("epochs", torch.tensor(0.0)).item())
        self.anchor_counts = {n: float(v.item()) for n, v in kept.items()}

    def required_counts(self, counts: Tensor | None) -> Tensor:
        """pairing=matched: the batch's free-attribute counts [B, F], which a reward must report."""
        if counts is None:
            raise ValueError(self.no_counts_message(self.name, "no reward of this run reports any"))
        return counts

    @staticmethod
    def no_counts_message(name: str, why: str) -> str:
        """The one line of a matched pairing without a reward that counts (`why`: which rewards, or what ran)."""
        return (
            f"train.{name}.pairing=matched pairs images by what they drew where the prompt left it free, the count "
            f"components a reward reports as '<reward>/free_<attribute>=<value>' (shapes_geneval's free_color=...), "
            f"and {why}; use pairing=ranked or best_worst, or a reward that counts its prompts' free attributes"
        )

    def time_weight(self, t: Tensor) -> Tensor | None:
        """w(t) [N] of flow times `t` [N] under train.dpo.weighting (None: velocity's w = 1)."""
        w = self.settings.weighting
        return (1 - t) ** 2 if w == "noise" else 1 - t if w == "linear" else None

    def row_losses(self, batch, idx, unit, adv):
        """The unit's pair losses [K*b]. A row whose time weighs w(t) = 0 (t = 1, pure noise, under weighting noise
        or linear) is not computed when kl_coef is 0: its inside is 0, so its loss is the constant log 2 whatever
        the model, and its gradient exactly zero. It stays in the loss's mean (the same loss and gradient, 1/T less
        work at T times a pair); the stats are the computed rows'."""
        idx = idx.cpu()
        losers = torch.where(self.partner[idx] >= 0, self.partner[idx], idx)  # a placeholder pass: itself
        rows_w, t, noise = self.inputs(batch, idx, unit)  # the winner's times and noise serve its loser too
        rows_l = losers.repeat(len(unit))
        keys = self.row_keys(idx, unit), self.row_keys(losers, unit, noise_of=idx)
        weight = self.time_weight(t)  # (kl_coef > 0: a penalty at every time, w or not)
        live = None if weight is None or self.settings.kl_coef > 0 else weight.cpu() > 0
        if live is None or live.all() or not live.any():  # (no live row: all computed, for a gradient)
            return self.pair_losses(batch, rows_w, rows_l, t, noise, keys)
        kept = live.nonzero().flatten()
        self.uncomputed_units += len(t) - len(kept)
        part, stats = self.pair_losses(
            batch,
            rows_w[kept],
            rows_l[kept],
            t[kept],
            noise[kept.to(noise.device)],
            tuple([k[i] for i in kept.tolist()] for k in keys),
        )
        loss = torch.full((len(t),), math.log(2.0), dtype=part.dtype, device=part.device)
        return loss.index_put((kept.to(part.device),), part), stats

    def pair_losses(self, batch, rows_w, rows_l, t, noise, keys) -> tuple[Tensor, dict]:
        """core.dpo_loss of the pairs (rows_w[i] over rows_l[i]) [P], noised with `noise` [P, ...] at `t` [P];
        `keys`: the reference cache's keys of the winners' and the losers' rows."""
        both, t2, noise2 = torch.cat([rows_w, rows_l]), torch.cat([t, t]), torch.cat([noise, noise])
        g = self.settings.guidance_scale
        pred = self.policy.flow_prediction(batch, both, t2, noise2, **({"guidance_scale": g} if g > 1 else {}))
        ref = self.reference_velocity(batch, both, t2, noise2, guidance_scale=g, keys=keys[0] + keys[1])
        v_w, v_l = pred.velocity.chunk(2)
        r_w, r_l = ref.chunk(2)
        t_used = pred.t.chunk(2)[0]
        loss, stats = core.dpo_loss(
            v_w,
            v_l,
            r_w,
            r_l,
            self.clean(batch, rows_w),
            self.clean(batch, rows_l),
            noise,
            t_used,
            beta=self.settings.beta,
            weight=self.time_weight(t_used),
            kl_coef=self.settings.kl_coef,
            sft_coef=self.settings.sft_coef,
        )
        stats.pop("num_pairs")
        return loss, stats

    def after_update(self, optimizer_steps):
        if self.settings.reference_decay < 1:
            self.soft_update(self.REFERENCE, self.settings.reference_decay)
        out = {"objective/dpo_pairs": float(self.pairs)}
        if self.pair_distance is not None:
            out["objective/dpo_pair_free_distance"] = self.pair_distance
        if self.free_shift is not None:
            out["objective/dpo_free_shift"] = self.free_shift
        return out

    @classmethod
    def progress(cls, metrics):
        """The pairs trained this epoch."""
        return {"pairs": f"{metrics['objective/dpo_pairs']:.0f}"} if "objective/dpo_pairs" in metrics else {}
