"""The models of a plan, built on the meta device from their configuration files: where the files come from (a
local directory, the JSON shipped in flowrl/plan_configs/, the hub), a pipeline's components, a causal LM, the LoRA
flowrl adds, and the models the rewards keep on the GPU (as each reward declares them). No weight is read."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flowrl.errors import FlowrlError

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SHIPPED_DIR = Path(__file__).parents[1] / "plan_configs"


class PlanError(FlowrlError, ValueError):
    """A model or config the planner cannot read: the message names it and what would work. `flowrl plan` exits
    with 2 for it, so that its 1 means one thing: the config was planned and fits under no column."""

    exit_code = 2


# ------------------------------------------------------------------------------------ configuration files


def shipped_models() -> list[str]:
    """The hub ids whose configuration files ship with flowrl (flowrl/plan_configs/)."""
    ids = []
    for file in sorted(SHIPPED_DIR.glob("*.json")):
        with open(file, encoding="utf-8") as f:
            ids.append(json.load(f)["_hub_id"])
    return ids


def _shipped(repo_id: str) -> dict | None:
    file = SHIPPED_DIR / (repo_id.replace("/", "--") + ".json")
    if not file.is_file():
        return None
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def config_reader(path: str) -> tuple[Callable[[str], dict], str]:
    """(read, source): `read(name)` returns the model's JSON file `name` ("model_index.json",
    "transformer/config.json", "config.json"); `source` says where they come from.

    path: a local directory, or a hub id: the JSON shipped in flowrl/plan_configs/ if there is one, else the
    hub's files through huggingface_hub (its cache, or downloaded unless HF_HUB_OFFLINE is set). A hub id
    with neither fails with a PlanError naming it."""
    if os.path.isdir(path):

        def read_local(name: str) -> dict:
            file = os.path.join(path, *name.split("/"))
            if not os.path.isfile(file):
                from flowrl.run.basemodel import flowrl_run_hint

                hint = flowrl_run_hint(path) if name in ("model_index.json", "config.json") else None
                raise PlanError(
                    f"{path} has no {name}: "
                    + (
                        hint
                        or "not a diffusers pipeline (pipe.save_pretrained(DIR)) or transformers model "
                        "(model.save_pretrained(DIR)) directory"
                    )
                )
            try:
                with open(file, encoding="utf-8") as f:
                    return json.load(f)
            except (ValueError, UnicodeDecodeError) as e:  # (json's JSONDecodeError is a ValueError)
                raise PlanError(
                    f"{file} is not valid JSON ({e}): a model's configuration files are JSON objects; fix the "
                    "file, or write the model again with save_pretrained(DIR)"
                ) from None

        return read_local, f"local directory {path}"
    if os.path.exists(path):
        raise PlanError(f"model.path={path} is a file; a model is a directory or a hub id (ORG/NAME)")
    files = _shipped(path)
    if files is not None:

        def read_shipped(name: str) -> dict:
            if name not in files:
                raise PlanError(f"{path}: the shipped configuration (flowrl/plan_configs) has no {name}")
            return files[name]

        return read_shipped, "configuration shipped with flowrl (flowrl/plan_configs)"
    return (lambda name: _read_hub(path, name)), "the Hugging Face hub"


def _read_hub(repo_id: str, name: str) -> dict:
    from flowrl.families import ImageModelError, hub_offline, read_hub_json

    try:
        return read_hub_json(repo_id, name)
    except ImageModelError as e:
        offline = " (HF_HUB_OFFLINE is set)" if hub_offline() else ""
        raise PlanError(
            f"no configuration for model {repo_id!r}: flowrl ships none for it and the hub gave none{offline}: {e}. "
            f"Shipped: {', '.join(shipped_models())}; or point model.path to a local directory holding its "
            f"config files"
        ) from None


# ------------------------------------------------------------------------------------ models on the meta device


@dataclass
class Component:
    """One model of the pipeline (or a reward backbone) and its size."""

    name: str  # "transformer", "text_encoder_2", "reward pickscore"
    class_name: str
    params: int  # parameters + persistent buffers: what its checkpoint holds
    weight_bytes: int  # parameters + all buffers in `dtype`
    dtype: str
    module: torch.nn.Module | None = field(default=None, repr=False)


@contextlib.contextmanager
def _quiet():
    """Silence the libraries' warnings and info logs while building modules from configs."""
    loggers = [logging.getLogger(n) for n in ("transformers", "diffusers", "peft", "accelerate")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _model_class(library: str, class_name: str):
    """The class a model_index.json entry names, or None if it is not an nn.Module (a tokenizer, scheduler,
    image processor)."""
    import importlib

    modules = {"diffusers": "diffusers", "transformers": "transformers"}
    module_name = modules.get(library, f"diffusers.pipelines.{library}")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        raise PlanError(
            f"model_index.json names {library}.{class_name}, which this diffusers/transformers install "
            f"does not have: upgrade them, or plan a model they know"
        ) from None
    return cls if isinstance(cls, type) and issubclass(cls, torch.nn.Module) else None


def build_on_meta(cls, config: Mapping) -> torch.nn.Module:
    """An instance of the diffusers or transformers model class `cls` made from its config dict on the meta
    device: every tensor has its shape and dtype and no storage."""
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with _quiet(), torch.device("meta"):
        if hasattr(cls, "from_config") and hasattr(cls, "config_name"):  # diffusers ModelMixin
            return cls.from_config(config)
        config_class = getattr(cls, "config_class", None)
        if config_class is None:
            raise PlanError(f"cannot build {cls.__name__} from a config: neither a diffusers nor a transformers model")
        return cls._from_config(config_class(**config))


def _sizes(module: torch.nn.Module, dtype: str) -> tuple[int, int]:
    """(parameters + persistent buffers: what its checkpoint holds, bytes of the parameters and all buffers in
    `dtype`). Tied weights count once; integer buffers keep their own size."""
    persistent = {id(t) for t in module.state_dict(keep_vars=True).values()}
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    params = sum(t.numel() for t in module.parameters()) + sum(
        t.numel() for t in module.buffers() if id(t) in persistent
    )
    nbytes = sum(
        t.numel() * (DTYPE_BYTES[dtype] if t.is_floating_point() else t.element_size()) for t in tensors.values()
    )
    return params, nbytes


def pipeline_components(path: str, dtype: str, *, skip: tuple[str, ...] = ()) -> tuple[str, list[Component], str]:
    """(pipeline class, its models built on meta, where the configuration came from) for a diffusers pipeline:
    a tiny test model, a local directory, a shipped configuration or the hub. `skip`: components left out
    (drop_t5). A shipped or hub model's modules are built once per process and shared: copy one before
    changing it."""
    if os.path.isdir(path):
        return _pipeline_components(path, dtype, tuple(skip))
    return _cached_pipeline_components(path, dtype, tuple(skip))


@functools.lru_cache(maxsize=8)
def _cached_pipeline_components(path: str, dtype: str, skip: tuple[str, ...]):
    return _pipeline_components(path, dtype, skip)


def _pipeline_components(path: str, dtype: str, skip: tuple[str, ...]) -> tuple[str, list[Component], str]:
    from flowrl.families import UNUSED_COMPONENTS, tiny_models, tiny_pipeline  # (the loader never loads those)

    if path in tiny_models() and not os.path.exists(path):
        with _quiet():
            pipe = tiny_pipeline(path)
        parts = []
        for name, module in pipe.components.items():
            if isinstance(module, torch.nn.Module) and name not in skip and name not in UNUSED_COMPONENTS:
                params, nbytes = _sizes(module, dtype)
                parts.append(Component(name, type(module).__name__, params, nbytes, dtype, module))
        return type(pipe).__name__, parts, "tiny test model built in code"
    read, source = config_reader(path)
    index = read("model_index.json")
    if os.path.isdir(path):  # a copy that missed a component's folder: train's message (and its model.drop_t5 hint)
        _as_plan_error(_check_folders, path, index, skip)
    pipeline_class = index.get("_class_name")
    pipeline_class = pipeline_class[-1] if isinstance(pipeline_class, list) else pipeline_class
    parts = []
    for name, entry in index.items():
        if name.startswith("_") or name in skip or not isinstance(entry, (list, tuple)) or entry[0] is None:
            continue
        if name in UNUSED_COMPONENTS:  # never loaded (a safety checker: flowrl's rollout never runs it)
            continue
        cls = _model_class(*entry)
        if cls is None:
            continue
        module = build_on_meta(cls, read(f"{name}/config.json"))
        params, nbytes = _sizes(module, dtype)
        parts.append(Component(name, cls.__name__, params, nbytes, dtype, module))
    return pipeline_class, parts, source


def _as_plan_error(check: Callable, *args, **kwargs):
    """`check(*args, **kwargs)`, a check the trainer's preflight shares (flowrl.families), its ImageModelError a
    PlanError with the same message."""
    from flowrl.families import ImageModelError

    try:
        return check(*args, **kwargs)
    except ImageModelError as e:
        raise PlanError(str(e)) from None


def _check_folders(path: str, index: Mapping, skip: tuple[str, ...]) -> None:
    """Every component the local directory's model_index.json names has its folder (T5's are not needed when
    skipped: model.drop_t5), as the trainer's preflight checks it."""
    from flowrl.families import check_components, checked_backend

    backend_cls = checked_backend(path, index, "auto", False)
    drop_t5 = bool(backend_cls.t5_components) and set(backend_cls.t5_components) <= set(skip)
    check_components(path, index, backend_cls, drop_t5)


def causal_lm(path: str, dtype: str) -> tuple[Component, str]:
    """(the causal LM of the text backend built on meta, where its config came from). A shipped or hub model is
    built once per process and shared: copy its module before changing it."""
    if os.path.isdir(path):
        return _causal_lm(path, dtype)
    return _cached_causal_lm(path, dtype)


@functools.lru_cache(maxsize=4)
def _cached_causal_lm(path: str, dtype: str) -> tuple[Component, str]:
    return _causal_lm(path, dtype)


def _causal_lm(path: str, dtype: str) -> tuple[Component, str]:
    import transformers

    read, source = config_reader(path)
    config = read("config.json")
    architectures = config.get("architectures") or []
    cls = next((getattr(transformers, a) for a in architectures if hasattr(transformers, a)), None)
    if cls is None:
        cls = transformers.AutoModelForCausalLM
        with _quiet():
            model_config = transformers.AutoConfig.for_model(**config)
            with torch.device("meta"):
                module = cls.from_config(model_config)
    else:
        module = build_on_meta(cls, config)
    params, nbytes = _sizes(module, dtype)
    return Component("model", type(module).__name__, params, nbytes, dtype, module), source


def inject_lora(
    module: torch.nn.Module, rank: int, alpha: float, targets, *, causal_lm: bool = False
) -> tuple[torch.nn.Module, dict[str, int]]:
    """(the module with LoRA adapters, as flowrl's policies add them; the adapted layers' names -> rank).
    targets: module names (peft's matching) or None for peft's default of a causal LM's model type."""
    import peft
    from peft.tuners.tuners_utils import BaseTunerLayer

    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, task_type="CAUSAL_LM" if causal_lm else None
    )
    # the adapters on the meta device, as the model is: their initialisation (kaiming on every adapted layer, ~1 s
    # for a FLUX-size model on a CPU) is skipped, and a plan counts their elements only
    with _quiet(), torch.device("meta"):
        try:
            if causal_lm:
                module = peft.get_peft_model(module, config)
            else:
                module = peft.inject_adapter_in_model(config, module)
        except ValueError as e:
            raise PlanError(
                f"lora.target_modules {list(targets) if targets else 'default'}: peft adapts nothing "
                f"in {type(module).__name__} ({e})"
            ) from None
    adapted = {}
    for name, mod in module.named_modules():
        if isinstance(mod, BaseTunerLayer) and mod.r:
            adapted[name.removeprefix("base_model.model.")] = next(iter(mod.r.values()))
    return module, adapted


