"""The registered shapes_geneval reward: the detector's scores through the reward signature."""

import numpy as np
import pytest
import torch
from PIL import Image

import rewards
from flowrl.shapes.prompts import load_jsonl
from flowrl.shapes.render import render


def test_shapes_reward_scores_rendered_ground_truth_and_a_blank():
    from pathlib import Path

    rows = load_jsonl(Path(__file__).resolve().parents[1] / "samples" / "shapes" / "test.jsonl")[:6]
    rng = np.random.default_rng(0)
    images = [Image.fromarray(render(r, rng)[0]) for r in rows]
    blank = Image.new("RGB", images[0].size, (255, 255, 255))
    fn = rewards.get("shapes_geneval")
    cols = {"objects": [r["objects"] for r in rows] + [rows[0]["objects"]],
            "relation": [r.get("relation") for r in rows] + [rows[0].get("relation")]}
    score = fn(images + [blank], [r["prompt"] for r in rows] + [rows[0]["prompt"]], **cols)
    assert score.dtype == torch.float32 and score.shape == (7,)
    torch.testing.assert_close(score[:6], torch.ones(6))          # ground truth: every clause holds
    assert fn.last_components["strict"][:6].tolist() == [1.0] * 6
    # a blank image: "exactly N <shape>" fails, "nothing but N objects" fails -> fraction < 1, strict 0
    assert score[6] < 1 and fn.last_components["strict"][6] == 0
    strict_fn = rewards.get("shapes_geneval", score="strict")
    torch.testing.assert_close(strict_fn(images[:2], ["", ""], objects=cols["objects"][:2],
                                         relation=cols["relation"][:2]), torch.ones(2))


def test_shapes_reward_needs_metadata():
    with pytest.raises(ValueError, match="objects"):
        rewards.get("shapes_geneval")([Image.new("RGB", (8, 8))], ["a red circle"])
