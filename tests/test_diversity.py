"""The diversity metric: the colour distribution where prompts leave colour free, its entropy and its total variation
distance from the base model's, computed by hand; the shapes reward's counts on rendered scenes; eval summaries."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.config import EvalConfig, SampleConfig
from flowrl.eval.diversity import (
    BaseDistribution,
    distribution_metrics,
    entropy_bits,
    eval_settings,
    histograms,
    is_count,
    settings_differences,
    total_variation,
)
from flowrl.eval.summary import eval_summary


def test_entropy_and_total_variation_by_hand():
    p = {"red": 0.5, "green": 0.25, "blue": 0.25}
    assert entropy_bits(p) == pytest.approx(1.5)  # 0.5*1 + 2 * 0.25*2
    assert entropy_bits({"red": 1.0}) == 0.0
    q = {"red": 0.25, "green": 0.25, "yellow": 0.5}
    # |0.5-0.25| + |0.25-0.25| + |0.25-0| + |0-0.5| = 1.0 -> TV 0.5
    assert total_variation(p, q) == pytest.approx(0.5)
    assert total_variation(p, p) == 0.0
    assert total_variation({"red": 1.0}, {"blue": 1.0}) == 1.0


def test_same_entropy_different_distribution_is_caught_by_tv():
    """A drift that keeps the spread (mostly green -> mostly red) leaves the entropy alone; TV sees it."""
    before = {"red": 10.0, "green": 70.0, "blue": 20.0}
    after = {"red": 70.0, "green": 10.0, "blue": 20.0}
    m = distribution_metrics({"r/color": after}, {"r/color": before})
    assert m["eval/diversity/r/color_entropy_bits"] == pytest.approx(
        distribution_metrics({"r/color": before})["eval/diversity/r/color_entropy_bits"]
    )
    assert m["eval/diversity/r/color_tv_from_base"] == pytest.approx(0.6)  # 0.5 * (0.6 + 0.6 + 0)
    assert m["eval/diversity/r/color_count"] == 100.0


def test_histograms_sum_counts_and_eval_summary_leaves_them_out_of_the_means():
    scores = {
        "shapes_geneval": torch.tensor([1.0, 0.0, 1.0]),
        "shapes_geneval/free_color=red": torch.tensor([1.0, 2.0, 0.0]),
        "shapes_geneval/free_color=blue": torch.tensor([0.0, 0.0, 1.0]),
    }
    assert is_count("shapes_geneval/free_color=red") and not is_count("shapes_geneval/strict")
    assert histograms(scores) == {"shapes_geneval/color": {"red": 3.0, "blue": 1.0}}
    base = {"shapes_geneval/color": {"red": 1.0, "blue": 3.0}}
    out = eval_summary(scores, [{}, {}, {}], base=base)
    assert set(out) == {
        "eval/shapes_geneval_mean",
        "eval/diversity/shapes_geneval/color_entropy_bits",
        "eval/diversity/shapes_geneval/color_count",
        "eval/diversity/shapes_geneval/color_tv_from_base",
    }
    assert out["eval/diversity/shapes_geneval/color_tv_from_base"] == pytest.approx(0.5)  # 0.75 vs 0.25
    h = -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))
    assert out["eval/diversity/shapes_geneval/color_entropy_bits"] == pytest.approx(h)


def test_tv_from_reference_by_hand(tmp_path):
    """eval.free_reference: 'uniform' spreads every value the reward reports (a zero count included) evenly; a
    JSON file's weights are normalised per attribute; off reports no _tv_from_reference."""
    import json

    from flowrl.eval.diversity import load_free_reference

    hists = {"r/color": {"red": 3.0, "blue": 1.0, "green": 0.0}}  # p = (0.75, 0.25, 0)
    key = "eval/diversity/r/color_tv_from_reference"
    # uniform: 1/3 each -> 1/2 (|0.75 - 1/3| + |0.25 - 1/3| + |0 - 1/3|) = 1/2 (5/12 + 1/12 + 4/12) = 5/12
    assert distribution_metrics(hists, reference="uniform")[key] == pytest.approx(5 / 12)
    path = tmp_path / "ref.json"
    path.write_text(json.dumps({"r/color": {"red": 1, "blue": 3}}))  # (0.25, 0.75): 1/2 (0.5 + 0.5 + 0) = 0.5
    ref = load_free_reference(str(path))
    assert ref == {"r/color": {"red": 1.0, "blue": 3.0}}
    assert distribution_metrics(hists, reference=ref)[key] == pytest.approx(0.5)
    assert key not in distribution_metrics(hists) and load_free_reference("") is None
    # the base's distance and the reference's are separate: the base model itself is off the reference
    both = eval_summary(
        {"r/free_color=red": torch.tensor([1.0, 1.0]), "r/free_color=blue": torch.tensor([1.0, 0.0])},
        [{}, {}],
        base={"r/color": {"red": 2.0, "blue": 1.0}},
        reference="uniform",
    )
    assert both["eval/diversity/r/color_tv_from_base"] == pytest.approx(0.0)
    assert both[key] == pytest.approx(1 / 6)  # (2/3, 1/3) vs (1/2, 1/2)


