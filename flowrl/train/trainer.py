"""The training loop: rollout -> reward -> advantage -> update -> log / eval / checkpoint.

One loop for every backend, objective and distributed strategy, read top to bottom:

    Trainer.__init__   the pieces: policy, objective, strategy (and its optimizer), scorer, updater, evaluator
    Trainer.fit        resume, then `train_epoch` until the epochs or the time budget run out; the final eval
    Trainer.train_epoch  rollout, scores, advantages, update, metrics

What differs between images and text lives in the policy (`flowrl.policies`); between objectives, in the objective
(`flowrl.objectives`); between DDP, FSDP and DeepSpeed, in the strategy (`flowrl.dist`). The math is the core's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flowrl import dist as distributed
from flowrl.config import Config, to_dict
from flowrl.data import check_prompt_lengths
from flowrl.errors import CheckpointError, ConfigError, Interrupted, RunDirError
from flowrl.eval import Evaluator
from flowrl.objectives import build_objective
from flowrl.policies.base import full_tensor
from flowrl.preflight import preflight
from flowrl.run import basemodel, rundir
from flowrl.run.checkpoint import (
    TRAINER_STATE,
    out_of_space,
    remove_temporary,
    resolve_resume,
    resume_target,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from flowrl.run.loading import check_base, check_resume, check_resume_base, check_weights
from flowrl.run.lock import RunLock
from flowrl.run.metrics import MetricsLog, Timer, read_metrics
from flowrl.seeding import derive_seed, seed_everything

from .async_rollout import AsyncRollout
from .optim import EMA, build_optimizer
from .prompts import PromptDraws
from .scoring import OverlappedScoring, Scorer, adv_metrics, count_features, count_names
from .signals import Abandoned, StopSignals
from .update import Updater


@dataclass
class State:
    """Counters saved in checkpoints."""

    epochs_done: int = 0
    optimizer_steps: int = 0
    samples_seen: int = 0
    train_wall_seconds: float = 0.0  # the epochs' wall-clock, evals excluded (time/train_wall_minutes)
    train_cpu_seconds: float = 0.0  # this process's CPU time in the epochs (time/train_process_minutes)
    budget_seconds: float = 0.0  # train.max_minutes spent on train.budget_clock when the checkpoint was written
    best_eval: float | None = None  # checkpoint.keep_best: the best eval's checkpoint.best_metric so far
    best_epoch: int = -1  # and the epochs done at it


def attention_backends(device: torch.device, *, cudnn: bool) -> None:
    """On a CUDA device, whether scaled_dot_product_attention may use cuDNN's fused attention (model.cudnn_attention):
    its backward failed with an illegal memory access for FLUX.1-dev on an H200 (torch 2.11, cuDNN 9.19), which the
    flash and memory-efficient backends trained. A process-wide torch setting; nothing changes on other devices."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(cudnn)


def progress_postfix(metrics: dict, objective) -> dict[str, str]:
    """What the progress bar shows after an epoch: the mean reward, and the objective's own fields (GRPO: the first
    minibatch's ratio; DPO: its pairs)."""
    reward = {"reward": f"{metrics['reward/total_mean']:.3f}"} if "reward/total_mean" in metrics else {}
    return {**reward, **objective.progress(metrics)}


def _epochs(n: int, done: str = "") -> str:
    """'1 epoch', '3 epochs'; with `done`: '1 epoch done is', '3 epochs done are'."""
    words = f"{n} epoch{'' if n == 1 else 's'}"
    return f"{words} {done} {'is' if n == 1 else 'are'}" if done else words


