"""The checks of a built config that need more than a field's type: every numeric field's range (each section's
RANGES), and the relations between keys (the objective in use checks its own section: `Objective.check`)."""

from __future__ import annotations

import difflib
import math
from typing import Any

from flowrl.errors import ConfigError
from flowrl.objectives import get_objective

from .tree import Config, section_ranges

#: The valid range of every numeric field (list fields: each item), by dotted key, from each section's RANGES; a
#: test walks the tree and asserts that each numeric field has one and refuses a value outside it.
RANGES = section_ranges()


def _get_dotted(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def range_problems(cfg: Config) -> list[str]:
    """Every numeric field outside its `RANGES` entry, as "key must be ..., got value" lines (list fields are
    checked item by item; a null optional field is not checked)."""
    problems = []
    for key, valid in RANGES.items():
        if key.startswith("rewards."):
            values = [
                (f"rewards[{i}].{key.split('.', 1)[1]}", getattr(r, key.split(".", 1)[1]))
                for i, r in enumerate(cfg.rewards)
            ]
        else:
            value = _get_dotted(cfg, key)
            values = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
        problems.extend(
            f"{name} must be {'a finite number ' if _non_finite(v) and 'finite' not in valid.text() else ''}"
            f"{valid.text()}, got {v!r}"
            for name, v in values
            if v is not None and v not in valid
        )
    return problems


def _non_finite(v) -> bool:
    return isinstance(v, float) and not math.isfinite(v)


#: reward labels the metrics use for themselves (`reward/total_mean`: the weighted sum of the rewards)
RESERVED_REWARD_NAMES = ("total",)


def _reward_name_problems(cfg: Config) -> list[str]:
    """Each reward has a name of its own in the metrics (`reward/NAME_mean`, `eval/NAME`): two of one name would
    write one metric, so they are refused (not suffixed: a metric's name does not depend on the order of the list)."""
    problems, first = [], {}
    for i, r in enumerate(cfg.rewards):
        if not r.reward and r.name.endswith(".py"):  # a plug-in's file without its function
            problems.append(
                f"rewards[{i}].name={r.name!r} names a file but no function in it; a plug-in is "
                f"'{r.name}:FUNCTION' (file.py:function)"
            )
        elif not r.name.strip():
            problems.append(
                f"rewards[{i}].name is empty; give a registered name, a plug-in 'path/to/file.py:function' or "
                "'package.module:function', or a label (what it builds in `reward`)"
            )
        elif r.name in RESERVED_REWARD_NAMES:
            problems.append(
                f"rewards[{i}].name={r.name!r} is reserved: reward/{r.name}_mean is the weighted sum of every reward "
                f"in the metrics; label it otherwise, e.g. {{name: {r.name}_score, reward: {r.reward or 'REWARD'}}}"
            )
        elif "/" in r.name:
            problems.append(
                f"rewards[{i}].name={r.name!r}: a reward's name in the metrics has no '/'; give a registered name, a "
                f"plug-in 'path/to/file.py:function' or 'package.module:function', or a label without '/' (what it "
                f"builds in `reward`)"
            )
        if r.name in first:
            problems.append(
                f"rewards[{first[r.name]}] and rewards[{i}] are both named {r.name!r} in the metrics; give one "
                f"a name of its own and what it builds as `reward`, e.g. {{name: {r.name}_2, reward: {r.target}}}"
            )
        first.setdefault(r.name, i)
    return problems


def _family_problems(cfg: Config) -> list[str]:
    """model.family against the registered families (flowrl.families), and what the family allows (drop_t5; its
    step kernels are checked by the objective that samples with them)."""
    from flowrl.families import FAMILIES, family_names

    names = family_names()
    m = cfg.model
    if m.family == "auto":
        return []
    if m.family not in names:
        close = difflib.get_close_matches(m.family, names, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]}?" if close else ""
        return [f"model.family: {m.family!r} is not a registered family; valid: auto, {', '.join(names)}.{hint}"]
    if m.drop_t5 and not FAMILIES.get(m.family).t5_components:
        return [f"model.drop_t5 is for families with an optional T5 encoder (SD3/SD3.5), not model.family={m.family}"]
    return []