def lora_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for n, p in module.named_parameters() if "lora_" in n)


@functools.lru_cache(maxsize=16)
def _transformers_size(class_name: str, config_json: str, dtype: str) -> tuple[int, int]:
    import transformers

    return _sizes(build_on_meta(getattr(transformers, class_name), json.loads(config_json)), dtype)


def _held_component(label: str, who: str, held) -> tuple[list[Component], list[str]]:
    """One model a reward (or the eval feature backbone) keeps on the GPU, as it declares it (`rewards.memory`): a
    `HubModel` built on meta from its configuration, `Parameters` of a known count, or, for what cannot be sized
    (`NotEstimated`, no configuration, a model type it does not take), a note that starts with `who`."""
    import rewards

    if isinstance(held, rewards.NotEstimated):
        return [], [f"{who}: {held.reason}; its memory is not estimated"]
    if isinstance(held, rewards.Parameters):
        return [Component(label, held.what, held.count, held.count * DTYPE_BYTES[held.dtype], held.dtype)], []
    try:
        read, _ = config_reader(held.source)
        config = read("config.json")
    except PlanError:
        return [], [f"{who}: no configuration for {held.source}, its memory is not estimated"]
    try:
        class_name = held.class_for(config)
        params, nbytes = _transformers_size(class_name, json.dumps(config, sort_keys=True), held.dtype)
    except (ValueError, AttributeError) as e:  # a model type it does not take, a class transformers lacks
        return [], [f"{who}: {e}; its memory is not estimated"]
    return [Component(label, f"{class_name} {held.source}", params, nbytes, held.dtype)], []


