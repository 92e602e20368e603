"""Reading a config: YAML presets, `key=value` overrides, other tools' names (ALIASES), keys that moved
(MOVED_KEYS), text loss presets (LOSS_PRESETS), and the conversion of each value against its field's type.

Defaults <- loss preset <- YAML preset <- overrides; the result is validated once (flowrl.config.checks) before
any work starts: an unknown key is an error naming the closest valid keys, a value of the wrong type or outside its
choices names what would be right.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
import warnings
from pathlib import Path
from typing import Any

import yaml

from flowrl.errors import ConfigError, ConfigWarning

from .checks import _get_dotted, validate
from .tree import Config, _dataclass_of, _hints, describe, field_name, key_name
from .values import convert_value

#: Names users bring from TRL, diffusers' training scripts, Flow-GRPO and DDPO -> the flowrl key.
ALIASES: dict[str, str] = {
    # TRL (GRPOConfig / TrainingArguments)
    "learning_rate": "train.lr",
    "num_generations": "sample.group_size",
    "num_train_epochs": "train.epochs",
    "num_iterations": "train.inner_epochs",
    "epsilon": "train.grpo.clip_low",
    "epsilon_high": "train.grpo.clip_high",
    "delta": "train.grpo.dual_clip",
    "max_completion_length": "text.max_new_tokens",
    "per_device_train_batch_size": "train.minibatch_size",
    "scale_rewards": "train.adv_scale",
    "loss_type": "text.loss_agg",
    "reward_weights": "rewards",
    "reward_funcs": "rewards",
    "lr_scheduler_type": "train.schedule",
    "adam_beta1": "train.adam_betas",
    "adam_beta2": "train.adam_betas",
    "adam_epsilon": "train.adam_eps",
    "output_dir": "log.run_dir",
    "logging_steps": "log.every",
    "save_steps": "checkpoint.every",
    "save_total_limit": "checkpoint.keep",
    "resume_from_checkpoint": "checkpoint.resume",
    "model_name_or_path": "model.path",
    "num_inner_epochs": "train.inner_epochs",
    "kl_coef": "train.grpo.beta",
    "init_kl_coef": "train.grpo.beta",
    # diffusers training scripts
    "pretrained_model_name_or_path": "model.path",
    "mixed_precision": "model.dtype",
    "torch_dtype": "model.dtype",
    "num_inference_steps": "sample.num_steps",
    "resolution": "sample.height",
    "lora_rank": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "use_lora": "lora.enabled",
    "train_batch_size": "train.minibatch_size",
    "gradient_checkpointing": "train.gradient_checkpointing",
    # Flow-GRPO / DDPO
    "clip_range": "train.grpo.clip_low",
    "num_image_per_prompt": "sample.group_size",
    "num_epochs": "train.epochs",
    "eval_num_steps": "eval.num_steps",
    "global_std": "train.adv_scale",
    "ema": "train.ema_decay",
    "per_prompt_stat_tracking": "train.per_prompt_stats",
    "sde_window_size": "train.grpo.window.size",
    "sde_window_range": "train.grpo.window.start",
    "timestep_fraction": "train.grpo.window.size",
    "use_8bit_adam": "train.optimizer",
    "offload_optimizer": "train.offload",
    "cpu_offload": "train.offload",
    "save_freq": "checkpoint.every",
    "eval_freq": "eval.every",
    "logdir": "log.run_dir",
    "num_batches_per_epoch": "sample.prompts_per_epoch",
    "kl_reward": "text.kl_in_reward",
}


#: Keys that moved into an objective's own section -> where they are now. A config that still spells them the old
#: way is read as the new key, with a one-line hint (ConfigWarning) naming it; a checkpoint's saved config is read
#: alike (`migrate(..., hint=False)`).
MOVED_KEYS: dict[str, str] = {
    **{
        f"train.{k}": f"train.grpo.{k}"
        for k in ("policy_loss", "clip_low", "clip_high", "dual_clip", "beta", "kl_std", "step_weighting")
    },
    **{f"sample.{k}": f"train.grpo.{k}" for k in ("sde_type", "noise_level", "window", "same_noise_per_group")},
}


def moved_key(key: str) -> str | None:
    """The current spelling of dotted `key` when it (or a section above it) moved, else None."""
    for old, new in MOVED_KEYS.items():
        if key == old or key.startswith(old + "."):
            return new + key[len(old) :]
    return None


def _moved_hint(old: str, new: str, where: str) -> None:
    warnings.warn(f"{where}{old} is now {new}: read as {new} (rename it to silence this)", ConfigWarning, stacklevel=4)


def migrate(tree: Any, *, hint: bool = True, where: str = "") -> Any:
    """A nested config dict with every MOVED_KEYS key put where it is now (a copy; other values shared). `hint`: one
    ConfigWarning per moved key; the old and the new spelling both set is a ConfigError."""
    if not isinstance(tree, dict):
        return tree
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    for old, new in MOVED_KEYS.items():
        *parents, leaf = old.split(".")
        node = tree
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        value = node.pop(leaf)
        target = tree
        *new_parents, new_leaf = new.split(".")
        for part in new_parents:
            child = target.get(part)
            target[part] = child = dict(child) if isinstance(child, dict) else ({} if child is None else child)
            if not isinstance(child, dict):
                raise ConfigError(f"{where}{'.'.join(new_parents)} must be a section (a mapping of keys)")
            target = child
        if new_leaf in target:
            raise ConfigError(f"{where}both {old} and {new} are set: {old} is the old spelling of {new}; keep {new}")
        target[new_leaf] = value
        if hint:
            _moved_hint(old, new, where)
    return tree


def without_other_objectives(tree: dict, objective: str) -> dict:
    """A nested config dict without the sections `train.<name>` of the registered objectives other than
    `objective` (which the run ignores): what two configs of one objective are compared on."""
    from flowrl.objectives import objective_names

    train = tree.get("train")
    if not isinstance(train, dict):
        return tree
    others = set(objective_names()) - {objective}
    return {**tree, "train": {k: v for k, v in train.items() if k not in others}}


def _all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    return [row[0] for row in describe(cls, prefix)] + (
        [
            "rewards.name",
            "rewards.reward",
            "rewards.weight",
            "rewards.kwargs",
            "rewards.video_frames",
            "rewards.video_aggregate",
        ]
        if cls is Config and not prefix
        else []
    )


def _suggest(key: str) -> list[str]:
    """Valid keys close to an unknown `key`, across every section: an alias users bring from other tools first,
    then keys whose last part or whole dotted path is close."""
    keys = _all_keys()
    leaf = key.split(".")[-1]
    if leaf in ALIASES:
        return [ALIASES[leaf]]
    by_leaf: dict[str, list[str]] = {}
    for k in keys:
        by_leaf.setdefault(k.split(".")[-1], []).append(k)
    for alias, target in ALIASES.items():
        by_leaf.setdefault(alias, []).append(target)
    out: list[str] = []
    for name in difflib.get_close_matches(leaf, list(by_leaf), n=4, cutoff=0.75):
        out.extend(by_leaf[name])
    out.extend(difflib.get_close_matches(key, keys, n=3, cutoff=0.6))
    return list(dict.fromkeys(out))[:3]


def _unknown_key(key: str, valid: list[str]) -> ConfigError:
    leaves = {v.split(".")[-1]: v for v in valid}  # the section's own keys come first: train.dpo.betta -> .beta
    here = [leaves[n] for n in difflib.get_close_matches(key.split(".")[-1], list(leaves), n=2, cutoff=0.75)]
    taken = {h.split(".")[-1] for h in here}
    close = list(dict.fromkeys(here + [k for k in _suggest(key) if k.split(".")[-1] not in taken]))[:3]
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    leaf = key.split(".")[-1]
    if leaf in ALIASES:
        hint += f" ({leaf!r} is another tool's name for it.)"
    error = ConfigError(f"unknown config key {key!r}.{hint} Valid keys here: {', '.join(valid)}")
    error.key = key
    return error


def _unknown_keys(cls: type, data: Any, prefix: str = "") -> list[ConfigError]:
    """Every unknown key of `data` read as dataclass `cls`, each as _unknown_key's error (the sections and lists
    of sections below it too; a value of the wrong shape is left to _build)."""
    if not isinstance(data, dict):
        return []
    hints = _hints(cls)
    out: list[ConfigError] = []
    for k, v in data.items():
        key = prefix + ("." if prefix else "") + str(k)
        name = field_name(k) if isinstance(k, str) else k
        if name not in hints:
            out.append(_unknown_key(key, [f"{prefix}.{key_name(n)}" if prefix else key_name(n) for n in hints]))
            continue
        tp = hints[name]
        sub = _dataclass_of(tp)
        if sub is not None:
            out.extend(_unknown_keys(sub, v, key))
        elif typing.get_origin(tp) is list and typing.get_args(tp) and _dataclass_of(typing.get_args(tp)[0]):
            if isinstance(v, list):
                for i, item in enumerate(v):
                    out.extend(_unknown_keys(typing.get_args(tp)[0], item, f"{key}[{i}]"))
    return out


def _check_keys(data: dict, path: Path | None = None) -> None:
    """One error for all the unknown keys of a config tree: the single key's message as it is, several as a list;
    a key the config file `path` spells is named with its line (`path:line: ...`, `key_lines`; read only when a key
    is unknown)."""
    unknown = _unknown_keys(Config, data)
    lines = key_lines(path.read_text(encoding="utf-8")) if unknown and path is not None else {}
    if lines:
        unknown = [
            ConfigError(f"{path}:{lines[e.key]}: {e}") if getattr(e, "key", None) in lines else e for e in unknown
        ]
    if len(unknown) == 1:
        raise unknown[0]
    if unknown:
        raise ConfigError(f"{len(unknown)} unknown config keys:\n  - " + "\n  - ".join(str(e) for e in unknown))


def _build(cls: type, data: Any, prefix: str = ""):
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {data!r}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = prefix + ("." if prefix else "") + str(k)
        k = field_name(k) if isinstance(k, str) else k  # `async` is the field `async_`
        if k not in names:
            raise _unknown_key(key, [f"{prefix}.{key_name(n)}" if prefix else key_name(n) for n in names])
        sub = _dataclass_of(hints[k])
        if sub is None and _is_null(v):
            off = _null_value(cls, k, hints[k])
            if off is not _NOT_NULLABLE:
                kwargs[k] = off
                continue
        kwargs[k] = _build(sub, v, key) if sub is not None else convert_value(v, hints[k], key, build=_build)
    return cls(**kwargs)


_NOT_NULLABLE = object()


def _is_null(value: Any) -> bool:
    """YAML's null (`null`, `~`, an empty YAML value) or the words `none` / `null` in any case, which YAML reads as
    strings."""
    return value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null"))


def _null_value(cls: type, name: str, tp) -> Any:
    """What null means for field `name` of section `cls`: None for an Optional field; "" for a text field whose
    default is "" (empty = off, e.g. data.balance_by); _NOT_NULLABLE for any other field (a Literal's `none` is
    one of its choices)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp):
        return None
    default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
    return "" if tp is str and default == "" else _NOT_NULLABLE


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    """Put `value` at dotted `key` of the override tree, checking each part against the config's types. A list of
    sections takes an item index (`rewards.0.weight`): the tree then holds {0: {...}} for `_merge` to apply."""
    parts = key.split(".")
    node: dict = tree
    cls: Any = Config
    item_cls: Any = None  # the item type of the list of sections being indexed (cls is None meanwhile)
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        prefix = ".".join(parts[:i])
        if cls is None:  # inside a list of sections: an index
            if not part.isdigit():
                raise ConfigError(
                    f"{key!r}: {prefix} is a list; name an item by its index, e.g. {prefix}.0.weight=2 "
                    f"(or set the whole list: {prefix}='[{{name: ..., weight: 1}}]')"
                )
            node = node.setdefault(int(part), {})
            cls = item_cls
            if last:
                raise ConfigError(f"{key!r}: set a key of the item, e.g. {key}.weight=2")
            continue
        hints = _hints(cls)
        part = field_name(part)
        if part not in hints:
            raise _unknown_key(key, [f"{prefix}.{key_name(n)}" if prefix else key_name(n) for n in hints])
        tp = hints[part]
        if last:
            node[part] = value
            return
        if typing.get_origin(tp) is list and _dataclass_of(typing.get_args(tp)[0]) is not None:
            item_cls, cls = typing.get_args(tp)[0], None
            node = node.setdefault(part, {})
            continue
        if typing.get_origin(tp) is dict:  # a free-form mapping (rewards.0.kwargs.gain=2): the rest names its keys
            rest = parts[i + 1 :]
            if any(not k for k in rest):
                raise ConfigError(f"{key!r}: an empty key inside {'.'.join(parts[: i + 1])}")
            for depth, k in enumerate([part, *rest[:-1]]):
                node = node.setdefault(k, {})
                if not isinstance(node, dict):
                    where = ".".join(parts[: i + 1 + depth])
                    raise ConfigError(f"{key!r}: another override set {where} to a value, not a mapping")
            node[rest[-1]] = value
            return
        if _dataclass_of(tp) is None:
            raise ConfigError(
                f"{key!r}: {'.'.join(parts[: i + 1])} is a value, not a section; set it as "
                f"{'.'.join(parts[: i + 1])}=VALUE"
            )
        cls = tp
        node = node.setdefault(part, {})


