"""The training loop: rollout -> reward -> advantage -> per-step GRPO update -> log / eval / checkpoint.

One loop for every backend. What differs between images and text lives in a `Policy` (`flowrl.policy`): how
to roll out, how to recompute recorded steps' log-probs with gradients, and how to get the reference policy
(the adapter switched off). What differs between objectives (GRPO, or DiffusionNFT / AWM / Diffusion-DPO on the
forward process) lives in an `Objective` (`flowrl.objectives`): what the rollout records, the units of the update
and their loss. The math is the core's.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import core, rundir
from .checkpoint import remove_temporary, resolve_resume, set_rng_state, write_checkpoint
from .config import Config, migrate, to_dict, without_other_objectives
from .errors import CheckpointError, Interrupted, NonFiniteError
from .objectives import build_objective
from .policy import full_tensor
from .preflight import preflight
from .seeding import derive_seed, seed_everything
from .diversity import (BaseDistribution, BaseFeatures, distribution_metrics, eval_settings, feature_metrics,
                        group_features, settings_differences,
                        histograms, is_count, prompt_keys)
from .offload import Parked, modules_in, visiting
from .train_utils import (EMA, MetricsLog, Timer, build_optimizer, eval_plan, eval_summary, lr_lambda,
                          read_metrics)

#: |ratio - 1| above this on the first (on-policy) minibatch of an epoch means the recomputed
#: log-probs do not match the recorded ones: a warning, and `policy/ratio_first` shows it.
ON_POLICY_TOL = 1e-4


def build_reward_fns(cfg: Config, kind: str):
    """The configured rewards, built (registered names and plug-ins `module:function` / `file.py:function`)."""
    import rewards

    return [rewards.build(spec.name, dict(spec.kwargs), kind, video_frames=spec.video_frames,
                          video_aggregate=spec.video_aggregate) for spec in cfg.rewards]


def build_feature_encoder(cfg: Config, device: torch.device):
    """The vision backbone of eval.diversity_features (`rewards.features.ImageEncoder`: images -> [N, D]
    L2-normalised float32 features), in float32 on `device`."""
    from rewards.features import ImageEncoder

    return ImageEncoder(cfg.eval.diversity_features, None, device, torch.float32)


def parallel_strategy(cfg: Config, num_processes: int, distributed_type) -> str:
    """How the processes share the training: "deepspeed" (an accelerate config of distributed_type DEEPSPEED:
    accelerate prepares the model and optimizer together), "none" (one process), "fsdp" (train.sharding=fsdp, or an
    accelerate config of distributed_type FSDP: flowrl shards with its own FSDP2 path, not accelerate's plugin) or
    "ddp"."""
    kind = str(distributed_type).rpartition(".")[2]
    if kind == "DEEPSPEED":
        return "deepspeed"
    if num_processes == 1:
        return "none"
    if cfg.train.sharding == "fsdp" or kind == "FSDP":
        return "fsdp"
    return "ddp"


def invalid_scores(scores: torch.Tensor, weights: torch.Tensor, nan_is_missing: bool) -> torch.Tensor:
    """Which samples of scores [N, K] cannot be scored [N] bool: a reward gave +-inf, or NaN where NaN is not
    "does not apply" (`nan_is_missing` False: image rewards always return a number), or no weighted reward
    applies at all (every one with a non-zero weight gave NaN / None)."""
    inf = torch.isinf(scores).any(1)
    nan = torch.isnan(scores)
    weighted = weights != 0
    none_apply = nan[:, weighted].all(1)
    return inf | none_apply | (torch.zeros_like(inf) if nan_is_missing else nan.any(1))


def combine_advantages(cfg: Config, scores: torch.Tensor, group_ids: torch.Tensor, prompts: list[str],
                       tracker: core.PerPromptStatTracker | None, penalty: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages [N] from per-reward scores [N, K] (NaN = does not apply) of the whole (gathered) batch, by the
    configured rule; `penalty` [N] (e.g. the KL-in-reward term) is subtracted from the total reward."""
    t = cfg.train
    weights = torch.tensor([r.weight for r in cfg.rewards], dtype=scores.dtype)
    if t.reward_combine == "gdpo":
        # a reward that does not apply to a sample (NaN) takes its group's mean there: no advantage from it
        filled = scores.clone()
        for k in range(scores.shape[1]):
            col = scores[:, k]
            for g in group_ids.unique():
                rows = (group_ids == g) & col.isnan()
                valid = col[(group_ids == g) & ~col.isnan()]
                filled[rows, k] = valid.mean() if len(valid) else 0.0
        if penalty is not None:
            filled = torch.cat([filled, penalty[:, None].to(filled.dtype)], 1)
            weights = torch.cat([weights, weights.new_tensor([-1.0])])
        adv = core.gdpo_advantages(filled, group_ids, weights=weights)
    else:
        total = (scores * weights).nansum(1)  # a reward that returned None leaves that sample out of it
        if penalty is not None:
            total = total - penalty.to(total.dtype)
        if tracker is not None:
            adv = tracker.update(prompts, total)
        else:
            estimator = core.get_advantage_estimator(t.adv_estimator)
            kwargs = {"scale": t.adv_scale} if t.adv_estimator == "grpo" else {}
            adv = estimator(total, group_ids, **kwargs)
    return adv.clamp(-t.adv_clip_max, t.adv_clip_max)


#: loss stats that are aggregates of the loss's terms: a micro-batch's value is its part of the sum
ADDITIVE_STATS = ("policy_loss", "entropy", "kl", "loss")


def merge_micro_stats(parts: list[dict]) -> dict[str, float]:
    """One unit's stats from its micro-batches' (one dict each): the aggregated terms summed (each micro-batch
    holds its share of the minibatch's sum), *_min / *_max the min / max, the rest (fractions, estimates) averaged."""
    merged = {}
    for k in parts[0]:
        values = [float(p[k]) for p in parts]
        merged[k] = (sum(values) if k in ADDITIVE_STATS else max(values) if k.endswith("_max")
                     else min(values) if k.endswith("_min") else sum(values) / len(values))
    return merged


@dataclass
class State:
    """Counters saved in checkpoints."""

    epochs_done: int = 0
    optimizer_steps: int = 0
    samples_seen: int = 0
    train_wall_seconds: float = 0.0  # the epochs' wall-clock, evals excluded (time/train_wall_minutes)
    train_cpu_seconds: float = 0.0  # this process's CPU time in the epochs (time/train_process_minutes)
    budget_seconds: float = 0.0  # train.max_minutes spent on train.budget_clock when the checkpoint was written


def merge_eval_shares(shares: list[tuple[list, dict[str, torch.Tensor]]]) -> tuple[list, dict[str, torch.Tensor]]:
    """The processes' eval shares [(outputs [n_p], {column: [n_p]})] in process order, as one (outputs [N],
    {column: [N]}). A process whose share of the prompts was empty (fewer prompts than processes) has no rows and
    may lack the reward components' columns; a share with rows that lacks a column is an error naming it."""
    keys = list(dict.fromkeys(k for out, sc in shares if out for k in sc))
    for p, (out, sc) in enumerate(shares):
        if out and set(sc) != set(keys):
            raise RuntimeError(f"eval: process {p}'s scores have the columns {sorted(sc)}, the others {keys}")
    outputs = [o for out, _ in shares for o in out]
    return outputs, {k: torch.cat([sc[k] for out, sc in shares if out]) for k in keys}


def progress_postfix(metrics: dict, objective) -> dict[str, str]:
    """What the progress bar shows after an epoch: the mean reward, and the objective's own fields (GRPO: the first
    minibatch's ratio; DPO: its pairs)."""
    return {"reward": f"{metrics['reward/total_mean']:.3f}", **objective.progress(metrics)}


class Trainer:
    """Holds the pieces the loop needs; `fit()` is the loop."""

    def __init__(self, cfg: Config, accelerator=None):
        from accelerate import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs

        from .policies import build_policy

        # everything that can be checked without the model (prompts, rewards, the model's class and image size,
        # loggers) fails now, before it loads
        self.train_set, self.eval_set = preflight(cfg)
        self.cfg = cfg
        # `accelerate launch` with a DEEPSPEED config: accelerate drops DeepSpeed when told cpu=True, and on the CPU
        # it must be told gloo (else it counts one process)
        deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        self.acc = accelerator or Accelerator(
            cpu=cfg.model.device == "cpu" and not deepspeed,
            # no buffer broadcast on every forward: the rollouts' forward passes run through the wrapper too
            kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)] + (
                [InitProcessGroupKwargs(backend="gloo")]
                if deepspeed and (cfg.model.device == "cpu" or not torch.cuda.is_available()) else []),
            log_with=(["tensorboard"] if cfg.log.tensorboard else []) + (["wandb"] if cfg.log.wandb else []) or None,
            project_dir=cfg.log.run_dir)
        if deepspeed:  # else with ZeRO-3 transformers partitions every model it builds (text encoders, rewards)
            from transformers.integrations import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        self.run_dir = Path(cfg.log.run_dir)
        self.main = self.acc.is_main_process
        if self.main:  # writable, and not another run's (unless resuming it or told to overwrite it)
            rundir.check_writable(self.run_dir)
            rundir.claim(self.run_dir, resume=cfg.checkpoint.resume, overwrite=cfg.log.overwrite)
            remove_temporary(self.run_dir)  # what a kill during a checkpoint write left behind
        self.acc.wait_for_everyone()
        seed_everything(cfg.train.seed)
        device = self.acc.device if cfg.model.device == "auto" else torch.device(cfg.model.device)
        self.device = device
        self.policy = build_policy(cfg, device)
        self.engine = None  # DeepSpeed's (`prepare_deepspeed`)
        # before wrapping or sharding: an objective may add to the model (NFT's "old" adapter)
        self.objective = build_objective(cfg, self.policy, self.acc.num_processes)
        strategy = parallel_strategy(cfg, self.acc.num_processes, self.acc.distributed_type)
        if strategy == "fsdp":  # FSDP2: sharded over the processes
            self.policy.shard()
        elif strategy == "ddp":  # DDP: backward passes average the gradients over the processes
            self.policy.wrap_trained(self.acc.prepare)
        self.params = [p for p in self.policy.trainable_parameters()]
        self.named_params = dict(self.policy.named_trainable_parameters())
        t = cfg.train
        self.world = self.acc.num_processes
        self.batch_total = cfg.sample.prompts_per_epoch * cfg.sample.group_size
        if self.batch_total % self.world:
            raise ValueError(f"the epoch batch {self.batch_total} (prompts_per_epoch x group_size) must split evenly "
                             f"over {self.world} processes")
        self.batch_local = self.batch_total // self.world
        self.minibatch = t.minibatch_size or self.batch_local
        if self.batch_local % self.minibatch:
            raise ValueError(f"train.minibatch_size={self.minibatch} must divide the per-process batch "
                             f"{self.batch_local}")
        self.opt = build_optimizer(self.params, t, sharded=self.policy.sharded or strategy == "deepspeed")
        if strategy == "deepspeed":  # after the optimizer: DeepSpeed prepares both together
            self.policy.wrap_trained(self.prepare_deepspeed)
        # the lr is a function of the minibatch's slot in the run, set before each optimizer step: resuming needs
        # no scheduler state, and a minibatch that takes no step (all its groups dropped) does not delay it
        self.slots_per_epoch = t.inner_epochs * (self.batch_local // self.minibatch)
        self.lr_factor = lr_lambda(t.warmup_steps, t.epochs * self.slots_per_epoch, t.schedule, t.decay_frac)
        self.budget_fraction = 0.0  # train.schedule_over=budget: the share of train.max_minutes spent, per epoch
        self.ema = EMA(self.named_params.items(), t.ema_decay, device="cpu" if t.offload else None
                       ) if t.ema_decay > 0 else None
        self.tracker = core.PerPromptStatTracker(t.stat_buffer_size, t.stat_min_count) if t.per_prompt_stats else None
        self.rewards = build_reward_fns(cfg, self.policy.reward_kind)
        # train.offload: each local reward model in CPU memory, on its device only while it scores
        reward_modules = [modules_in(fn) if t.offload else [] for fn in self.rewards]
        self.parked_rewards = [Parked(modules) if modules else None for modules in reward_modules]
        # eval.diversity_features: the backbone, built at the first eval; a warning about the base's features, once
        self.feature_encoder, self.parked_features, self.warned_base = None, None, set()
        self.state = State()
        self.clock_start, self.budget_before = time.perf_counter(), 0.0  # train.max_minutes' clock (budget_spent)
        self.log = MetricsLog(self.run_dir / "metrics.jsonl", self.acc, enabled=self.main)
        if self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.timer = Timer()
        if cfg.log.tensorboard or cfg.log.wandb:
            self.acc.init_trackers("flowrl", config={k: str(v) for k, v in to_dict(cfg).items()})

    # ------------------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        cfg = self.cfg
        found = resolve_resume(cfg.checkpoint.resume, self.run_dir)
        if found is not None:
            self.load(*found)
        elif cfg.checkpoint.resume == "auto" and self.main and rundir.holds_a_run(self.run_dir):
            raise rundir.nothing_to_resume(self.run_dir)  # its checkpoints are all corrupt
        if self.main:  # the epochs after the checkpoint are redone: their old rows go
            rundir.truncate_logs(self.run_dir, self.state.epochs_done)
        self.acc.wait_for_everyone()
        with self.stop_on_signals():
            return self._fit()

    def _fit(self) -> dict:
        cfg = self.cfg
        last = {}
        if cfg.eval.before and self.state.epochs_done == 0 and cfg.train.epochs > 0:
            self.log.log(self.evaluate(tag="epoch000000"), step=0)
        # the time budget and the time metrics go on from a checkpoint's: a resumed run trains what is left
        self.clock_start, self.budget_before = time.perf_counter(), self.state.budget_seconds
        spent = self.budget_spent
        first = self.state.epochs_done
        if cfg.train.max_minutes and first and self.any_process(spent() >= 60 * cfg.train.max_minutes):
            if self.main:
                print(f"train.max_minutes={cfg.train.max_minutes:g} was spent ({spent() / 60:.2f} min on the "
                      f"{cfg.train.budget_clock} clock) after {first} epochs: nothing left to train (raise "
                      f"train.max_minutes to train on)")
            first = cfg.train.epochs
        bar = tqdm(range(first, cfg.train.epochs), desc="epochs", disable=not (
            self.main and cfg.log.progress), initial=self.state.epochs_done, total=cfg.train.epochs)
        for epoch in bar:
            if cfg.train.schedule_over == "budget":  # the lr's position in a run that ends on its time budget
                self.budget_fraction = self.largest_over_processes(spent() / (60 * cfg.train.max_minutes))
            t0, cpu0 = time.perf_counter(), time.process_time()
            with self.timer("rollout"):
                batch = self.rollout(epoch)
            with self.timer("reward"):
                scores, components = self.score(batch, epoch)
            self.stop_if_asked(epoch, mid_epoch=False)  # nothing of this epoch has changed the weights yet
            metrics = self.reward_metrics(scores, components)
            metrics.update(self.reward_logs())
            extra = self.policy.pop_reward_extra()  # columns the rewards logged with log_extra (TRL's reward API)
            with self.timer("advantage"):
                adv, keep, invalid = self.advantages(batch, scores, epoch)
            metrics.update(adv_metrics(adv, keep))
            metrics["reward/nonfinite_count"] = invalid
            if cfg.log.completions_every and epoch % cfg.log.completions_every == 0:
                self.log_outputs(batch, scores, adv, epoch, extra)
            with self.timer("train"):
                metrics.update(self.update(batch, adv, keep, epoch))
            self.state.epochs_done = epoch + 1
            self.state.samples_seen += self.batch_total
            seconds = time.perf_counter() - t0
            self.state.train_wall_seconds += seconds
            self.state.train_cpu_seconds += time.process_time() - cpu0
            metrics.update({f"time/{k}": v for k, v in self.timer.pop().items()})
            metrics["time/train_wall_minutes"] = self.state.train_wall_seconds / 60
            metrics["time/train_process_minutes"] = self.state.train_cpu_seconds / 60
            metrics["perf/samples_per_s"] = self.batch_total / seconds
            metrics["perf/trained_steps_x_samples_per_s"] = metrics["policy/trained_units"] / seconds
            metrics["lr"] = self.opt.param_groups[0]["lr"]
            # train.max_minutes: the epoch that reaches the budget is the last (every process stops together)
            out_of_time = bool(cfg.train.max_minutes) and self.any_process(spent() >= 60 * cfg.train.max_minutes)
            if cfg.eval.every and (epoch + 1) % cfg.eval.every == 0 and epoch + 1 < cfg.train.epochs:
                metrics.update(self.evaluate(tag=f"epoch{epoch + 1:06d}"))
            if (epoch + 1) % cfg.log.every == 0 or epoch + 1 == cfg.train.epochs or out_of_time:
                self.log.log(metrics, step=epoch + 1)
            if cfg.checkpoint.every and (epoch + 1) % cfg.checkpoint.every == 0 and epoch + 1 < cfg.train.epochs:
                self.save()
            bar.set_postfix(progress_postfix(metrics, self.objective))
            last = metrics
            self.stop_if_asked(epoch + 1, mid_epoch=False)
            if out_of_time:
                if self.main:
                    print(f"train.max_minutes={cfg.train.max_minutes:g} ({cfg.train.budget_clock} clock) reached "
                          f"after {epoch + 1} epochs: the final eval and checkpoint follow")
                break
        if last:  # some epoch ran in this call (a resume of a finished run does nothing)
            final = self.evaluate(tag="final")
            self.log.log({**final, "final": True}, step=self.state.epochs_done)
            last.update(final)
            self.save()
            if self.main:
                from .report import plot_curves, result_keys, write_before_after

                rows = read_metrics(self.run_dir / "metrics.jsonl")
                headline = next(iter(result_keys(rows, cfg.rewards[0].name, cfg.eval.group_by)), None)
                plot_curves(self.run_dir, title=f"{cfg.model.path}: {headline}" if headline else None)
                if cfg.eval.before:  # else an eval-epoch000000.png here would be an earlier run's
                    write_before_after(self.run_dir, rows, headline)
        if self.world > 1 and not self.policy.sharded:  # (sharded weights differ by design)
            last["dist/replica_max_abs_diff"] = self.replica_divergence()
            self.log.log({"dist/replica_max_abs_diff": last["dist/replica_max_abs_diff"]}, step=self.state.epochs_done)
        self.acc.wait_for_everyone()
        if cfg.log.tensorboard or cfg.log.wandb:
            self.acc.end_training()
        return last

    # ------------------------------------------------------------------------------ signals

    @contextlib.contextmanager
    def stop_on_signals(self):
        """SIGINT / SIGTERM ask the run to stop at the next safe point (after the current minibatch, or before an
        epoch's update): it writes a checkpoint and raises Interrupted. A second SIGINT stops at once."""
        self.stop_signal = None
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return

        def ask(signum, frame):
            if self.stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.stop_signal = signum
            if self.main:
                print(f"\nflowrl: {signal.Signals(signum).name} received: stopping after the current minibatch and "
                      "writing a checkpoint (Ctrl-C again stops at once, losing the work since the last checkpoint)",
                      flush=True)

        previous = {sig: signal.signal(sig, ask) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop_if_asked(self, epoch: int, *, mid_epoch: bool) -> None:
        """At a safe point: when a stop signal arrived (on any process), write a checkpoint and raise Interrupted.
        `epoch`: the epoch in progress (mid_epoch) or the number of epochs done."""
        signum = getattr(self, "stop_signal", None)
        if not self.any_process(signum is not None):
            return
        signum = signum or signal.SIGTERM
        path = self.save()
        what = (f"during epoch {epoch + 1} (its finished minibatches are in the weights; the epoch restarts on resume)"
                if mid_epoch else f"after {self.state.epochs_done} epochs")
        raise Interrupted(f"stopped by {signal.Signals(signum).name} {what}; checkpoint {path or self.run_dir}. "
                          f"Resume with checkpoint.resume=auto (same config and log.run_dir={self.run_dir})", signum)

    def replica_divergence(self) -> float:
        """Max |w_rank - w_rank0| over the trained weights of all processes (0 when they are in sync)."""
        flat = torch.cat([p.detach().float().reshape(-1) for p in self.params]).to(self.acc.device)
        everyone = self.acc.gather(flat[None]).cpu()                                          # [world, P]
        return float((everyone - everyone[0:1]).abs().max())

    # ------------------------------------------------------------------------------ the phases

    def rollout(self, epoch: int):
        """This process's slice of the epoch's samples: P prompts x G, laid out prompt-major and cut into
        `world` contiguous slices (so a group may span two processes)."""
        cfg = self.cfg
        prompts, meta = self.train_set.draw(cfg.sample.prompts_per_epoch, epoch, cfg.train.seed,
                                             cfg.data.balance_by)
        G = cfg.sample.group_size
        start = self.acc.process_index * self.batch_local
        gids = [i // G for i in range(start, start + self.batch_local)]
        gen = torch.Generator().manual_seed(derive_seed(cfg.train.seed, epoch, self.acc.process_index))
        batch = self.objective.rollout([prompts[g] for g in gids], [meta[g] for g in gids], epoch=epoch, generator=gen)
        batch.group_ids = torch.tensor(gids)
        batch.epoch_prompts = prompts
        return batch

    def score(self, batch, epoch: int = 0) -> tuple[torch.Tensor, dict]:
        """Per-reward scores [B_local, K] and extra components, from this process's outputs."""
        state = self.policy.reward_state  # what TRL-style rewards see as `trainer_state`
        state.global_step, state.epoch = self.state.optimizer_steps, float(epoch)
        state.max_steps = self.cfg.train.epochs * self.slots_per_epoch
        columns = {k: [m.get(k) for m in batch.metadata] for k in {k for m in batch.metadata for k in m}}
        scores, components = [], {}
        for spec, fn, parked in zip(self.cfg.rewards, self.rewards, self.parked_rewards):
            with visiting(parked):
                s = self.policy.call_reward(fn, batch, columns)
            scores.append(s)
            for name, v in (getattr(fn, "last_components", None) or {}).items():
                components[f"{spec.name}/{name}"] = torch.as_tensor(v, dtype=torch.float32).reshape(-1)
        return torch.stack(scores, 1), components

    def advantages(self, batch, scores: torch.Tensor, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Advantages of this process's samples from the whole batch's rewards, which samples to train, and how many
        samples of the batch had a non-finite reward (left out of the advantages and the loss)."""
        all_scores = self.gather(scores)
        all_gids = self.gather(batch.group_ids)
        weights = torch.tensor([r.weight for r in self.cfg.rewards])
        invalid = invalid_scores(all_scores, weights, nan_is_missing=self.policy.reward_kind == "text")
        valid = ~invalid
        n_bad = int(invalid.sum())
        if n_bad:
            bad_rewards = [r.name for k, r in enumerate(self.cfg.rewards)
                           if not torch.isfinite(all_scores[invalid, k]).all()]
            warnings.warn(f"epoch {epoch}: {n_bad} of {len(all_scores)} samples have a non-finite reward "
                          f"({', '.join(bad_rewards)}: NaN or inf); they are left out of the advantages and the loss",
                          stacklevel=2)
        prompts = [batch.epoch_prompts[g] for g in all_gids[valid].tolist()]
        penalty = self.policy.reward_penalty(batch)
        penalty = self.gather(penalty).double()[valid] if penalty is not None else None
        adv_all = torch.zeros(len(all_scores), dtype=torch.float32)
        if valid.any():
            scored = all_scores.double()[valid].masked_fill(torch.isinf(all_scores[valid]), float("nan"))
            adv_all[valid] = combine_advantages(self.cfg, scored, all_gids[valid], prompts, self.tracker,
                                                penalty).float()
        keep_all = valid.clone()
        if self.cfg.train.drop_zero_adv_groups:
            nonzero = torch.zeros(int(all_gids.max()) + 1, dtype=torch.bool).index_put_(
                (all_gids,), adv_all != 0, accumulate=True)
            keep_all &= nonzero[all_gids]
        start = self.acc.process_index * self.batch_local
        sl = slice(start, start + self.batch_local)
        return adv_all[sl], keep_all[sl], n_bad

    def update(self, batch, adv: torch.Tensor, keep: torch.Tensor, epoch: int) -> dict:
        """`inner_epochs` passes over the batch in minibatches; each minibatch accumulates the loss of every
        trained step (in units of `steps_per_forward`) and takes one optimizer step."""
        t = self.cfg.train
        keep = self.objective.prepare(batch, adv, keep, epoch=epoch, process_index=self.acc.process_index)
        units = self.objective.train_units(batch, t.steps_per_forward)
        n_units = sum(len(u) for u in units)
        sums: dict[str, float] = {}
        first_ratio, trained, stepped, skipped = None, 0, False, 0
        for inner in range(t.inner_epochs):
            gen = torch.Generator().manual_seed(derive_seed(t.seed, epoch, inner, self.acc.process_index, 7))
            perm = torch.randperm(self.batch_local, generator=gen)
            per_pass = self.batch_local // self.minibatch
            for mb_start in range(0, self.batch_local, self.minibatch):
                slot = (epoch * t.inner_epochs + inner) * per_pass + mb_start // self.minibatch
                idx = perm[mb_start: mb_start + self.minibatch]
                # samples outside the loss (groups dropped for zero advantage) are masked out of every term,
                # so they are not computed at all: the same loss and gradient, fewer forward passes
                n_slot = len(idx)
                idx = idx[keep[idx]]
                # the loss is a mean over the kept samples; `minibatch` rescales it to a mean over the slot
                norm = len(idx) / n_slot if t.dropped_norm == "minibatch" else 1.0
                self.opt.zero_grad(set_to_none=True)
                if not self.any_process(len(idx) > 0):
                    # nothing to learn from anywhere: no optimizer step (AdamW would move the weights on a zero
                    # gradient, by its momentum and weight decay)
                    self.stop_if_asked(epoch, mid_epoch=stepped)
                    continue
                mb_stats, finite = self.minibatch_backward(batch, units, idx, adv, keep, norm,
                                                           placeholder=perm[mb_start: mb_start + 1])
                trained += len(idx) * n_units
                grad_norm = self.clip_gradients()
                if not math.isfinite(grad_norm) or self.any_process(not finite):
                    self.skip_nonfinite(epoch, grad_norm)
                    skipped += 1
                    self.stop_if_asked(epoch, mid_epoch=stepped)
                    continue
                self.nonfinite_streak = 0
                self.set_lr(slot)
                (self.engine or self.opt).step()  # DeepSpeed's clips to train.max_grad_norm itself
                if self.ema is not None:
                    self.ema.update()
                self.state.optimizer_steps += 1
                self.objective.after_optimizer_step(self.state.optimizer_steps)
                # on-policy check: the first minibatch that trained here, if no step has moved the weights before
                if first_ratio is None and "ratio_min" in mb_stats and not stepped:
                    first_ratio = (min(mb_stats["ratio_min"]), max(mb_stats["ratio_max"]))
                stepped = True
                mb_stats["grad_norm"] = [grad_norm]
                for k, v in mb_stats.items():
                    agg = max(v) if k.endswith("_max") else min(v) if k.endswith("_min") else sum(v) / len(v)
                    sums.setdefault(k, []).append(agg)
                self.stop_if_asked(epoch, mid_epoch=True)
        out = {f"policy/{k}": (max(v) if k.endswith("_max") else min(v) if k.endswith("_min") else sum(v) / len(v))
               for k, v in sums.items()}
        if first_ratio is not None:  # None: every group was dropped, nothing was trained this epoch
            dev = max(abs(first_ratio[0] - 1), abs(first_ratio[1] - 1))
            out["policy/ratio_first"] = 1.0 + (dev if first_ratio[1] - 1 >= 1 - first_ratio[0] else -dev)
            out["policy/ratio_first_dev"] = dev
            if dev > ON_POLICY_TOL:
                warnings.warn(f"epoch {epoch}: the first minibatch is not on-policy: max |ratio - 1| = {dev:.2e} > "
                              f"{ON_POLICY_TOL:g}; recomputed log-probs differ from the rollout's (non-deterministic "
                              "kernels, dropout, or a sampler/trainer mismatch)", stacklevel=2)
        out["policy/trained_units"] = trained  # steps x samples whose loss was computed
        out["policy/skipped_nonfinite"] = skipped
        out.update(self.objective.after_update(self.state.optimizer_steps))
        return out

    def skip_nonfinite(self, epoch: int, grad_norm: float) -> None:
        """A minibatch whose loss or gradient is NaN/inf: no optimizer step (the weights stay finite), a warning;
        train.max_nonfinite_steps of them in a row stop the run with NonFiniteError."""
        if self.engine is not None:
            self.engine.step()  # DeepSpeed takes no step on a non-finite gradient (see minibatch_backward): drops it
        self.opt.zero_grad(set_to_none=True)
        self.nonfinite_streak = getattr(self, "nonfinite_streak", 0) + 1
        limit = self.cfg.train.max_nonfinite_steps
        if self.nonfinite_streak >= limit:
            raise NonFiniteError(
                f"epoch {epoch}: the loss or gradient was NaN/inf in {self.nonfinite_streak} minibatches in a row "
                f"(train.max_nonfinite_steps={limit}); no step was taken on them, so the weights and the last "
                f"checkpoint are finite. Check the rewards (reward/* in metrics.jsonl), lower train.lr or set "
                f"train.max_grad_norm, then resume with checkpoint.resume=auto")
        warnings.warn(f"epoch {epoch}: non-finite loss or gradient (grad norm {grad_norm}); this minibatch takes no "
                      f"optimizer step ({self.nonfinite_streak} in a row of at most {limit})", stacklevel=2)

    def unit_forward(self, batch, idx: torch.Tensor, unit: list[int], adv: torch.Tensor, keep: torch.Tensor,
                     normalizer: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """The loss (with grad) and stats of `unit` for samples `idx`: the objective's."""
        return self.objective.unit_loss(batch, idx, unit, adv, keep, normalizer)

    def minibatch_normalizer(self, batch, idx: torch.Tensor, unit: list[int], keep: torch.Tensor
                             ) -> torch.Tensor | None:
        """What this process's loss of `unit` divides by so that the minibatch's loss is the same whatever the number
        of processes and micro-batches: the aggregation's normalizer of the whole minibatch (over every process:
        the counts summed, e.g. kept samples or tokens), divided by the number of processes (DDP averages the
        gradients). None: one process and one micro-batch, where each loss's own normalizer is that."""
        micro = self.cfg.train.micro_batch_size
        if self.world == 1 and (not micro or micro >= len(idx)):
            return None
        mask = self.objective.step_mask(batch, idx, unit) * keep[idx][:, None].to(torch.float32)     # [b, K]
        mode, length = self.policy.aggregation, mask.shape[-1]
        if self.world == 1:
            return core.loss_normalizer(mask, mode, length=length)
        count = core.loss_normalizer(mask, mode, length=length, clamp=False)
        if mode != "seq-mean-token-sum-norm":  # a count: summed over the processes (every process calls this)
            count = self.acc.reduce(count.reshape(1).to(self.acc.device), reduction="sum").cpu()[0].clamp(min=1)
        return count / self.world

    def micro_batches(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """The minibatch's samples `idx` in micro-batches of train.micro_batch_size (one when it is 0)."""
        micro = self.cfg.train.micro_batch_size
        if not len(idx):
            return []
        return list(idx.split(micro)) if micro and micro < len(idx) else [idx]

    def minibatch_backward(self, batch, units: list[list[int]], idx: torch.Tensor, adv: torch.Tensor,
                           keep: torch.Tensor, norm: float, placeholder: torch.Tensor) -> tuple[dict, bool]:
        """Accumulate the minibatch's gradient: the loss of every unit of steps for the samples `idx`, one
        micro-batch at a time, each weighted by its unit's share of the trained steps (x `norm`). With several
        processes the passes run through the DDP-wrapped model inside accelerate's `no_sync`, but for the last,
        whose backward averages the accumulated gradients over the processes; a process whose share is empty
        (all its samples dropped) runs one pass of weight 0 on `placeholder` to take part in that average (when
        sharded, as many as the busiest process runs).
        Returns (stats per unit, whether every loss was finite)."""
        n_units = sum(len(u) for u in units)
        normalizers = [self.minibatch_normalizer(batch, idx, unit, keep) for unit in units]
        work = [(u, unit, chunk, normalizers[u]) for u, unit in enumerate(units) for chunk in self.micro_batches(idx)]
        n_real = len(work)
        # every process makes the same number of passes when sharded (each forward gathers the weights: a
        # collective), else at least one (its backward takes part in the gradient average): placeholders of weight 0
        n_passes = self.max_over_processes(n_real) if self.policy.sharded or self.engine else max(n_real, 1)
        work += [(0, units[0], placeholder, None)] * (n_passes - n_real)
        parts: dict[int, list[dict]] = {}
        finite = True
        for k, (u, unit, chunk, normalizer) in enumerate(work):
            last = k == len(work) - 1
            with self.gradient_sync(last):
                loss, stats = self.unit_forward(batch, chunk, unit, adv, keep, normalizer)
                if k >= n_real:  # zero gradients, but through every trained weight
                    (loss.nan_to_num() * 0.0).backward()
                    continue
                finite = finite and bool(torch.isfinite(loss))
                if self.engine is not None and not torch.isfinite(loss):
                    loss = loss * float("nan")  # a NaN gradient everywhere: DeepSpeed's step skips it on every process
                # each unit's loss is a mean over its steps; weight by its share of all trained steps
                (loss * (len(unit) / n_units * norm)).backward()
            parts.setdefault(u, []).append(stats)
        mb_stats: dict[str, list] = {}
        for unit_parts in parts.values():
            for key, v in merge_micro_stats(unit_parts).items():
                mb_stats.setdefault(key, []).append(v)
        return mb_stats, finite

    def prepare_deepspeed(self, module: torch.nn.Module) -> torch.nn.Module:
        """DeepSpeed ZeRO (`accelerate launch` with a DEEPSPEED config): the trained module and the optimizer become
        its engine, which partitions the optimizer state (stage 1), the gradients (2) and the weights (3) over the
        processes. flowrl accumulates a minibatch's passes itself (the last is the accumulation boundary) and the
        engine's step clips to train.max_grad_norm; the precision stays flowrl's (model.dtype, float32 trained
        weights): DeepSpeed's bf16 / fp16 would cast the trained weights too."""
        ds = self.acc.state.deepspeed_plugin.deepspeed_config
        if any(ds.get(k, {}).get("enabled") in (True, "auto") for k in ("bf16", "fp16")):
            raise ValueError("DeepSpeed's bf16 / fp16 would cast flowrl's float32 trained weights: set "
                             "mixed_precision: \"no\" in the accelerate config (model.dtype=bfloat16 keeps the frozen "
                             "weights in bf16)")
        if self.cfg.train.optimizer != "adamw":
            raise ValueError(f"train.optimizer={self.cfg.train.optimizer} under DeepSpeed: its ZeRO optimizer wraps "
                             "torch's AdamW; use train.optimizer=adamw (ZeRO already partitions the states)")
        if any(p.dtype != torch.float32 for p in self.params):
            raise ValueError("full fine-tuning of bf16/fp16 weights under DeepSpeed would keep their optimizer states "
                             "in that dtype: use train.sharding=fsdp (float32 master shards) or model.dtype=float32")
        ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                  gradient_clipping=max(self.cfg.train.max_grad_norm, 0.0))
        if ds.get("zero_optimization", {}).get("stage") == 3:  # the weights partitioned, as FSDP's (`sharded`)
            if not hasattr(self.policy, "shard") or self.cfg.train.ema_decay > 0:
                raise ValueError("DeepSpeed ZeRO-3 trains image models without train.ema_decay (as train.sharding="
                                 "fsdp); use ZeRO-2 (configs/accelerate/deepspeed_zero2.yaml)")
            self.policy.sharded = True
        self.engine, _ = self.acc.prepare(module, self.opt)
        return self.engine

    def gathered(self, modifier_rank: int | None = None):
        """A context in which ZeRO-3's partitioned trained weights are whole (a collective; `modifier_rank`'s changes
        are kept); else nothing."""
        if self.engine is None or not self.engine.zero_optimization_partition_weights():
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(self.params, modifier_rank=modifier_rank)

    def set_lr(self, slot: int) -> None:
        """The scheduled lr of minibatch slot `slot` (0-based over the whole run)."""
        for g in self.opt.param_groups:
            g["lr"] = self.cfg.train.lr * self.lr_factor(slot, self.budget_fraction)

    def gradient_sync(self, sync: bool):
        """A context for one forward/backward pass of a minibatch: with several processes, gradients are averaged
        (DDP) or reduce-scattered (FSDP) only in the pass with `sync`, the minibatch's last (accelerate's no_sync
        for DDP; FSDP2's set_requires_gradient_sync; DeepSpeed's accumulation boundary)."""
        if self.engine is not None:
            self.engine.set_gradient_accumulation_boundary(sync)
            return contextlib.nullcontext()
        if self.world == 1:
            return contextlib.nullcontext()
        if self.policy.sharded:
            self.policy.trained_module.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if sync else self.acc.no_sync(self.policy.trained_module)

    def clip_gradients(self) -> float:
        """Clip the (process-averaged: DDP did it in the last backward) gradient by global norm; returns the norm."""
        if self.engine is not None:  # the norm of ZeRO's partitioned gradient; its step does the clipping
            from deepspeed.runtime.utils import combine_grad_norm_groups

            zero = self.engine.optimizer
            norm = (zero.scaled_global_norm() if hasattr(zero, "scaled_global_norm")
                    else combine_grad_norm_groups(zero._get_norm_groups()))
            return float(norm)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        max_norm = self.cfg.train.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm > 0 else float("inf"))
        return float(full_tensor(norm))

    def max_over_processes(self, n: int) -> int:
        """The largest `n` of all processes (a collective: every process must call it)."""
        if self.world == 1:
            return n
        return int(self.acc.reduce(torch.tensor([float(n)], device=self.acc.device), reduction="max").item())

    def any_process(self, flag: bool) -> bool:
        """True when `flag` holds on some process (a collective: every process must call it)."""
        if self.world == 1:
            return flag
        return bool(self.acc.reduce(torch.tensor([float(flag)]), reduction="sum").item() > 0)

    def largest_over_processes(self, value: float) -> float:
        """The largest of the processes' `value`s (a collective: every process must call it)."""
        if self.world == 1:
            return value
        return float(self.gather(torch.tensor([float(value)], dtype=torch.float64)).max())

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        return self.acc.gather(x.to(self.acc.device)).cpu()

    def log_outputs(self, batch, scores: torch.Tensor, adv: torch.Tensor, epoch: int, extra: dict | None = None
                    ) -> None:
        """Append this process's (prompt, completion, rewards, advantage) rows to completions.jsonl (main
        process; text backends)."""
        outputs = self.policy.describe_outputs(batch)
        if outputs is None or not self.main:
            return
        import json

        names = [r.name for r in self.cfg.rewards]
        with open(self.run_dir / "completions.jsonl", "a") as f:
            for i, (p, c) in enumerate(zip(batch.prompts, outputs)):
                row = {"epoch": epoch, "prompt": p, "completion": c, "advantage": round(float(adv[i]), 5),
                       "rewards": {n: (None if not torch.isfinite(scores[i, k]) else float(scores[i, k]))
                                   for k, n in enumerate(names)}}
                row.update({col: values[i] for col, values in (extra or {}).items() if i < len(values)})
                f.write(json.dumps(row, default=str) + "\n")

    def reward_logs(self) -> dict[str, float]:
        """What the rewards logged with `log_metric` this epoch (TRL's reward API), averaged over processes."""
        logs = self.policy.pop_reward_logs()
        if self.world > 1:
            from accelerate.utils import gather_object

            everyone = gather_object([logs])
            keys = sorted({k for d in everyone for k in d})
            logs = {k: sum(d[k] for d in everyone if k in d) / sum(k in d for d in everyone) for k in keys}
        return logs

    def reward_metrics(self, scores: torch.Tensor, components: dict) -> dict:
        all_scores = self.gather(scores)
        m = {}
        for k, spec in enumerate(self.cfg.rewards):
            col = all_scores[:, k]
            col = col[torch.isfinite(col)]  # NaN: does not apply (or invalid: counted in reward/nonfinite_count)
            m[f"reward/{spec.name}_mean"] = col.mean().item() if len(col) else float("nan")
            m[f"reward/{spec.name}_std"] = col.std().item() if len(col) > 1 else 0.0
            m[f"reward/{spec.name}_applies"] = len(col) / len(all_scores)
        scored = ~torch.isinf(all_scores).any(1)
        total = (all_scores[scored] * torch.tensor([r.weight for r in self.cfg.rewards])).nansum(1)
        m["reward/total_mean"] = total.mean().item() if len(total) else float("nan")
        counts = {}
        for name, v in components.items():
            if is_count(name):  # free-attribute counts: a distribution, not a mean
                counts[name] = self.gather(v)
            else:
                m[f"reward/{name}_mean"] = self.gather(v).mean().item()
        m.update(distribution_metrics(histograms(counts), prefix="reward/diversity/"))
        return m

    # ------------------------------------------------------------------------------ eval, checkpoints

    @torch.no_grad()
    def evaluate(self, tag: str) -> dict:
        """Deterministic sampling on held-out prompts with the eval settings (EMA weights when on). Every process
        samples a contiguous share of the prompts; the main process gathers the outputs and scores, logs them
        and draws the grid."""
        cfg = self.cfg
        prompts, meta, eval_cfg = eval_plan(self.eval_set, cfg.eval)
        # sharded weights: every forward pass is a collective, so every process samples every prompt
        world = 1 if self.policy.sharded else self.world
        share = -(-len(prompts) // world)
        rank = 0 if world == 1 else self.acc.process_index
        part = slice(min(len(prompts), rank * share), min(len(prompts), (rank + 1) * share))
        ctx = self.ema.applied() if self.ema is not None else contextlib.nullcontext()
        with ctx, contextlib.ExitStack() as rewards_on_device:
            for parked in self.parked_rewards:
                rewards_on_device.enter_context(visiting(parked))
            outputs, per_reward, components = self.policy.evaluate_prompts(prompts, meta, self.rewards, eval_cfg,
                                                                           part=part)
        scores = {spec.name: vals for spec, vals in zip(cfg.rewards, per_reward)}
        scores.update(components)
        if world > 1:
            from accelerate.utils import gather_object

            outputs, scores = merge_eval_shares(gather_object([(outputs, {k: v.cpu() for k, v in scores.items()})]))
        results = {}
        if self.main:
            # the base model's distribution of what prompts leave free (colours...): the first eval's, kept
            settings = eval_settings(prompts, meta, eval_cfg, cfg.sample)
            base_file = BaseDistribution(self.run_dir)
            base = base_file.load()
            hists = histograms(scores)
            if base is None and hists and self.state.optimizer_steps == 0:
                base_file.save(hists, settings)
                base = hists
            elif base is not None and self.unlike_base(base_file, settings):
                base = None
            results.update(eval_summary(scores, meta, cfg.eval.group_by, base))
            if cfg.eval.diversity_features:
                results.update(self.feature_diversity(outputs, prompt_keys(prompts, meta, eval_cfg.images_per_prompt),
                                                      settings))
            if cfg.eval.grid:
                headline = scores[cfg.rewards[0].name]
                path = self.policy.save_eval_outputs(outputs, prompts, self.run_dir / f"eval-{tag}", scores=headline)
                self.log_eval_images(path, tag)
        self.acc.wait_for_everyone()
        return results

    def feature_diversity(self, images: list, keys: list[str], settings: dict) -> dict[str, float]:
        """`flowrl.diversity.feature_metrics` of the eval images [N] (main process), grouped by their prompts' keys
        [N], against the base model's features: those of the first eval before any optimizer step, written then to
        the run directory (with the eval's `settings`) and read from there by the later evals (and after a resume).
        The backbone loads at the first call (train.offload: in CPU memory, on the device only while it embeds)."""
        backbone = self.cfg.eval.diversity_features
        if self.feature_encoder is None:
            self.feature_encoder = build_feature_encoder(self.cfg, self.device)
            if self.cfg.train.offload:
                self.parked_features = Parked([self.feature_encoder.model])
        with visiting(self.parked_features):
            groups = group_features(self.feature_encoder(images), keys)
        store = BaseFeatures(self.run_dir)
        found = store.load()
        base = None
        if found is not None and found[1] == backbone:
            base = None if self.unlike_base(store, settings) else found[0]
        elif self.state.optimizer_steps == 0:  # this model is the base model: its features are the base's
            store.save(groups, backbone, settings)
            base = groups
        elif found is not None and store.path not in self.warned_base:
            self.warned_base.add(store.path)
            warnings.warn(f"{store.path} holds the base model's features by {found[1]!r}, not by "
                          f"eval.diversity_features={backbone}: the comparisons with the base model are left out",
                          stacklevel=2)
        return feature_metrics(groups, base)

    def unlike_base(self, store, settings: dict) -> bool:
        """Whether a stored base-model eval (`BaseDistribution` or `BaseFeatures` in the run directory) was sampled
        with other eval settings than `settings` (e.g. a run resumed with another eval.num_steps or eval prompts):
        its images do not pair with this eval's, so the comparisons with it are left out (warned once per file)."""
        differences = settings_differences(store.settings(), settings)
        if differences and store.path not in self.warned_base:
            self.warned_base.add(store.path)
            warnings.warn(f"{store.path} holds the base model's eval with other settings ({'; '.join(differences)}): "
                          f"its comparisons with the base model (*_from_base) are left out; resume with the eval "
                          f"settings the run started with to compare", stacklevel=3)
        return bool(differences)

    def log_eval_images(self, path: Path | None, tag: str) -> None:
        """The eval grid to TensorBoard / W&B when those loggers are on."""
        if path is None or not (self.cfg.log.tensorboard or self.cfg.log.wandb) or not self.acc.trackers:
            return
        import numpy as np
        from PIL import Image

        grid = np.asarray(Image.open(path).convert("RGB"))
        step = self.state.epochs_done
        for tracker in self.acc.trackers:
            if tracker.name == "tensorboard":
                tracker.writer.add_image(f"eval/{tag}", grid, step, dataformats="HWC")
            elif tracker.name == "wandb":
                import wandb

                tracker.log({f"eval/{tag}": wandb.Image(grid)}, step=step)

    def budget_spent(self) -> float:
        """Seconds of train.max_minutes spent, on train.budget_clock, since the run began (across resumes):
        `process` = this process's CPU time in the epochs; `wall` = the wall-clock of the calls of fit, evals
        included."""
        if self.cfg.train.budget_clock == "process":
            return self.state.train_cpu_seconds
        return self.budget_before + time.perf_counter() - self.clock_start

    def save(self) -> Path | None:
        """Write a checkpoint (main process). Sharded weights are gathered first, by every process."""
        path = None
        self.state.budget_seconds = self.budget_spent()
        sharded = self.policy.sharded
        # DeepSpeed's: gathered from ZeRO's partitions (a collective) as a plain AdamW's
        opt_state = self.deepspeed_optimizer_state() if self.engine is not None else self.opt.state_dict()
        objective = self.objective.state_dict()  # e.g. NFT's old adapter (gathered when sharded: every process)
        if sharded:  # collectives: every process takes part, the main one writes
            trainable = {n: full_tensor(p).detach() for n, p in self.named_params.items()}
            optimizer = {"state": {k: {s: full_tensor(v) if torch.is_tensor(v) else v for s, v in st.items()}
                                   for k, st in opt_state["state"].items()},
                         "param_groups": opt_state["param_groups"]}
            ema = {n: full_tensor(v) for n, v in self.ema.state_dict().items()} if self.ema else None
            with self.ema.applied() if self.ema else contextlib.nullcontext(), self.gathered():
                exported = self.policy.export_state()  # the LoRA's or the whole model's tensors, gathered
        if self.main:
            st = {"counters": vars(self.state),
                  "tracker": self.tracker.state_dict() if self.tracker else None, "config": to_dict(self.cfg)}
            extra = {}
            if self.policy.can_export:
                if sharded:
                    def export(p):
                        self.policy.export(p, state=exported)
                elif self.ema is not None:
                    def export(p):
                        with self.ema.applied():
                            self.policy.export(p)
                else:
                    export = self.policy.export
                extra["lora" if self.cfg.lora.enabled else "model"] = export
            if not sharded:
                trainable = dict(self.named_params)
                optimizer = opt_state
                ema = self.ema.state_dict() if self.ema else None
            path = write_checkpoint(self.run_dir, self.state.epochs_done, trainable=trainable, optimizer=optimizer,
                                    ema=ema, state=st, extra_dirs=extra, keep=self.cfg.checkpoint.keep,
                                    objective=objective or None)
        self.acc.wait_for_everyone()
        return path

    def deepspeed_optimizer_state(self) -> dict:
        """The optimizer's state as a plain AdamW's state_dict (an entry of whole tensors per trained weight), gathered
        from ZeRO's partitions (a collective: every process calls it)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        steps = [st["step"] for st in self.opt.state.values() if "step" in st]
        state = {}
        for i, p in enumerate(self.params):
            moments = {k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")}
            if steps and all(v is not None for v in moments.values()):
                state[i] = {"step": steps[0].clone(), **{k: v.detach().cpu() for k, v in moments.items()}}
        group = {k: v for k, v in self.opt.param_groups[0].items() if k != "params"}
        return {"state": state, "param_groups": [{**group, "params": list(range(len(self.params)))}]}

    def load_deepspeed(self, ck: dict) -> None:
        """A checkpoint's trained weights and plain-AdamW state into ZeRO's float32 weights and partitioned state
        (the module's weights were copied already)."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        for n, p in self.named_params.items():
            safe_set_full_fp32_param(p, ck["trainable"][n].to(p.device, torch.float32))
        states = {int(k): st for k, st in ck.get("optimizer", {}).get("state", {}).items()}
        if not states:
            return
        step = next(iter(states.values()))["step"]
        zero = self.engine.optimizer
        # this process's partition of the float32 weights (ZeRO-3's, ZeRO-1/2's): an AdamW state to fill
        flats = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
        for flat in flats:
            self.opt.state[flat] = {"step": torch.as_tensor(step).clone().float(),
                                    **{k: torch.zeros_like(flat) for k in ("exp_avg", "exp_avg_sq")}}
        if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2: (re)link the weights' views into it
            zero._hp_optimizer_states_linked = False
            zero._lazy_init_hp_params_optimizer_state()
        for i, p in enumerate(self.params):
            for k in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, states[i][k].to(p.device), k)

    def load(self, path: Path, ck: dict) -> None:
        """Continue from checkpoint `path` (read: `ck`). A changed model, adapter or batch shape is refused with the
        differing keys; other config changes are listed in a warning."""
        saved = ck["state"].get("config")
        if saved is not None:  # (a checkpoint written before keys moved is read with their current spelling)
            objective = self.cfg.train.objective
            saved, now, defaults = (without_other_objectives(tree, objective)
                                    for tree in (migrate(saved, hint=False), to_dict(self.cfg), to_dict(Config())))
            refused, allowed = rundir.compare_configs(saved, now, defaults)
            if refused:
                raise CheckpointError(f"cannot resume from {path}: the config changed what the checkpoint was trained "
                                      f"as ({'; '.join(refused)}); undo those changes, or start a new run in another "
                                      "log.run_dir (or log.overwrite=true)")
            if allowed and self.main:
                warnings.warn(f"resuming from {path} with a changed config: {'; '.join(allowed)}", stacklevel=2)
        missing = set(self.named_params) - set(ck["trainable"])
        if missing:
            raise CheckpointError(f"checkpoint {path} lacks trained weights {sorted(missing)[:3]} (a different model "
                                  "or LoRA config?)")
        with torch.no_grad(), self.gathered(modifier_rank=0):
            for n, p in self.named_params.items():
                p.copy_(like(ck["trainable"][n].to(p.dtype), p))
        if hasattr(self.opt, "sync_masters"):  # float32 master copies (offload, bf16 weights): from the loaded ones
            self.opt.sync_masters()
        if self.engine is not None:
            self.load_deepspeed(ck)
        elif "optimizer" in ck:
            params = [p for group in self.opt.param_groups for p in group["params"]]
            state = {k: {s: like(v, params[int(k)]) if torch.is_tensor(v) and v.ndim else v for s, v in st.items()}
                     for k, st in ck["optimizer"]["state"].items()}
            self.opt.load_state_dict({"state": state, "param_groups": ck["optimizer"]["param_groups"]})
        st = ck["state"]
        if self.ema is not None and "ema" in ck:
            self.ema.load_state_dict({n: like(v, self.named_params[n]) for n, v in ck["ema"].items()})
        if self.tracker is not None and st.get("tracker"):
            self.tracker.load_state_dict(st["tracker"])
        self.objective.load_state_dict(ck.get("objective", {}), like)
        self.state = State(**st["counters"])
        set_rng_state(ck["rng_tensors"], st["rng"])
        if self.main:
            print(f"resumed from {path} after {self.state.epochs_done} epochs")


def like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A whole tensor laid out as `param` is: this process's shard when `param` is a DTensor (FSDP2)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
    return value


def adv_metrics(adv: torch.Tensor, keep: torch.Tensor) -> dict:
    return {"adv/mean": adv.mean().item(), "adv/std": adv.std().item() if len(adv) > 1 else 0.0,
            "adv/abs_max": adv.abs().max().item(), "adv/kept_frac": keep.float().mean().item()}


def train(cfg: Config) -> dict:
    """Build a Trainer from `cfg` and run it; returns the last epoch's metrics."""
    try:
        return Trainer(cfg).fit()
    finally:
        # leave no gloo/NCCL threads running into interpreter shutdown (they abort the process there)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
