"""The held-out eval, one code path for `flowrl train` (before, during and after training) and `flowrl eval`.

Deterministic (ODE) sampling of the eval plan's prompts with the eval settings, every reward's scores and their
break-down, and the diversity metrics against the base model's eval: the free attributes' distribution
(`BaseDistribution`) and, with eval.diversity_features, the feature-space spread and distance (`BaseFeatures`).
The base model's eval is the first one made of the base model (a run's eval before training, or `flowrl eval`
without a checkpoint), kept in a directory with the settings it was sampled with; an eval sampled with other
settings does not pair with it and is not compared.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flowrl.errors import FlowrlError
from flowrl.offload import Parked, visiting

from .diversity import (
    BaseDistribution,
    BaseFeatures,
    BaseMetrics,
    eval_settings,
    feature_metrics,
    group_features,
    histograms,
    load_free_reference,
    prompt_keys,
    settings_differences,
)
from .summary import eval_plan, eval_summary


def build_feature_encoder(cfg, device: torch.device):
    """The vision backbone of eval.diversity_features (`rewards.features.ImageEncoder`: images -> [N, D]
    L2-normalised float32 features), in float32 on `device`."""
    from rewards.features import ImageEncoder

    return ImageEncoder(cfg.eval.diversity_features, None, device, torch.float32)


class EvalBaseError(FlowrlError, ValueError):
    """A base-model eval to compare with that cannot be: none in the directory given, or sampled otherwise."""


def base_for_eval(base: str | None, checkpoint: str | None, settings: dict) -> Path | None:
    """The directory whose base-model eval (`eval-base-distribution.json`, `eval-base-features.safetensors`) an eval
    of `checkpoint` compares with: `base` (flowrl eval --base), else the checkpoint's run directory when it holds one
    (its eval before training wrote it), else None. The base's eval must have been sampled with this eval's
    `settings` (`flowrl.eval.diversity.eval_settings`: prompts, steps, CFG, seed, size), else its images do not pair
    with these: a `base` that differs is an EvalBaseError naming the differences; a run directory that differs (e.g.
    an eval of the run's checkpoint on other prompts) is not compared with (a warning says so)."""

    def holds(d: Path) -> bool:
        return BaseDistribution(d).path.exists() or BaseFeatures(d).exists() or BaseMetrics(d).path.exists()

    def differences(d: Path) -> list[str]:
        stores = (BaseDistribution(d), BaseFeatures(d), BaseMetrics(d))
        found = [store.settings() for store in stores if store.path.exists()]
        return sorted({line for stored in found for line in settings_differences(stored, settings)})

    if base:
        where = Path(base)
        if not holds(where):
            raise EvalBaseError(
                f"--base {where} holds no base-model eval ({BaseMetrics(where).path.name}, "
                f"{BaseDistribution(where).path.name} or {BaseFeatures.NAME}): pass a training run's directory (its "
                f"eval before training writes them) or the --out of `flowrl eval` of the base model (no --checkpoint)"
            )
        unlike = differences(where)
        if unlike:
            raise EvalBaseError(
                f"--base {where} holds a base-model eval sampled with other settings than this "
                f"eval's ({'; '.join(unlike)}), whose images do not pair with these: give this eval "
                f"the base's settings, or make a base with this eval's (`flowrl eval` of the same "
                f"config and overrides without --checkpoint, --out DIR)"
            )
        return where
    if checkpoint and holds(Path(checkpoint).parent):
        run = Path(checkpoint).parent
        unlike = differences(run)
        if unlike:
            warnings.warn(
                f"the run directory {run} holds the base model's eval with other settings than this eval's "
                f"({'; '.join(unlike)}): no comparison with the base model (pass --base DIR of a base eval "
                f"with these settings to compare)",
                stacklevel=2,
            )
            return None
        return run
    return None


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


def images_per_call(sample_cfg, processes: int = 1) -> int:
    """The images an eval samples per model call: sample.rollout_batch_size when set, else one process's share of
    the training epoch's batch (prompts_per_epoch x group_size / processes), the most a training rollout samples
    in one call. Chunking changes no image (each keeps its own initial noise) and keeps an eval of many prompts
    within the memory that training's rollout needs."""
    if sample_cfg.rollout_batch_size:
        return sample_cfg.rollout_batch_size
    return max(1, sample_cfg.prompts_per_epoch * sample_cfg.group_size // max(1, processes))


class Evaluator:
    """The eval of a config: its plan (prompts, metadata and eval settings, fixed once), its sampling and scoring,
    and its comparison with the base model's eval. The feature backbone loads at its first use (with `offload`:
    in CPU memory, on `device` only while it embeds)."""

    def __init__(self, cfg, eval_set, device, *, offload: bool = False):
        self.cfg, self.device, self.offload = cfg, torch.device(device), offload
        self.prompts, self.meta, self.eval_cfg = eval_plan(eval_set, cfg.eval)
        self.settings = eval_settings(
            self.prompts, self.meta, self.eval_cfg, cfg.sample, cfg.text if cfg.backend == "text" else None
        )
        self.reference = load_free_reference(cfg.eval.free_reference)  # None (off), 'uniform' or its mapping
        self.encoder, self.parked_encoder = None, None
        self.warned: set[Path] = set()  # the base files a warning was given about (once each)

    # ---- sampling and scoring

    def _share(self, rank: int, world: int) -> slice:
        """The contiguous part of the plan's prompts that process `rank` of `world` samples."""
        share = -(-len(self.prompts) // world)
        return slice(min(len(self.prompts), rank * share), min(len(self.prompts), (rank + 1) * share))

    def encode_as_sampled(self, policy, *, rank: int = 0, world: int = 1, processes: int | None = None) -> None:
        """The prompt encodings `sample` (with the same arguments) makes, without sampling (a policy that caches
        none: nothing): what an eval read from eval.base_cache leaves behind, as sampling it would."""
        encode = getattr(policy, "encode_as_eval", None)
        if encode is not None:
            per_call = images_per_call(self.cfg.sample, processes or world)
            encode(self.prompts, self.eval_cfg, self._share(rank, world), per_call=per_call)

    def sample(
        self,
        policy,
        reward_fns: list,
        *,
        parked=(),
        rank: int = 0,
        world: int = 1,
        stop=None,
        processes: int | None = None,
        progress: bool = False,
    ) -> tuple[list, dict[str, torch.Tensor]]:
        """(outputs [N], {reward or reward/component: scores [N]}) of the plan's prompts, prompt-major. With `world`
        processes each samples a contiguous share and every process gets the whole (a collective); `parked`: the
        rewards' offloaded models, put on their device while the eval runs; `stop()`: called between the eval's
        batches and rewards, it raises to abandon the eval (a stop signal; the shares' batches differ in number, so
        it is for one process, or processes that sample every prompt alike). Images are sampled in calls of
        `images_per_call(cfg.sample, processes)` (`processes`: the run's process count, `world` when not given),
        the size of a training rollout's calls, so an eval fits where training does. `progress`: a bar over
        this process's outputs."""
        part = self._share(rank, world)
        image = policy.reward_kind == "image"
        bar = tqdm(
            total=(part.stop - part.start) * (self.eval_cfg.images_per_prompt if image else 1),
            desc="eval",
            unit="image" if image else "completion",
            leave=False,
            disable=not progress,
        )
        with contextlib.ExitStack() as on_device, bar:
            for p in parked:
                on_device.enter_context(visiting(p))
            outputs, per_reward, components = policy.evaluate_prompts(
                self.prompts,
                self.meta,
                reward_fns,
                self.eval_cfg,
                part=part,
                stop=stop,
                per_call=images_per_call(self.cfg.sample, processes or world),
                on_batch=bar.update,
            )
        scores = {spec.name: vals for spec, vals in zip(self.cfg.rewards, per_reward)}
        scores.update(components)
        if world > 1:
            from accelerate.utils import gather_object

            outputs, scores = merge_eval_shares(gather_object([(outputs, {k: v.cpu() for k, v in scores.items()})]))
        return outputs, scores

    # ---- against the base model

    def results(
        self,
        outputs: list,
        scores: dict[str, torch.Tensor],
        *,
        base_dir: Path | None,
        this_is_base: bool,
        save_base_to: Path | None = None,
    ) -> dict[str, float]:
        """The eval's metrics: each score's mean (and per group), the free attributes' distributions and, with
        eval.diversity_features, the feature diversity; compared with the base model's eval in `base_dir` when it
        holds one sampled with these settings. When it holds none and `this_is_base` (the model evaluated is the base
        model), this eval is its own base, written to `save_base_to` (if given) for the later evals."""
        stored_dir = Path(base_dir) if base_dir is not None else None
        hists = histograms(scores)
        base = None
        store = BaseDistribution(stored_dir) if stored_dir is not None else None
        stored = store.load() if store is not None else None
        if stored is not None:
            base = None if self._unlike(store) else stored
        elif this_is_base and hists:
            base = hists
            if save_base_to is not None:
                BaseDistribution(save_base_to).save(hists, self.settings)
        text = self.cfg.backend == "text"  # a text reward's None (NaN here) does not apply: no score, no failure
        out = eval_summary(
            scores, self.meta, self.cfg.eval.group_by, base, reference=self.reference, nan_is_absent=text
        )
        if self.cfg.eval.diversity_features:
            out.update(self.feature_diversity(outputs, stored_dir, this_is_base, save_base_to))
        if this_is_base and save_base_to is not None and (stored_dir is None or not BaseMetrics(stored_dir).load()):
            BaseMetrics(save_base_to).save(out, self.settings)
        return out

    def feature_diversity(
        self, images: list, base_dir: Path | None, this_is_base: bool, save_base_to: Path | None
    ) -> dict[str, float]:
        """`flowrl.eval.diversity.feature_metrics` of the eval images [N], grouped by their prompts, against the base
        model's features in `base_dir` (by the same backbone, sampled with these settings)."""
        backbone = self.cfg.eval.diversity_features
        if self.encoder is None:
            self.encoder = build_feature_encoder(self.cfg, self.device)
            if self.offload:
                self.parked_encoder = Parked([self.encoder.model])
        with visiting(self.parked_encoder):
            groups = group_features(
                self.encoder(images), prompt_keys(self.prompts, self.meta, self.eval_cfg.images_per_prompt)
            )
        store = BaseFeatures(base_dir) if base_dir is not None else None
        found = store.load() if store is not None else None
        base = None
        if found is not None and found[1] == backbone:
            base = None if self._unlike(store) else found[0]
        elif this_is_base:  # this model is the base model: its features are the base's
            base = groups
            if save_base_to is not None:
                BaseFeatures(save_base_to).save(groups, backbone, self.settings)
        elif found is not None and store.path not in self.warned:
            self.warned.add(store.path)
            warnings.warn(
                f"{store.path} holds the base model's features by {found[1]!r}, not by "
                f"eval.diversity_features={backbone}: the comparisons with the base model are left out",
                stacklevel=2,
            )
        return feature_metrics(groups, base)

    def _unlike(self, store) -> bool:
        """Whether a stored base-model eval (`BaseDistribution` or `BaseFeatures`) was sampled with other settings than
        this eval's (e.g. a run resumed with another eval.num_steps or other eval prompts): its images do not pair
        with these, so the comparisons with it are left out (warned once per file)."""
        differences = settings_differences(store.settings(), self.settings)
        if differences and store.path not in self.warned:
            self.warned.add(store.path)
            warnings.warn(
                f"{store.path} holds the base model's eval with other settings ({'; '.join(differences)}): "
                f"its comparisons with the base model (*_from_base) are left out; resume with the eval "
                f"settings the run started with to compare",
                stacklevel=3,
            )
        return bool(differences)

    # ---- what is written

    def write_outputs(self, policy, outputs: list, scores: dict[str, torch.Tensor], path: Path) -> Path | None:
        """The eval's outputs next to `path` (an image grid with the headline reward's scores, a JSONL of
        completions); returns the file."""
        prompts, headline = self.prompts, scores[self.cfg.rewards[0].name]
        keep = self.eval_cfg.grid_images
        if policy.reward_kind == "image" and keep and len(outputs) > keep:  # the grid shows a share of each prompt's
            per_image = [q for q in self.prompts for _ in range(len(outputs) // len(self.prompts))]
            idx = grid_subset(per_image, keep)
            outputs, prompts = [outputs[i] for i in idx], [per_image[i] for i in idx]
            headline = torch.as_tensor(headline)[idx]
        return policy.save_eval_outputs(outputs, prompts, path, scores=headline)


def grid_subset(prompts: list[str], keep: int) -> list[int]:
    """eval.grid_images: the indices of the images an eval grid shows out of `prompts` (the plan's, one entry per
    image, a prompt's images in a row): the first ceil(n_p * keep / N) of the n_p images of each prompt, N all of
    them, so that every prompt keeps the same share (an eval of 4x the images per prompt shows the grid of the
    eval it grew from)."""
    out, start = [], 0
    for _, run in itertools.groupby(prompts):
        n = len(list(run))
        out.extend(range(start, start + -(-n * keep // len(prompts))))
        start += n
    return out