def _merge(base: Any, over: dict, path: str = "", empty_replaces: bool = False) -> Any:
    """`over` laid on `base`; an int-keyed mapping in `over` updates those items of a list in `base`.
    `empty_replaces` (command-line overrides): an empty mapping replaces what it is laid on (`rewards.0.kwargs={}`
    clears the reward's options), where a mapping with keys updates those keys."""
    if isinstance(base, list) and over and all(isinstance(k, int) for k in over):
        out_list = list(base)
        for i, v in over.items():
            if i >= len(out_list):
                raise ConfigError(
                    f"{path}.{i}: the list {path} has {len(out_list)} item(s), indices 0 to "
                    f"{len(out_list) - 1}; set the whole list to add one"
                )
            mergeable = isinstance(v, dict) and isinstance(out_list[i], dict) and (v or not empty_replaces)
            out_list[i] = _merge(out_list[i], v, f"{path}.{i}", empty_replaces) if mergeable else v
        return out_list
    out = dict(base)
    for k, v in over.items():
        key = f"{path}.{k}" if path else str(k)
        if isinstance(v, dict) and not v and empty_replaces:
            out[k] = {}
        elif isinstance(v, dict) and isinstance(out.get(k), (dict, list)):
            out[k] = _merge(out[k], v, key, empty_replaces)
        elif isinstance(v, dict) and v and all(isinstance(i, int) for i in v):  # an index into a default list
            out[k] = _merge(to_dict(Config()).get(k, []), v, key, empty_replaces)
        else:
            out[k] = v
    return out


