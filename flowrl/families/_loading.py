"""Finding the family of a model and loading it: discovery of the family modules, checks from the model's
configuration files before any weight is read (`preflight_image_model`), and `load_image_backend`."""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
from collections.abc import Callable, Mapping, Sequence

import torch
from safetensors import SafetensorError

from ._base import FAMILIES, ImageBackend, ImageModelError


def load_all() -> None:
    """Import every module of `flowrl.families` whose name does not start with "_": each registers its family.
    Nothing else lists the families."""
    FAMILIES.discover(__package__, [os.path.dirname(__file__)])


def family_names() -> list[str]:
    """The registered families' names, sorted."""
    load_all()
    return FAMILIES.names()


def family(name: str) -> type[ImageBackend]:
    """The backend class of family `name`; an unknown name is an error listing the valid ones."""
    load_all()
    return FAMILIES.get(name)


def tiny_models() -> dict[str, type[ImageBackend]]:
    """The tiny test models' names ("tiny-<family>") -> their family's backend class."""
    load_all()
    return {f"tiny-{n}": FAMILIES.get(n) for n in FAMILIES.names()}


def tiny_pipeline(name: str, seed: int = 0, **options):
    """The tiny random-weight pipeline `name` ("tiny-sd3", ...; see `tiny_models`)."""
    models = tiny_models()
    if name not in models:
        raise ImageModelError(f"unknown tiny model {name!r}; valid: {', '.join(sorted(models))}")
    return models[name].tiny_pipeline(seed, **options)


def _supported_pipelines() -> str:
    """The pipeline classes the families drive, with their families ("StableDiffusion3Pipeline (sd3), ..."),
    for error messages."""
    load_all()
    return ", ".join(f"{c} ({n})" for n in FAMILIES for c in FAMILIES.get(n).pipeline_classes)


def _family_of_class(cls_or_name: type | str) -> str | None:
    """The family driving a pipeline class (or a subclass of one, or its image-to-image variant: the same
    components and weights), or a pipeline class name; None if no family does."""
    load_all()
    by_name = {c: n for n in FAMILIES for c in FAMILIES.get(n).pipeline_classes}
    names = [cls_or_name] if isinstance(cls_or_name, str) else [c.__name__ for c in cls_or_name.__mro__]
    names = [m for name in names for m in (name, text_to_image_class(name))]
    return next((by_name[name] for name in names if name in by_name), None)


def text_to_image_class(name: str) -> str:
    """The text-to-image pipeline class an image-to-image one shares its components and weights with
    (StableDiffusion3Img2ImgPipeline -> StableDiffusion3Pipeline, as diffusers names them); other names as they
    are. (Inpainting pipelines are not mapped: an inpainting checkpoint's denoiser may take the mask as input.)"""
    return name.replace("Img2Img", "") if "Img2ImgPipeline" in name else name


def as_text_to_image(pipe):
    """`pipe`, or the text-to-image pipeline over its components when it is an image-to-image variant
    (`text_to_image_class`); the rollout drives the text-to-image class's methods."""
    name = type(pipe).__name__
    if text_to_image_class(name) == name:
        return pipe
    import diffusers

    return getattr(diffusers, text_to_image_class(name)).from_pipe(pipe)


def detect_family(pipe) -> str:
    """The backend family of a pipeline, from its class (or a base class)."""
    family = _family_of_class(type(pipe))
    if family is None:
        raise ImageModelError(
            f"no image backend drives {type(pipe).__name__}; supported pipelines: {_supported_pipelines()}"
        )
    return family


# ---- before loading: the model's configuration files only ----------------------------------------------


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as the environment says now (`flowrl.hub.offline`)."""
    from flowrl import hub

    return hub.offline()


def _causal_lm_hint(directory: str) -> str | None:
    """What to set when the directory given as an image model is a causal LM's (its config.json names a class
    `...ForCausalLM` / `...LMHeadModel`, as transformers' save_pretrained writes it): a text run; None otherwise."""
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            names = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    lm = next((n for n in names if isinstance(n, str) and n.endswith(("ForCausalLM", "LMHeadModel"))), None)
    if lm is None:
        return None
    return f"it is a causal LM ({lm}, its config.json), which a text run trains: set backend: text"


