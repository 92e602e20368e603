"""Moved to ``rewards.features`` (public). This alias stays only until ``flowrl/trainer.py`` imports
``from rewards.features import ImageEncoder``; then delete it (tests/test_import_graph.py says when)."""

from rewards.features import BACKBONES, ImageEncoder  # noqa: F401
