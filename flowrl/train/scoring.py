"""Rewards and advantages: scoring a rollout with the configured rewards, their metrics, and the advantages of the
whole batch (gathered over the processes) by the configured rule.

A sample a reward cannot score (+-inf, or NaN where NaN does not mean "does not apply") is left out of the
advantages and the loss, counted in `reward/nonfinite_count`.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import warnings
from pathlib import Path

import torch

from flowrl import core
from flowrl.eval.diversity import distribution_metrics, histograms, is_count, load_free_reference
from flowrl.offload import Parked, modules_in, visiting

from .prompts import groups_with_signal


def build_reward_fns(cfg, kind: str) -> list:
    """The configured rewards, built (registered names, plug-ins `module:function` / `file.py:function`, and the
    rewards of installed packages)."""
    import rewards

    return [
        rewards.build(
            spec.target, dict(spec.kwargs), kind, video_frames=spec.video_frames, video_aggregate=spec.video_aggregate
        )
        for spec in cfg.rewards
    ]


def scores_each_sample(fn) -> bool:
    """Whether reward `fn` declares `per_sample = True` (on the reward, its class or a plug-in function): its score
    and components of a sample depend on that sample, its prompt and its columns alone, bit for bit, whatever else
    the call holds, and it may be called from a thread of its own. Only such rewards are scored chunk by chunk while
    the rollout goes on (rollout.overlap_rewards); the others see the whole batch after the rollout, as without it."""
    return getattr(fn, "per_sample", False) is True


def invalid_scores(scores: torch.Tensor, weights: torch.Tensor, nan_is_missing: bool) -> torch.Tensor:
    """Which samples of scores [N, K] cannot be scored [N] bool: a reward gave +-inf, or NaN where NaN is not
    "does not apply" (`nan_is_missing` False: image rewards always return a number), or no weighted reward
    applies at all (every one with a non-zero weight gave NaN / None)."""
    inf = torch.isinf(scores).any(1)
    nan = torch.isnan(scores)
    weighted = weights != 0
    none_apply = nan[:, weighted].all(1)
    return inf | none_apply | (torch.zeros_like(inf) if nan_is_missing else nan.any(1))


def combine_advantages(
    cfg,
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    prompts: list[str],
    tracker: core.PerPromptStatTracker | None,
    penalty: torch.Tensor | None = None,
) -> torch.Tensor:
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


def adv_metrics(adv: torch.Tensor, keep: torch.Tensor) -> dict:
    """The advantages' summary of this process's samples [B], and the share `keep` [B] trains."""
    return {
        "adv/mean": adv.mean().item(),
        "adv/std": adv.std().item() if len(adv) > 1 else 0.0,
        "adv/abs_max": adv.abs().max().item(),
        "adv/kept_frac": keep.float().mean().item(),
    }


class Scorer:
    """The run's rewards (built once; with train.offload each local reward model waits in CPU memory and visits its
    device only while it scores), DDPO's per-prompt tracker when train.per_prompt_stats is on, and the
    computations of an epoch's scoring phase. `dist` answers the questions across processes."""

    def __init__(self, cfg, policy, dist, run_dir: Path, main: bool):
        t = cfg.train
        self.cfg, self.policy, self.dist, self.run_dir, self.main = cfg, policy, dist, run_dir, main
        self.fns = build_reward_fns(cfg, policy.reward_kind)
        modules = [modules_in(fn) if t.offload else [] for fn in self.fns]
        self.parked = [Parked(m) if m else None for m in modules]
        self.tracker = core.PerPromptStatTracker(t.stat_buffer_size, t.stat_min_count) if t.per_prompt_stats else None
        self.group_signal: list[bool] = []  # the last epoch's groups: which had a reward that differed (skip_no_signal)
        self.count_totals: dict[str, float] = {}  # reward_metrics': the last batch's free-attribute counts, summed
        self.weights = torch.tensor([r.weight for r in cfg.rewards])
        # eval.free_reference (None: off): the training rollouts' free counts are measured against it too
        self.free_reference = load_free_reference(cfg.eval.free_reference)
        pairwise = [r.name for r in cfg.rewards if r.pairwise]
        if pairwise and dist.world > 1:
            from flowrl.errors import ConfigError

            raise ConfigError(
                f"rewards {', '.join(pairwise)}: pairwise (win rates within a group) needs each group on one "
                f"process, and this run has {dist.world}: launch one process, or set pairwise: false"
            )

    def set_reward_state(self, epoch: int, optimizer_steps: int, max_steps: int) -> None:
        """Keep what TRL-style rewards see as `trainer_state` current."""
        state = self.policy.reward_state
        state.global_step, state.epoch = optimizer_steps, float(epoch)
        state.max_steps = max_steps

    def overlapped(self) -> list[int]:
        """The rewards (indices) that rollout.overlap_rewards scores chunk by chunk during the rollout: those that
        declare `per_sample` (`scores_each_sample`) and hold no model offloaded by train.offload (it would visit
        the device while the rollout uses it); [] when the key is off or the backend is text (no effect there)."""
        if not self.cfg.rollout.overlap_rewards or self.policy.reward_kind != "image":
            return []
        return [
            k for k, (fn, parked) in enumerate(zip(self.fns, self.parked)) if parked is None and scores_each_sample(fn)
        ]

    def columns(self, batch) -> dict[str, list]:
        """The batch's metadata columns, as rewards take them (one list per column)."""
        return {k: [m.get(k) for m in batch.metadata] for k in {k for m in batch.metadata for k in m}}

    def score_rewards(self, batch, which: list[int]) -> dict[int, tuple[torch.Tensor, dict]]:
        """Rewards `which` (indices) on `batch`: for each, its scores [B] and its components {name: [B]}."""
        columns = self.columns(batch)
        out = {}
        for k in which:
            fn = self.fns[k]
            with visiting(self.parked[k]):
                s = self.policy.call_reward(fn, batch, columns)
            out[k] = s, dict(getattr(fn, "last_components", None) or {})
        return out

    def score(
        self,
        batch,
        epoch: int = 0,
        *,
        optimizer_steps: int = 0,
        max_steps: int = 0,
        scored: dict[int, tuple[torch.Tensor, dict]] | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """Per-reward scores [B_local, K] and extra components, from this process's outputs. `scored`: the rewards
        already scored (by `OverlappedScoring`), by index; the others are scored now, on the whole batch."""
        self.set_reward_state(epoch, optimizer_steps, max_steps)
        scored = dict(scored or {})
        scored.update(self.score_rewards(batch, [k for k in range(len(self.fns)) if k not in scored]))
        scores, components = [], {}
        for k, spec in enumerate(self.cfg.rewards):
            s, parts = scored[k]
            if spec.pairwise:  # Pref-GRPO: each sample's win rate in its group
                parts = {**parts, "raw": s}
                s = self.win_rates(self.fns[k], batch, s)
            scores.append(s)
            for name, v in parts.items():
                components[f"{spec.name}/{name}"] = torch.as_tensor(v, dtype=torch.float32).reshape(-1)
        return torch.stack(scores, 1), components

    def win_rates(self, fn, batch, scores: torch.Tensor) -> torch.Tensor:
        """A pairwise reward's training scores [B]: per group (batch.group_ids), each sample's win rate against the
        others (core.win_rates), the preferences from the reward's judge `compare(images_a, images_b, prompts,
        **columns) -> P(a beats b)` when it has one, else from its scores (core.scalar_preferences). A sample with
        no finite score stays as it is (it is left out of the advantages anyway)."""
        out = scores.clone().float()
        gids = batch.group_ids.tolist()
        columns = self.columns(batch)
        judge = getattr(fn, "compare", None)
        for g in dict.fromkeys(gids):
            rows = [i for i, x in enumerate(gids) if x == g and torch.isfinite(scores[i])]
            if not rows:
                continue
            if judge is None or not hasattr(batch, "images"):
                prefs = core.scalar_preferences(scores[rows])
            else:
                pairs = [(i, j) for a, i in enumerate(rows) for j in rows[a + 1 :]]
                prefs = torch.full((len(rows), len(rows)), 0.5)
                if pairs:
                    pos = {r: n for n, r in enumerate(rows)}
                    cols = {k: [v[i] for i, _ in pairs] for k, v in columns.items()}
                    p = judge(
                        [batch.images[i] for i, _ in pairs],
                        [batch.images[j] for _, j in pairs],
                        [batch.prompts[i] for i, _ in pairs],
                        **cols,
                    )
                    p = torch.as_tensor(p, dtype=torch.float32).reshape(-1)
                    for (i, j), pij in zip(pairs, p.tolist()):
                        prefs[pos[i], pos[j]], prefs[pos[j], pos[i]] = pij, 1.0 - pij
            out[rows] = core.win_rates(prefs)
        return out

    def invalid(self, all_scores: torch.Tensor) -> torch.Tensor:
        """`invalid_scores` of the whole batch's scores [N, K] under this run's weights (a text reward's NaN is its
        None: "does not apply"; an image reward's is invalid)."""
        return invalid_scores(all_scores, self.weights, nan_is_missing=self.policy.reward_kind == "text")

    def advantages(self, batch, scores: torch.Tensor, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Advantages of this process's samples from the whole batch's rewards, which samples to train, and how many
        samples of the batch had a non-finite reward (left out of the advantages and the loss)."""
        all_scores = self.dist.gather(scores)
        all_gids = self.dist.gather(batch.group_ids)
        invalid = self.invalid(all_scores)
        valid = ~invalid
        n_bad = int(invalid.sum())
        if n_bad:
            bad_rewards = [
                r.name for k, r in enumerate(self.cfg.rewards) if not torch.isfinite(all_scores[invalid, k]).all()
            ]
            warnings.warn(
                f"epoch {epoch + 1}: {n_bad} of {len(all_scores)} samples have a non-finite reward "
                f"({', '.join(bad_rewards)}: NaN or inf); they are left out of the advantages and the loss",
                stacklevel=2,
            )
        prompts = [batch.epoch_prompts[g] for g in all_gids[valid].tolist()]
        penalty = self.policy.reward_penalty(batch)
        penalty = self.dist.gather(penalty).double()[valid] if penalty is not None else None
        adv_all = torch.zeros(len(all_scores), dtype=torch.float32)
        if valid.any():
            scored = all_scores.double()[valid].masked_fill(torch.isinf(all_scores[valid]), float("nan"))
            adv_all[valid] = combine_advantages(
                self.cfg, scored, all_gids[valid], prompts, self.tracker, penalty
            ).float()
        n_groups = len(batch.epoch_prompts)
        self.group_signal = groups_with_signal(all_scores[valid], all_gids[valid], n_groups)
        keep_all = valid.clone()
        if self.cfg.train.drop_zero_adv_groups:
            nonzero = torch.zeros(int(all_gids.max()) + 1, dtype=torch.bool).index_put_(
                (all_gids,), adv_all != 0, accumulate=True
            )
            keep_all &= nonzero[all_gids]
        local = len(batch.prompts)
        sl = slice(self.dist.rank * local, self.dist.rank * local + local)
        return adv_all[sl], keep_all[sl], n_bad

    def log_outputs(
        self, batch, scores: torch.Tensor, adv: torch.Tensor, epoch: int, extra: dict | None = None
    ) -> None:
        """Append this process's (prompt, completion, rewards, advantage) rows to completions.jsonl (main
        process; text backends)."""
        outputs = self.policy.describe_outputs(batch)
        if outputs is None or not self.main:
            return
        names = [r.name for r in self.cfg.rewards]
        with open(self.run_dir / "completions.jsonl", "a") as f:
            for i, (p, c) in enumerate(zip(batch.prompts, outputs)):
                row = {
                    "epoch": epoch,
                    "prompt": p,
                    "completion": c,
                    "advantage": round(float(adv[i]), 5),
                    "rewards": {
                        n: (None if not torch.isfinite(scores[i, k]) else float(scores[i, k]))
                        for k, n in enumerate(names)
                    },
                }
                if getattr(batch, "turns", None):  # a multi-turn rollout: its turns, tool calls and replies
                    row["turns"] = batch.turns[i]
                row.update({col: values[i] for col, values in (extra or {}).items() if i < len(values)})
                f.write(json.dumps(row, default=str) + "\n")

    def reward_logs(self) -> dict[str, float]:
        """What the rewards logged with `log_metric` this epoch (TRL's reward API), averaged over processes."""
        logs = self.policy.pop_reward_logs()
        if self.dist.world > 1:
            from accelerate.utils import gather_object

            everyone = gather_object([logs])
            keys = sorted({k for d in everyone for k in d})
            logs = {k: sum(d[k] for d in everyone if k in d) / sum(k in d for d in everyone) for k in keys}
        return logs

    def reward_metrics(self, scores: torch.Tensor, components: dict) -> dict:
        """The whole batch's reward metrics: each reward's mean, std and share it applies to (finite scores only),
        the weighted total's mean, the components' means, and the free-attribute counts' distribution."""
        all_scores = self.dist.gather(scores)
        m = {}
        for k, spec in enumerate(self.cfg.rewards):
            col = all_scores[:, k]
            col = col[torch.isfinite(col)]  # NaN: does not apply (or invalid: counted in reward/nonfinite_count)
            m[f"reward/{spec.name}_mean"] = col.mean().item() if len(col) else float("nan")
            m[f"reward/{spec.name}_std"] = col.std().item() if len(col) > 1 else 0.0
            m[f"reward/{spec.name}_applies"] = len(col) / len(all_scores)
        # the total over the samples that train (as combine_advantages weighs them): none that a reward could not
        # score, none to which no weighted reward applies (a None is no 0)
        scored = ~self.invalid(all_scores)
        total = (all_scores[scored] * self.weights).nansum(1)
        m["reward/total_mean"] = total.mean().item() if len(total) else float("nan")
        counts = {}
        for name, v in components.items():
            if is_count(name):  # free-attribute counts: a distribution, not a mean
                counts[name] = self.dist.gather(v)
            else:
                m[f"reward/{name}_mean"] = self.dist.gather(v).mean().item()
        m.update(distribution_metrics(histograms(counts), prefix="reward/diversity/", reference=self.free_reference))
        # each count summed over every process's images, a non-finite one as 0 (as count_features reads it)
        self.count_totals = {
            n: float(torch.nan_to_num(torch.as_tensor(v, dtype=torch.float64), nan=0.0, posinf=0.0, neginf=0.0).sum())
            for n, v in counts.items()
        }
        return m


def count_names(components: dict[str, torch.Tensor]) -> list[str]:
    """The names of count_features' columns, in its order ([] when no reward reports a count)."""
    return sorted(n for n in components if is_count(n))


def count_features(components: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The free-attribute counts among the score components (name -> [B], flowrl.eval.diversity's
    "<reward>/free_<attribute>=<value>") as one matrix [B, F], a column per count in the order of their sorted
    names; None when no reward reports any. A row says what its image drew where the prompt left things free
    (train.dpo.pairing=matched pairs by it); a count that is not finite (a reward that did not apply) is 0."""
    names = count_names(components)
    if not names:
        return None
    counts = torch.stack([torch.as_tensor(components[n], dtype=torch.float32).reshape(-1) for n in names], 1)
    return torch.nan_to_num(counts, nan=0.0, posinf=0.0, neginf=0.0)


class OverlappedScoring:
    """rollout.overlap_rewards: rewards `which` score each finished rollout call's images (`submit`, the rollout's
    `on_chunk`) on one thread of their own while the next call samples; `finish` waits for the last and returns
    their scores and components over the whole batch, in the rollout's order (`Scorer.score`'s `scored`).

    Chunks wait in a queue of `depth` (a full queue holds the rollout back). A reward that raises stops the thread;
    its exception is raised in the rollout's thread, unchanged, at the next `submit` or at `finish`. Leaving the
    `with` block before `finish` (a stop signal abandoned the rollout, or an error) drops the chunks not yet scored
    and joins the thread once the call it is in returns. `busy`: the seconds the thread spent scoring."""

    def __init__(self, scorer: Scorer, which: list[int], depth: int = 2):
        self.scorer, self.which = scorer, which
        self.chunks: queue.Queue = queue.Queue(maxsize=depth)
        self.results: list[dict[int, tuple[torch.Tensor, dict]]] = []
        self.error: BaseException | None = None
        self.busy = 0.0
        self.thread = threading.Thread(target=self._work, name="flowrl-reward-overlap", daemon=True)

    def __enter__(self) -> OverlappedScoring:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if not self.thread.is_alive():
            return
        while True:  # drop what waits; the thread ends at the sentinel, after the call it is in
            try:
                self.chunks.get_nowait()
            except queue.Empty:
                break
        self.chunks.put(None)
        self.thread.join()

    def _work(self) -> None:
        while (part := self.chunks.get()) is not None:
            t0 = time.perf_counter()
            try:
                self.results.append(self.scorer.score_rewards(part, self.which))
            except BaseException as e:  # raised in the rollout's thread
                self.error = e
                return
            finally:
                self.busy += time.perf_counter() - t0

    def _put(self, item) -> None:
        while True:
            self._raise()
            try:
                self.chunks.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, part) -> None:
        """Score one rollout call's images (an ImageBatch) once the thread gets to them."""
        self._put(part)

    def finish(self) -> dict[int, tuple[torch.Tensor, dict]]:
        """Wait for every submitted chunk; the rewards' scores [B] and components {name: [B]}, chunks in order."""
        self._put(None)
        self.thread.join()
        self._raise()
        out = {}
        for k in self.which:
            parts = [r[k] for r in self.results]
            names = list(parts[0][1]) if parts else []
            if any(list(p[1]) != names for p in parts):
                raise ValueError(
                    f"reward {self.scorer.cfg.rewards[k].name!r} declares per_sample but gave other components on "
                    f"other calls ({names} and {[list(p[1]) for p in parts if list(p[1]) != names][0]}); give the "
                    f"same names on every call, or drop per_sample"
                )
            components = {n: torch.cat([torch.as_tensor(p[1][n]).reshape(-1) for p in parts]) for n in names}
            out[k] = torch.cat([p[0] for p in parts]), components
        return out
