"""Checks that run before any model loads, so that a typo costs seconds, not a model load: the prompt data (with
its conditioning images, and their count for the model's family), the rewards' names and options, the model's
pipeline class and image size (from its config files only), the loggers, and that the reward servers answer.
Each failure is one FlowrlError line saying what was wrong and what would be right."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import TYPE_CHECKING

from .errors import ConfigError, FlowrlError

if TYPE_CHECKING:
    from .config import Config
    from .data import PromptSet


class PreflightError(FlowrlError, ValueError):
    """A config that cannot run, found before the model loaded."""


def _checked(what: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, its ValueError/TypeError/LookupError/OSError as a PreflightError (message kept)."""
    try:
        return fn(*args, **kwargs)
    except (FlowrlError, ValueError, TypeError, LookupError, OSError, ImportError) as e:
        if isinstance(e, FlowrlError) and not _library_error(e):  # (a model's or reward's own: prefixed below)
            raise
        message = str(e).strip("'\"") if isinstance(e, KeyError) else str(e)
        error = PreflightError(_named(what, message))
        error.exit_code = getattr(e, "exit_code", error.exit_code)  # a config error's 2 stays 2
        raise error from e


def _named(what: str, message: str) -> str:
    """`message` of a check of `what` (a config key, or KEY=VALUE) that names it: as it is when it does, KEY= before
    it when it starts with the VALUE (a model's own error: "/models/x: model_index.json ..." ->
    "model.path=/models/x: model_index.json ...", "hub model ID (its ... snapshot S): ..." -> "model.path=ID (its
    ... snapshot S): ..."), else "what: message"."""
    if what in message:
        return message
    key, sep, value = what.partition("=")
    if sep and value:
        rest = message.removeprefix(f"hub model {value}") if message.startswith(f"hub model {value}") else None
        if rest is None and message.startswith(value):
            rest = message[len(value) :]
        if rest is not None and rest[:1] in ("", ":", " "):  # (a hub model's: "hub model ID (its ... snapshot ...)")
            return f"{key}={value}{rest}"
    return f"{what}: {message}"


def _library_error(e: BaseException) -> bool:
    """A model's or a reward's own error (it names the file or the option, not the config key that led to it)."""
    from rewards.registry import RewardConfigError

    from .families import ImageModelError

    return isinstance(e, (ImageModelError, RewardConfigError))


def load_prompt_sets(cfg: Config, *, train: bool = True) -> tuple[PromptSet | None, PromptSet]:
    """The training and eval prompt sets of `cfg` (eval: the training prompts when none are given), with the
    columns that data.balance_by and eval.group_by need checked. An objective that reads its own training set
    (offline DPO's pairs: `Objective.training_prompts`) gives it in place of data.train_prompts. `train` False (an
    eval alone) with data.eval_prompts given: the training prompts are not read (None in their place)."""
    from .data import load_config_prompts, warn_eval_not_held_out, warn_repeated_prompts
    from .objectives import get_objective

    d = cfg.data
    if cfg.backend == "text":  # a text model takes no images: its `image` column, if any, is plain metadata
        d = dataclasses.replace(d, image_column="")
    if not train and d.eval_prompts:
        eval_set = _checked("data.eval_prompts", load_config_prompts, d, "eval")
        _check_eval_groups(cfg, eval_set)
        return None, eval_set
    if cfg.backend == "text":
        if not d.train_prompts:
            raise PreflightError(
                "a text run needs data.train_prompts (a .jsonl/.csv/.txt file of prompts, or hf:DATASET): the "
                "built-in prompts are an image model's"
            )
    objective = cfg.train.objective
    train_set = _checked(f"train.{objective}", get_objective(objective).training_prompts, cfg)
    if train_set is None:
        train_set = _checked("data.train_prompts", load_config_prompts, d, "train")
        warn_repeated_prompts(train_set, cfg.sample.prompts_per_epoch)
    eval_set = _checked("data.eval_prompts", load_config_prompts, d, "eval") if d.eval_prompts else train_set
    warn_eval_not_held_out(train_set, eval_set if d.eval_prompts else None, d.image_column)
    if d.balance_by:
        _checked("data.balance_by", train_set.strata, d.balance_by)
    _check_eval_groups(cfg, eval_set)
    return train_set, eval_set


