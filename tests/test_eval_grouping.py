"""`eval.group_by`: per-group means and their unweighted mean (GenEval's "overall"), by hand."""

import math

import pytest

from flowrl.eval.summary import grouped_means


def test_grouped_means_by_hand():
    # 3 prompts x 2 samples, prompt-major: a = {1, 0, 0, 0} -> 0.25, b = {1, 1} -> 1.0
    meta = [{"family": "a"}, {"family": "b"}, {"family": "a"}]
    out = grouped_means("strict", [1, 0, 1, 1, 0, 0], meta, "family")
    assert out["eval/strict_by_family/a"] == pytest.approx(0.25, abs=1e-12)
    assert out["eval/strict_by_family/b"] == pytest.approx(1.0, abs=1e-12)
    # unweighted over groups (0.625), not over samples (4/6)
    assert out["eval/strict_family_mean"] == pytest.approx(0.625, abs=1e-12)
    assert set(out) == {"eval/strict_by_family/a", "eval/strict_by_family/b", "eval/strict_family_mean"}


def test_grouped_means_skips_nan_samples():
    meta = [{"k": "x"}, {"k": "y"}]
    out = grouped_means("r", [0.5, math.nan, math.nan, math.nan], meta, "k")
    assert out == {"eval/r_by_k/x": 0.5, "eval/r_k_mean": 0.5}


def test_grouped_means_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"columns are \['family'\]"):
        grouped_means("s", [1.0, 0.0], [{"family": "a"}, {"family": "b"}], "task")
    with pytest.raises(ValueError, match="do not split evenly"):
        grouped_means("s", [1.0, 0.0, 1.0], [{"k": 1}, {"k": 2}], "k")
    with pytest.raises(ValueError, match="plain-text prompts"):
        grouped_means("s", [1.0], [{}], "family")


def _cfg(**kw):
    from flowrl.config import EvalConfig

    return EvalConfig(**{"num_prompts": 0, "group_by": "family", **kw})


def test_eval_plan_shares_each_groups_images_over_its_prompts():
    from flowrl.data import PromptSet
    from flowrl.eval.summary import eval_plan

    ps = PromptSet(["a1", "b1", "a2", "c1"], [{"family": f} for f in "abac"])
    # by hand: N = 4 -> a (2 prompts) gives each 2 images, b and c (1 prompt) give theirs 4; one image per listing
    prompts, meta, ecfg = eval_plan(ps, _cfg(images_per_group=4, images_per_prompt=8))
    assert ecfg.images_per_prompt == 1 and ecfg.images_per_group == 4
    assert prompts == ["a1", "a1", "b1", "b1", "b1", "b1", "a2", "a2", "c1", "c1", "c1", "c1"]
    assert [m["family"] for m in meta] == [p[0] for p in prompts]
    # then every group holds N samples, so the grouped means weigh each group's images alike
    out = grouped_means("s", [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1], meta, "family")
    assert out["eval/s_by_family/a"] == pytest.approx(0.5, abs=1e-12)
    assert out["eval/s_by_family/b"] == 0.0 and out["eval/s_by_family/c"] == 1.0
    # off: the first num_prompts prompts, images_per_prompt each
    cfg = _cfg(num_prompts=3, images_per_prompt=8)
    assert eval_plan(ps, cfg) == (["a1", "b1", "a2"], ps.metadata[:3], cfg)


def test_eval_plan_errors_name_the_counts_and_the_smallest_valid_value():
    from flowrl.data import PromptSet
    from flowrl.eval.summary import eval_plan

    ps = PromptSet(["a1", "a2", "b1", "b2", "b3"], [{"family": f} for f in "aabbb"])
    with pytest.raises(
        ValueError,
        match=r"images_per_group=4 must be a multiple.*\{'a': 2, 'b': 3\}.*"
        r"\{'b': 3\} do not divide it.*smallest that works is 6",
    ):
        eval_plan(ps, _cfg(images_per_group=4))
    with pytest.raises(ValueError, match=r"eval.group_by='family': prompt 0 has no column"):
        eval_plan(PromptSet(["x"]), _cfg(images_per_group=2))


def test_images_per_group_needs_group_by():
    from flowrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"eval.images_per_group=48 .* eval.group_by.*not set"):
        load_config(None, ["eval.images_per_group=48"])
    with pytest.raises(ConfigError, match=r"eval.images_per_prompt must be >= 1"):
        load_config(None, ["eval.images_per_prompt=0"])


def test_eval_shares_merge_in_process_order_and_an_empty_share_adds_nothing():
    """Fewer eval prompts than processes: a process samples nothing and has no reward components."""
    import torch

    from flowrl.eval import merge_eval_shares

    shares = [
        (["a", "b"], {"r": torch.tensor([1.0, 2.0]), "r/strict": torch.tensor([0.0, 1.0])}),
        ([], {"r": torch.zeros(0)}),
        (["c"], {"r": torch.tensor([3.0]), "r/strict": torch.tensor([1.0])}),
    ]
    outputs, scores = merge_eval_shares(shares)
    assert outputs == ["a", "b", "c"]
    assert scores["r"].tolist() == [1.0, 2.0, 3.0] and scores["r/strict"].tolist() == [0.0, 1.0, 1.0]
    with pytest.raises(RuntimeError, match="process 1's scores have the columns"):
        merge_eval_shares([shares[0], (["c"], {"r": torch.tensor([3.0])})])


def test_grid_images_keeps_the_same_share_of_every_prompt():
    """eval.grid_images: each prompt's first ceil(n_p * keep / N) images, by hand; the scores go with their images;
    0 or a grid as large as the eval shows everything; text completions are never cut."""
    import types

    import torch

    from flowrl.config import Config
    from flowrl.eval.evaluator import Evaluator, grid_subset

    listed = ["a"] * 8 + ["b"] * 4 + ["c"] * 4  # N = 16, keep 4: a 2, b 1, c 1
    assert grid_subset(listed, 4) == [0, 1, 8, 12]
    assert grid_subset(listed, 3) == [0, 1, 8, 12]  # ceil: 1.5 -> 2, 0.75 -> 1
    assert grid_subset(listed, 16) == list(range(16))

    calls = []

    class Policy:
        reward_kind = "image"

        def save_eval_outputs(self, outputs, prompts, path, scores=None):
            calls.append((outputs, prompts, scores))
            return path

    ev = Evaluator.__new__(Evaluator)
    ev.cfg = Config()
    ev.eval_cfg = types.SimpleNamespace(grid_images=4)
    ev.prompts = ["a", "a", "b", "c"]  # one entry per image, listed as eval_plan lists images_per_group's
    name = ev.cfg.rewards[0].name
    scores = {name: torch.arange(8.0)}  # images_per_prompt 2: 8 images, prompt-major
    ev.write_outputs(Policy(), list("ABCDEFGH"), scores, "x")  # a: A-D (4 of 8 -> 2), b: E, F (1), c: G, H (1)
    assert calls[-1][0] == ["A", "B", "E", "G"] and calls[-1][1] == ["a", "a", "b", "c"]
    assert calls[-1][2].tolist() == [0.0, 1.0, 4.0, 6.0]
    ev.eval_cfg.grid_images = 0
    ev.write_outputs(Policy(), list("ABCDEFGH"), scores, "x")
    assert calls[-1][0] == list("ABCDEFGH") and calls[-1][1] == ev.prompts
    text = Policy()
    text.reward_kind = "text"
    ev.eval_cfg.grid_images = 4
    ev.write_outputs(text, list("ABCDEFGH"), scores, "x")
    assert calls[-1][0] == list("ABCDEFGH")