def _read_local_json(directory: str, name: str) -> dict:
    """The JSON file `name` (e.g. "vae/config.json") of a local pipeline directory."""
    file = os.path.join(directory, *name.split("/"))
    if not os.path.isfile(file):
        parent = os.path.dirname(os.path.abspath(directory))
        if name == "model_index.json" and os.path.isfile(os.path.join(parent, name)):  # a component's folder
            raise ImageModelError(
                f"{directory} has no {name}: it is the {os.path.basename(os.path.abspath(directory))} folder of the "
                f"pipeline directory {parent}: set model.path={parent}"
            )
        from flowrl.run.basemodel import flowrl_run_hint

        hint = flowrl_run_hint(directory) if name == "model_index.json" else None
        if name == "model_index.json" and hint is None:
            hint = _causal_lm_hint(directory)
        raise ImageModelError(
            f"{directory} has no {name}: "
            + (hint or "not a diffusers pipeline directory (write one with pipe.save_pretrained(DIR))")
        )
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # (json's JSONDecodeError is a ValueError)
        raise ImageModelError(
            f"{file} is not valid JSON ({e}): a diffusers pipeline's configuration files are JSON objects; "
            "fix the file, or write the model again with pipe.save_pretrained(DIR)"
        ) from None


def read_hub_json(repo_id: str, name: str, **hub_kwargs) -> dict:
    """The JSON file `name` of a hub model, from the huggingface_hub cache or downloaded (never with
    HF_HUB_OFFLINE set: then a file not cached fails at once)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    from flowrl import hub

    offline = hub.settle()  # (offline at once when the hub cannot be reached)
    subfolder, filename = posixpath.split(name)
    hub_kwargs["local_files_only"] = hub_kwargs.get("local_files_only", False) or offline
    try:
        file = hf_hub_download(repo_id, filename, subfolder=subfolder or None, **hub_kwargs)
    except HFValidationError:
        raise ImageModelError(
            f"{repo_id!r} is neither a local directory (none there; a relative path is read from the working "
            f"directory, {os.getcwd()}) nor a hub id (ORG/NAME), nor one of the tiny test models "
            f"({', '.join(sorted(tiny_models()))})"
        ) from None
    except LocalEntryNotFoundError:
        why = hub.why_offline() if offline else "the hub could not be reached"
        raise ImageModelError(
            f"hub model {repo_id}: {name} is not in the Hugging Face cache and {why} (nor is there a directory "
            f"{repo_id} under the working directory, {os.getcwd()}); download the model once online (without "
            f"HF_HUB_OFFLINE) or pass a local directory (pipe.save_pretrained(DIR))"
        ) from None
    except (RepositoryNotFoundError, EntryNotFoundError) as e:
        raise ImageModelError(
            f"hub model {repo_id} has no {name} ({type(e).__name__}): not a diffusers pipeline repository"
        ) from None
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def _config_reader(path: str, **hub_kwargs) -> Callable[[str], dict]:
    """A reader of the model's JSON configuration files by their path inside it ("model_index.json",
    "transformer/config.json"): from a tiny model's known configs, a local directory, or the hub.
    hub_kwargs: revision, cache_dir, token, local_files_only (hub ids only)."""
    tiny = tiny_models()
    if path in tiny and not os.path.exists(path):
        files = tiny[path].tiny_config_files()
        return lambda name: files[name]
    if os.path.isdir(path):
        return lambda name: _read_local_json(path, name)
    if os.path.exists(path):
        raise ImageModelError(_file_given(path))
    return lambda name: read_hub_json(path, name, **hub_kwargs)


def _file_given(path: str) -> str:
    """Why a file is not a model.path: a LoRA file (its keys name lora_A/lora_B or lora_down/lora_up) belongs in
    lora.init_path; a single-file checkpoint (.safetensors, .ckpt, ...) is converted to a pipeline directory once."""
    base = f"model.path={path} is a file; a model is a diffusers pipeline directory or a hub id (ORG/NAME)"
    from flowrl.lora_files import is_lora_file

    if is_lora_file(path):
        return f"{base}; this file holds a LoRA: give the base model as model.path and this file as lora.init_path"
    folder = os.path.dirname(os.path.abspath(path))
    pipeline = next(
        (d for d in (folder, os.path.dirname(folder)) if os.path.isfile(os.path.join(d, "model_index.json"))), None
    )
    if pipeline is not None:  # its model_index.json, or a component's config.json: the directory holding them
        return f"{base}; this file is part of the pipeline directory {pipeline}: set model.path={pipeline}"
    if path.endswith((".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".gguf")):
        pipeline = _single_file_pipeline(path)
        which = "" if pipeline else " (PIPELINE: its family's pipeline class, e.g. StableDiffusionXLPipeline)"
        return (
            f"{base}; a single-file checkpoint is converted once: {pipeline or 'PIPELINE'}.from_single_file("
            f"{path!r}).save_pretrained('my_model'){which}, then model.path=my_model"
        )
    return base


#: a key only one kind of original (single-file) checkpoint has -> the diffusers pipeline class that converts it
_SINGLE_FILE_KEYS = (
    ("joint_blocks.", "StableDiffusion3Pipeline"),
    ("x_embedder.", "StableDiffusion3Pipeline"),
    ("double_blocks.", "FluxPipeline"),
    ("conditioner.embedders.", "StableDiffusionXLPipeline"),
    ("model.diffusion_model.input_blocks.", "StableDiffusionPipeline"),
)


def _single_file_pipeline(path: str) -> str | None:
    """The pipeline class a single-file .safetensors checkpoint is converted with, from its keys; None if unknown."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            keys = list(f.keys())
    except (OSError, ValueError, SafetensorError):  # not a safetensors file (.ckpt, .gguf, damaged)
        return None
    return next((cls for part, cls in _SINGLE_FILE_KEYS if any(part in key for key in keys)), None)