def _check_eval_groups(cfg: Config, eval_set: PromptSet) -> None:
    """eval.group_by's column is in the eval prompts, and eval.images_per_group shares them out."""
    from .data import require_column
    from .eval.summary import eval_plan

    if cfg.eval.group_by:
        _checked(
            "eval.group_by",
            require_column,
            eval_set.head(cfg.eval.num_prompts)[1],
            cfg.eval.group_by,
            f"eval.group_by={cfg.eval.group_by!r}",
            "; set eval.group_by= (or eval.group_by=null) to average over every image"
            + (
                f", with eval.images_per_group=0 (it is {cfg.eval.images_per_group}, a share of each group)"
                if cfg.eval.images_per_group
                else ""
            ),
            eval_set.origins,
        )
        _checked("eval.images_per_group", eval_plan, eval_set, cfg.eval)


def check_rewards(cfg: Config) -> None:
    """Every reward name resolves (registered, or a plug-in `module:function` / `file.py:function`) and takes the
    given kwargs; nothing is built, no weights load."""
    import rewards

    kind = "text" if cfg.backend == "text" else "image"
    for i, spec in enumerate(cfg.rewards):
        _checked(f"rewards[{i}] ({spec.target})", rewards.check, spec.target, dict(spec.kwargs), kind)


def check_reward_weights(cfg: Config) -> None:
    """Offline (HF_HUB_OFFLINE, or the hub unreachable), each registered reward's weights that name a hub model
    (`rewards.registry.weight_sources`: ORG/NAME, not a local path) are in the Hugging Face cache, so that a missing
    one fails before the model loads, naming the option to point at a local copy. Online they download when built."""
    from rewards.registry import weight_sources

    from . import hub

    wanted = []
    for i, spec in enumerate(cfg.rewards):
        for option, value in weight_sources(spec.target, dict(spec.kwargs)).items():
            if not os.path.exists(os.path.expanduser(value)):
                wanted.append((i, spec.target, option, value))
    if not wanted or not hub.settle():
        return
    from huggingface_hub import constants

    for i, target, option, value in wanted:
        folder = os.path.join(constants.HF_HUB_CACHE, "models--" + value.replace("/", "--"), "snapshots")
        if os.path.isdir(folder) and os.listdir(folder):
            continue
        raise PreflightError(
            f"rewards[{i}] ({target}): {option}={value!r} is neither a local path nor in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and {hub.why_offline()}; run once with network access to cache it, or "
            f"give a local copy: rewards.{i}.kwargs.{option}=/path/to/dir"
        )


def check_reward_columns(cfg: Config, train_set: PromptSet | None, eval_set: PromptSet) -> None:
    """Each prompt a reward scores has the metadata columns it declares (`rewards.declared_columns`, a plug-in's
    required parameters among them) and passes its check of a row (`rewards.row_check`): the training prompts (when
    the objective scores its samples) and the eval prompts."""
    from rewards import declared_columns, required_columns, row_check

    from .data import metadata_columns
    from .objectives import get_objective

    scored = get_objective(cfg.train.objective).scores_batch and train_set is not None  # (None: not read)
    sets = [("data.train_prompts", train_set)] if scored else []
    if eval_set is not train_set or not scored:
        sets.append(("data.eval_prompts" if cfg.data.eval_prompts else "the eval's prompts", eval_set))
    for i, spec in enumerate(cfg.rewards):
        for where, prompts in sets:  # a column reaches the reward as an argument of its name, as an option would
            clash = sorted(set(spec.kwargs) & {k for m in prompts.metadata for k in (m or {})})
            if clash:
                raise PreflightError(
                    f"rewards[{i}] ({spec.target}): its option(s) {', '.join(map(repr, clash))} are also columns of "
                    f"{where}, which reach the reward by the same name on every call; rename the option or the column"
                )
        declared = _checked(f"rewards[{i}] ({spec.target})", declared_columns, spec.target)
        required = _checked(f"rewards[{i}] ({spec.target})", required_columns, spec.target, dict(spec.kwargs))
        named = {n for names in declared for n in names}
        for names in declared + tuple(c for c in required if c[0] not in named):
            for where, prompts in sets:
                missing = next((k for k, m in enumerate(prompts.metadata) if not set(names) & set(m or {})), None)
                if missing is None:
                    continue
                raise PreflightError(
                    f"rewards[{i}] ({spec.target}) reads each prompt's {' or '.join(map(repr, names))} column, and "
                    f"{where} has none at {prompts.origins[missing]}: its prompts' metadata columns are "
                    f"{metadata_columns(prompts.metadata)}; give a .jsonl, .json or .csv file (or an hf: dataset) "
                    f"with that column, or another reward"
                )
        check = _checked(f"rewards[{i}] ({spec.target})", row_check, spec.target)
        for where, prompts in sets if check is not None else ():
            for origin, meta in zip(prompts.origins, prompts.metadata):
                problem = check(dict(meta or {}))
                if problem:
                    raise PreflightError(
                        f"rewards[{i}] ({spec.target}) cannot score {where} at {origin}: {problem}; fix the prompt's "
                        f"metadata (or use another reward)"
                    )


