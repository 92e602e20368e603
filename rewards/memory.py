"""What a reward keeps on the accelerator, declared where the reward is registered, so that the memory planner
(``flowrl plan``) asks the reward instead of keeping a table of reward names.

    @register("pickscore", kind=IMAGE, memory=hub_model("model", "CLIPModel"))   # the hub id / dir in option `model`
    @register("jpeg_compressibility", kind=IMAGE, memory=NOTHING)                 # no model on the accelerator

A declaration is one of:

- ``NOTHING``: the reward holds no model on the accelerator (rules, a CPU detector, Tesseract, a server);
- a held item (below), or a list of them;
- a function ``declaration(options) -> held item(s)``, called with the reward's options: the config's ``kwargs``
  over the defaults of its factory's signature. ``hub_model(option, architecture)`` makes the usual one.

Held items, what ``rewards.memory_spec(name, kwargs)`` returns (each names the ``reward`` it belongs to):

- ``HubModel(source, architecture, dtype)``: a transformers model whose ``config.json`` is at ``source`` (a hub id
  or a local directory); the planner builds ``transformers.<architecture>`` from it on the meta device.
  ``architecture`` is a class name, or a map from the config's ``model_type`` to a class name.
- ``Parameters(count, what, dtype)``: a model of a known size that is not built from a transformers config.
- ``NotEstimated(reason)``: the planner cannot size it, and its note says why.

A plug-in (``module:function``, ``file.py:function``) declares the same in a ``.memory`` attribute of its
function; one that declares nothing is noted as not estimated. Nothing here imports torch or loads a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable, Union

#: canonical dtype names, and the spellings a reward's ``dtype`` option takes (as ``rewards._common.resolve_dtype``)
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


@dataclass(frozen=True)
class HubModel:
    """A transformers model built from the ``config.json`` at ``source`` (hub id or local directory) as the class
    ``architecture`` (or ``architecture[config["model_type"]]``), its weights in ``dtype``."""

    source: str
    architecture: str | Mapping[str, str]
    dtype: str = "float32"
    reward: str = ""

    def class_for(self, config: Mapping[str, Any]) -> str:
        """The transformers class name for the model of ``config`` (its config.json); a ValueError naming its
        ``model_type`` and the ones this model may be when ``architecture`` has no class for it."""
        if isinstance(self.architecture, str):
            return self.architecture
        model_type = config.get("model_type")
        if model_type not in self.architecture:
            raise ValueError(f"{self.source} is a {model_type!r} model, not one of {', '.join(self.architecture)}")
        return self.architecture[model_type]


@dataclass(frozen=True)
class Parameters:
    """A model of ``count`` parameters (``what`` it is) in ``dtype``, not built from a transformers config."""

    count: int
    what: str
    dtype: str = "float32"
    reward: str = ""


@dataclass(frozen=True)
class NotEstimated:
    """Something the planner cannot size, and why: "reward NAME: REASON; its memory is not estimated"."""

    reason: str
    reward: str = ""


Held = Union[HubModel, Parameters, NotEstimated]
HELD_TYPES = (HubModel, Parameters, NotEstimated)
NOTHING: tuple[Held, ...] = ()
Declaration = Union[Held, tuple, list, Callable[[dict], Any]]


def dtype_name(dtype: Any) -> str:
    """ "float32", "bfloat16" or "float16" for a dtype option: one of ``DTYPE_NAMES`` or a ``torch.dtype``."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_NAMES)} or a torch.dtype")
    return DTYPE_NAMES[name]


def hub_model(
    option: str, architecture: str | Mapping[str, str], *, dtype_option: str = "dtype"
) -> Callable[[dict], HubModel]:
    """The declaration of a reward that loads a transformers model from the hub id or local directory given in its
    option ``option``, as the class ``architecture`` (see ``HubModel``), in the dtype of its option
    ``dtype_option`` (float32 when it has none)."""

    def declaration(options: dict) -> HubModel:
        return HubModel(str(options[option]), architecture, dtype_name(options.get(dtype_option, "float32")))

    declaration.__qualname__ = f"hub_model({option!r}, {architecture!r})"
    return declaration


def is_declaration(declared: Any) -> bool:
    """Whether ``declared`` has one of a declaration's forms (a function's result is checked by ``resolve``)."""
    return (
        callable(declared)
        or isinstance(declared, HELD_TYPES)
        or (isinstance(declared, (tuple, list)) and all(isinstance(h, HELD_TYPES) for h in declared))
    )


def resolve(declared: Declaration, options: dict, reward: str) -> list[Held]:
    """The held items of a declaration for these ``options``, each naming ``reward`` unless it names its own (a
    sum of rewards names its components). A TypeError when the declaration is not of a declaration's forms."""
    held = declared(dict(options)) if callable(declared) else declared
    if isinstance(held, HELD_TYPES):
        held = [held]
    if not isinstance(held, (tuple, list)) or not all(isinstance(h, HELD_TYPES) for h in held):
        raise TypeError(
            f"a memory declaration gives NOTHING, a HubModel, Parameters or NotEstimated, or a list of "
            f"them; got {held!r}"
        )
    return [h if h.reward else replace(h, reward=reward) for h in held]
