"""The registered shapes_geneval reward: the detector's scores through the reward signature."""

import numpy as np
import pytest
import torch
from PIL import Image

import rewards
from flowrl.worlds.shapes.prompts import load_jsonl
from flowrl.worlds.shapes.render import render


def test_shapes_reward_scores_rendered_ground_truth_and_a_blank():
    from pathlib import Path

    rows = load_jsonl(Path(__file__).resolve().parents[1] / "samples" / "shapes" / "test.jsonl")[:6]
    rng = np.random.default_rng(0)
    images = [Image.fromarray(render(r, rng)[0]) for r in rows]
    blank = Image.new("RGB", images[0].size, (255, 255, 255))
    fn = rewards.get("shapes_geneval")
    cols = {
        "objects": [r["objects"] for r in rows] + [rows[0]["objects"]],
        "relation": [r.get("relation") for r in rows] + [rows[0].get("relation")],
    }
    score = fn(images + [blank], [r["prompt"] for r in rows] + [rows[0]["prompt"]], **cols)
    assert score.dtype == torch.float32 and score.shape == (7,)
    torch.testing.assert_close(score[:6], torch.ones(6))  # ground truth: every clause holds
    assert fn.last_components["strict"][:6].tolist() == [1.0] * 6
    # a blank image: "exactly N <shape>" fails, "nothing but N objects" fails -> fraction < 1, strict 0
    assert score[6] < 1 and fn.last_components["strict"][6] == 0
    strict_fn = rewards.get("shapes_geneval", score="strict")
    torch.testing.assert_close(
        strict_fn(images[:2], ["", ""], objects=cols["objects"][:2], relation=cols["relation"][:2]), torch.ones(2)
    )


def test_shapes_reward_needs_metadata():
    with pytest.raises(ValueError, match="objects"):
        rewards.get("shapes_geneval")([Image.new("RGB", (8, 8))], ["a red circle"])


# ---------------------------------------------------------------- shapes_soft: the graded training signal


def _det(shape_ious, color="red", w=10, h=10, x0=0):
    from flowrl.worlds.shapes.detect import Detection

    return Detection(None, color, x0, 0, x0 + w, h, w * h, tuple(shape_ious))  # ious: circle, square, triangle


def test_soft_score_by_hand():
    from flowrl.worlds.shapes.detect import soft_score
    from flowrl.worlds.shapes.render import SHAPES

    assert SHAPES == ("circle", "square", "triangle")  # the order of Detection.ious in _det
    red_circle = {"objects": [{"shape": "circle", "color": "red", "count": 1}]}
    assert soft_score([_det((0.9, 0.7, 0.4))], red_circle) == pytest.approx(0.9)
    assert soft_score([_det((0.9, 0.7, 0.4), color="blue")], red_circle) == pytest.approx(0.45)  # colour halves
    # two squares; the circle is the extra object: greedy matches 0.8 then 0.6 (its square IoU 0.5 is lower),
    # minus 0.5 x 1 extra / 2 wanted
    two_squares = {"objects": [{"shape": "square", "color": None, "count": 2}]}
    dets = [_det((0.9, 0.5, 0.3)), _det((0.2, 0.8, 0.3)), _det((0.2, 0.6, 0.3))]
    assert soft_score(dets, two_squares) == pytest.approx((0.8 + 0.6) / 2 - 0.25)
    # a wanted object with nothing left to match counts 0
    pair = {"objects": [{"shape": "circle", "color": None, "count": 1}, {"shape": "square", "color": None, "count": 1}]}
    assert soft_score([_det((0.9, 0.6, 0.3))], pair) == pytest.approx(0.45)
    # an elongated box (aspect 2 > MAX_ASPECT 1.5) has its IoU divided by the aspect
    assert soft_score([_det((0.1, 0.8, 0.1), w=20, h=10)], two_squares) == pytest.approx(0.4 / 2)
    assert soft_score([], pair) == 0.0


def test_soft_reward_ranks_ground_truth_over_wrong_shapes_and_blank():
    from pathlib import Path

    rows = load_jsonl(Path(__file__).resolve().parents[1] / "samples" / "shapes" / "test.jsonl")
    rng = np.random.default_rng(1)
    images = [render(r, rng)[0] for r in rows]
    fn = rewards.get("shapes_soft")
    score = fn(images, [r["prompt"] for r in rows], objects=[r["objects"] for r in rows])
    assert score.shape == (len(rows),) and score.dtype == torch.float32
    assert score.min() > 0.9  # pixelated circles and triangles fill their boxes almost ideally
    # the same scenes asked for with every shape swapped (circle -> square -> triangle -> circle) score lower
    swap = {"circle": "square", "square": "triangle", "triangle": "circle"}
    wrong = [[dict(o, shape=swap[o["shape"]]) for o in r["objects"]] for r in rows]
    # (graded: a circle is still a pi/4 = 0.785 match for a square, a triangle a 0.5 one)
    worse = fn(images, [""] * len(rows), objects=wrong)
    assert (worse < score - 0.05).all() and (score - worse).mean() > 0.25
    blank = np.full_like(images[0], 240)
    assert fn([blank], [""], objects=[rows[0]["objects"]]).item() == 0.0
    with pytest.raises(ValueError, match="objects"):
        fn([blank], [""])