def test_free_reference_errors_name_the_problem_and_the_form(tmp_path):
    from flowrl.config import ConfigError, load_config
    from flowrl.eval.diversity import free_reference_problems, load_free_reference, reference_distributions

    assert free_reference_problems("") == [] and free_reference_problems("uniform") == []
    bad = {
        "nofile.json": "no such file",
        "text.json": "does not read as JSON",
        "list.json": "holds list",
        "neg.json": "not finite numbers >= 0",
        "zero.json": "sum to 0",
        "flat.json": "not a mapping of values to weights",
    }
    (tmp_path / "text.json").write_text("red: 1")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "neg.json").write_text('{"r/color": {"red": -1, "blue": 2}}')
    (tmp_path / "zero.json").write_text('{"r/color": {"red": 0}}')
    (tmp_path / "flat.json").write_text('{"r/color": 0.5}')
    for name, says in bad.items():
        problems = free_reference_problems(str(tmp_path / name))
        assert len(problems) == 1 and says in problems[0] and "'uniform'" in problems[0], (name, problems)
        with pytest.raises(ValueError, match=says):
            load_free_reference(str(tmp_path / name))
    with pytest.raises(ConfigError, match="eval.free_reference=.*no such file"):
        load_config(None, [f"eval.free_reference={tmp_path / 'nofile.json'}"])
    # an attribute no reward counts: a warning naming the counted ones, and no metric for it
    with pytest.warns(UserWarning, match=r"names \['r/shape'\].*counted ones: \['r/color'\]"):
        assert reference_distributions({"r/shape": {"square": 1.0}}, {"r/color": {"red": 1.0}}) == {}


def test_count_features_are_the_count_components_in_sorted_columns():
    """The trainer's free counts for train.dpo.pairing=matched: one column per count component, sorted by name,
    the other components left out, a non-finite count 0; None without any count."""
    from flowrl.train.scoring import count_features

    components = {
        "shapes_geneval/strict": torch.tensor([1.0, 0.0, 1.0]),
        "shapes_geneval/free_color=red": torch.tensor([1.0, 2.0, float("nan")]),
        "shapes_geneval/free_color=blue": torch.tensor([0.0, 0.0, 1.0]),
    }
    assert torch.equal(count_features(components), torch.tensor([[0.0, 1.0], [0.0, 2.0], [1.0, 0.0]]))
    assert count_features({"shapes_geneval/strict": torch.tensor([1.0])}) is None


