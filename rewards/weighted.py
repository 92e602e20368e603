"""A weighted sum of rewards, ``R = Σ_k w_k R_k``, keeping each ``R_k`` in ``last_components``.

(GDPO's normalise-each-reward-then-sum acts on advantages, so it lives in the core, not here.)

    rewards.get("weighted", components={"pickscore": 1.0,
                                        "ocr": {"weight": 0.5, "engine": "tesseract"},
                                        "clip100": {"reward": "clip_score", "weight": 0.1, "scale": 100}})
    combine({"a": reward_a, "b": reward_b}, {"a": 1.0, "b": 0.5})   # from built callables
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from rewards.memory import Held
from rewards.registry import IMAGE, RewardConfigError, check_registered, get, is_plugin, kind_of, memory_spec, register


class WeightedSum:
    """``Σ_k w_k R_k`` over named rewards of one kind.

    Image kind: a ``Tensor[B]``; ``last_components[name]`` is ``R_k`` and ``last_components[f"{name}/{c}"]``
    each component ``c`` of ``R_k``. Text kind: per completion the weighted sum over the rewards that
    did not return None (as TRL's nansum), or None when all did; ``last_components[name]`` is ``R_k``.
    """

    def __init__(self, named: Mapping[str, Callable[..., Any]], weights: Mapping[str, float]):
        if not named:
            raise ValueError("a weighted reward needs at least one component")
        if set(named) != set(weights):
            raise ValueError(
                f"weights must name the same rewards as the components: "
                f"rewards {sorted(named)}, weights {sorted(weights)}"
            )
        kinds = {name: kind_of(fn, default=None) for name, fn in named.items()}
        if len(set(kinds.values())) != 1:
            raise ValueError(f"a weighted reward mixes kinds {kinds}; combine image rewards or text rewards, not both")
        self.kind = next(iter(kinds.values()))
        self.rewards, self.weights = dict(named), {k: float(w) for k, w in weights.items()}
        self.last_components: dict[str, Any] = {}

    def __call__(self, prompts_or_images, *args, **kwargs):
        return (
            self._image(prompts_or_images, *args, **kwargs)
            if self.kind == IMAGE
            else self._text(prompts_or_images, *args, **kwargs)
        )

    def _image(self, images, prompts, **metadata):
        total, components = None, {}
        for name, reward in self.rewards.items():
            score = reward(images, prompts, **metadata).float()  # [B]
            components[name] = score
            for sub, value in (getattr(reward, "last_components", None) or {}).items():
                components[f"{name}/{sub}"] = value
            total = self.weights[name] * score if total is None else total + self.weights[name] * score
        self.last_components = components
        return total

    def _text(self, prompts, completions, **columns):
        per_reward = {name: reward(prompts, completions, **columns) for name, reward in self.rewards.items()}
        self.last_components = per_reward
        totals: list[float | None] = []
        for i in range(len(completions)):
            terms = [
                self.weights[name] * values[i]
                for name, values in per_reward.items()
                if values[i] is not None and not math.isnan(values[i])
            ]
            totals.append(sum(terms) if terms else None)
        return totals


def combine(named: Mapping[str, Callable[..., Any]], weights: Mapping[str, float] | None = None) -> WeightedSum:
    """The weighted sum of already-built rewards; all weights 1 when ``weights`` is None."""
    return WeightedSum(named, weights if weights is not None else dict.fromkeys(named, 1.0))


def components_memory(options: Mapping[str, Any]) -> list[Held]:
    """What the components of ``weighted`` keep on the accelerator (``rewards.memory_spec`` of each, with its
    options): the sum holds nothing of its own."""
    held: list[Held] = []
    for key, spec in (options.get("components") or {}).items():
        spec = dict(spec) if isinstance(spec, Mapping) else {}
        spec.pop("weight", None)
        held += memory_spec(str(spec.pop("reward", key)), spec)
    return held


@register(
    "weighted",
    kind=IMAGE,
    memory=components_memory,
    counts=None,
    summary="a weighted sum of rewards, each kept as a component",
)
def weighted(components: Mapping[str, float | Mapping[str, Any]]) -> WeightedSum:
    """Build each component by name and sum them with weights.

    ``components`` maps a name to its weight, or to a dict ``{"weight": w, "reward": registered_name,
    **options}`` (``reward`` defaults to the key, ``weight`` to 1; the other keys are the reward's options).
    The result's kind is that of its components (all must share it).
    """
    if not isinstance(components, Mapping) or not components:
        raise ValueError(
            f"weighted needs components={{name: weight or {{'weight': w, **options}}}}, got {components!r}"
        )
    named, weights = {}, {}
    for key, spec in components.items():
        if isinstance(spec, (int, float)):
            spec = {"weight": spec}
        if not isinstance(spec, Mapping):
            raise TypeError(f"weighted component {key!r}: expected a weight or a dict of options, got {spec!r}")
        options = dict(spec)
        weights[key] = options.pop("weight", 1.0)
        named[key] = get(options.pop("reward", key), **options)
    return WeightedSum(named, weights)


__all__ = ["WeightedSum", "combine", "components_memory", "weighted"]


def check_options(kwargs: dict[str, Any], kind: str) -> str:
    """The config check of ``weighted`` (rewards.check, before any model loads): its components, each a registered
    reward of ``kind`` with valid options; returns ``kind``, its components' kind."""
    components = kwargs.get("components")
    if not isinstance(components, Mapping) or not components:
        raise RewardConfigError(
            f"reward 'weighted' needs components={{name: weight, or name: {{weight: w, "
            f"reward: registered_name, **options}}}}, got {components!r}"
        )
    weights = []
    for key, spec in components.items():
        if isinstance(spec, bool) or not isinstance(spec, (int, float, Mapping)):
            raise RewardConfigError(f"weighted component {key!r}: expected a weight or a dict of options, got {spec!r}")
        options = dict(spec) if isinstance(spec, Mapping) else {}
        weight = options.pop("weight", 1.0) if isinstance(spec, Mapping) else spec
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise RewardConfigError(f"weighted component {key!r}: its weight must be a finite number, got {weight!r}")
        weights.append(weight)
        component = str(options.pop("reward", key))
        if is_plugin(component):
            raise RewardConfigError(
                f"weighted component {key!r}: plug-in {component!r} cannot be a component; "
                f"give it its own entry in the config's rewards list, with its weight"
            )
        try:
            check_registered(component, options, kind)
        except RewardConfigError as e:
            raise RewardConfigError(f"weighted component {key!r}: {e}") from None
    if not any(weights):
        raise RewardConfigError(
            f"reward 'weighted': every component's weight is 0 ({', '.join(map(repr, components))}): its sum is 0 "
            "for every sample, nothing to train on; give a component a weight other than 0"
        )
    return kind


weighted.check_options = check_options
