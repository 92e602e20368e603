"""Reward functions for flowrl, looked up by name.

    import rewards
    reward = rewards.get("pickscore", device="cuda")       # image reward
    scores = reward(images, prompts)                        # Tensor[B] float32
    rewards.available()                                     # all names; available("text") for one kind

    rewards.check("mypkg.scores:brightness", {"gain": 2}, "image")        # cheap: nothing is built
    reward = rewards.build("path/to/scores.py:brightness", {"gain": 2}, "image")
    rewards.memory_spec("pickscore", {})    # [HubModel("yuvalkirstain/PickScore_v1", "CLIPModel", ...)]

Image rewards: ``reward(images: list[PIL.Image], prompts: list[str], **metadata) -> Tensor[B]``, with
extra per-image values in ``reward.last_components``; ``reward.accepts`` says whether it scores images, videos
(uint8 frames ``[F, H, W, C]``) or both, and a built image-only reward scores a video by some of its frames.
Text rewards have TRL's signature ``(prompts, completions, **columns) -> list[float | None]``; ``call_text_reward``
calls one as TRL's GRPOTrainer does, with ``RewardState`` as its ``trainer_state``. Each built reward carries ``.kind``.
Every reward declares what it keeps on the accelerator (``rewards.memory``); ``memory_spec`` answers the planner.
``rewards.features.ImageEncoder`` embeds images with a DINOv2 or CLIP backbone.

Where rewards come from: the files of this package (one reward per file, see ``rewards/registry.py`` for how to
add one); other installed packages, through entry points of the group ``flowrl.rewards`` (each names a module
that registers the reward of its name, see ``rewards/registry.py``); and plug-ins, a name
``"package.module:function"`` or ``"path/to/file.py:function"``: that function of the user's code is the reward.
Importing this package loads no model.
"""

from rewards._common import RewardState, call_text_reward
from rewards.memory import NOTHING, HubModel, NotEstimated, Parameters, hub_model
from rewards.registry import (
    ENTRY_POINT_GROUP,
    IMAGE,
    KINDS,
    REWARDS,
    TEXT,
    VIDEO,
    NamedReward,
    RewardConfigError,
    RewardError,
    accepts_of,
    available,
    build,
    check,
    declared_accepts,
    declared_columns,
    declared_counts,
    get,
    kind_of,
    memory_spec,
    register,
)
from rewards.rows import checks_rows, required_columns, row_check


def combine(named, weights=None):
    """The weighted sum ``Σ_k w_k R_k`` of built rewards (``rewards.weighted.combine``)."""
    from rewards.weighted import combine as _combine

    return _combine(named, weights)


__all__ = [
    "ENTRY_POINT_GROUP",
    "IMAGE",
    "KINDS",
    "NOTHING",
    "REWARDS",
    "TEXT",
    "VIDEO",
    "HubModel",
    "NamedReward",
    "NotEstimated",
    "Parameters",
    "RewardConfigError",
    "RewardError",
    "RewardState",
    "accepts_of",
    "available",
    "build",
    "call_text_reward",
    "check",
    "checks_rows",
    "combine",
    "declared_accepts",
    "declared_columns",
    "declared_counts",
    "get",
    "hub_model",
    "kind_of",
    "memory_spec",
    "register",
    "required_columns",
    "row_check",
]