def parse_overrides(overrides: list[str], *, hint: bool = True) -> dict:
    """`["train.lr=1e-4", "sample.group_size=8"]` -> a nested dict (values read as YAML scalars). A key that moved
    (MOVED_KEYS) is put where it is now, with a one-line hint."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. train.lr=1e-4")
        key, raw = item.split("=", 1)
        key = key.strip()
        new = moved_key(key)
        if new is not None:
            if hint:
                _moved_hint(key, new, "override ")
            key = new
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            if not _is_text_key(key):
                raise ConfigError(f"override {item!r}: the value is not valid YAML ({_yaml_problem(e)})") from None
            value = raw.strip()
        if isinstance(value, (dict, list)) and _is_text_key(key):
            value = raw.strip()  # a text key takes braces as written: data.prompt_template={prompt}, a photo
        _set_dotted(tree, key, value)
    return tree


def _is_text_key(key: str) -> bool:
    """Whether dotted `key` is a plain text field (str, or str | None) of the config: an override that YAML reads
    as a mapping or a list, or not at all, is its text as written (braces, colons and commas stay text; an unknown
    key is left to _set_dotted's error)."""
    cls: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        if cls is None or part.isdigit():
            return False
        hints = _hints(cls)
        tp = hints.get(field_name(part))
        if tp is None:
            return False
        if i == len(parts) - 1:
            args = set(typing.get_args(tp)) if typing.get_origin(tp) in (typing.Union, types.UnionType) else {tp}
            return tp is str or args == {str, type(None)}
        cls = _dataclass_of(tp)
    return False


def _yaml_problem(e: yaml.YAMLError) -> str:
    return " ".join(str(getattr(e, "problem", None) or e).split())


class _DuplicateKey(Exception):
    def __init__(self, key, line: int, first: int):
        super().__init__(key)
        self.key, self.line, self.first = key, line, first


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last one silently: a
    second `train:` section would replace the first)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` (its keys may be given again: that overrides)
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: construct_mapping says so
                break
            if first is not None:
                raise _DuplicateKey(key, key_node.start_mark.line + 1, first)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def key_lines(text: str) -> dict[str, int]:
    """{dotted key: its 1-based line} of every mapping key of a YAML text, as config errors spell keys (`train.lr`,
    `rewards[0].kwargs`); {} for a text YAML cannot compose (read_yaml reports that)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    lines: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
                lines.setdefault(key, key_node.start_mark.line + 1)
                walk(value_node, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, f"{prefix}[{i}]")

    walk(root, "")
    return lines


def read_yaml(path: Path) -> Any:
    """A YAML file's content; a syntax error (or a key given twice in one mapping) is one ConfigError line naming
    the file, line and column."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); save the config as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except _DuplicateKey as e:
        raise ConfigError(
            f"{path}:{e.line}: {e.key!r} is given twice in one mapping (first at line {e.first}); YAML would keep "
            "only the second: merge the two into one"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        context = getattr(e, "context", None)
        raise ConfigError(
            f"{where}: YAML syntax error: {_yaml_problem(e)}" + (f" ({context})" if context else "")
        ) from None


#: text.loss_preset -> the settings of the published variant (a base layer under the user's own keys).
LOSS_PRESETS: dict[str, dict] = {
    # DeepSeekMath GRPO (arXiv 2402.03300): token ratio, symmetric clip 0.2, group std, per-sequence token mean,
    # k3 KL in the loss with beta 0.04.
    "grpo": {
        "train": {
            "adv_estimator": "grpo",
            "adv_scale": "group",
            "grpo": {"policy_loss": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2, "beta": 0.04},
        },
        "text": {"loss_agg": "seq-mean-token-mean", "kl_estimator": "k3", "kl_in_reward": False},
    },
    # DAPO (arXiv 2503.14476): clip-higher 0.2 / 0.28, token-level mean, no KL, dynamic sampling (groups with no
    # signal dropped), overlong completions masked.
    "dapo": {
        "train": {
            "adv_estimator": "grpo",
            "adv_scale": "group",
            "drop_zero_adv_groups": True,
            "grpo": {"policy_loss": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28, "beta": 0.0},
        },
        "text": {"loss_agg": "token-mean", "mask_truncated": True},
    },
    # Dr.GRPO (arXiv 2503.20783): no std division, a constant normaliser (the max completion length), no KL.
    "dr_grpo": {
        "train": {
            "adv_estimator": "grpo",
            "adv_scale": "none",
            "grpo": {"policy_loss": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2, "beta": 0.0},
        },
        "text": {"loss_agg": "seq-mean-token-sum-max-len"},
    },
    # GSPO (arXiv 2507.18071): sequence-level ratio, clip 3e-4 / 4e-4, per-sequence token mean, no KL.
    "gspo": {
        "train": {
            "adv_estimator": "grpo",
            "adv_scale": "group",
            "grpo": {"policy_loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4, "beta": 0.0},
        },
        "text": {"loss_agg": "seq-mean-token-mean"},
    },
}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- loss preset <- YAML preset <- `key=value` overrides, validated; raises ConfigError with the fix.
    Keys that moved (MOVED_KEYS) are read where they are now, each with a one-line hint."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        if path.is_dir():
            pipeline = (path / "model_index.json").exists() or (path / "config.json").exists()
            if pipeline:
                raise ConfigError(
                    f"config file {str(path)!r} is a directory (a model's directory, which a config names as "
                    f"model.path); give a YAML config and model.path={path} after it (e.g. `flowrl train "
                    f"configs/tiny_cpu.yaml model.path={path}`)"
                )
            yamls = sorted(p.name for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
            shown = ", ".join(yamls[:3]) + (", ..." if len(yamls) > 3 else "")
            raise ConfigError(
                f"config file {str(path)!r} is a directory; give "
                + (f"one of its YAML files ({shown})" if yamls else "a YAML config file")
            )
        loaded = read_yaml(path)
        if loaded is None:  # an empty file, or comments alone: most likely not the file meant
            warnings.warn(
                f"{path} holds no keys (empty, or comments only): the defaults"
                f"{' and the overrides' if overrides else ''} are used",
                ConfigWarning,
                stacklevel=2,
            )
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        data = migrate(loaded, where=f"{path}: ")
    if overrides:
        data = _merge(data, parse_overrides(overrides), empty_replaces=True)
    preset = (data.get("text") or {}).get("loss_preset", "none") if isinstance(data.get("text"), dict) else "none"
    if preset not in ("none", *LOSS_PRESETS):
        raise ConfigError(f"text.loss_preset: {preset!r} is not a valid choice; valid: none, {', '.join(LOSS_PRESETS)}")
    if preset != "none":
        data = _merge(LOSS_PRESETS[preset], data)
    _check_keys(data, path)
    cfg = _build(Config, data)
    _expand_home(cfg)
    validate(cfg)
    _warn_other_backends_keys(cfg)
    if path is not None:
        _warn_paths_beside(cfg, path)
    return cfg


#: The settings only an image run reads: a text run's lengths are text.max_prompt_length and text.max_new_tokens.
IMAGE_ONLY_KEYS = (
    "sample.num_steps",
    "sample.guidance_scale",
    "sample.height",
    "sample.width",
    "sample.max_sequence_length",
    "sample.num_frames",
    "eval.num_steps",
    "eval.guidance_scale",
    "model.drop_t5",
    "train.grpo.kl_std",
    "train.grpo.step_weighting",
    "train.grpo.sde_type",
    "train.grpo.noise_level",
    "train.grpo.window",
    "train.grpo.same_noise_per_group",
)


def _warn_other_backends_keys(cfg: Config) -> None:
    """One warning for the settings changed from their defaults that the run's backend does not read: an image
    setting (IMAGE_ONLY_KEYS) in a text run, a `text.*` one in an image run (most likely a config meant for the
    other kind of model, or a missing `backend: text`)."""
    default = Config()
    if cfg.backend == "text":
        keys = [k for k in IMAGE_ONLY_KEYS if _get_dotted(cfg, k) != _get_dotted(default, k)]
        what = "an image setting" if len(keys) == 1 else "image settings"
        what += ", which this text run (backend: text) does not read"
        sizes = any(k.startswith(("sample.", "eval.")) for k in keys)
        hint = "its lengths are text.max_prompt_length and text.max_new_tokens" if sizes else "an image sampler's"
    else:
        keys = _changed_keys(cfg.text, default.text, "text")
        what = f"a text run's {'setting' if len(keys) == 1 else 'settings'}, which this {cfg.backend} run does not read"
        hint = "a language model trains with backend: text"
    if keys:
        shown = ", ".join(f"{k}={_shown(_get_dotted(cfg, k))}" for k in keys)
        warnings.warn(f"{shown}: {what} ({hint})", ConfigWarning, stacklevel=3)
    _warn_other_objectives_keys(cfg, default)


def _changed_keys(section, default, prefix: str) -> list[str]:
    """The dotted keys (`prefix.name`) of a config section's fields that differ from `default`'s (the same section
    of the default config)."""
    return [
        f"{prefix}.{f.name}"
        for f in dataclasses.fields(section)
        if getattr(section, f.name) != getattr(default, f.name)
    ]


def _shown(value) -> str:
    """A setting's value as a warning names it: a section (a dataclass) as its fields."""
    return repr(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)


def _warn_other_objectives_keys(cfg: Config, default: Config) -> None:
    """One warning for the settings of the objectives other than train.objective (`train.<name>.*`, changed from
    their defaults), which the run does not read: most likely a config meant for that objective."""
    from flowrl.objectives import objective_names

    objective, changed = cfg.train.objective, []
    for name in objective_names():
        section = getattr(cfg.train, name, None)
        if name == objective or not dataclasses.is_dataclass(section):
            continue
        keys = _changed_keys(section, getattr(default.train, name), f"train.{name}")
        changed += [f"{k}={_shown(_get_dotted(cfg, k))}" for k in keys]
    if changed:
        warnings.warn(
            f"{', '.join(changed)}: {'a setting' if len(changed) == 1 else 'settings'} of another objective, which "
            f"this train.objective={objective} run does not read",
            ConfigWarning,
            stacklevel=4,
        )


# The config keys that name a file or directory. A relative one is read from the working directory.
PATH_KEYS = (
    "model.path",
    "lora.init_path",
    "data.train_prompts",
    "data.eval_prompts",
    "train.dpo_offline.pairs",
    "eval.base_cache",
    "eval.diversity_features",
)


#: The keys whose value `~` or `~user` starts is a path in that home directory (the shell does not expand a `~`
#: in YAML, nor one after `=` in a `key=value` override).
HOME_KEYS = (*PATH_KEYS, "log.run_dir", "checkpoint.resume", "eval.free_reference")


def _expand_home(cfg: Config) -> None:
    """Each HOME_KEYS value that starts with `~`, with the home directory put in (os.path.expanduser), as a
    prompt file's path always was: `model.path=~/models/sd35` is that directory, not a hub id."""
    for key in HOME_KEYS:
        section, _, name = key.rpartition(".")
        node = _get_dotted(cfg, section)
        value = getattr(node, name)
        if isinstance(value, str) and value.startswith("~"):
            setattr(node, name, os.path.expanduser(value))


def paths_beside(cfg: Config, config_file: str | Path, levels: int = 3) -> list[tuple[str, str, Path]]:
    """(key, value, where) for each PATH_KEYS value that is relative, absent from the working directory and present
    relative to the config file's folder or one of its `levels - 1` parents (`where`, the first that has it): a preset
    run from another directory, e.g. `flowrl train ~/flowrl/configs/shapes.yaml` whose paths are the repository's."""
    folders = list(Path(config_file).resolve().parents)[:levels]
    found = []
    paths = [(key, value, value) for key in PATH_KEYS for value in [_get_dotted(cfg, key)]]
    for key, value, file in paths + _plug_ins(cfg):
        if not isinstance(file, str) or not file or file.startswith("hf:") or Path(file).is_absolute():
            continue
        if Path(file).exists():
            continue
        where = next((f for f in folders if (f / file).exists()), None)
        if where is not None:
            found.append((key, value, where))
    return found


def _plug_ins(cfg: Config) -> list[tuple[str, str, str]]:
    """(key, value, file) for each plug-in given as FILE.py:FUNCTION: a reward's name, text.tool_env."""
    named = [(f"rewards[{i}].name", spec.reward or spec.name) for i, spec in enumerate(cfg.rewards)]
    named.append(("text.tool_env", cfg.text.tool_env))
    return [
        (key, value, value.rpartition(":")[0])
        for key, value in named
        if isinstance(value, str) and value.rpartition(":")[0].endswith(".py")
    ]


def _warn_paths_beside(cfg: Config, config_file: str | Path) -> None:
    found = paths_beside(cfg, config_file)
    if not found:
        return
    roots = sorted({str(where) for _, _, where in found})
    listed = ", ".join(f"{key}={value}" for key, value, _ in found)
    warnings.warn(
        f"{listed}: not in the working directory {Path.cwd()}, but relative to {' and '.join(roots)}, near the config "
        f"file: relative paths are read from the working directory, so run from {roots[0]} (or give absolute paths)",
        ConfigWarning,
        stacklevel=3,
    )