def _class_name(model_index: Mapping) -> str:
    """The pipeline class model_index.json names (a custom pipeline's [module, class] gives its class)."""
    name = model_index.get("_class_name")
    return name[-1] if isinstance(name, (list, tuple)) else str(name)


def _null_components(model_index: Mapping) -> list[str]:
    """The components model_index.json records as absent ([null, null]: saved as None)."""
    return [
        name
        for name, value in model_index.items()
        if not name.startswith("_") and (value is None or (isinstance(value, (list, tuple)) and value[0] is None))
    ]


def check_components(path: str, model_index: Mapping, backend_cls: type[ImageBackend], drop_t5: bool = False) -> None:
    """Every component model_index.json names (not as [null, null], nor T5's with drop_t5) has its folder in the
    local pipeline directory `path`: a copy that missed one (or a folder deleted to save space) is an ImageModelError
    naming it before diffusers fails on its weights; a directory missing T5's alone names model.drop_t5=true too."""
    absent = set(_null_components(model_index)) | set(backend_cls.t5_components if drop_t5 else ())
    missing = [
        name
        for name, value in model_index.items()
        if not name.startswith("_")
        and name not in absent
        and isinstance(value, (list, tuple))
        and not os.path.isdir(os.path.join(path, name))
    ]
    if not missing:
        return
    folders = ", ".join(f"{name}/ ({_class_name({'_class_name': model_index[name]})})" for name in missing)
    t5 = " or leave T5 out: model.drop_t5=true;" if set(missing) <= set(backend_cls.t5_components) else ""
    raise ImageModelError(
        f"{path}: model_index.json names components the directory has no folder for: {folders}; copy the whole "
        f"pipeline directory, or save it again with pipe.save_pretrained(DIR);{t5} a component left out on purpose "
        "is saved as [null, null] by a pipeline built with it as None"
    )


def _vae_scale_factor(read: Callable[[str], dict], model_index: Mapping) -> int:
    """The VAE's downsampling factor as the pipelines compute it (8 without a VAE)."""
    if "vae" not in model_index or "vae" in _null_components(model_index):
        return 8
    config = read("vae/config.json")
    if "scale_factor_spatial" in config:  # AutoencoderKLWan: WanPipeline's vae_scale_factor_spatial
        return config["scale_factor_spatial"]
    if "temperal_downsample" in config:  # AutoencoderKLQwenImage: 2 ** len(temperal_downsample), as QwenImagePipeline
        return 2 ** len(config["temperal_downsample"])
    # AutoencoderKL's block_out_channels; AutoencoderDC's (SANA) encoder_block_out_channels, as SanaPipeline reads it
    channels = config.get("block_out_channels") or config["encoder_block_out_channels"]
    return 2 ** (len(channels) - 1)


def checked_backend(source: str, model_index: Mapping, family: str, drop_t5: bool) -> type[ImageBackend]:
    """The backend class for a model_index.json: an ImageModelError if no family drives its pipeline
    class, if `family` (unless "auto") is another one, or if drop_t5 is asked of a family with no
    optional T5."""
    load_all()
    if not isinstance(model_index, Mapping):
        raise ImageModelError(
            f"{source}: model_index.json holds a JSON {type(model_index).__name__}, not the object a diffusers "
            'pipeline writes ({"_class_name": ..., COMPONENT: [LIBRARY, CLASS], ...}): save the pipeline again '
            "with pipe.save_pretrained(DIR)"
        )
    if not model_index.get("_class_name"):
        raise ImageModelError(
            f"{source}: model_index.json has no `_class_name` (the pipeline class, e.g. StableDiffusion3Pipeline): "
            "save the pipeline again with pipe.save_pretrained(DIR)"
        )
    class_name = _class_name(model_index)
    detected = _family_of_class(class_name)
    if detected is None:
        others = _pipelines_of(_listed_components(model_index), class_name)
        if others:  # a pipeline class of its own (PAG, a fork) over a family's components
            raise ImageModelError(
                f"{source}: no image backend drives {class_name} (model_index.json's _class_name), and its "
                f"components are those of {' or '.join(others)}: set model_index.json's _class_name to it "
                f"(supported pipelines: {_supported_pipelines()})"
            )
        raise ImageModelError(
            f"{source}: no image backend drives {class_name} (model_index.json's _class_name); "
            f"supported pipelines: {_supported_pipelines()}"
        )
    if family != "auto":
        FAMILIES.get(family)  # an unknown name: the error lists the valid ones
        if family != detected:
            raise ImageModelError(
                f"{source} is a {class_name}, a {detected!r} model, not {family!r}: set model.family={detected} "
                "(or auto)"
            )
    backend_cls = FAMILIES.get(detected)
    if drop_t5:
        _check_drop_t5(backend_cls, source)
    return backend_cls