def test_base_distribution_round_trips_with_its_eval_settings(tmp_path):
    store = BaseDistribution(tmp_path)
    assert store.load() is None and store.settings() is None
    settings = eval_settings(["a square"], [{"family": "single"}], EvalConfig(), SampleConfig())
    store.save({"r/color": {"red": 2.0}}, settings)
    assert store.load() == {"r/color": {"red": 2.0}} and store.settings() == settings
    assert [p.name for p in tmp_path.iterdir()] == [store.path.name]  # no temporary file left
    # a file from before the settings were recorded: the histograms alone, taken as comparable with any eval
    store.path.write_text('{"r/color": {"red": 1.0, "blue": 3.0}}')
    assert store.load() == {"r/color": {"red": 1.0, "blue": 3.0}} and store.settings() is None
    assert settings_differences(store.settings(), settings) == []


def test_eval_settings_tell_evals_whose_images_pair_from_those_that_do_not():
    """Two evals compare image for image only when they sample the same prompts (as listed, metadata included)
    with the same steps, CFG, seed, images per prompt and size; the differences name the key and both values."""
    prompts, meta = ["a square", "two circles"], [{"family": "single"}, {"family": "count"}]
    now = eval_settings(prompts, meta, EvalConfig(num_steps=20), SampleConfig(height=64, width=64))
    assert settings_differences(now, dict(now)) == []
    assert settings_differences(
        eval_settings(prompts, meta, EvalConfig(num_steps=10), SampleConfig(height=64, width=64)), now
    ) == ["eval.num_steps: 10 (base) vs 20"]
    other_meta = eval_settings(
        prompts,
        [{"family": "single"}, {"family": "counting"}],
        EvalConfig(num_steps=20),
        SampleConfig(height=64, width=64),
    )
    assert [d.split(":")[0] for d in settings_differences(other_meta, now)] == ["prompts"]
    reordered = eval_settings(prompts[::-1], meta[::-1], EvalConfig(num_steps=20), SampleConfig(height=64, width=64))
    assert [d.split(":")[0] for d in settings_differences(reordered, now)] == ["prompts"]
    several = eval_settings(
        prompts,
        meta,
        EvalConfig(num_steps=20, seed=7, guidance_scale=1.0, images_per_prompt=2),
        SampleConfig(height=32, width=64),
    )
    assert [d.split(":")[0] for d in settings_differences(several, now)] == [
        "eval.guidance_scale",
        "eval.seed",
        "images per listed prompt",
        "sample.height",
    ]


def test_shapes_reward_counts_the_colours_of_objects_the_prompt_left_uncoloured():
    """Rendered scenes: "a square" (free colour) drawn red counts red; "a blue circle" (colour fixed) counts
    nothing; "two triangles" (free) count both triangles' colours."""
    import rewards
    from flowrl.worlds.shapes.render import render

    rows = [
        {"objects": [{"shape": "square", "color": None, "count": 1}], "relation": None},
        {"objects": [{"shape": "circle", "color": "blue", "count": 1}], "relation": None},
        {"objects": [{"shape": "triangle", "color": None, "count": 2}], "relation": None},
    ]
    rng = np.random.default_rng(3)
    images, scenes = [], []
    for r in rows:
        pixels, scene = render(r, rng)
        images.append(Image.fromarray(pixels))
        scenes.append(scene)
    fn = rewards.get("shapes_geneval")
    fn(images, ["", "", ""], objects=[r["objects"] for r in rows], relation=[None] * 3)
    counts = {k.split("=")[1]: v for k, v in fn.last_components.items() if k.startswith("free_color=")}
    expected = torch.zeros(3, len(counts))
    names = list(counts)
    for obj in scenes[0]:
        expected[0, names.index(obj.color)] += 1
    for obj in scenes[2]:
        expected[2, names.index(obj.color)] += 1
    got = torch.stack([counts[c] for c in names], 1)
    assert torch.equal(got, expected), (got, expected)
    assert got[1].sum() == 0 and got[0].sum() == 1 and got[2].sum() == 2