def check_reward_counts(cfg: Config) -> None:
    """An objective that pairs by the free-attribute counts (train.dpo.pairing=matched) has a reward that says it
    reports them (`rewards.declared_counts`); a reward that cannot say before it runs (a reward server, a weighted
    sum, a plug-in without `.counts`) leaves the check to the first update."""
    from rewards import declared_counts

    from .objectives import get_objective

    objective = get_objective(cfg.train.objective)
    if not objective.needs_free_counts(cfg):
        return
    declared = [_checked(f"rewards[{i}] ({s.target})", declared_counts, s.target) for i, s in enumerate(cfg.rewards)]
    if any(d is None or d for d in declared):
        return
    names = ", ".join(s.target for s in cfg.rewards) or "none"
    raise PreflightError(
        objective.no_counts_message(
            objective.name,
            f"the run's rewards ({names}) count nothing (a reward that does declares it: "
            "register(..., counts=('color',)), or a plug-in's .counts)",
        )
    )


def check_reward_servers(cfg: Config) -> None:
    """Each reward server a remote reward calls answers `GET /health` (a few seconds, two tries) and serves the
    reward's kind (`rewards.remote.check_server`); else one line naming its URL and how to start it."""
    from rewards.remote import RewardServerError, check_server, server_urls

    for i, spec in enumerate(cfg.rewards):
        for url, kind in server_urls(spec.target, dict(spec.kwargs)):
            try:
                check_server(url, kind)
            except RewardServerError as e:
                raise PreflightError(f"rewards[{i}] ({spec.name}): {e}") from None


def check_reward_samples(cfg: Config, family_name: str | None) -> None:
    """An image family's samples are images: a reward that scores videos only cannot score them (a video family's
    videos suit every image reward, which then scores some of their frames)."""
    if family_name is None:
        return
    from rewards import declared_accepts

    from .families import family

    if family(family_name).video:
        return
    for i, spec in enumerate(cfg.rewards):
        accepts = _checked(f"rewards[{i}] ({spec.target})", declared_accepts, spec.target)
        if "image" not in accepts:
            raise PreflightError(
                f"rewards[{i}] ({spec.target}) scores videos only ({', '.join(accepts)}), and "
                f"{family_name} makes images; use an image reward or a video model"
            )