def _eval_features_problems(cfg: Config) -> list[str]:
    """eval.diversity_features: an image backend, and >= 2 images of every prompt (with eval.images_per_group the
    prompts' shares are checked with the prompts, by the preflight)."""
    e = cfg.eval
    if not e.diversity_features:
        return []
    if cfg.backend != "image":
        return [
            f"eval.diversity_features={e.diversity_features} embeds generated images, and backend={cfg.backend} "
            "makes text; set eval.diversity_features='' (off)"
        ]
    if not e.images_per_group and e.images_per_prompt < 2:
        return [
            f"eval.diversity_features measures how far apart each prompt's images are, and "
            f"eval.images_per_prompt={e.images_per_prompt} gives each prompt one; set eval.images_per_prompt=2 "
            "or more (or eval.images_per_group with eval.group_by), or eval.diversity_features='' (off)"
        ]
    return []


def _async_problems(cfg: Config) -> list[str]:
    """rollout.async: image rollouts, without rollout.overlap_rewards (the number of processes is checked when the
    run starts, before the model loads)."""
    if not cfg.rollout.async_:
        return []
    if cfg.backend != "image":
        return [
            f"rollout.async samples image rollouts in a worker process; backend={cfg.backend} generates in the "
            "trainer: set rollout.async=false"
        ]
    if cfg.rollout.overlap_rewards:
        return [
            "rollout.async and rollout.overlap_rewards cannot be combined (the worker's rollout returns whole); "
            "set rollout.overlap_rewards=false (the rewards still score while the worker samples the next epoch)"
        ]
    return []


def _engine_problems(cfg: Config) -> list[str]:
    """text.engine and its correction: a text run's keys; the correction needs an engine that is not the trainer."""
    t = cfg.text
    if cfg.backend != "text":
        if t.engine != "hf":
            return [f"text.engine={t.engine} samples text rollouts, and backend={cfg.backend}; leave text.engine=hf"]
        if t.tool_env:
            return [f"text.tool_env answers a language model's turns, and backend={cfg.backend}; set text.tool_env="]
        return []
    if t.engine == "vllm":
        from flowrl.urls import http_url_problem

        problem = {
            "host": "is not an http:// or https:// URL of a host",
            "port": "names a port that is not a number from 1 to 65535",
        }.get(http_url_problem(t.vllm_url))
        if problem:
            return [f"text.vllm_url={t.vllm_url!r} {problem}, e.g. text.vllm_url=http://127.0.0.1:8100"]
    if t.engine_correction != "none" and t.engine == "hf":
        return [
            f"text.engine_correction={t.engine_correction} corrects an inference engine's sampling numerics, and "
            "text.engine=hf samples with the trained model itself (nothing to correct): set text.engine=vllm, or "
            "text.engine_correction=none"
        ]
    if (
        t.engine == "vllm"
        and (t.top_k or t.top_p < 1)
        and not (t.old_log_probs == "forward" and t.engine_correction == "none")
    ):
        using = (
            f"text.engine_correction={t.engine_correction}"
            if t.engine_correction != "none"
            else "text.old_log_probs=sampling"
        )
        return [
            f"text.top_k={t.top_k} / text.top_p={t.top_p} with text.engine=vllm and {using}: vLLM's log-probs are "
            "those of the truncated distribution, the update's are over the whole vocabulary (as text.engine=hf "
            "records them), so the ratio would compare unlike things; set text.old_log_probs=forward "
            "text.engine_correction=none (the trainer's own log-probs), or leave top_k=0 and top_p=1"
        ]
    return []


#: the device types model.device may name (torch's; `auto` picks the accelerator's)
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "npu", "hpu")


def _device_problems(cfg: Config) -> list[str]:
    """model.device: `auto` or a torch device string of a known type (whether this machine has it is the
    preflight's check: a config may be planned for GPUs on a machine without one)."""
    import torch

    device = cfg.model.device
    if device == "auto":
        return []
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        kind = None
    if kind not in DEVICE_TYPES:
        return [
            f"model.device={device!r} is not a device: use auto (the accelerator's), or one of "
            f"{', '.join(DEVICE_TYPES)}, with an index where there are several (cuda:1)"
        ]
    return []


