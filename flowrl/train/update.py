"""The update of an epoch: `inner_epochs` passes over the batch in minibatches; each minibatch accumulates the
objective's loss of every unit (in micro-batches whose losses add up to the minibatch's) and takes one optimizer
step. The distributed strategy averages the gradients over the processes in the minibatch's last pass.

The loss of a minibatch is the same whatever the number of processes and micro-batches: each part divides by the
aggregation's normalizer of the whole minibatch (`minibatch_normalizer`). The first minibatch that trains before
any step of the epoch is on-policy: for GRPO its ratio is 1 (`policy/ratio_first`), checked here.
"""

from __future__ import annotations

import math
import warnings

import torch

from flowrl import core
from flowrl.errors import NonFiniteError
from flowrl.seeding import derive_seed

from .optim import lr_lambda

#: |ratio - 1| above this on the first (on-policy) minibatch of an epoch means the recomputed log-probs do not match
#: the recorded ones: a warning, and `policy/ratio_first` shows it.
ON_POLICY_TOL = 1e-4

#: loss stats that are aggregates of the loss's terms: a micro-batch's value is its part of the sum
ADDITIVE_STATS = ("policy_loss", "entropy", "kl", "loss")


def merge_micro_stats(parts: list[dict]) -> dict[str, float]:
    """One unit's stats from its micro-batches' (one dict each): the aggregated terms summed (each micro-batch
    holds its share of the minibatch's sum), *_min / *_max the min / max, the rest (fractions, estimates) averaged."""
    merged = {}
    for k in parts[0]:
        values = [float(p[k]) for p in parts]
        merged[k] = (
            sum(values)
            if k in ADDITIVE_STATS
            else max(values)
            if k.endswith("_max")
            else min(values)
            if k.endswith("_min")
            else sum(values) / len(values)
        )
    return merged


def _reduce(k: str, values: list[float]) -> float:
    """Minibatches' (or units') values of stat `k` as one: max of *_max, min of *_min, else the mean."""
    return max(values) if k.endswith("_max") else min(values) if k.endswith("_min") else sum(values) / len(values)


