"""The policies the trainer drives (see `flowrl.policies.base.Policy`): `image` (diffusers pipelines of every family in
`flowrl.families`) and `text` (Hugging Face causal LMs)."""

from __future__ import annotations

from flowrl.policies.base import DTYPES, ImageBatch, Policy, TextBatch, UnitOutput


def build_policy(cfg, device) -> Policy:
    """The policy of `cfg.backend`: "image" (diffusers pipelines) or "text" (causal LMs)."""
    if cfg.backend == "text":
        from flowrl.policies.text import TextPolicy

        return TextPolicy(cfg, device)
    from flowrl.policies.image import ImagePolicy

    return ImagePolicy(cfg, device)


__all__ = ["DTYPES", "ImageBatch", "Policy", "TextBatch", "UnitOutput", "build_policy"]