def reward_components(specs) -> tuple[list[Component], list[str]]:
    """(the models the rewards keep on the GPU, built on meta as each reward declares them
    (`rewards.memory_spec`: a sum of rewards, its components'), notes on those whose memory is not estimated)."""
    import rewards

    parts, notes = [], []
    for spec in specs:
        try:
            held = rewards.memory_spec(spec.target, dict(spec.kwargs))
        except rewards.RewardConfigError as e:
            notes.append(f"reward {spec.target}: its memory is not estimated: {e}")
            continue
        for item in held:
            found, why = _held_component(f"reward {item.reward}", f"reward {item.reward}", item)
            parts, notes = parts + found, notes + why
    return parts, notes


def feature_components(backbone: str) -> tuple[list[Component], list[str]]:
    """The eval.diversity_features backbone built on meta (float32, as the trainer loads it; on the main process
    only) as `rewards.features.encoder_memory` describes it, or a note when its memory cannot be estimated.
    ("": none.)"""
    if not backbone:
        return [], []
    from rewards.features import encoder_memory

    return _held_component(
        "eval.diversity_features, main process", "eval.diversity_features", encoder_memory(backbone, "float32")
    )


def check_local_model(cfg) -> None:
    """A local pipeline directory at model.path passes the checks `flowrl train` makes of its files before it loads
    (`flowrl.families.preflight_image_model`: its components' folders, links and weights, the weights of
    model.variant, the denoiser's config), as a PlanError of the same line; the image size is not checked (a plan
    plans any size). A tiny model, a shipped configuration or a hub id is read as it is."""
    if not os.path.isdir(cfg.model.path):
        return
    from flowrl.families import preflight_image_model

    m = cfg.model
    _as_plan_error(
        preflight_image_model, m.path, m.family, height=None, width=None, drop_t5=m.drop_t5, variant=m.variant
    )


def family_of(path: str, requested: str):
    """The family backend class for model.path (a tiny model's name says it; otherwise its model_index.json)."""
    from flowrl.families import tiny_models

    if path in tiny_models() and not os.path.exists(path):
        fam = tiny_models()[path]
    else:
        from flowrl.families import check_model_index, checked_backend

        read, _ = config_reader(path)
        index = read("model_index.json")
        # the trainer's checks of model_index.json: its pipeline class, its components, the family's own (Wan2.2)
        fam = _as_plan_error(checked_backend, path, index, "auto", False)
        _as_plan_error(check_model_index, path, index, fam)
    if requested != "auto" and requested != fam.family:
        raise PlanError(
            f"model.family={requested} but {path} is a {fam.family!r} model: set model.family={fam.family} or auto"
        )
    return fam
