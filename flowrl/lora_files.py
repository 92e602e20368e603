"""lora.init_path's file: the settings a saved LoRA was made with, and its weights matched key by key to the
adapter they start.

Two formats are read, the two that flowrl writes (and other tools write alike):
- diffusers' (`pytorch_lora_weights.safetensors`: an image run's `lora/`, `pipe.save_lora_weights`): keys prefixed
  with the pipeline component (`transformer.`, `unet.`), the LoraConfig in the safetensors header's
  `lora_adapter_metadata` under the same prefix (`transformer.lora_alpha`);
- peft's (`adapter_model.safetensors` with `adapter_config.json` beside it: a text run's `lora/`,
  `PeftModel.save_pretrained`; of an image model's denoiser, its keys' `base_model.model.` prefix is dropped).
A diffusers file of another component than the denoiser (a UNet's LoRA given to a transformer model, a text
encoder's besides the denoiser's) is refused, naming the components.
Diffusers' UNet format (`lora.down`/`lora.up`: what `convert_state_dict_to_diffusers` makes of peft's keys, so an SD1.5
or SDXL run's own export; and the old attention processors' `processor.to_q_lora.down`) is read as diffusers'
`load_lora_weights` reads it: converted to peft's keys (`peft_keys`). Another format (kohya's `lora_down`/`lora_up`) is
named in the error, with how to convert it. A file that records no settings is taken as the config describes it.

The scale of a LoRA is alpha / r (peft's default): the same A and B under another alpha are another function, so
an alpha that differs from lora.alpha is refused rather than loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ConfigError

#: the LoraConfig fields a start must agree with (the rest, e.g. peft_version or inference_mode, change nothing)
CHECKED = ("r", "lora_alpha", "use_rslora", "use_dora", "alpha_pattern", "rank_pattern", "target_modules")

#: key fragments of LoRA formats flowrl does not read -> the format's name
FOREIGN = {
    "lora_down": "kohya's (lora_down / lora_up)",
    "lora_up": "kohya's (lora_down / lora_up)",
}
#: key fragments of diffusers' UNet LoRA format (`unet.<module>.lora.down.weight`, and the old attention processors'
#: `<attn>.processor.to_q_lora.down.weight`), which `peft_keys` converts to peft's
DIFFUSERS_UNET = ("lora.down", "lora.up")


#: the pipeline components a diffusers LoRA file's keys start with (save_lora_weights' `<component>_lora_layers`)
COMPONENTS = ("transformer", "transformer_2", "unet", "prior", "text_encoder", "text_encoder_2", "text_encoder_3")
#: the prefix of every key of a LoRA that peft's `PeftModel.save_pretrained` writes of a model it wraps
PEFT_PREFIX = "base_model.model."


def is_lora_key(key: str) -> bool:
    """Whether a tensor name is a LoRA's: peft's lora_A / lora_B, diffusers' UNet format's (`DIFFUSERS_UNET`) or
    another format's fragments (`FOREIGN`)."""
    return "lora_A" in key or "lora_B" in key or any(f in key for f in (*DIFFUSERS_UNET, *FOREIGN))


def peft_keys(state: dict) -> dict:
    """`state` (a LoRA file's tensors, or their shapes) with peft's key names (`lora_A` / `lora_B`) when it is in
    diffusers' UNet format (`DIFFUSERS_UNET`: no peft key, some `lora.down` / `lora.up` one), converted as diffusers'
    `load_lora_weights` converts it (`convert_unet_state_dict_to_peft`: `.lora.down` -> `.lora_A`, the attention
    processors' `.processor.to_q_lora.down` -> `.to_q.lora_A`); any other `state` as it is."""
    if any("lora_A" in k or "lora_B" in k for k in state) or not any(f in k for k in state for f in DIFFUSERS_UNET):
        return state
    from diffusers.utils import convert_unet_state_dict_to_peft

    return convert_unet_state_dict_to_peft(dict(state))


