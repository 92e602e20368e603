"""Reward functions for flowrl, looked up by name.

    import rewards
    reward = rewards.get("pickscore", device="cuda")       # image reward
    scores = reward(images, prompts)                        # Tensor[B] float32
    rewards.available()                                     # all names; available("text") for one kind

Image rewards: ``reward(images: list[PIL.Image], prompts: list[str], **metadata) -> Tensor[B]``, with
extra per-image values in ``reward.last_components``. Text rewards have TRL's signature
``(prompts, completions, **columns) -> list[float | None]``. Each built reward carries ``.kind``.
See ``rewards/registry.py`` for how to register a new reward. Importing this package loads no model.
"""

from rewards.registry import IMAGE, KINDS, REWARDS, TEXT, available, get, kind_of, register



def combine(named, weights=None):
    """The weighted sum ``Σ_k w_k R_k`` of built rewards (``rewards.weighted.combine``)."""
    from rewards.weighted import combine as _combine

    return _combine(named, weights)


__all__ = ["IMAGE", "KINDS", "REWARDS", "TEXT", "available", "combine", "get", "kind_of", "register"]
