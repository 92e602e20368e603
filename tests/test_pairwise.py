"""Pairwise-preference rewards (Pref-GRPO; rewards' `pairwise: true`): the win rates and the two judges by hand,
the scorer's group win rates with and without a judge, the shapes detector's clause judge on rendered images, and a
run that trains on them."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flowrl import core
from flowrl.config import load_config

torch.set_num_threads(1)


def test_win_rates_and_the_judges_by_hand():
    prefs = torch.tensor([[0.0, 0.75, 1.0], [0.25, 0.0, 0.5], [0.0, 0.5, 0.0]])
    torch.testing.assert_close(core.win_rates(prefs), torch.tensor([0.875, 0.375, 0.25]))
    assert core.win_rates(torch.zeros(1, 1)).tolist() == [0.5]
    torch.testing.assert_close(
        core.scalar_preferences(torch.tensor([3.0, 1.0, 3.0])),
        torch.tensor([[0.5, 1.0, 0.5], [0.0, 0.5, 0.0], [0.5, 1.0, 0.5]]),
    )
    holds = torch.tensor([[True, True, False], [True, False, True]])
    # a holds clause 2 where b does not (1 win), b clause 3 (a's loss), both clause 1 (a tie): (1 + 0.5) / 3
    p = core.clause_preferences(holds)
    assert p[0, 1].item() == pytest.approx(0.5) and p[1, 0].item() == pytest.approx(0.5)
    p = core.clause_preferences(torch.tensor([[True, True], [False, True]]))
    assert p[0, 1].item() == pytest.approx(0.75) and p[1, 0].item() == pytest.approx(0.25)
    with pytest.raises(ValueError, match="square"):
        core.win_rates(torch.zeros(2, 3))


def scorer_for(world=1):
    from flowrl.train.scoring import Scorer

    cfg = load_config(None, ["rewards=[{name: jpeg_compressibility, pairwise: true}]"])
    policy = SimpleNamespace(reward_kind="image")
    return Scorer(cfg, policy, SimpleNamespace(world=world, rank=0), run_dir=None, main=True)


def test_the_scorer_turns_scores_into_group_win_rates():
    scorer = scorer_for()
    batch = SimpleNamespace(group_ids=torch.tensor([0, 0, 0, 1, 1]), metadata=[{}] * 5, prompts=["p"] * 5)
    scalar = SimpleNamespace()  # no judge: its scores are compared
    w = scorer.win_rates(scalar, batch, torch.tensor([3.0, 1.0, 2.0, 5.0, 5.0]))
    torch.testing.assert_close(w, torch.tensor([1.0, 0.0, 0.5, 0.5, 0.5]))
    w = scorer.win_rates(scalar, batch, torch.tensor([3.0, float("nan"), 2.0, 5.0, 4.0]))
    assert w[0] == 1.0 and w[2] == 0.0 and torch.isnan(w[1]) and w[3] == 1.0  # a missing score stays out

    calls = []

    def compare(a, b, prompts, **columns):  # a judge that prefers the first of every pair 3:1
        calls.append((list(a), list(b)))
        return [0.75] * len(a)

    batch.images = ["i0", "i1", "i2", "i3", "i4"]
    w = scorer.win_rates(SimpleNamespace(compare=compare), batch, torch.zeros(5))
    torch.testing.assert_close(w, torch.tensor([0.75, 0.5, 0.25, 0.75, 0.25]))
    assert calls == [(["i0", "i0", "i1"], ["i1", "i2", "i2"]), (["i3"], ["i4"])]  # each pair once, per group


def test_pairwise_rewards_need_one_process():
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="pairwise .* needs each group on one process, and this run has 2"):
        scorer_for(world=2)


def test_the_shapes_judge_compares_the_prompts_clauses_on_rendered_images():
    from flowrl.worlds.shapes.render import render
    from rewards.shapes_geneval import ShapesGenEval

    meta = {"objects": [{"shape": "square", "color": "red", "count": 1}], "relation": None}
    right, _ = render(meta, np.random.default_rng(0))
    wrong, _ = render(
        {"objects": [{"shape": "circle", "color": "blue", "count": 1}], "relation": None}, np.random.default_rng(0)
    )
    judge = ShapesGenEval()
    p = judge.compare([right, wrong, right], [wrong, right, right], ["p"] * 3, objects=[meta["objects"]] * 3)
    assert p[0] > 0.5 and p[1] == pytest.approx(1 - p[0].item()) and p[2] == 0.5


def test_a_run_trains_on_win_rates(tmp_path):
    from flowrl.train import Trainer

    cfg = load_config(
        None,
        [
            "model.path=tiny-sd3",
            "sample.height=32",
            "sample.width=32",
            "sample.num_steps=3",
            "sample.max_sequence_length=16",
            "sample.prompts_per_epoch=2",
            "sample.group_size=3",
            "train.epochs=1",
            "eval.before=false",
            "eval.num_steps=2",
            "eval.num_prompts=1",
            "log.progress=false",
            "model.device=cpu",
            "rewards=[{name: jpeg_compressibility, pairwise: true}]",
            f"log.run_dir={tmp_path}",
        ],
    )
    tr = Trainer(cfg)
    batch = tr.rollout(0)
    scores, components = tr.score(batch, 0)
    raw = components["jpeg_compressibility/raw"]
    for g in batch.group_ids.unique():
        rows = batch.group_ids == g
        torch.testing.assert_close(scores[rows, 0], core.win_rates(core.scalar_preferences(raw[rows])))
    assert scores[:, 0].mean().item() == pytest.approx(0.5)
    tr.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("policy/loss" in r for r in rows)