def is_lora_file(path: str | Path) -> bool:
    """Whether `path` is a .safetensors file whose tensor names are a LoRA's (`is_lora_key`), from its header alone
    (no tensor is loaded); False for another file, or one safetensors cannot read (truncated, foreign)."""
    from safetensors import safe_open

    path = Path(path)
    if not (path.is_file() and path.suffix == ".safetensors"):
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            return any(is_lora_key(k) for k in f.keys())
    except Exception:  # safetensors raises its own error types for a truncated or foreign file
        return False


def adapter_settings(path: str | Path, prefix: str | None = None) -> dict[str, Any]:
    """The LoraConfig fields (`CHECKED`) the LoRA file at `path` records: from its header's `lora_adapter_metadata`
    (diffusers: the fields of component `prefix`, e.g. "transformer"; without a prefix, those of the only component
    it holds), else from an `adapter_config.json` beside it (peft); {} when it records none."""
    from safetensors import safe_open

    path = Path(path)
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata() or {}
    raw = header.get("lora_adapter_metadata")
    if raw:
        fields = json.loads(raw)
        groups: dict[str, dict[str, Any]] = {}
        for key, value in fields.items():
            component, _, name = key.rpartition(".")
            groups.setdefault(component, {})[name] = value
        if prefix is not None and prefix in groups:
            found = groups[prefix]
        elif len(groups) == 1:
            found = next(iter(groups.values()))
        else:
            found = {}
    elif (path.parent / "adapter_config.json").is_file():
        found = json.loads((path.parent / "adapter_config.json").read_text())
    else:
        found = {}
    return {k: found[k] for k in CHECKED if k in found}


def lora_ranks(shapes: dict) -> list[int]:
    """The ranks of a LoRA's A matrices, sorted (`shapes`: its keys and their shapes, or tensors)."""
    return sorted({tuple(v.shape if hasattr(v, "shape") else v)[0] for k, v in shapes.items() if "lora_A" in k})


def settings_problem(settings: dict[str, Any], lora_cfg, where: Path, ranks: list[int] | None = None) -> str | None:
    """Why the LoRA at `where`, made with `settings` (`adapter_settings`), is not the adapter `lora_cfg` (the
    config's `lora` section) describes, as one line naming the setting that would start from it; None when
    nothing it records disagrees. Its rank and modules are checked against the adapter's weights (`match_state`).
    A file that records no alpha is read as diffusers reads it, alpha = its rank (`ranks`: a scale of 1)."""
    if settings.get("use_dora"):
        return f"lora.init_path: {where} is a DoRA adapter (use_dora), and flowrl trains plain LoRA; start from a LoRA"
    if settings.get("use_rslora"):
        return (
            f"lora.init_path: {where} is scaled as rsLoRA (use_rslora: alpha / sqrt(r)), and flowrl's LoRA as "
            "alpha / r; start from a plain LoRA"
        )
    for pattern, what in (("alpha_pattern", "alphas"), ("rank_pattern", "ranks")):
        if settings.get(pattern):
            return (
                f"lora.init_path: {where} has {what} of its own for some modules ({pattern}: "
                f"{_short(settings[pattern])}), and flowrl's LoRA one for all (lora.alpha, lora.rank); start from a "
                "LoRA without them"
            )
    alpha = settings.get("lora_alpha")
    if alpha is None and ranks and len(ranks) == 1 and float(ranks[0]) != float(lora_cfg.alpha):
        r = ranks[0]
        return (
            f"lora.init_path: {where} records no lora alpha, which diffusers reads as alpha = its rank ({r}: a scale "
            f"of 1); this config's lora.alpha is {lora_cfg.alpha:g} (a scale of {lora_cfg.alpha / lora_cfg.rank:g}): "
            f"set lora.alpha={r} to start from the adapter diffusers would load, or save the LoRA with its alpha "
            "(save_lora_weights(..., transformer_lora_adapter_metadata=...))"
        )
    if alpha is not None and float(alpha) != float(lora_cfg.alpha):
        r = settings.get("r", lora_cfg.rank)
        return (
            f"lora.init_path: {where} was made with lora alpha {alpha:g} (rank {r}: a scale of {float(alpha) / r:g}), "
            f"this config's lora.alpha is {lora_cfg.alpha:g}: set lora.alpha={alpha:g} to start from the same "
            "adapter (its weights under another alpha are another function)"
        )
    return None


