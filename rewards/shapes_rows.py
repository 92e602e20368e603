"""The shapes world's rewards' checks of a prompt's metadata (`rewards.row_check`): a shape, colour, count or
relation outside the world, which the detector would score as never holding, is named before the model loads.

Kept apart from `rewards/shapes_geneval.py`, whose source is part of the shipped base-model eval's fingerprint
(`flowrl.eval.base_cache`): checking the prompts changes no image and no score."""

from __future__ import annotations

from rewards.rows import checks_rows


@checks_rows("shapes_geneval")
def geneval_row(row: dict) -> str:
    """Why the detector cannot check a prompt's `objects` and `relation` ("" when it can)."""
    from flowrl.worlds.shapes.prompts import metadata_problem

    return metadata_problem(row)


@checks_rows("shapes_soft")
def soft_row(row: dict) -> str:
    """Why a prompt's `objects` are not the world's ("" when they are); shapes_soft scores no relation."""
    from flowrl.worlds.shapes.prompts import metadata_problem

    return metadata_problem({"objects": row.get("objects")})