class Updater:
    """The update's pieces: the objective (its units and their loss), the strategy (gradient sync, clipping, the
    step), the EMA, and the lr schedule by minibatch slot (set before each optimizer step, so that resuming needs no
    scheduler state and a minibatch that takes no step does not delay it)."""

    def __init__(self, cfg, objective, dist, ema, batch_local: int):
        t = cfg.train
        self.cfg, self.objective, self.dist, self.ema = cfg, objective, dist, ema
        self.batch_local = batch_local
        self.minibatch = t.minibatch_size or batch_local
        if batch_local % self.minibatch:
            raise ValueError(f"train.minibatch_size={self.minibatch} must divide the per-process batch {batch_local}")
        self.per_pass = batch_local // self.minibatch  # minibatches (slots) of one pass over the batch
        local = objective.groups_split() if objective.group_batches else None
        if local is not None:
            raise ValueError(
                f"train.objective={objective.name} computes group-level terms on one process, but the per-process "
                f"batch {local} (prompts_per_epoch x group_size / {dist.world} processes) splits groups of "
                f"sample.group_size={cfg.sample.group_size}; make prompts_per_epoch a multiple of the process count"
            )
        self.max_steps = t.epochs * t.inner_epochs * self.per_pass  # the run's slots: the lr schedule's length
        self.lr_factor = lr_lambda(t.warmup_steps, self.max_steps, t.schedule, t.decay_frac)
        self.budget_fraction = 0.0  # train.schedule_over=budget: the share of train.max_minutes spent, per epoch
        self.nonfinite_streak = 0
        #: rollout.async: epochs between the weights that sampled this epoch's batch and the trained ones (0: the
        #: same, and the first minibatch's ratio must be 1)
        self.version_lag = 0

    @property
    def opt(self):
        return self.dist.opt

    def run(self, batch, adv: torch.Tensor, keep: torch.Tensor, epoch: int, state) -> dict:
        """The epoch's update of this process's batch [B] with advantages `adv` [B] and the samples `keep` [B] trains;
        counts optimizer steps in `state`. Returns the update's metrics. A stop signal does not cut it short: the run
        stops after it, at the epoch's end, whose checkpoint a resumed run continues from as the uninterrupted run
        would (a checkpoint of a part of an update would have the resumed run train that part twice)."""
        t = self.cfg.train
        self.objective.uncomputed_units = 0
        keep = self.objective.prepare(batch, adv, keep, epoch=epoch, process_index=self.dist.rank)
        units = self.objective.train_units(batch, t.steps_per_forward)
        n_units = sum(len(u) for u in units)
        sums: dict[str, list] = {}
        first_ratio, trained, stepped, skipped = None, 0, False, 0
        for inner in range(t.inner_epochs):
            self.objective.begin_pass(inner)
            gen = torch.Generator().manual_seed(derive_seed(t.seed, epoch, inner, self.dist.rank, 7))
            perm = self.shuffle(batch, gen)
            for mb_start in range(0, self.batch_local, self.minibatch):
                slot = (epoch * t.inner_epochs + inner) * self.per_pass + mb_start // self.minibatch
                idx = perm[mb_start : mb_start + self.minibatch]
                # samples outside the loss (groups dropped for zero advantage) are masked out of every term,
                # so they are not computed at all: the same loss and gradient, fewer forward passes
                n_slot = len(idx)
                idx = idx[keep[idx]]
                # the loss is a mean over the kept samples; `minibatch` rescales it to a mean over the slot
                norm = len(idx) / n_slot if t.dropped_norm == "minibatch" else 1.0
                self.opt.zero_grad(set_to_none=True)
                if not self.dist.any_process(len(idx) > 0):
                    # nothing to learn from anywhere: no optimizer step (AdamW would move the weights on a zero
                    # gradient, by its momentum and weight decay)
                    continue
                mb_stats, finite = self.minibatch_backward(
                    batch, units, idx, adv, keep, norm, placeholder=perm[mb_start : mb_start + 1]
                )
                trained += len(idx) * n_units
                grad_norm = self.dist.clip_gradients(t.max_grad_norm)
                if not math.isfinite(grad_norm) or self.dist.any_process(not finite):
                    self.skip_nonfinite(epoch, grad_norm)
                    skipped += 1
                    continue
                self.nonfinite_streak = 0
                self.set_lr(slot)
                self.dist.step()
                if self.ema is not None:
                    self.ema.update()
                state.optimizer_steps += 1
                self.objective.after_optimizer_step(state.optimizer_steps)
                # on-policy check: the first minibatch that trained here, if no step has moved the weights before
                if first_ratio is None and "ratio_min" in mb_stats and not stepped:
                    first_ratio = (min(mb_stats["ratio_min"]), max(mb_stats["ratio_max"]))
                stepped = True
                mb_stats["grad_norm"] = [grad_norm]
                for k, v in mb_stats.items():
                    sums.setdefault(k, []).append(_reduce(k, v))
        out = {f"policy/{k}": _reduce(k, v) for k, v in sums.items()}
        if first_ratio is not None:  # None: every group was dropped, nothing was trained this epoch
            out.update(self.on_policy_metrics(first_ratio, epoch, lag=self.version_lag))
        out["policy/trained_units"] = trained - self.objective.uncomputed_units  # steps x samples computed
        out["policy/skipped_nonfinite"] = skipped
        out.update(self.objective.after_update(state.optimizer_steps))
        return out

    @staticmethod
    def on_policy_metrics(first_ratio: tuple[float, float], epoch: int, lag: int = 0) -> dict[str, float]:
        """`policy/ratio_first` (the first minibatch's ratio furthest from 1) and its distance from 1, from the
        minibatch's (min, max) ratio; a warning when it is further than ON_POLICY_TOL and the batch was sampled with
        the trained weights (`lag` 0; rollout.async's batch of lag 1 was sampled with the previous version's, whose
        log-probs it records: its ratio is not 1, and clipping bounds it)."""
        low, high = first_ratio
        dev = max(abs(low - 1), abs(high - 1))
        if dev > ON_POLICY_TOL and lag == 0:
            warnings.warn(
                f"epoch {epoch + 1}: the first minibatch is not on-policy: max |ratio - 1| = {dev:.2e} > "
                f"{ON_POLICY_TOL:g}; recomputed log-probs differ from the rollout's (non-deterministic "
                "kernels, dropout, or a sampler/trainer mismatch)",
                stacklevel=3,
            )
        return {"policy/ratio_first": 1.0 + (dev if high - 1 >= 1 - low else -dev), "policy/ratio_first_dev": dev}

    def skip_nonfinite(self, epoch: int, grad_norm: float) -> None:
        """A minibatch whose loss or gradient is NaN/inf: no optimizer step (the weights stay finite), a warning;
        train.max_nonfinite_steps of them in a row stop the run with NonFiniteError."""
        self.dist.skip_step()
        self.nonfinite_streak += 1
        limit = self.cfg.train.max_nonfinite_steps
        if self.nonfinite_streak >= limit:
            raise NonFiniteError(
                f"epoch {epoch + 1}: the loss or gradient was NaN/inf in {self.nonfinite_streak} minibatches in a "
                f"row (train.max_nonfinite_steps={limit}); no step was taken on them, so the weights and the last "
                f"checkpoint are finite. Check the rewards (reward/* in metrics.jsonl), lower train.lr or set "
                f"train.max_grad_norm, then resume with checkpoint.resume=auto"
            )
        warnings.warn(
            f"epoch {epoch + 1}: non-finite loss or gradient (grad norm {grad_norm}); this minibatch takes no "
            f"optimizer step ({self.nonfinite_streak} in a row of at most {limit})",
            stacklevel=3,
        )

    def set_lr(self, slot: int) -> None:
        """The scheduled lr of minibatch slot `slot` (0-based over the whole run)."""
        for g in self.opt.param_groups:
            g["lr"] = self.cfg.train.lr * self.lr_factor(slot, self.budget_fraction)

    def minibatch_normalizer(
        self, batch, idx: torch.Tensor, unit: list[int], keep: torch.Tensor
    ) -> torch.Tensor | None:
        """What this process's loss of `unit` divides by so that the minibatch's loss is the same whatever the number
        of processes and micro-batches: the aggregation's normalizer of the whole minibatch (over every process:
        the counts summed, e.g. kept samples or tokens), divided by the number of processes (DDP averages the
        gradients). None: one process and one micro-batch, where each loss's own normalizer is that."""
        micro, world = self.cfg.train.micro_batch_size, self.dist.world
        if world == 1 and (not micro or micro >= len(idx)):
            return None
        mask = self.objective.step_mask(batch, idx, unit)
        mask = mask * keep[idx][:, None].to(device=mask.device, dtype=torch.float32)  # [b, K]
        mode, length = self.objective.policy.aggregation, mask.shape[-1]
        if world == 1:
            return core.loss_normalizer(mask, mode, length=length)
        count = core.loss_normalizer(mask, mode, length=length, clamp=False)
        if mode != "seq-mean-token-sum-norm":  # a count: summed over the processes (every process calls this)
            count = self.dist.sum_counts(count).clamp(min=1)
        return count / world

    def shuffle(self, batch, gen: torch.Generator) -> torch.Tensor:
        """The order of an inner epoch's pass over the batch [B]: a random permutation of the samples, or, for an
        objective with group-level terms (`group_batches`), of the groups, each group's samples kept together in
        batch order (so that every minibatch of a multiple of the group size holds whole groups)."""
        if not self.objective.group_batches:
            return torch.randperm(self.batch_local, generator=gen)
        groups = batch.group_ids.cpu().unique()  # sorted
        order = groups[torch.randperm(len(groups), generator=gen)]
        return torch.cat([(batch.group_ids.cpu() == g).nonzero().flatten() for g in order])

    def micro_batches(self, idx: torch.Tensor, batch=None) -> list[torch.Tensor]:
        """The minibatch's samples `idx` in micro-batches of train.micro_batch_size (one when it is 0); for an
        objective with group-level terms, of train.micro_batch_size / sample.group_size whole groups each (`idx`
        holds whole groups, less the samples dropped from the loss)."""
        micro = self.cfg.train.micro_batch_size
        if not len(idx):
            return []
        if not (micro and micro < len(idx)):
            return [idx]
        if not self.objective.group_batches:
            return list(idx.split(micro))
        gids = batch.group_ids.cpu()[idx]
        starts = [0] + [i for i in range(1, len(idx)) if gids[i] != gids[i - 1]]
        per = max(micro // self.cfg.sample.group_size, 1)
        cuts = starts[::per] + [len(idx)]
        return [idx[a:b] for a, b in zip(cuts[:-1], cuts[1:])]

    def minibatch_backward(
        self,
        batch,
        units: list[list[int]],
        idx: torch.Tensor,
        adv: torch.Tensor,
        keep: torch.Tensor,
        norm: float,
        placeholder: torch.Tensor,
    ) -> tuple[dict, bool]:
        """Accumulate the minibatch's gradient: the loss of every unit of steps for the samples `idx`, one
        micro-batch at a time, each weighted by its unit's share of the trained steps (x `norm`). With several
        processes the gradients are averaged only in the last pass (`dist.gradient_sync`); a process whose share is
        empty (all its samples dropped) runs one pass of weight 0 on `placeholder` to take part in that average (as
        many as the busiest process runs, where every pass is a collective: `dist.equal_passes`).
        Returns (stats per unit, whether every loss was finite)."""
        n_units = sum(len(u) for u in units)
        normalizers = [self.minibatch_normalizer(batch, idx, unit, keep) for unit in units]
        work = [
            (u, unit, chunk, normalizers[u]) for u, unit in enumerate(units) for chunk in self.micro_batches(idx, batch)
        ]
        n_real = len(work)
        n_passes = int(self.dist.largest(n_real)) if self.dist.equal_passes else max(n_real, 1)
        work += [(0, units[0], placeholder, None)] * (n_passes - n_real)
        parts: dict[int, list[dict]] = {}
        finite = True
        for k, (u, unit, chunk, normalizer) in enumerate(work):
            with self.dist.gradient_sync(k == len(work) - 1):
                loss, stats = self.objective.unit_loss(batch, chunk, unit, adv, keep, normalizer)
                if k >= n_real:  # zero gradients, but through every trained weight
                    (loss.nan_to_num() * 0.0).backward()
                    continue
                finite = finite and bool(torch.isfinite(loss))
                # each unit's loss is a mean over its steps; weight by its share of all trained steps
                (self.dist.backward_loss(loss) * (len(unit) / n_units * norm)).backward()
            parts.setdefault(u, []).append(stats)
        mb_stats: dict[str, list] = {}
        for unit_parts in parts.values():
            for key, v in merge_micro_stats(unit_parts).items():
                mb_stats.setdefault(key, []).append(v)
        return mb_stats, finite