def validate(cfg: Config) -> None:
    """Value checks that need more than a type: every numeric field's range, and relations between keys."""
    s, t = cfg.sample, cfg.train
    problems = range_problems(cfg)
    problems.extend(_device_problems(cfg))
    if len(t.adam_betas) != 2:
        problems.append(
            f"train.adam_betas takes two numbers, Adam's (beta1, beta2), e.g. [0.9, 0.999]; got {t.adam_betas}"
        )
    batch = s.group_size * s.prompts_per_epoch
    if t.minibatch_size and batch % t.minibatch_size:
        problems.append(
            f"train.minibatch_size={t.minibatch_size} must divide the epoch batch "
            f"{batch} (= sample.prompts_per_epoch x sample.group_size)"
        )
    if s.rollout_batch_size and batch % s.rollout_batch_size:
        problems.append(f"sample.rollout_batch_size={s.rollout_batch_size} must divide the epoch batch {batch}")
    if t.per_prompt_stats and t.stat_min_count > t.stat_buffer_size:
        problems.append(
            f"train.stat_min_count={t.stat_min_count} exceeds train.stat_buffer_size="
            f"{t.stat_buffer_size}: the per-prompt statistics would never be used"
        )
    if cfg.data.eval_prompt_column and not cfg.data.eval_prompts:
        problems.append(
            f"data.eval_prompt_column={cfg.data.eval_prompt_column} names the prompt column of data.eval_prompts, "
            "which is not set (the eval reads the training prompts, in data.prompt_column); set data.eval_prompts, "
            "or leave data.eval_prompt_column empty"
        )
    problems.extend(_eval_features_problems(cfg))
    from flowrl.eval.diversity import free_reference_problems

    problems.extend(free_reference_problems(cfg.eval.free_reference))
    if cfg.eval.images_per_group and not cfg.eval.group_by:
        problems.append(
            f"eval.images_per_group={cfg.eval.images_per_group} shares images out over the groups of "
            "eval.group_by, which is not set; set eval.group_by (e.g. family) or images_per_group=0"
        )
    if cfg.lora.init_path and not cfg.lora.enabled:
        problems.append(
            f"lora.init_path={cfg.lora.init_path} starts a LoRA, and lora.enabled=false trains the model without one "
            "(the file would be ignored): set lora.enabled=true, or leave lora.init_path unset"
        )
    if not str(cfg.log.run_dir).strip():
        problems.append(
            "log.run_dir is empty: a run writes its checkpoints, metrics and grids there, so give it a directory "
            "of its own, e.g. log.run_dir=runs/my_run"
        )
    if not cfg.rewards:
        problems.append("rewards: at least one reward is needed")
    elif not any(r.weight for r in cfg.rewards):
        problems.append(
            f"rewards: every weight is 0 ({', '.join(r.name for r in cfg.rewards)}), so there is nothing "
            "to train on; give at least one reward a non-zero weight (weight 0 = report only)"
        )
    problems.extend(_reward_name_problems(cfg))
    from flowrl.sampling.acceleration import config_problems

    problems.extend(config_problems(cfg))
    if cfg.backend == "text" and cfg.rollout.overlap_rewards:
        problems.append(
            "rollout.overlap_rewards scores image rollouts while they sample; a text run scores its completions "
            "after generate(): set rollout.overlap_rewards=false"
        )
    problems.extend(_async_problems(cfg))
    problems.extend(_engine_problems(cfg))
    if cfg.backend == "image":
        problems.extend(_family_problems(cfg))
    if t.optimizer == "adamw_8bit" and t.sharding == "fsdp":
        problems.append(
            "train.optimizer=adamw_8bit cannot step FSDP's sharded weights (bitsandbytes' 8-bit states "
            "are per whole tensor); use train.optimizer=adamw with train.sharding=fsdp, or sharding=none"
        )
    if t.schedule_over == "budget" and not t.max_minutes:
        problems.append(
            "train.schedule_over=budget decays the lr over the time budget, and train.max_minutes is 0 "
            "(none); set train.max_minutes, or train.schedule_over=epochs"
        )
    if cfg.data.skip_epochs and not cfg.data.skip_no_signal:
        problems.append(
            f"data.skip_epochs={cfg.data.skip_epochs} says for how long data.skip_no_signal leaves a prompt out, and "
            "data.skip_no_signal is 0 (off); set data.skip_no_signal=N (a prompt's groups without signal in a row), "
            "or data.skip_epochs=0"
        )
    problems.extend(get_objective(t.objective).check(cfg))  # its own section's relations (others' are ignored)
    from flowrl.core import ADVANTAGE_ESTIMATORS

    if t.adv_estimator not in ADVANTAGE_ESTIMATORS:
        problems.append(
            f"train.adv_estimator {t.adv_estimator!r} is not registered; valid: "
            f"{', '.join(ADVANTAGE_ESTIMATORS.names())}"
        )
    if len(problems) == 1:  # one mistake: one line
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"invalid config ({len(problems)} problems):\n  - " + "\n  - ".join(problems))