#: components of diffusers' pipelines that flowrl never runs (the rollout decodes and scores its images itself)
UNUSED_COMPONENTS = frozenset({"safety_checker", "feature_extractor"})


def _pipeline_takes(class_name: str) -> tuple[frozenset[str], frozenset[str]] | None:
    """(the components a diffusers pipeline class needs, all it takes) from its __init__: the modules it takes
    without a default, less the ones flowrl never runs; None if this diffusers has no such class."""
    import diffusers

    cls = getattr(diffusers, text_to_image_class(class_name), None)
    if not isinstance(cls, type) or not issubclass(cls, diffusers.DiffusionPipeline):
        return None
    required, optional = diffusers.DiffusionPipeline._get_signature_keys(cls)
    return frozenset(required) - UNUSED_COMPONENTS, frozenset(required) | frozenset(optional)


def _unused_kwargs(model_index: Mapping) -> dict:
    """The from_pretrained arguments that leave out the components of model_index.json flowrl never runs
    (`UNUSED_COMPONENTS`: an SD1.5's safety checker and its feature extractor) that its pipeline class takes: each as
    None (never read, never moved to the device), and `requires_safety_checker=False` where the pipeline records it
    (else diffusers warns that the checker was disabled)."""
    takes = _pipeline_takes(_class_name(model_index))
    unused = [n for n in _listed_components(model_index) if n in UNUSED_COMPONENTS and (takes is None or n in takes[1])]
    kwargs = dict.fromkeys(unused)
    if unused and "requires_safety_checker" in model_index:
        kwargs["requires_safety_checker"] = False
    return kwargs


def _listed_components(model_index: Mapping) -> dict[str, str]:
    """The components model_index.json lists with a class (not [null, null]): {name: class name}."""
    return {
        name: str(value[-1])
        for name, value in model_index.items()
        if not name.startswith("_") and isinstance(value, (list, tuple)) and value and value[0] is not None
    }


def _pipelines_of(components: Mapping[str, str], skip: str) -> list[str]:
    """The pipeline classes of the families (other than `skip`) that take every one of `components`, need none it
    lacks and train the denoiser class it lists: "FluxPipeline (flux)", ..."""
    found = []
    for name in FAMILIES:
        other = FAMILIES.get(name)
        for class_name in other.pipeline_classes:
            takes = _pipeline_takes(class_name)
            if class_name == skip or takes is None or components.get(other.denoiser_attr) != other.denoiser_class:
                continue
            if set(components) <= takes[1] and takes[0] - set(other.t5_components) <= set(components):
                found.append(f"{class_name} ({name})")
    return found


