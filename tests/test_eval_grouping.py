"""`eval.group_by`: per-group means and their unweighted mean (GenEval's "overall"), by hand."""

import math

import pytest

from flowrl.train_utils import grouped_means


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