def hub_file(key: str, repo_id: str, filename: str) -> str:
    """The local path of `filename` of hub model `repo_id` (config key `key`, for the errors): from the Hugging Face
    cache, or downloaded (never under HF_HUB_OFFLINE: then a file not cached fails at once, naming the id)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    from . import hub

    offline = hub.settle()  # (offline at once when the hub cannot be reached)
    try:
        return hf_hub_download(repo_id, filename, local_files_only=offline)
    except HFValidationError:
        raise PreflightError(f"{key}={repo_id!r} is neither a local directory nor a hub id (ORG/NAME)") from None
    except LocalEntryNotFoundError:
        why = hub.why_offline() if offline else "the hub could not be reached"
        raise PreflightError(
            f"{key}={repo_id}: the hub model is not in the Hugging Face cache and {why}; "
            "download it once online (without HF_HUB_OFFLINE) or pass a local directory"
        ) from None
    except RepositoryNotFoundError:
        raise PreflightError(f"{key}={repo_id}: no such model on the hub") from None
    except EntryNotFoundError:
        raise PreflightError(f"{key}={repo_id}: the hub model has no {filename}") from None


#: the files of which a causal LM directory holds at least one for its tokenizer (fast, or a slow one's vocab)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_text_model(path: str, max_new_tokens: int | None = None) -> None:
    """A causal LM's path is a local directory with a config.json, or a hub id whose config.json is in the cache
    or can be downloaded (never under HF_HUB_OFFLINE: then it fails at once, naming the id); with
    `max_new_tokens` (text.max_new_tokens), the model's positions (its config's max_position_embeddings) leave
    room for a prompt beside them."""
    if os.path.isdir(path):
        config = os.path.join(path, "config.json")
        if not os.path.isfile(config):
            from .run.basemodel import flowrl_run_hint

            hint = flowrl_run_hint(path)
            if os.path.isfile(os.path.join(path, "model_index.json")):
                hint = (
                    "it is a diffusers pipeline (its model_index.json), which an image run trains: drop backend: text"
                )
            raise PreflightError(
                f"model.path={path}: no config.json there"
                + (f": {hint}" if hint else "; a causal LM directory is what model.save_pretrained(DIR) writes")
            )
        names = set(os.listdir(path))
        if not names & set(TOKENIZER_FILES):
            raise PreflightError(
                f"model.path={path}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)}); save the model's "
                "tokenizer beside it (tokenizer.save_pretrained(DIR))"
            )
        if not any(n.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")) for n in names):
            raise PreflightError(
                f"model.path={path}: no weights there (no model.safetensors, pytorch_model.bin or their shards' "
                "index); a causal LM directory is what model.save_pretrained(DIR) writes"
            )
    else:
        config = hub_file("model.path", path, "config.json")
    problem = _not_a_causal_lm(config, path)
    if problem:
        raise PreflightError(problem)
    if max_new_tokens is not None:
        positions = _text_positions(config)
        if positions is not None and positions - max_new_tokens < 1:
            raise PreflightError(no_room_for_a_prompt(max_new_tokens, positions, path))


def _not_a_causal_lm(config_file: str, path: str) -> str | None:
    """Why the model of `config_file` (its config.json) is not one AutoModelForCausalLM loads (a T5, a CLIP text
    encoder, a BERT), as transformers decides it from its model_type; None when it is, or when transformers does not
    know the model_type or the config names its own classes (`auto_map`: the load reports those itself)."""
    import json

    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except (OSError, ValueError, ImportError):  # the model load reports a config.json it cannot read
        return None
    if not isinstance(config, dict) or "AutoModelForCausalLM" in (config.get("auto_map") or {}):
        return None
    kind = config.get("model_type")
    if not isinstance(kind, str) or kind not in CONFIG_MAPPING_NAMES or kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    names = config.get("architectures") or []
    what = f"{names[0]} (model_type {kind})" if names and isinstance(names[0], str) else f"model_type {kind} model"
    return (
        f"model.path={path} is a {what}, not a causal LM: a text run trains what AutoModelForCausalLM loads (e.g. "
        "GPT-2, Llama, Qwen2, Gemma, Phi)"
    )


def no_room_for_a_prompt(max_new_tokens: int, positions: int, path: str) -> str:
    """The one line for a text.max_new_tokens that fills a model's `positions` (max_position_embeddings)."""
    return (
        f"text.max_new_tokens={max_new_tokens} leaves no room for a prompt in the {positions} positions of "
        f"model.path={path} (max_position_embeddings); set text.max_new_tokens below {positions}"
    )