def check_model_index(source: str, model_index: Mapping, backend_cls: type[ImageBackend]) -> None:
    """The components of a (real, not tiny) model_index.json are the ones its pipeline class and family run: the
    family's denoiser class, nothing only another family's pipeline takes, each component the pipeline needs listed
    and not saved as [null, null] (T5 excepted where the family runs without it: model.drop_t5); the family's own
    checks last (`check_model_index` of the backend class, e.g. Wan2.2's two experts). An ImageModelError naming both
    classes, or the component, before any weight is read."""
    class_name = _class_name(model_index)
    listed = _listed_components(model_index)
    attr, wanted = backend_cls.denoiser_attr, backend_cls.denoiser_class
    others = _pipelines_of(listed, class_name)
    hint = (
        f": its components are those of {' or '.join(others)}: set model_index.json's _class_name to it"
        if others
        else ""
    )
    if attr in listed and listed[attr] != wanted:
        raise ImageModelError(
            f"{source}: model_index.json's _class_name {class_name} ({backend_cls.family}) trains a {wanted} as its "
            f"{attr}, and this {attr} is a {listed[attr]}{hint or '; save the pipeline again with its own class'}"
        )
    takes = _pipeline_takes(class_name)
    if takes is None:  # a class this diffusers lacks: diffusers names it when it loads
        return
    foreign = sorted(set(listed) - takes[1])
    if foreign and others:  # (a component no family's pipeline takes is ignored by diffusers, and here)
        raise ImageModelError(
            f"{source}: model_index.json's _class_name is {class_name} ({backend_cls.family}), which takes no "
            f"{', '.join(foreign)}{hint}"
        )
    needed = sorted(takes[0] - set(backend_cls.t5_components) | {attr})
    absent = [name for name in needed if name not in listed]
    nulls = [name for name in absent if name in model_index]
    if nulls:
        raise ImageModelError(
            f"{source}: model_index.json saves {', '.join(nulls)} as [null, null] (the pipeline was saved without "
            f"{'it' if len(nulls) == 1 else 'them'}), and {class_name} ({backend_cls.family}) needs "
            f"{', '.join(nulls)} to run: use a pipeline saved with every component it needs"
        )
    if absent:
        raise ImageModelError(
            f"{source}: model_index.json lists no {', '.join(absent)}, which {class_name} ({backend_cls.family}) "
            "needs to run: save the pipeline again with pipe.save_pretrained(DIR)"
        )
    family_check = getattr(backend_cls, "check_model_index", None)  # (a family's own: Wan's)
    if family_check is not None:
        family_check(source, model_index)


def _check_drop_t5(backend_cls: type[ImageBackend], source: str) -> None:
    """An ImageModelError if the family cannot run without its T5 encoder."""
    if not backend_cls.t5_components:
        can = [n for n in FAMILIES if FAMILIES.get(n).t5_components]
        raise ImageModelError(
            f"drop_t5 is SD3-only (families with an optional T5: {can}); {source} is a {backend_cls.family!r} model"
        )


def preflight_image_model(
    path: str,
    family: str = "auto",
    *,
    height: int | None,
    width: int | None,
    drop_t5: bool = False,
    num_frames: int = 0,
    variant: str | None = None,
) -> str:
    """Check that the model at `path` can be run as asked, from its configuration files alone (never its
    weights), and return its family.

    path: a local pipeline directory (its model_index.json, the denoiser's config.json and the VAE's),
        a hub id (the same files from the huggingface_hub cache, or downloaded unless HF_HUB_OFFLINE is
        set), or a tiny test model name ("tiny-sd3", ...).
    family: "auto" or the family the caller expects (`family_names()`).
    height, width: the image size in pixels the run will ask for (None: not checked; `flowrl plan` plans any size).
    drop_t5: the run will leave the T5 encoder out (SD3 only).
    num_frames: the frames per sample the run will ask for (0: the family's default; image families make 1).
    variant: the weight files' variant the run will load (diffusers' `variant`, e.g. "fp16"; None: the plain
        files); checked against a local directory's files (`check_variant`).
    Raises ImageModelError (a ValueError) naming what is wrong and what would be right: a pipeline class
    no family drives (with the supported ones), another family than `family`, a size the model cannot
    make (with the nearest valid ones), drop_t5 for a family without an optional T5, a missing file.
    """
    path = os.fspath(path)
    read = _config_reader(path)
    model_index = read("model_index.json")
    backend_cls = checked_backend(path, model_index, family, drop_t5)
    tiny = path in tiny_models() and not os.path.exists(path)
    folder = path if os.path.isdir(path) else None if tiny else cached_snapshot(path)
    with _naming(path, folder):
        if not tiny:
            check_model_index(path, model_index, backend_cls)
        if folder is not None:
            check_components(folder, model_index, backend_cls, drop_t5)
            check_links(folder, model_index)
            check_weights_present(folder, model_index)
        denoiser_config = read(f"{backend_cls.denoiser_attr}/config.json")
        _check_denoiser_config(path, denoiser_config, model_index, backend_cls)
        if height is not None and width is not None:
            backend_cls.size_rule(denoiser_config, _vae_scale_factor(read, model_index)).check(height, width)
        backend_cls.check_num_frames(num_frames)
        if folder is not None:
            check_variant(folder, model_index, variant)
    return backend_cls.family


def _check_denoiser_config(source: str, config: Mapping, model_index: Mapping, backend_cls: type[ImageBackend]):
    """The denoiser's config.json names the class model_index.json lists for it (diffusers builds the class the
    index names from this config: another model's config fails in its __init__)."""
    attr = backend_cls.denoiser_attr
    listed = _listed_components(model_index).get(attr)
    found = config.get("_class_name") if isinstance(config, Mapping) else None
    if listed and found and found != listed:
        raise ImageModelError(
            f"{source}: {attr}/config.json is a {found}'s, and model_index.json lists {attr} as a {listed}: the folder "
            "is another model's; copy or save the pipeline again"
        )