class Trainer:
    """Holds the pieces the loop needs; `fit()` is the loop."""

    def __init__(self, cfg: Config, accelerator=None):
        self.lock = None  # the run directory's (main process), from before the model loads to the end of fit
        self.created: list[Path] = []  # the folders of log.run_dir this run made (removed if it writes nothing)
        try:
            self._build(cfg, accelerator)
        except BaseException:
            self.let_go(refused=True)
            raise

    def let_go(self, refused: bool) -> None:
        """Release the run directory's lock; a run `refused` (or failed) before it wrote anything takes away the
        folders it made for its run directory, which stay empty."""
        if self.lock is not None:
            self.lock.release()
        if refused:
            rundir.remove_empty(self.created)

    def _build(self, cfg: Config, accelerator) -> None:
        from flowrl.policies import build_policy

        # everything that can be checked without the model (prompts, rewards, the model's class and image size,
        # loggers) fails now, before it loads
        self.train_set, self.eval_set = preflight(cfg)
        self.cfg, t = cfg, cfg.train
        self.acc = accelerator or distributed.make_accelerator(cfg)
        self.run_dir = Path(cfg.log.run_dir)
        self.main = self.acc.is_main_process
        # the base weights' fingerprint, once (every checkpoint keeps it), on every process: a resume's checks agree
        self.base_model, self.base_checked = basemodel.fingerprint(cfg.model.path, cfg.model.variant), None
        # checkpoint.resume as the checkpoint it names (a run directory: its newest intact one), checked now
        self.resume = resume_target(cfg.checkpoint.resume, self.run_dir, TRAINER_STATE)
        if self.main:  # writable, this run's alone, and not another run's (unless resuming it or told to overwrite it)
            self.created = rundir.check_writable(self.run_dir)
            self.lock = RunLock(self.run_dir).acquire()  # released when fit ends (or at exit)
            # what a kill during a checkpoint write left behind (the lock held: no run of this folder writes them)
            remove_temporary(self.run_dir)
            rundir.claim(self.run_dir, resume=self.resume, overwrite=cfg.log.overwrite)
            self.base_checked = check_resume_base(cfg, self.run_dir, self.base_model, self.resume)
        self.acc.wait_for_everyone()
        if cfg.rollout.async_ and self.acc.num_processes > 1:
            raise ConfigError(
                f"rollout.async runs one rollout worker beside one trainer process, and this run has "
                f"{self.acc.num_processes}: set rollout.async=false, or launch one process"
            )
        if cfg.backend == "text" and cfg.text.engine != "hf" and self.acc.num_processes > 1:
            raise ConfigError(
                f"text.engine={cfg.text.engine} pushes the weights to one server from one trainer process, and this "
                f"run has {self.acc.num_processes}: set text.engine=hf, or launch one process"
            )
        seed_everything(t.seed)
        self.device = self.acc.device if cfg.model.device == "auto" else torch.device(cfg.model.device)
        attention_backends(self.device, cudnn=cfg.model.cudnn_attention)
        self.policy = build_policy(cfg, self.device)
        prompt_sets = {"data.train_prompts": self.train_set, "data.eval_prompts": self.eval_set}
        check_prompt_lengths(self.policy, prompt_sets, warn=self.main)  # and silences the libraries' own logs
        # before the strategy wraps or shards the model: an objective may add to it (NFT's "old" adapter)
        self.objective = build_objective(cfg, self.policy, self.acc.num_processes)
        self.objective.check_data(self.train_set)
        self.draws = PromptDraws(
            self.train_set,
            cfg.sample.prompts_per_epoch,
            t.seed,
            cfg.data.balance_by,
            skip_after=cfg.data.skip_no_signal,
            skip_epochs=cfg.data.skip_epochs,
        )
        self.world = self.acc.num_processes
        self.batch_total = cfg.sample.prompts_per_epoch * cfg.sample.group_size
        if self.batch_total % self.world:
            raise ValueError(
                f"the epoch batch {self.batch_total} (prompts_per_epoch x group_size) must split evenly "
                f"over {self.world} processes"
            )
        self.batch_local = self.batch_total // self.world
        self.dist = distributed.build_strategy(cfg, self.acc)
        self.opt = self.dist.prepare(self.policy, lambda params, sharded: build_optimizer(params, t, sharded=sharded))
        self.params = self.dist.params
        self.named_params = dict(self.policy.named_trainable_parameters())
        self.ema = (
            EMA(self.named_params.items(), t.ema_decay, device="cpu" if t.offload else None)
            if t.ema_decay > 0
            else None
        )
        self.updater = Updater(cfg, self.objective, self.dist, self.ema, self.batch_local)
        self.max_steps = self.updater.max_steps  # the lr schedule's length, in minibatch slots
        self.scorer = Scorer(cfg, self.policy, self.dist, self.run_dir, self.main)
        self.evaluator = Evaluator(cfg, self.eval_set, self.device, offload=t.offload)
        self.state = State()
        self.signals = StopSignals(announce=self.main)
        self.saved: tuple[tuple[int, int], Path | None] | None = None  # the newest checkpoint's (epochs, steps), path
        self.whole = True  # whether the state is an epoch boundary's, which a checkpoint may keep (save_after_failure)
        self.epoch_rng = None  # the RNG state at the start of the epoch in progress (rng_state())
        self.saving = False  # whether a checkpoint is being written (and stays so when its write raised)
        self.clock_start, self.budget_before = time.perf_counter(), 0.0  # train.max_minutes' clock (budget_spent)
        self.log = MetricsLog(self.run_dir / "metrics.jsonl", self.acc, enabled=self.main)
        if self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.timer = Timer()
        # rollout.async: the rollout worker (spawned as fit starts, stopped when it ends)
        self.rollouts = AsyncRollout(cfg, self.device) if cfg.rollout.async_ else None
        self.threads = torch.get_num_threads()  # this process's torch threads (rollout.async shares them on a CPU)
        self.best_metric = ""  # checkpoint.keep_best's metric, resolved at the first eval
        self.base_fingerprint: dict | None = None  # eval.base_cache: this run's, made at its first use
        self.resumed_sampling = None  # (version, trainable, objective state) a resumed async run samples first with
        if cfg.log.tensorboard or cfg.log.wandb:
            self.acc.init_trackers("flowrl", config={k: str(v) for k, v in to_dict(cfg).items()})

    @property
    def tracker(self):
        """DDPO's per-prompt stat tracker (train.per_prompt_stats), or None."""
        return self.scorer.tracker

    # ------------------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        """Train to train.epochs (or the time budget), resuming from a checkpoint when asked; returns the last epoch's
        metrics with the final eval's. The run directory's lock is released when it returns or raises."""
        if self.lock is not None:
            self.lock.acquire()  # (again, when an earlier fit released it)
        ended = False
        try:
            skipped: list[str] = []
            found = resolve_resume(self.resume, self.run_dir, skipped, TRAINER_STATE)
            if found is not None:
                self.load(*found)
            elif self.resume == "auto" and self.main and rundir.holds_a_run(self.run_dir):
                # its checkpoints are all damaged
                raise rundir.nothing_to_resume(self.run_dir, skipped[0] if skipped else None)
            elif self.resume == "auto" and self.main:
                print(f"checkpoint.resume=auto: no checkpoint in {self.run_dir}: starting a new run")
            if self.main:  # the epochs after the checkpoint are redone: their old rows go
                rundir.truncate_logs(self.run_dir, self.state.epochs_done)
            self.acc.wait_for_everyone()
            with self.signals.installed():
                try:
                    last = self._fit()
                except Exception as error:  # (Interrupted wrote its checkpoint already)
                    if not isinstance(error, Interrupted):
                        self.save_after_failure(error)
                    raise
            ended = True
            return last
        finally:
            if self.rollouts is not None:  # stopped and joined, whatever ended the run
                self.rollouts.close()
                self.share_threads(worker_sampling=False)
            self.let_go(refused=not ended)

    def _fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        last = {}
        if self.rollouts is not None and self.rollouts.process is None and self.state.epochs_done < t.epochs:
            self.rollouts.spawn()  # the worker builds its policy during the eval before training
        if cfg.eval.before and self.state.epochs_done == 0 and t.epochs > 0:
            before = self.base_eval_from_cache()
            if before is None:
                before = self.evaluate(tag="epoch000000")
                if before is None:
                    self.stop_if_asked(abandoned="the eval before training")
                self.add_base_eval_to_cache(before)
            self.log.log(before, step=0)
            self.keep_if_best(before)
        # the time budget and the time metrics go on from a checkpoint's: a resumed run trains what is left
        self.clock_start, self.budget_before = time.perf_counter(), self.state.budget_seconds
        first = self.state.epochs_done
        if t.max_minutes and first and self.out_of_time():
            if self.main:
                print(
                    f"train.max_minutes={t.max_minutes:g} was spent ({self.budget_spent() / 60:.2f} min on the "
                    f"{t.budget_clock} clock) after {_epochs(first)}: nothing left to train (raise "
                    f"train.max_minutes to train on)"
                )
            first = t.epochs
        elif first >= t.epochs and self.main:  # a finished run resumed, or train.epochs=0
            print(
                f"train.epochs={t.epochs} and the run in {self.run_dir} has done {_epochs(first)}: nothing to train "
                f"(raise train.epochs to train on; `flowrl eval CONFIG --checkpoint {self.run_dir}` evaluates its "
                f"newest checkpoint)"
                if first
                else "train.epochs=0: nothing to train"
            )
        if first and first < t.epochs and self.main:  # resumed past its end: its final eval is made again
            rundir.truncate_logs(self.run_dir, first, past_end=True)
        bar = tqdm(
            range(first, t.epochs),
            desc="epochs",
            disable=not (self.main and cfg.log.progress),
            initial=self.state.epochs_done,
            total=t.epochs,
        )
        steps_before, silent = self.state.optimizer_steps, 0
        for epoch in bar:
            try:
                metrics = self.train_epoch(epoch)
            except Abandoned:
                self.stop_if_asked(abandoned=f"epoch {epoch + 1}'s rollout")
                raise
            silent += metrics.get("data/groups_without_signal") == 1.0  # every group's rewards alike
            # train.max_minutes: the epoch that reaches the budget is the last (every process stops together)
            out_of_time = bool(t.max_minutes) and self.out_of_time()
            done, abandoned = epoch + 1, None
            if cfg.eval.every and done % cfg.eval.every == 0 and done < t.epochs:
                results = self.evaluate(tag=f"epoch{done:06d}")
                metrics.update(results or {})
                abandoned = None if results is not None else f"the eval after epoch {done}"
                if results is not None:
                    self.keep_if_best(results)
            if done % cfg.log.every == 0 or done == t.epochs or out_of_time:
                self.log.log(metrics, step=done)
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < t.epochs:
                now = (self.state.epochs_done, self.state.optimizer_steps)
                if self.saved is None or self.saved[0] != now:  # (keep_best may have saved this epoch just now)
                    self.save()
            bar.set_postfix(progress_postfix(metrics, self.objective))
            last = metrics
            self.stop_if_asked(abandoned=abandoned)
            if out_of_time:
                if self.main:
                    print(
                        f"train.max_minutes={t.max_minutes:g} ({t.budget_clock} clock) reached after "
                        f"{_epochs(done)}: the final eval and checkpoint follow"
                    )
                break
        if last and self.state.optimizer_steps == steps_before and self.main:
            ran = self.state.epochs_done - first
            warnings.warn(
                f"{_epochs(ran)} took no optimizer step: in every group the rewards were alike "
                "(no advantage, no pair) or not finite, so the weights did not move; give each epoch more groups or "
                "larger ones (sample.prompts_per_epoch, sample.group_size), or a graded reward",
                stacklevel=2,
            )
        elif last and silent == self.state.epochs_done - first and self.main:  # steps taken, on zero advantages
            warnings.warn(
                f"{'in its one epoch' if silent == 1 else f'in each of its {silent} epochs'} every group's rewards "
                "were alike (data/groups_without_signal 1.0): "
                "no advantage, so nothing was learned from the rewards; check that the reward tells the samples "
                "apart (a constant or saturated reward), or give each epoch more groups or larger ones",
                stacklevel=2,
            )
        if last:  # some epoch ran in this call (a resume of a finished run does nothing)
            final = self.evaluate(tag="final")
            if final is None:
                final_eval = "the final eval, which `flowrl eval CONFIG --checkpoint` of this checkpoint makes,"
                self.stop_if_asked(abandoned=final_eval)
            self.log.log({**final, "final": True}, step=self.state.epochs_done)
            last.update(final)
            if not self.keep_if_best(final):  # (a best final eval saves its checkpoint there)
                self.save()
            if self.main:
                self.report_or_warn()
                if self.cfg.checkpoint.keep_best and self.state.best_eval is not None:
                    print(
                        f"best eval: {self.best_metric} {self.state.best_eval:.4f} after "
                        f"{_epochs(self.state.best_epoch)}: {self.run_dir / f'ckpt-{self.state.best_epoch:06d}'} "
                        "(best.json)"
                    )
        divergence = self.dist.replica_divergence()  # (sharded weights differ by design: None)
        if divergence is not None:
            last["dist/replica_max_abs_diff"] = divergence
            self.log.log({"dist/replica_max_abs_diff": divergence}, step=self.state.epochs_done)
        self.acc.wait_for_everyone()
        if cfg.log.tensorboard or cfg.log.wandb:
            self.acc.end_training()
        return last

    def train_epoch(self, epoch: int) -> dict:
        """One epoch: roll out, score, the advantages of the whole batch, the update; returns its metrics."""
        cfg = self.cfg
        if cfg.train.schedule_over == "budget":  # the lr's position in a run that ends on its time budget
            self.updater.budget_fraction = self.dist.largest(self.budget_spent() / (60 * cfg.train.max_minutes))
        t0, cpu0 = time.perf_counter(), time.process_time()
        self.epoch_rng = rng_state()  # the RNG at the epoch's start, which a checkpoint after its failure keeps
        if self.objective.scores_batch:
            batch, adv, keep, metrics, worker = self.scored_rollout(epoch)
        else:  # the batch says which sample is preferred (offline DPO's pairs): no reward scores it
            with self.timer("rollout"):
                batch = self.rollout(epoch)
            self.stop_if_asked()
            self.whole = False
            adv, keep, metrics = torch.zeros(len(batch.prompts)), torch.ones(len(batch.prompts), dtype=torch.bool), {}
        with self.timer("train"):
            metrics.update(self.update(batch, adv, keep, epoch))
        self.state.epochs_done = epoch + 1
        if self.rollouts is not None:  # the worker samples epoch+2 with these
            self.send_weights()
            metrics.update(worker)
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
        self.whole, self.epoch_rng = True, None  # an epoch boundary again
        return metrics

    # ------------------------------------------------------------------------------ the phases

    def scored_rollout(self, epoch: int) -> tuple:
        """The epoch's rollout, its scores and advantages: (batch, adv, keep, metrics, the async worker's metrics)."""
        cfg, worker = self.cfg, None
        overlapped = self.scorer.overlapped()  # rollout.overlap_rewards: rewards scored during the rollout
        with OverlappedScoring(self.scorer, overlapped) if overlapped else contextlib.nullcontext() as overlap:
            with self.timer("rollout"):
                if self.rollouts is None:
                    batch = self.rollout(epoch, on_chunk=overlap.submit if overlap else None)
                else:
                    batch, worker = self.async_rollout(epoch)
            self.stop_point()  # before the rewards: the epoch's rollout is abandoned
            with self.timer("reward"):
                scored = None
                if overlap:
                    with self.timer("reward_wait"):  # for the chunks the thread has not scored yet
                        scored = overlap.finish()
                scores, components = self.score(batch, epoch, scored=scored)
                # [B, F] what each sample drew where its prompt left it free (None: no reward counts it), for an
                # objective that pairs by it (train.dpo.pairing=matched)
                batch.free_counts = count_features(components)
                batch.free_count_names = count_names(components)  # its columns' "<reward>/free_<attr>=<value>"
        self.stop_if_asked()  # nothing of this epoch has changed the weights yet
        self.whole = False  # from here on (the per-prompt statistics, the update) the epoch changes the state
        metrics = self.scorer.reward_metrics(scores, components)
        # [F] the whole batch's counts, every process's, as reward_metrics gathered them (train.dpo.free_anchor's
        # distribution of this epoch)
        totals = self.scorer.count_totals
        batch.free_count_totals = (
            None
            if batch.free_counts is None
            else torch.tensor([totals[n] for n in batch.free_count_names], dtype=torch.float64)
        )
        metrics.update(getattr(batch, "rollout_metrics", None) or {})  # a text engine's version and mismatch
        metrics.update(self.scorer.reward_logs())
        extra = self.policy.pop_reward_extra()  # columns the rewards logged with log_extra (TRL's reward API)
        with self.timer("advantage"):
            adv, keep, invalid = self.advantages(batch, scores, epoch)
        metrics.update(adv_metrics(adv, keep))
        metrics.update(self.draws.observe(epoch, self.scorer.group_signal))  # data.skip_no_signal's history
        metrics["reward/nonfinite_count"] = invalid
        if cfg.log.completions_every and epoch % cfg.log.completions_every == 0:
            self.scorer.log_outputs(batch, scores, adv, epoch, extra)
        if overlapped:
            metrics["time/reward_thread"] = overlap.busy  # what the thread scored, mostly while the rollout sampled
        return batch, adv, keep, metrics, worker

    def rollout_request(self, epoch: int) -> dict:
        """What this process samples in epoch `epoch`: P prompts x G, laid out prompt-major and cut into `world`
        contiguous slices (so a group may span two processes), their metadata, their group ids and the generator's
        seed."""
        cfg = self.cfg
        prompts, meta = self.draws.draw(epoch)
        G = cfg.sample.group_size
        start = self.acc.process_index * self.batch_local
        gids = [i // G for i in range(start, start + self.batch_local)]
        return {
            "prompts": [prompts[g] for g in gids],
            "metadata": [meta[g] for g in gids],
            "seed": derive_seed(cfg.train.seed, epoch, self.acc.process_index),
            "group_ids": gids,
            "epoch_prompts": prompts,
        }

    def rollout(self, epoch: int, on_chunk=None):
        """This process's slice of the epoch's samples (`rollout_request`). `on_chunk`: the image policy's (each
        rollout call's images, as it returns)."""
        req = self.rollout_request(epoch)
        gen = torch.Generator().manual_seed(req["seed"])
        self.policy.weights_version = self.state.optimizer_steps  # a text engine samples with these weights
        batch = self.objective.rollout(
            req["prompts"], req["metadata"], epoch=epoch, generator=gen, stop=self.stop_point, on_chunk=on_chunk
        )
        batch.group_ids = torch.tensor(req["group_ids"])
        batch.epoch_prompts = req["epoch_prompts"]
        return batch

    def sampling_weights(self) -> dict[str, torch.Tensor] | None:
        """rollout.async: the older weights the next epoch's rollout samples with (a checkpoint keeps them: the resumed
        run samples that epoch with them, as the uninterrupted run does)."""
        pending = self.rollouts.sampling_weights() if self.rollouts is not None else None
        if pending is None:
            return None
        version, trainable, state = pending
        return {
            "version": torch.tensor(version),
            **{f"trainable/{n}": t for n, t in trainable.items()},
            **{f"objective/{n}": t for n, t in state.items()},
        }

    def send_weights(self) -> None:
        """rollout.async: the trained adapter and the objective's state (e.g. NFT's "old" adapter, which samples),
        as version `epochs_done`, to the worker."""
        self.rollouts.send_weights(self.state.epochs_done, self.named_params, self.objective.state_dict())

    def async_rollout(self, epoch: int):
        """rollout.async: epoch `epoch`'s batch from the worker (the first of a fit sampled with the current
        weights), and the worker's metrics; the worker is asked for the next epoch's at once."""
        w, t0 = self.rollouts, time.perf_counter()
        if w.process is None:
            w.spawn()
        w.ready()
        if w.asked is None:  # the first epoch of this fit: version lag 0; after a resume, as the run it resumes
            resumed, self.resumed_sampling = self.resumed_sampling, None
            if resumed is not None:  # the older weights that run sampled this epoch with (its checkpoint's)
                w.send_weights(*resumed)
                w.ask(epoch, self.rollout_request(epoch))
            self.send_weights()
            if resumed is None:
                w.ask(epoch, self.rollout_request(epoch))
        start = time.perf_counter()
        batch, version, idle, seconds = w.take(epoch, waiting=self.stop_point)
        wait = time.perf_counter() - start
        sampling = epoch + 1 < self.cfg.train.epochs
        if sampling:  # sampled with the weights it has while this epoch updates
            w.ask(epoch + 1, self.rollout_request(epoch + 1))
        self.share_threads(worker_sampling=sampling)
        lag = self.state.epochs_done - version
        self.updater.version_lag = lag
        if lag:  # the older weights that sampled it (an objective whose ratio needs the sampling policy's: ELBO)
            if version not in w.sent:
                raise RuntimeError(f"rollout.async: version {version}'s weights were not kept (have {sorted(w.sent)})")
            batch.sampled_with = w.sent[version][0]
        req = self.rollout_request(epoch)
        batch.group_ids = torch.tensor(req["group_ids"])
        batch.epoch_prompts = req["epoch_prompts"]
        return batch, {
            "rollout/version_lag": lag,
            "time/rollout_wait": wait,
            "time/worker_start": start - t0,
            "time/worker_idle": idle,
            "time/worker_rollout": seconds,
            "rollout/worker_threads": w.threads,
            "rollout/trainer_threads": torch.get_num_threads(),
        }

    def share_threads(self, worker_sampling: bool) -> None:
        """rollout.async on a CPU: this process's torch threads less the worker's (rollout.async_threads) while the
        worker samples beside it, so that the two use the threads the run was given; all of them while it samples
        nothing (the eval after the last epoch). On a GPU the threads are left alone."""
        if self.rollouts is None or self.device.type != "cpu":
            return
        busy = max(1, self.threads - self.cfg.rollout.async_threads)
        torch.set_num_threads(busy if worker_sampling else self.threads)

    def score(self, batch, epoch: int = 0, scored: dict | None = None) -> tuple[torch.Tensor, dict]:
        """Per-reward scores [B_local, K] and extra components, from this process's outputs (`scored`: those the
        overlapped scoring gave)."""
        return self.scorer.score(
            batch, epoch, optimizer_steps=self.state.optimizer_steps, max_steps=self.max_steps, scored=scored
        )

    def advantages(self, batch, scores: torch.Tensor, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Advantages of this process's samples from the whole batch's rewards, which samples to train, and how many
        samples of the batch had a non-finite reward (left out of the advantages and the loss)."""
        return self.scorer.advantages(batch, scores, epoch)

    def update(self, batch, adv: torch.Tensor, keep: torch.Tensor, epoch: int) -> dict:
        """The epoch's update (`flowrl.train.update`), whole: a stop signal takes effect at the epoch's end."""
        return self.updater.run(batch, adv, keep, epoch, self.state)

    @torch.no_grad()
    def evaluate(self, tag: str) -> dict | None:
        """The held-out eval (EMA weights when on): every process samples a share of the prompts (all of them when
        the weights are sharded: every forward pass is a collective); the main process compares with the base
        model's eval (the run's first, before any optimizer step) and draws the grid. None when a stop signal
        abandoned it (between its batches, or after them): nothing of it is written."""
        world = 1 if self.dist.sharded else self.world
        rank = 0 if world == 1 else self.acc.process_index
        t0 = time.perf_counter()
        try:
            with self.ema.applied() if self.ema is not None else contextlib.nullcontext():
                outputs, scores = self.evaluator.sample(
                    self.policy,
                    self.scorer.fns,
                    parked=self.scorer.parked,
                    rank=rank,
                    world=world,
                    stop=self.stop_point if world == 1 else None,  # shares differ in batches: no collective inside
                    processes=self.world,  # calls the size of a training rollout's, also when sharded (world 1)
                    progress=self.main and self.cfg.log.progress,
                )
            self.stop_point()
        except Abandoned:
            return None
        results = {}
        if self.main:
            base = self.state.optimizer_steps == 0
            results = self.evaluator.results(
                outputs, scores, base_dir=self.run_dir, this_is_base=base, save_base_to=self.run_dir
            )
            if self.cfg.eval.grid:
                path = self.write_eval_outputs(outputs, scores, tag)
                self.log_eval_images(path, tag)
            results["time/eval"] = time.perf_counter() - t0  # sampling, scoring and the grid (the demo's split)
        self.acc.wait_for_everyone()
        return results

    def write_eval_outputs(self, outputs: list, scores: dict, tag: str) -> Path | None:
        """The eval's grid (a text run's completions) as `eval-TAG.*` in the run directory (main process); one that
        cannot be written (a full disk) is a RunDirError naming it, its temporary file removed."""
        stem = self.run_dir / f"eval-{tag}"
        try:
            return self.evaluator.write_outputs(self.policy, outputs, scores, stem)
        except OSError as e:
            for tmp in self.run_dir.glob(f"{stem.name}.tmp*"):
                with contextlib.suppress(OSError):
                    tmp.unlink()
            file = f"{stem}.{'png' if self.policy.reward_kind == 'image' else 'jsonl'}"
            reason = out_of_space(e) or e.strerror or str(e)
            raise RunDirError(
                f"could not write the eval's outputs {file}: {reason}; free space there (or set eval.grid=false) and "
                "resume with checkpoint.resume=auto"
            ) from None

    def _base_cache(self):
        """(eval.base_cache's cache, this run's fingerprint) on the main process when the cache is on, else None.
        The fingerprint digests the model's files: made once."""
        if not self.cfg.eval.base_cache or not self.main or self.state.optimizer_steps:
            return None
        from flowrl.eval.base_cache import BaseEvalCache, fingerprint_of_run

        if self.base_fingerprint is None:
            self.base_fingerprint = (
                fingerprint_of_run(
                    self.cfg, self.evaluator, self.policy, self.scorer.fns, self.device, processes=self.world
                )
                or {}
            )
            if not self.base_fingerprint:
                warnings.warn(
                    f"eval.base_cache: the files of model.path={self.cfg.model.path} could not be identified (not "
                    f"a local directory, a hub model in the cache or a tiny model): its eval is sampled, not kept",
                    stacklevel=2,
                )
        if not self.base_fingerprint:
            return None
        return BaseEvalCache(self.cfg.eval.base_cache), self.base_fingerprint

    def base_eval_from_cache(self) -> dict | None:
        """eval.base_cache: the eval before training read from the cache's entry for this run (its metrics logged,
        its grid and base-model files copied into the run directory), when there is one; else None (every
        process: the main process decides)."""
        t0 = time.perf_counter()
        cache = self._base_cache()
        try:
            record = cache[0].restore(cache[1], self.run_dir) if cache is not None else None
        except OSError as e:  # an entry that cannot be copied: sampled instead
            warnings.warn(f"eval.base_cache={self.cfg.eval.base_cache}: not read ({e}); sampling it", stacklevel=2)
            record = None
        if not self.dist.any_process(record is not None):
            return None
        world = 1 if self.dist.sharded else self.world  # as evaluate() shares the prompts out
        self.evaluator.encode_as_sampled(
            self.policy, rank=0 if world == 1 else self.acc.process_index, world=world, processes=self.world
        )
        if not self.main:
            return {}
        print(
            f"eval before training: read from {cache[0].entry(cache[1])} (eval.base_cache; this base model's "
            f"eval with these settings, sampled {record['sampled']} in {record['seconds']:.0f} s)"
        )
        # not time/eval: nothing was sampled
        return {**record["metrics"], "time/eval_read": time.perf_counter() - t0}

    def encode_as_before(self) -> None:
        """A resumed run past epoch 0 (every process): the prompt encodings the uninterrupted run's eval before
        training made (eval.before), made as it made them, in its calls, without sampling. A training prompt that is
        an eval prompt too trains with the encoding that eval made of it, whose last bits depend on the batch it was
        made in: without them the resumed run's first update differs from the uninterrupted run's in the last bits."""
        if not (self.cfg.eval.before and self.state.epochs_done > 0):
            return
        world = 1 if self.dist.sharded else self.world  # as evaluate() shares the prompts out
        rank = 0 if world == 1 else self.acc.process_index
        self.evaluator.encode_as_sampled(self.policy, rank=rank, world=world, processes=self.world)

    def add_base_eval_to_cache(self, results: dict) -> None:
        """eval.base_cache: the eval before training just sampled, added to the cache (main process)."""
        cache = self._base_cache()
        if cache is not None:
            try:
                cache[0].store(cache[1], results, self.run_dir, "epoch000000", results.get("time/eval", 0.0))
            except OSError as e:  # a cache is a saving, never a reason to stop a run
                warnings.warn(f"eval.base_cache={self.cfg.eval.base_cache}: the eval was not kept ({e})", stacklevel=2)

    def keep_if_best(self, results: dict) -> bool:
        """checkpoint.keep_best: when `results` (an eval's, on the main process) beat every earlier eval on
        checkpoint.best_metric, a checkpoint of this epoch (kept by checkpoint.keep) and `best.json` naming it;
        True when it wrote them. Every process calls it (the checkpoint is a collective when sharded)."""
        if not self.cfg.checkpoint.keep_best:
            return False
        better, problem = 0.0, None
        if self.main:
            try:
                key = self.best_metric = self.best_metric or self._best_metric(results)
            except ConfigError as e:  # said on every process, not only this one (the others would wait on it)
                better, problem = 2.0, e
            else:
                value = float(results[key])
                if self.state.best_eval is None or value > self.state.best_eval:
                    better, self.state.best_eval = 1.0, value
        decided = self.dist.largest(better)
        if decided == 2.0:
            raise problem or ConfigError(
                "checkpoint.best_metric is not a number the eval reports (see the main process)"
            )
        if not decided:
            return False
        self.state.best_epoch = self.state.epochs_done  # on every process: the checkpoint's retention reads it
        path = self.save()
        if self.main:
            best = {
                "metric": self.best_metric,
                "value": self.state.best_eval,
                "epochs": self.state.best_epoch,
                "checkpoint": path.name,
            }
            tmp = self.run_dir / "best.json.tmp"
            tmp.write_text(json.dumps(best, indent=1))
            tmp.replace(self.run_dir / "best.json")
        return True

    def _best_metric(self, results: dict) -> str:
        """checkpoint.best_metric, or the run's headline (`result_keys`), checked to be among the eval's numbers."""
        from flowrl.run.report import result_keys

        key = self.cfg.checkpoint.best_metric
        if not key:
            key = next(iter(result_keys([results], self.cfg.rewards[0].name, self.cfg.eval.group_by)), "")
        if key not in results or not isinstance(results[key], (int, float)):
            numbers = sorted(k for k, v in results.items() if k.startswith("eval/") and isinstance(v, (int, float)))
            raise ConfigError(
                f"checkpoint.best_metric={key!r} is not a number the eval reports; it reports: {', '.join(numbers)}"
            )
        return key

    def log_eval_images(self, path: Path | None, tag: str) -> None:
        """The eval grid to TensorBoard / W&B when those loggers are on."""
        if path is None or not (self.cfg.log.tensorboard or self.cfg.log.wandb) or not self.acc.trackers:
            return
        import numpy as np
        from PIL import Image

        grid = np.asarray(Image.open(path).convert("RGB"))
        for tracker in self.acc.trackers:
            if tracker.name == "tensorboard":
                tracker.writer.add_image(f"eval/{tag}", grid, self.state.epochs_done, dataformats="HWC")
            elif tracker.name == "wandb":
                import wandb

                tracker.log({f"eval/{tag}": wandb.Image(grid)}, step=self.state.epochs_done)

    def report_or_warn(self) -> None:
        """`report`, after the run is complete: a plot that cannot be written (a full disk) is a one-line warning."""
        try:
            self.report()
        except OSError as e:
            reason = out_of_space(e) or e.strerror or str(e)
            warnings.warn(
                f"the run is complete, but its plots (curves.png, before_after.png) were not written to "
                f"{self.run_dir}: {reason}; `flowrl report {self.run_dir}` draws the curves once it can",
                stacklevel=2,
            )

    def report(self) -> None:
        """The run's curves (and the before/after grid when the run evaluated before training) in its directory."""
        from flowrl.run.report import plot_curves, result_keys, write_before_after

        rows = read_metrics(self.run_dir / "metrics.jsonl")
        headline = next(iter(result_keys(rows, self.cfg.rewards[0].name, self.cfg.eval.group_by)), None)
        plot_curves(self.run_dir, title=f"{self.cfg.model.path}: {headline}" if headline else None)
        if self.cfg.eval.before:  # else an eval-epoch000000.png here would be an earlier run's
            write_before_after(self.run_dir, rows, headline)

    # ------------------------------------------------------------------------------ time, signals, checkpoints

    def budget_spent(self) -> float:
        """Seconds of train.max_minutes spent, on train.budget_clock, since the run began (across resumes):
        `process` = this process's CPU time in the epochs; `wall` = the wall-clock of the calls of fit, evals
        included."""
        if self.cfg.train.budget_clock == "process":
            return self.state.train_cpu_seconds
        return self.budget_before + time.perf_counter() - self.clock_start

    def out_of_time(self) -> bool:
        """Whether train.max_minutes is spent on some process (a collective)."""
        return self.dist.any_process(self.budget_spent() >= 60 * self.cfg.train.max_minutes)

    def stop_point(self) -> None:
        """Between the batches of a rollout or an eval: raise Abandoned when a stop signal arrived (on any process:
        a collective, so every process must call it alike)."""
        self.signals.stop_point(self.dist.any_process)

    def stop_if_asked(self, abandoned: str | None = None) -> None:
        """At a safe point, where the state is an epoch boundary's (between epochs, or in an epoch before anything of
        it changed the weights or the statistics): when a stop signal arrived (on any process), write a checkpoint
        (unless the newest one holds this state, or nothing was trained yet) and raise Interrupted. `abandoned`:
        what the signal cut short, for the message."""
        signum = self.signals.signum
        if not self.dist.any_process(signum is not None):
            return
        signum = signum or signal.SIGTERM
        what = f"after {_epochs(self.state.epochs_done)}"
        if abandoned:
            what += f" ({abandoned} was abandoned)"
        now = (self.state.epochs_done, self.state.optimizer_steps)
        if self.saved is None and now == (0, 0):
            again = " with log.overwrite=true" if rundir.holds_a_run(self.run_dir) else ""
            raise Interrupted(
                f"stopped by {signal.Signals(signum).name} {what}; nothing was trained, so no checkpoint was "
                f"written: run the same command again{again} to start over",
                signum,
            )
        path = self.save_epoch_boundary()
        raise Interrupted(
            f"stopped by {signal.Signals(signum).name} {what}; checkpoint {path or self.run_dir}. "
            f"Resume with checkpoint.resume=auto (same config and log.run_dir={self.run_dir})",
            signum,
        )

    def save_after_failure(self, error: Exception) -> None:
        """A run that failed where its state is an epoch boundary's (in an epoch before anything of it changed the
        weights or the statistics, e.g. a reward that raised, or in an eval): write a checkpoint of the epochs done,
        unless the newest one holds them, so that `checkpoint.resume=auto` continues as the run would have, with
        nothing lost. Elsewhere (in an update) the newest checkpoint is named. Said as a note on `error` (the command
        line prints it under the error's line). One process only: with several, a save is a collective that the
        others, elsewhere in the run, would not join."""
        now = (self.state.epochs_done, self.state.optimizer_steps)
        if self.world > 1 or not self.main or now == (0, 0) or self.saving:  # (saving: the save itself failed)
            return
        held = self.saved is not None and self.saved[0] == now
        path = self.saved[1] if held else None
        if not held and self.whole:
            try:
                path = self.save_epoch_boundary()
            except Exception as e:  # (the failure may be the disk's)
                error.add_note(f"the checkpoint of the {_epochs(now[0])} done could not be written either: {e}")
                return
        trained = now[0] >= self.cfg.train.epochs or (bool(self.cfg.train.max_minutes) and self.out_of_time())
        if path is not None and trained:  # (it failed in the final eval: a resume would find nothing to train)
            error.add_note(
                f"the {_epochs(now[0], 'trained')} in checkpoint {path}: once the cause is fixed, `flowrl eval CONFIG "
                f"--checkpoint {path}` makes the final eval"
            )
        elif path is not None:
            error.add_note(
                f"the {_epochs(now[0], 'done')} in checkpoint {path}: once the cause is fixed, the same command with "
                f"checkpoint.resume=auto continues from there"
            )
        elif self.saved is not None and self.saved[1] is not None:
            error.add_note(
                f"it failed during epoch {now[0] + 1}'s update; the newest checkpoint is {self.saved[1]} (after "
                f"{_epochs(self.saved[0][0])}): checkpoint.resume=auto continues from there"
            )

    def save_epoch_boundary(self) -> Path | None:
        """Where the state is an epoch boundary's: the newest checkpoint when it holds this state, else one written
        now, with the RNG put back to the epoch's start when in an epoch (its resumed run draws what this one drew).
        Decided on the state, alike on every process (only the main one knows a checkpoint's path): a save is a
        collective that every process joins or none. The path (None on the other processes)."""
        if self.saved is not None and self.saved[0] == (self.state.epochs_done, self.state.optimizer_steps):
            return self.saved[1]
        if self.epoch_rng is not None:
            set_rng_state(*self.epoch_rng)
        return self.save()

    def save(self) -> Path | None:
        """Write a checkpoint (main process). Partitioned weights and states are gathered first, by every process.
        `saving` stays True when it raises (a full disk, non-finite weights): save_after_failure does not try again."""
        self.saving = True
        self.state.budget_seconds = self.budget_spent()
        sharded = self.dist.sharded
        optimizer = self.dist.optimizer_state()  # whole tensors (a collective when they are partitioned)
        objective = self.objective.state_dict()  # e.g. NFT's old adapter (gathered when sharded: every process)
        trainable = {n: full_tensor(p).detach() if sharded else p for n, p in self.named_params.items()}
        ema = self.ema.state_dict() if self.ema else None
        if sharded and ema is not None:
            ema = {n: full_tensor(v) for n, v in ema.items()}
        exported = None
        if sharded:  # the LoRA's or the whole model's tensors, gathered (a collective)
            with self.ema.applied() if self.ema else contextlib.nullcontext(), self.dist.gathered():
                exported = self.policy.export_state()
        path = None
        if self.main:
            st = {
                "counters": vars(self.state),
                "tracker": self.tracker.state_dict() if self.tracker else None,
                "prompt_draws": self.draws.state_dict(),
                "config": to_dict(self.cfg),
                "base_model": self.base_model,  # the base weights' fingerprint (flowrl.run.basemodel)
            }
            extra = (
                {"lora" if self.cfg.lora.enabled else "model": functools.partial(self.export, exported=exported)}
                if self.policy.can_export
                else {}
            )
            with self.signals.deferred() as done:  # a second signal waits for the checkpoint to be whole
                path = write_checkpoint(
                    self.run_dir,
                    self.state.epochs_done,
                    trainable=trainable,
                    optimizer=optimizer,
                    ema=ema,
                    state=st,
                    extra_dirs=extra,
                    keep=self.cfg.checkpoint.keep,
                    protect=(self.state.best_epoch,) if self.cfg.checkpoint.keep_best else (),
                    objective=objective or None,
                    rollout=self.sampling_weights(),
                )
                done.append(f"checkpoint {path} is written (resume with checkpoint.resume=auto)")
        self.saved = ((self.state.epochs_done, self.state.optimizer_steps), path)
        self.saving = False
        self.acc.wait_for_everyone()
        return path

    def export(self, directory: Path, exported: dict | None = None) -> None:
        """The trained weights (their EMA when on) in the format their library loads, into `directory`;
        `exported`: the gathered tensors when sharded."""
        if exported is not None:
            self.policy.export(directory, state=exported)
            return
        with self.ema.applied() if self.ema is not None else contextlib.nullcontext():
            self.policy.export(directory)

    def load(self, path: Path, ck: dict) -> None:
        """Continue from checkpoint `path` (read: `ck`). A changed model, adapter or batch shape is refused with the
        differing keys, other base weights with the files that differ; other config changes are listed in a
        warning. Counters this flowrl does not know (a newer flowrl's checkpoint) are refused, naming them."""
        known = {f.name for f in dataclasses.fields(State)}
        unknown = sorted(set(ck["state"]["counters"]) - known)
        if unknown:
            raise CheckpointError(
                f"{path / 'state.json'} holds counters this flowrl does not know ({', '.join(unknown)}): it was "
                "written by a newer flowrl; resume it with that version (or start a new run)"
            )
        check_resume(ck, path, self.cfg, warn=self.main, current=self.base_model)
        if path != self.base_checked:  # (the checkpoint checked before the model loaded was another)
            check_base(ck["state"], path, self.base_model, self.cfg.checkpoint.allow_other_base)
        check_weights(self.named_params, ck["trainable"], path)
        if self.ema is not None and "ema" in ck:
            check_weights(self.named_params, ck["ema"], path, "EMA weights")
        self.dist.load_trained(self.named_params, ck["trainable"])
        self.dist.load_optimizer_state(ck)
        st = ck["state"]
        if self.ema is not None and "ema" in ck:
            self.ema.load_state_dict({n: distributed.like(v, self.named_params[n]) for n, v in ck["ema"].items()})
        if self.tracker is not None and st.get("tracker"):
            self.tracker.load_state_dict(st["tracker"])
        if st.get("prompt_draws"):  # (a checkpoint from before data.skip_no_signal: its draws resume in place)
            self.draws.load_state_dict(st["prompt_draws"])
        self.objective.load_state_dict(ck.get("objective", {}), distributed.like)
        if "rollout" in ck and self.rollouts is not None:  # rollout.async: what the next epoch samples with
            saved = ck["rollout"]
            self.resumed_sampling = (
                int(saved["version"]),
                {n.removeprefix("trainable/"): t for n, t in saved.items() if n.startswith("trainable/")},
                {n.removeprefix("objective/"): t for n, t in saved.items() if n.startswith("objective/")},
            )
        self.state = State(**st["counters"])
        self.saved = ((self.state.epochs_done, self.state.optimizer_steps), path)
        self.encode_as_before()
        set_rng_state(ck["rng_tensors"], st["rng"])
        if self.main:
            print(f"resumed from {path} after {_epochs(self.state.epochs_done)}")


def train(cfg: Config) -> dict:
    """Build a Trainer from `cfg` and run it; returns the last epoch's metrics."""
    try:
        return Trainer(cfg).fit()
    finally:
        # leave no gloo/NCCL threads running into interpreter shutdown (they abort the process there)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