def component_problem(keys, prefix: str | None, where: Path) -> str | None:
    """Why the LoRA whose tensor names are `keys` cannot start the adapter of the pipeline component `prefix` (the
    family's denoiser: "transformer", "unet"): its diffusers keys are another component's (a UNet's LoRA on a
    transformer model: another kind of model), or other components' besides (a text encoder's, which flowrl does not
    train); None when they are `prefix`'s alone, or name no component (peft's, an unprefixed file)."""
    if prefix is None:
        return None
    found = {k.split(".", 1)[0] for k in keys}
    others = sorted(c for c in found if c in COMPONENTS and c != prefix)
    if not others:
        return None
    if prefix in found:
        return (
            f"lora.init_path: {where} holds LoRA weights of the pipeline's {' and '.join(others)} besides its "
            f"{prefix}'s, and flowrl trains the {prefix} alone: save the {prefix}'s alone, "
            f"pipe.save_lora_weights(DIR, {prefix}_lora_layers=...), and give DIR"
        )
    return (
        f"lora.init_path: {where} is a LoRA of the pipeline's {' and '.join(others)}, and this model's trained "
        f"network is its {prefix}: the LoRA was made for another kind of model; start from a LoRA of this model"
    )


def foreign_format(state, where: Path, prefix: str | None = None) -> str | None:
    """Why the LoRA whose tensor names are `state`'s is not read: a format flowrl does not read (`FOREIGN`), named,
    with how to convert it for the pipeline component `prefix` (the family's denoiser: "transformer", "unet"; None:
    a text model, peft's format); None for peft's and diffusers' formats."""
    names = sorted({name for key in state for frag, name in FOREIGN.items() if frag in key})
    if not names or any("lora_A" in k for k in state):
        return None
    example = next(k for k in state if any(frag in k for frag in FOREIGN))
    head = (
        f"lora.init_path: {where} is a LoRA in {names[0]} format (e.g. {example}), and flowrl reads peft's and "
        "diffusers' (lora_A / lora_B, and a UNet's lora.down / lora.up)"
    )
    if prefix is None:
        return f"{head}: convert it to peft's, PeftModel.save_pretrained(DIR) of the model with it loaded, and give DIR"
    return (
        f"{head}: convert it with diffusers first: pipe.load_lora_weights(FILE), then pipe.save_lora_weights(DIR, "
        f"{prefix}_lora_layers=peft.get_peft_model_state_dict(pipe.{prefix}, adapter_name=NAME), "
        f"{prefix}_lora_adapter_metadata=pipe.{prefix}.peft_config[NAME].to_dict()) (the metadata keeps its alpha), "
        "and give DIR"
    )