def cached_snapshot(repo_id: str, **hub_kwargs) -> str | None:
    """The snapshot directory of hub model `repo_id` in the huggingface_hub cache when the hub is not to be reached
    (HF_HUB_OFFLINE, or local_files_only): what diffusers will load, so a local directory's checks apply to it.
    None when online (a download completes the cache), or when it is not cached. Never reaches the network."""
    if not (hub_offline() or hub_kwargs.get("local_files_only")):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    kwargs = {k: hub_kwargs[k] for k in ("revision", "cache_dir", "token") if hub_kwargs.get(k) is not None}
    try:
        folder = snapshot_download(repo_id, local_files_only=True, **kwargs)
    except (HFValidationError, LocalEntryNotFoundError, OSError, ValueError):  # not a hub id, or not cached
        return None
    return folder if os.path.isdir(folder) else None


@contextlib.contextmanager
def _naming(path: str, folder: str | None):
    """A check's ImageModelError on the cached snapshot `folder` of hub model `path` names the hub id too."""
    try:
        yield
    except ImageModelError as e:
        if folder is None or folder == path or folder not in str(e):
            raise
        snapshot = f"{path} (its Hugging Face cache snapshot {folder})"
        named = re.sub(
            rf"(model\.path=)?{re.escape(folder)}",
            lambda m: f"model.path={snapshot}" if m.group(1) else f"hub model {snapshot}",
            str(e),
        )
        raise ImageModelError(named) from e


def check_links(path: str, model_index: Mapping) -> None:
    """No file of a component's folder is a link to nothing (a hub cache's snapshot whose blob was deleted, or a
    download that stopped): diffusers would fail on it without naming it."""
    for name, file, link in _component_files(path, model_index):
        if os.path.islink(link) and not os.path.exists(link):
            raise ImageModelError(
                f"{path}: {name}/{file} is a link to {os.readlink(link)}, which does not exist (a cache "
                "blob deleted, or a download or copy that did not finish): download or copy the model again"
            )


def _component_folders(path: str, model_index: Mapping):
    """(component, its folder) of each component model_index.json names whose folder the directory `path` holds."""
    for name in model_index:
        folder = os.path.join(path, name)
        if not name.startswith("_") and os.path.isdir(folder):
            yield name, folder


def _component_files(path: str, model_index: Mapping):
    """(component, file name, full path) of every file in the folders of the components model_index.json names."""
    for name, folder in _component_folders(path, model_index):
        for file in sorted(os.listdir(folder)):
            yield name, file, os.path.join(folder, file)


#: weight files diffusers and transformers read: NAME[.VARIANT][-0000k-of-0000n].(safetensors|bin)
_WEIGHT_FILE = re.compile(r"^[^.]+?(?:\.(?P<variant>[^.-]+))?(?:-\d+-of-\d+)?\.(?:safetensors|bin)$")


def weight_variants(path: str, model_index: Mapping) -> dict[str, set[str]]:
    """The variants of each weighted component's files in the pipeline directory `path`: {component: {"" (the
    plain files), "fp16", ...}}, for the components whose folder holds weight files."""
    found = {}
    nulls = _null_components(model_index)
    for name, folder in _component_folders(path, model_index):
        if name in nulls:
            continue
        kinds = {m["variant"] or "" for f in os.listdir(folder) if (m := _WEIGHT_FILE.match(f))}
        if kinds:
            found[name] = kinds
    return found


def check_variant(path: str, model_index: Mapping, variant: str | None) -> None:
    """A local pipeline directory has the weight files `variant` asks for: without one, every component its plain
    files (a component saved only as a variant names the variant to ask for); with one, some component that
    variant's files (the others load their plain files, as diffusers does)."""
    found = weight_variants(path, model_index)
    if variant is None:
        only = {name: kinds for name, kinds in found.items() if "" not in kinds}
        if only:
            kinds = sorted(set.union(*only.values()))
            common = sorted(set.intersection(*only.values())) or kinds
            raise ImageModelError(
                f"{path}: {', '.join(f'{n}/' for n in sorted(only))} hold{'s' * (len(only) == 1)} only the "
                f"{' or '.join(repr(k) for k in kinds)} variant of the weights (as save_pretrained(DIR, "
                f"variant=...) names them), no plain files: set model.variant={common[0]}"
            )
    elif not any(variant in kinds for kinds in found.values()):
        present = sorted({k for kinds in found.values() for k in kinds} - {""})
        raise ImageModelError(
            f"{path} has no weight file of variant {variant!r} (model.variant): "
            + (
                f"its variants are {', '.join(present)}"
                if present
                else "it holds only plain files: set model.variant=null"
            )
        )


