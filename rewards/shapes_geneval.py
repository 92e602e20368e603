"""The shapes world's compositional reward, GenEval-style: find the objects, check the prompt's clauses.

The training reward is the fraction of the prompt's clauses that hold (a dense signal); the headline metric,
strict correctness (1 when every clause holds), is reported as the component `strict`. The prompt's
metadata (`objects`, `relation`) comes from the prompt set's JSONL columns.
"""

from __future__ import annotations

import torch

from rewards.memory import NOTHING
from rewards.registry import IMAGE, register


@register(
    "shapes_geneval",
    kind=IMAGE,
    memory=NOTHING,
    columns=("objects",),
    counts=("color",),
    summary="the shapes world's GenEval-style check: the fraction of the prompt's clauses that hold "
    "(`score: strict`: all of them)",
)
class ShapesGenEval:
    """reward(images, prompts, objects=[...], relation=[...]) -> Tensor[B] (fraction of clauses that hold);
    `last_components`: `strict` [B] (all clauses hold), `fraction` [B], and `free_color=<colour>` [B]: how many
    objects the prompt left uncoloured came out in that colour (`free_color_counts`)."""

    code_modules = (
        "flowrl.worlds.shapes.detect",
        "flowrl.worlds.shapes.render",
    )  # its scorer (flowrl.eval.base_cache)

    kind = IMAGE
    per_sample = True  # each image scored on its own, on any thread (rollout.overlap_rewards)

    def __init__(self, score: str = "fraction"):
        if score not in ("fraction", "strict"):
            raise ValueError(f"score must be 'fraction' (the dense training reward) or 'strict', got {score!r}")
        self.score = score
        self.last_components: dict[str, torch.Tensor] = {}
        self.last_details: list[dict] = []

    def __call__(self, images, prompts, objects=None, relation=None, **_columns) -> torch.Tensor:
        from flowrl.worlds.shapes.detect import score_images

        if objects is None:
            raise ValueError(
                "shapes_geneval needs each prompt's metadata: the prompt file's `objects` (and "
                "`relation`) columns, as in samples/shapes/*.jsonl"
            )
        relation = relation if relation is not None else [None] * len(images)
        metadata = [{"objects": o, "relation": r} for o, r in zip(objects, relation)]
        strict, fraction, details = score_images(images, metadata)
        self.last_components = {
            "strict": torch.from_numpy(strict),
            "fraction": torch.from_numpy(fraction),
            **free_color_counts(details, metadata),
        }
        self.last_details = details
        return torch.from_numpy(fraction if self.score == "fraction" else strict).float()

    def compare(self, images_a, images_b, prompts, objects=None, relation=None, **_columns) -> torch.Tensor:
        """The pairwise judge (rewards' `pairwise: true`): P(a beats b) [n] of each pair of images of one prompt,
        clause by clause: (the prompt's clauses that hold in a and not in b + half those on which they agree) / the
        clauses (flowrl.core.clause_preferences)."""
        from flowrl.core import clause_preferences
        from flowrl.worlds.shapes.detect import score_images

        if objects is None:
            raise ValueError("shapes_geneval's judge needs each prompt's metadata: the `objects` column")
        relation = relation if relation is not None else [None] * len(images_a)
        metadata = [{"objects": o, "relation": r} for o, r in zip(objects, relation)]
        _, _, da = score_images(list(images_a), metadata)
        _, _, db = score_images(list(images_b), metadata)
        out = []
        for a, b in zip(da, db):
            holds = torch.tensor([[c["ok"] for c in a["clauses"]], [c["ok"] for c in b["clauses"]]])
            out.append(clause_preferences(holds)[0, 1])
        return torch.stack(out).float() if out else torch.zeros(0)


def free_color_counts(details: list[dict], metadata: list[dict]) -> dict[str, torch.Tensor]:
    """Per image, how many objects of a shape the prompt asked for without a colour came out in each colour:
    {"free_color=<colour>": [B] counts} for every colour of the palette (see flowrl.eval.diversity: summed over an
    eval they are the model's colour distribution where the prompt leaves colour free)."""
    from flowrl.worlds.shapes import COLORS

    counts = {c: torch.zeros(len(details)) for c in COLORS}
    for i, (found, meta) in enumerate(zip(details, metadata)):
        free = {o["shape"] for o in meta["objects"] or () if o.get("color") is None}
        for d in found["objects"]:
            if d["shape"] in free and d["color"] in counts:
                counts[d["color"]][i] += 1
    return {f"free_color={c}": v for c, v in counts.items()}


@register(
    "shapes_soft",
    kind=IMAGE,
    memory=NOTHING,
    columns=("objects",),
    summary="the shapes world's graded check: shape IoU, colour, extra objects",
)
class ShapesSoft:
    """reward(images, prompts, objects=[...]) -> Tensor[B]: a graded match of the detected objects to the
    prompt's (`flowrl.worlds.shapes.detect.soft_score`: shape IoU, colour, extra objects), in about [-0.5k, 1].

    A training signal to add to `shapes_geneval`'s clause fraction (a weighted second reward): it tells a
    crisp, right-coloured square from a blob that is barely one, which the clauses score alike."""

    code_modules = (
        "flowrl.worlds.shapes.detect",
        "flowrl.worlds.shapes.render",
    )  # its scorer (flowrl.eval.base_cache)

    kind = IMAGE

    def __init__(self):
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, images, prompts, objects=None, **_columns) -> torch.Tensor:
        from flowrl.worlds.shapes.detect import soft_scores

        if objects is None:
            raise ValueError(
                "shapes_soft needs each prompt's metadata: the prompt file's `objects` column, as in "
                "samples/shapes/*.jsonl"
            )
        return torch.from_numpy(soft_scores(images, [{"objects": o} for o in objects])).float()