def match_state(
    state: dict,
    own: dict[str, tuple[int, ...]],
    lora_cfg,
    where: Path,
    recorded_targets=None,
    prefix: str | None = None,
) -> dict:
    """`state` (the file's tensors, keys already in the adapter's naming, or in diffusers' UNet format: `peft_keys`)
    checked against the adapter's keys and shapes `own`: the same rank, the same modules, the same shapes, else one
    ConfigError line naming what differs and the setting that would take it (lora.rank, lora.target_modules with the
    file's modules); a format flowrl does not read is named (`foreign_format`, its conversion for the pipeline
    component `prefix`). Returns `state` (converted)."""
    problem = foreign_format(state, where, prefix)
    if problem:
        raise ConfigError(problem)
    state = peft_keys(state)
    ranks = sorted({v.shape[0] for k, v in state.items() if "lora_A" in k})
    if ranks and ranks != [lora_cfg.rank]:
        raise ConfigError(
            f"lora.init_path: {where} holds a LoRA of rank {'/'.join(map(str, ranks))}, this config's "
            f"lora.rank is {lora_cfg.rank}: set lora.rank={ranks[0]} to start from it"
        )
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    unlike = [k for k in sorted(set(own) & set(state)) if own[k] != tuple(state[k].shape)]
    parts = [
        f"{len(keys)} {what} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
        for keys, what in (
            (missing, "of the adapter's keys are not in it"),
            (extra, "of its keys are not the adapter's"),
            (unlike, "keys differ in shape"),
        )
        if keys
    ]
    absent = sorted(_blocks(state) - _blocks(own))
    if parts and absent:  # blocks this model does not have: no lora.target_modules makes the LoRA this model's
        raise ConfigError(
            f"lora.init_path: {where} adapts blocks this model does not have ({', '.join(absent[:3])}"
            f"{', ...' if len(absent) > 3 else ''}): it was made for another model (another family, or another size "
            "of it); start from a LoRA of this model"
        )
    if parts:
        targets = sorted(recorded_targets) if isinstance(recorded_targets, list) else lora_modules(state)
        if set(targets) == set(lora_cfg.target_modules or lora_modules(own)):  # the advice would change nothing
            raise ConfigError(
                f"lora.init_path: {where} is a LoRA of the modules this config adapts ({', '.join(targets)}) and "
                f"still not this model's adapter: {'; '.join(parts)}: it was made for another model (another "
                "family, or another size of it); start from a LoRA of this model"
            )
        raise ConfigError(
            f"lora.init_path: {where} is a LoRA of other modules than this config's "
            f"(lora.target_modules={lora_cfg.target_modules or 'the family default'}): {'; '.join(parts)}; its "
            f"modules are lora.target_modules=[{','.join(targets)}]: set that to start from it"
        )
    return state


def _block_and_module(key: str) -> tuple[str, str]:
    """A LoRA key's numbered block and module: `transformer_blocks.3.attn.to_out.0.lora_A.weight` ->
    (`transformer_blocks.3`, `attn.to_out.0`): split after the last block index before the module's own name (to_out.0's
    0 is the layer's); ("", the whole path) for a key in no numbered block."""
    module = key.split(".lora_A")[0].split(".lora_B")[0]
    parts = module.split(".")
    index = max((i for i, p in enumerate(parts[:-1]) if p.isdigit()), default=-1)
    return ".".join(parts[: index + 1]), ".".join(parts[index + 1 :]) or module


def _blocks(keys) -> set[str]:
    """The numbered blocks a LoRA's keys sit in (`_block_and_module`)."""
    return {block for block, _ in map(_block_and_module, keys) if block}


def lora_modules(state: dict) -> list[str]:
    """The module names a LoRA's keys adapt, as lora.target_modules takes them (the part after the last block
    index: `transformer_blocks.3.attn.to_q.lora_A.weight` -> `attn.to_q`, `...attn.to_out.0.lora_B.weight` ->
    `attn.to_out.0`), sorted."""
    return sorted({module for _, module in map(_block_and_module, state)})


def _short(value, limit: int = 80) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def init_state(path: Path, lora_cfg, own: dict[str, tuple[int, ...]], prefix: str | None = None) -> dict:
    """The tensors of the LoRA file `path` (lora.init_path's, found by `preflight.lora_init_file`), ready for
    `set_peft_model_state_dict`: its keys in peft's naming (`peft_keys`), the settings it records checked
    (`settings_problem`: a ConfigError), the keys of component `prefix` (diffusers' `transformer.`, `unet.`) stripped
    of it, and matched to the adapter's keys and shapes `own` (`match_state`)."""
    from safetensors.torch import load_file

    settings = adapter_settings(path, prefix)
    state = peft_keys(load_file(path))  # diffusers' UNet format (an SD1.5 or SDXL run's export) as peft's
    problem = settings_problem(settings, lora_cfg, path, lora_ranks(state))
    if problem:
        raise ConfigError(problem)
    problem = component_problem(state, prefix, path)
    if problem:
        raise ConfigError(problem)
    if all(k.startswith(PEFT_PREFIX) for k in state) and not any(k.startswith(PEFT_PREFIX) for k in own):
        state = {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()}  # peft's save_pretrained of the denoiser
    if prefix is not None:
        state = {k.removeprefix(prefix + "."): v for k, v in state.items()}
    return match_state(state, own, lora_cfg, path, settings.get("target_modules"), prefix)