# ---- loading -----------------------------------------------------------------------------------------------

_HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only")


def _without(pipe, components: Sequence[str]):
    """A new pipeline of pipe's class sharing its modules, with `components` set to None."""
    return type(pipe)(**{**pipe.components, **dict.fromkeys(components)})


def _load_pipeline(path: str, family: str, dtype, drop_t5: bool, from_pretrained_kwargs: dict):
    """A pipeline from a tiny model name, a local directory or a hub id, its configuration checked first
    (see preflight_image_model) so that a model no family drives fails before any weight is read."""
    hub_kwargs = {k: from_pretrained_kwargs[k] for k in _HUB_KWARGS if k in from_pretrained_kwargs}
    model_index = _config_reader(path, **hub_kwargs)("model_index.json")
    backend_cls = checked_backend(path, model_index, family, drop_t5)
    if path in tiny_models() and not os.path.exists(path):
        return backend_cls.tiny_pipeline(drop_t5=True) if drop_t5 else backend_cls.tiny_pipeline()
    check_model_index(path, model_index, backend_cls)
    folder = path if os.path.isdir(path) else cached_snapshot(path, **hub_kwargs)
    if folder is not None:
        with _naming(path, folder):
            check_components(folder, model_index, backend_cls, drop_t5)
            check_links(folder, model_index)
    from diffusers import DiffusionPipeline
    from diffusers.pipelines import pipeline_utils

    # diffusers renamed `torch_dtype` to `dtype` (and deprecated the old name) in late 0.3x
    dtype_kwarg = "dtype" if hasattr(pipeline_utils, "_resolve_dtype") else "torch_dtype"
    kwargs = {dtype_kwarg: dtype or torch.float32}
    # a component saved as None ([null, null], e.g. an SD3 saved without T5) must be passed as None again
    kwargs.update(dict.fromkeys(_null_components(model_index)))
    kwargs.update(_unused_kwargs(model_index))  # a safety checker flowrl never runs: never read nor moved
    if drop_t5:  # never read the T5 weights
        kwargs.update(dict.fromkeys(backend_cls.t5_components))
    saved_as = _class_name(model_index)
    if text_to_image_class(saved_as) != saved_as:  # an image-to-image pipeline's folder: its text-to-image class
        import diffusers

        DiffusionPipeline = getattr(diffusers, text_to_image_class(saved_as))  # noqa: N806 - a pipeline class
    try:
        return DiffusionPipeline.from_pretrained(path, **{**kwargs, **from_pretrained_kwargs})
    except (OSError, ValueError, SafetensorError) as e:
        if folder is None:  # a hub model's errors (offline, not cached, gated) name it already
            raise
        raise _load_error(path, folder, model_index, e) from e


def _load_error(path: str, folder: str, model_index: Mapping, e: BaseException) -> ImageModelError:
    """The one-line error of a local (or cached) pipeline whose files do not load: the components without weights,
    or the files that are damaged (`damaged_files`), named; else diffusers' first line and what to do."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    where = f"model.path={path}" + (f" (its Hugging Face cache snapshot {folder})" if folder != path else "")
    bare = _components_without_weights(folder, model_index)
    if bare:
        return ImageModelError(
            f"{where}: {', '.join(f'{name}/' for name in bare)} holds a config.json and no weights file "
            f"(a copy that left the weights out, or a file deleted): copy or save the pipeline again ({first})"
        )
    damaged = damaged_files(folder, model_index)
    if damaged:
        return ImageModelError(
            f"{where}: its weights do not load: {'; '.join(f'{file} is {why}' for file, why in damaged)}; copy, "
            f"download or save the pipeline again ({first})"
        )
    return ImageModelError(
        f"{where}: its weights do not load ({first}); a file may be truncated (an interrupted copy or "
        "download) or of another model: copy or save the pipeline again"
    )


def _safetensors_damage(file: str) -> str | None:
    """Why a .safetensors file cannot be read (a git-lfs pointer, a header longer than the file, data cut short),
    from its header alone; None if it looks whole."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if head.startswith(b"version "):  # "version https://git-lfs.github.com/spec/v1"
            return "a git-lfs pointer, not the weights (git lfs pull fetches them)"
        length = int.from_bytes(head, "little") if len(head) == 8 else size
        if length > size - 8:
            return f"truncated or not a safetensors file ({size} bytes; its header claims {length})"
        try:
            header = json.loads(f.read(length))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "not a safetensors file (its header is not the JSON safetensors writes)"
    if 8 + length + end > size:
        return f"truncated ({size} bytes of the {8 + length + end} its header describes)"
    return None