def _text_positions(config_file: str) -> int | None:
    """max_position_embeddings of a causal LM's config.json (its text config's, for a multimodal one), read as
    transformers reads it (GPT-2's n_positions is that); None when it has none or transformers cannot read it."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(os.path.dirname(config_file))
        positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    except Exception:  # noqa: BLE001 - an unknown architecture is the model load's to report, with its own words
        return None
    return positions if isinstance(positions, int) else None


def check_eval_features(cfg: Config, family_name: str | None, eval_set: PromptSet) -> None:
    """eval.diversity_features: an image (not video) family; >= 2 images of every eval prompt (with
    eval.images_per_group, every prompt's share); and the backbone's config.json and preprocessor_config.json, in
    its local directory or in the Hugging Face cache (or downloadable, unless HF_HUB_OFFLINE), of a model type
    `rewards.features.ImageEncoder` embeds with. Nothing loads."""
    import json
    import os

    key, path = "eval.diversity_features", cfg.eval.diversity_features
    if not path or family_name is None:  # off, or a text model (config validation refused it)
        return
    from .families import family

    if family(family_name).video:
        raise PreflightError(
            f"{key}={path} embeds images, and {family_name} makes videos (their diversity is not "
            f"measured); set {key}='' (off)"
        )
    _check_images_per_prompt(cfg, eval_set)
    from rewards.features import BACKBONES

    files = {}
    for name in ("config.json", "preprocessor_config.json"):
        if os.path.isdir(path):
            files[name] = os.path.join(path, name)
            if not os.path.isfile(files[name]):
                raise PreflightError(
                    f"{key}={path}: no {name} there; a backbone directory is what "
                    "model.save_pretrained(DIR) and its image processor's save_pretrained(DIR) write"
                )
        else:
            files[name] = hub_file(key, path, name)
    with open(files["config.json"], encoding="utf-8") as f:
        model_type = json.load(f).get("model_type")
    if model_type not in BACKBONES:
        raise PreflightError(
            f"{key}={path} is a {model_type!r} checkpoint; the feature diversity embeds with one of "
            f"{', '.join(BACKBONES)} (e.g. facebook/dinov2-small or openai/clip-vit-large-patch14)"
        )


def _check_images_per_prompt(cfg: Config, eval_set: PromptSet) -> None:
    """Every eval prompt gets >= 2 images (eval.images_per_group shares a group's images out over its prompts)."""
    import math

    from .eval.diversity import prompt_keys
    from .eval.summary import eval_plan, group_prompt_counts

    e = cfg.eval
    prompts, meta, plan = _checked("eval.images_per_group", eval_plan, eval_set, e)
    counts: dict[str, int] = {}
    for k in prompt_keys(prompts, meta, plan.images_per_prompt):
        counts[k] = counts.get(k, 0) + 1
    if not counts or min(counts.values()) >= 2:
        return
    if not e.images_per_group:
        raise PreflightError(
            f"eval.diversity_features needs >= 2 images of every eval prompt; set "
            f"eval.images_per_prompt=2 or more (now {e.images_per_prompt})"
        )
    sizes = group_prompt_counts(eval_set.head(e.num_prompts)[1], e.group_by)
    lcm = math.lcm(*sizes.values())
    least = lcm * -(-2 * max(sizes.values()) // lcm)
    few = {g: n for g, n in sorted(sizes.items()) if e.images_per_group // n < 2}
    raise PreflightError(
        f"eval.diversity_features needs >= 2 images of every eval prompt, and "
        f"eval.images_per_group={e.images_per_group} gives fewer to the prompts of the {e.group_by!r} "
        f"groups of these prompt counts: {few}; set eval.images_per_group={least} (the smallest "
        f"multiple of every group's prompt count that gives each prompt 2)"
    )


def check_model(cfg: Config) -> str | None:
    """Image backend: the model's pipeline class is driven by a family, and the image size suits it (from the
    model's config files); returns the family. Text backend: the model's config is reachable; None."""
    if cfg.backend != "image":
        check_text_model(cfg.model.path, cfg.text.max_new_tokens)
        return None
    from .families import preflight_image_model

    m, s = cfg.model, cfg.sample
    return _checked(
        f"model.path={m.path}",
        preflight_image_model,
        m.path,
        m.family,
        height=s.height,
        width=s.width,
        drop_t5=m.drop_t5,
        num_frames=s.num_frames,
        variant=m.variant,
    )


def check_conditioning(cfg: Config, family_name: str | None, *prompt_sets: PromptSet | None) -> None:
    """Every prompt carries as many conditioning images (`data.image_column`) as the image family takes: none for
    text-to-image, its count for an editing family; the error names the prompt's file and line."""
    if family_name is None:
        return
    from .conditioning import check_image_counts
    from .families import family

    accepts = family(family_name).condition_images
    for key, prompts in zip(("data.train_prompts", "data.eval_prompts"), prompt_sets):
        if prompts is None:  # (an eval alone does not read the training prompts)
            continue
        _checked(
            key, check_image_counts, prompts.metadata, prompts.origins, cfg.data.image_column, accepts, family_name
        )


def check_loggers(cfg: Config) -> None:
    for flag, module, extra in (("tensorboard", "tensorboard", "tensorboard"), ("wandb", "wandb", "wandb")):
        if getattr(cfg.log, flag):
            try:
                __import__(module)
            except ImportError:
                raise PreflightError(
                    f"log.{flag}=true needs the `{module}` package: pip install 'flowrl[{extra}]' "
                    f"(or set log.{flag}=false)"
                ) from None


def check_optimizer(cfg: Config) -> None:
    """train.optimizer=adamw_8bit: bitsandbytes imports (else one line saying how to install it)."""
    if cfg.train.optimizer == "adamw_8bit":
        from .train.optim import import_bitsandbytes

        import_bitsandbytes()


#: weights files that are Python pickles, which flowrl never loads (unpickling an untrusted file can run its code)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: the LoRA files diffusers' save_lora_weights and peft's save_pretrained write
LORA_FILE_NAMES = ("pytorch_lora_weights.safetensors", "adapter_model.safetensors")


def pickled_lora(init_path) -> str:
    return (
        f"lora.init_path={str(init_path)!r} is a pickled LoRA (.bin / .pt), which flowrl does not read (a pickle can "
        "run code as it loads): convert it to safetensors, e.g. with diffusers: pipe.load_lora_weights(FILE), then "
        "pipe.save_lora_weights(DIR, ...), and give DIR"
    )


def _lora_file_in(folder, init_path, example):
    """The LoRA file of the directory `folder`: the one that diffusers or peft names so, else its only .safetensors
    file; several others (a training script's per-epoch files) are one line listing them, not a guess."""
    files = sorted(folder.glob("*.safetensors"))
    named = [f for f in files if f.name in LORA_FILE_NAMES]
    if len(named) == 1 or len(files) == 1:
        return (named or files)[0]
    if not files:
        if any(f.suffix in PICKLE_SUFFIXES for f in folder.iterdir() if f.is_file()):
            raise PreflightError(pickled_lora(init_path))
        raise PreflightError(f"lora.init_path={init_path!r} holds no .safetensors LoRA file ({example})")
    shown = ", ".join(f.name for f in files[:6]) + (", ..." if len(files) > 6 else "")
    raise PreflightError(
        f"lora.init_path={init_path!r} holds {len(files)} .safetensors files ({shown}), none of them named as "
        f"diffusers or peft save a LoRA: give the one to start from, e.g. lora.init_path={folder / files[-1].name}"
    )


#: the run directories given as lora.init_path whose checkpoint was named (once a process: preflight and the load
#: both read it)
_NAMED_RUNS: set[tuple[str, str]] = set()


def _run_lora(folder, init_path: str):
    """`folder` (lora.init_path's directory, holding no .safetensors file), or, when it is a run directory, the
    `lora/` of its newest complete checkpoint (as --checkpoint RUN takes it: a newer damaged one is skipped), named
    in a line; a run without a checkpoint, or whose checkpoint holds no LoRA (a full fine-tune), is a
    PreflightError."""
    from .errors import CheckpointError
    from .run.checkpoint import checkpoint_dirs, intact_checkpoint

    if not checkpoint_dirs(folder):
        if (folder / "metrics.jsonl").is_file():
            raise PreflightError(
                f"lora.init_path={init_path!r} is a run directory without a complete checkpoint yet (a run writes "
                "one every checkpoint.every epochs, and at its end): give one of a run that has one"
            )
        return folder
    try:
        checkpoint = intact_checkpoint(folder, f"lora.init_path={init_path}")
    except CheckpointError as e:
        raise PreflightError(str(e)) from None
    if not (checkpoint / "lora").is_dir():
        raise PreflightError(
            f"lora.init_path={init_path!r} is a run directory whose newest complete checkpoint, {checkpoint.name}, "
            "holds no lora/ (its run trained the whole model, lora.enabled=false): start from a run that trained a "
            "LoRA"
        )
    if (str(folder), checkpoint.name) not in _NAMED_RUNS:
        _NAMED_RUNS.add((str(folder), checkpoint.name))
        warnings.warn(
            f"lora.init_path={init_path} is a run directory: starting from the LoRA of its newest complete "
            f"checkpoint, {checkpoint.name} ({checkpoint / 'lora'})",
            stacklevel=3,
        )
    return checkpoint / "lora"


def lora_init_file(init_path: str):
    """The LoRA file of `lora.init_path` (a directory holding its .safetensors file, as a checkpoint's `lora/`; a
    checkpoint, meaning its `lora/`; a run directory, meaning its newest complete checkpoint's, named in a line:
    `_run_lora`; or that file), its header read (cheap: no tensor is loaded), so that a missing, foreign or
    truncated file is a PreflightError naming it; returns (path, {key: shape})."""
    from pathlib import Path

    from safetensors import safe_open

    where = Path(init_path)
    example = "e.g. RUN_DIR/ckpt-000010/lora, the LoRA a run exports"
    if where.is_dir() and (where / "lora").is_dir() and (where / "state.json").is_file():
        where = where / "lora"  # a run's checkpoint: the LoRA it exports
    elif where.is_dir() and not any(where.glob("*.safetensors")):
        where = _run_lora(where, init_path)
    if where.is_dir():
        where = _lora_file_in(where, init_path, example)
    elif not where.is_file():
        raise PreflightError(f"lora.init_path={init_path!r} does not exist: give a LoRA directory ({example})")
    if where.suffix in PICKLE_SUFFIXES:
        raise PreflightError(pickled_lora(init_path))
    try:
        with safe_open(str(where), framework="pt") as f:
            return where, {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated or foreign files
        raise PreflightError(
            f"lora.init_path: {where} is not a readable safetensors file (corrupt or truncated: {e}); "
            f"give an intact LoRA ({example})"
        ) from None


def check_lora_init(cfg: Config, family_name: str | None = None) -> None:
    """lora.init_path, when set: an intact LoRA file (`lora_init_file`) made with the settings the config's lora
    section describes (its alpha; not DoRA, rsLoRA or per-module alphas: `lora_files.settings_problem`), of the
    family's denoiser alone (`lora_files.component_problem`)."""
    if not (cfg.lora.enabled and cfg.lora.init_path):
        return
    from .lora_files import adapter_settings, component_problem, foreign_format, lora_ranks, peft_keys, settings_problem

    path, shapes = lora_init_file(cfg.lora.init_path)
    shapes = peft_keys(shapes)  # diffusers' UNet format (an SD1.5 or SDXL run's export): its ranks are lora_A's
    prefix = None
    if family_name is not None:
        from .families import family

        prefix = family(family_name).denoiser_attr
    problem = (
        foreign_format(shapes, path, prefix)  # (kohya's keys: named before the model loads, not at its load)
        or component_problem(shapes, prefix, path)
        or settings_problem(adapter_settings(path, prefix), cfg.lora, path, lora_ranks(shapes))
    )
    if problem:
        raise PreflightError(problem)


def preflight(cfg: Config, *, engine: bool = True, train: bool = True) -> tuple[PromptSet | None, PromptSet]:
    """All checks of `cfg` that need no model, before it loads; returns the (train, eval) prompt sets. (The run
    directory is the trainer's to check: `flowrl.run.rundir`.) `engine` False: a command that samples no rollouts
    (`flowrl eval`: greedy on the trainer's own model) does not ask text.engine's server. `train` False: a command
    that does not train (`flowrl eval`) reads the eval prompts alone when data.eval_prompts is given (train: None)."""
    check_device(cfg.model.device)
    train_set, eval_set = load_prompt_sets(cfg, train=train)
    check_rewards(cfg)
    check_reward_columns(cfg, train_set, eval_set)
    check_reward_counts(cfg)
    family_name = check_model(cfg)
    check_reward_weights(cfg)  # after the model's own: the model is named first when both are missing
    check_conditioning(cfg, family_name, train_set, eval_set)
    check_reward_samples(cfg, family_name)
    check_eval_features(cfg, family_name, eval_set)
    check_loggers(cfg)
    check_optimizer(cfg)
    check_lora_init(cfg, family_name)
    check_tool_env(cfg)
    check_reward_servers(cfg)  # last: the checks that wait on the network
    if engine:
        check_engine_server(cfg)
    return train_set, eval_set


def check_device(device: str, key: str = "model.device") -> None:
    """A device this machine has: CUDA (and the index asked for), Apple's MPS or Intel's XPU; `auto` and `cpu`
    always are (the config's check has read the string)."""
    import torch

    if device in ("auto", "cpu"):
        return
    d = torch.device(device)
    backend = {"cuda": torch.cuda, "xpu": getattr(torch, "xpu", None), "mps": getattr(torch.backends, "mps", None)}
    module = backend.get(d.type)
    if module is None or not module.is_available():
        raise PreflightError(
            f"{key}={device} but this machine has no {d.type.upper()} device that torch can use (torch "
            f"{torch.__version__}); use {key}=cpu, or auto (the accelerator's device, the CPU when there is none)"
        )
    count = module.device_count() if hasattr(module, "device_count") else 1
    if d.index is not None and d.index >= count:
        raise PreflightError(
            f"{key}={device} but this machine has {count} {d.type.upper()} device(s), numbered from 0; use "
            f"{d.type}:0{f' to {d.type}:{count - 1}' if count > 1 else ''}, or auto"
        )


def check_tool_env(cfg: Config) -> None:
    """text.tool_env: the environment loads, and the model's turn has stop strings to end at."""
    if cfg.backend != "text" or not cfg.text.tool_env:
        return
    from .tools import load_tool_env

    env = load_tool_env(cfg.text.tool_env)
    if not (cfg.text.tool_stop or env.stop):
        raise ConfigError(
            f"text.tool_env={cfg.text.tool_env!r} declares no stop strings (a `stop` attribute), so the model's turn "
            "would never end for it to answer: set text.tool_stop, e.g. text.tool_stop=['</call>']"
        )


def check_engine_server(cfg: Config) -> None:
    """text.engine=vllm: its server answers /health as a flowrl vLLM server, before the model loads (an
    EngineError of one line naming the URL and how to start it)."""
    if cfg.backend != "text" or cfg.text.engine != "vllm":
        return
    from .engines.vllm_engine import SERVER_KIND, request, start_command
    from .errors import EngineError

    url = cfg.text.vllm_url.rstrip("/")
    info = request(f"{url}/health", timeout=10.0, model=cfg.model.path)
    if info.get("kind") != SERVER_KIND:
        raise EngineError(
            f"{url} answers, but not as a flowrl vLLM server (kind {info.get('kind')!r}); start one with "
            f"`{start_command(cfg.model.path, url)}`"
        )
    differ = engine_model_mismatch(cfg.model.path, info.get("config"))
    if differ:
        raise EngineError(
            f"the vLLM server at {url} holds another model than model.path={cfg.model.path} "
            f"({info.get('model')}: {'; '.join(differ)}); start it with `{start_command(cfg.model.path, url)}`"
        )


def engine_model_mismatch(path: str, theirs: dict | None) -> list[str]:
    """The architecture entries (vllm_server.CONFIG_KEYS) in which the engine server's model (`theirs`, from its
    /health; None from a server that does not report them) differs from model.path's, as 'key: ours vs theirs'."""
    if not isinstance(theirs, dict):
        return []
    try:
        from transformers import AutoConfig

        ours = AutoConfig.from_pretrained(path).to_dict()
    except Exception:  # noqa: BLE001 - the model's own load reports an unreadable config
        return []
    return [
        f"{k} {ours[k]!r} here, {v!r} there"
        for k, v in theirs.items()
        if ours.get(k) is not None and v is not None and ours[k] != v
    ]


def check_sample_images(family_name: str, paths: list[str]) -> None:
    """`flowrl sample --image`: each path a file Pillow reads, as many as the model's family takes per prompt."""
    from PIL import Image, UnidentifiedImageError

    from .conditioning import count_problem
    from .families import family

    for path in paths:
        try:
            with Image.open(path) as im:
                im.verify()
        except (OSError, UnidentifiedImageError) as e:
            raise PreflightError(f"--image {path!r} is not an image Pillow reads ({e})") from None
    accepts = family(family_name).condition_images
    problem = count_problem(len(paths), accepts, family_name, fix="or leave --image out")
    if problem:
        each = " (give each image with its own --image)" if len(paths) < accepts[0] else ""  # (too few)
        raise PreflightError(f"--image: {problem}{each}")