def _json_damage(file: str) -> str | None:
    """Why a JSON file (a config, tokenizer.json) does not parse; None if it does."""
    try:
        with open(file, encoding="utf-8") as f:
            json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        return f"not valid JSON ({e})"
    return None


def damaged_files(path: str, model_index: Mapping) -> list[tuple[str, str]]:
    """The files of the local pipeline directory's components that cannot be read: [(COMPONENT/FILE, why)] for a
    link to nothing, a broken .safetensors (`_safetensors_damage`), a JSON file that does not parse."""
    found = []
    for name, file, full in _component_files(path, model_index):
        if os.path.islink(full) and not os.path.exists(full):
            why = f"a link to {os.readlink(full)}, which does not exist"
        elif file.endswith(".safetensors") and os.path.isfile(full):
            why = _safetensors_damage(full)
        elif file.endswith(".json") and os.path.isfile(full):
            why = _json_damage(full)
        else:
            continue
        if why:
            found.append((f"{name}/{file}", why))
    return found


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5")


def check_weights_present(path: str, model_index: Mapping) -> None:
    """Every model component of the local pipeline directory `path` holds a weights file (a copy or a cache that
    lost one fails here, not after the others have loaded). A directory of configuration files alone (no
    component has weights: what a plan or these checks read) passes."""
    bare = _components_without_weights(path, model_index)
    if bare and weight_variants(path, model_index):
        raise ImageModelError(
            f"model.path={path}: {', '.join(f'{name}/' for name in bare)} holds a config.json and no weights file "
            "(a copy that left the weights out, or a file deleted): copy or save the pipeline again"
        )


def _components_without_weights(path: str, model_index: Mapping) -> list[str]:
    """The components of the local pipeline directory `path` that are models (a folder with a config.json) but hold
    no weights file."""
    bare = []
    for name, folder in _component_folders(path, model_index):
        value = model_index[name]
        if not isinstance(value, (list, tuple)) or value[0] is None:
            continue
        if os.path.isfile(os.path.join(folder, "config.json")):
            if not any(f.endswith(_WEIGHT_SUFFIXES) for f in os.listdir(folder)):
                bare.append(name)
    return bare


def load_image_backend(
    path_or_pipe,
    family: str = "auto",
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    max_sequence_length: int | None = None,
    prompt_cache_size: int = 1024,
    drop_t5: bool = False,
    **from_pretrained_kwargs,
) -> ImageBackend:
    """An ImageBackend for a pipeline object, a hub id, a local directory, or a tiny test pipeline
    ("tiny-<family>", random weights: `tiny_models()`).

    family: "auto" (from the pipeline class) or a family's name (`family_names()`).
    dtype, device: where the whole pipeline goes (weights of a path are loaded in `dtype`).
    drop_t5: SD3 only: leave the T5 encoder out (never loaded); prompts are encoded by the CLIP encoders
        and T5's part of the embedding is zeros, as diffusers does for a pipeline saved without T5 (which
        loads without drop_t5 too).
    A path is checked from its configuration files before any weight is loaded (a pipeline class no
    family drives, another family than `family`, drop_t5: an ImageModelError naming the fix).
    Hub loads honour HF_HUB_OFFLINE and the usual huggingface_hub cache settings.
    """
    load_all()
    if isinstance(path_or_pipe, (str, os.PathLike)):
        pipe = _load_pipeline(os.fspath(path_or_pipe), family, dtype, drop_t5, from_pretrained_kwargs)
    else:
        pipe = as_text_to_image(path_or_pipe)
    if family == "auto":
        family = detect_family(pipe)
    backend_cls = FAMILIES.get(family)
    try:
        detected = detect_family(pipe)
    except ValueError:  # a pipeline class we do not know: trust the family we were given
        detected = family
    if detected != family:
        raise ValueError(f"{type(pipe).__name__} is a {detected!r} pipeline, not {family!r}: pass family={detected!r}")
    if drop_t5 and not isinstance(path_or_pipe, (str, os.PathLike)):
        _check_drop_t5(backend_cls, f"this {type(pipe).__name__}")
        pipe = _without(pipe, backend_cls.t5_components)
    denoiser = getattr(pipe, backend_cls.denoiser_attr)
    current = next(denoiser.parameters())
    moves = device is not None and torch.device(device) != current.device
    if moves or (dtype is not None and dtype != current.dtype):
        pipe.to(device=device, dtype=dtype)
    return backend_cls(pipe, max_sequence_length=max_sequence_length, prompt_cache_size=prompt_cache_size)
