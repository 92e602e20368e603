"""Run-directory plots."""

import json

import pytest
from PIL import Image

from flowrl.report import headline_eval_keys, plot_curves


def test_plot_curves_writes_a_png(tmp_path):
    rows = [{"epoch": 0, "eval/accuracy_mean": 0.5}]
    rows += [{"epoch": e, "reward/total_mean": 0.2 + 0.01 * e} for e in range(1, 30)]
    rows += [{"epoch": 30, "eval/accuracy_mean": 0.7}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot_curves(tmp_path)
    assert out == tmp_path / "curves.png"
    with Image.open(out) as im:
        assert im.size[0] > 500 and im.size[1] > 200


def test_plot_curves_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_curves(tmp_path)


def test_plot_leaves_out_per_group_breakdowns():
    rows = [{"epoch": 0, "eval/g_mean": 0.4, "eval/g/strict_mean": 0.2, "eval/g/strict_family_mean": 0.3,
             "eval/g/strict_by_family/colors": 0.9, "eval/g_by_family/position": 0.1},
            {"epoch": 1, "reward/total_mean": 0.5}]
    assert headline_eval_keys(rows) == ["eval/g/strict_family_mean", "eval/g/strict_mean", "eval/g_mean"]


def test_an_eval_key_without_numbers_draws_no_empty_legend(tmp_path):
    """An eval column with no numeric value (here a text sample) gives no line, so no legend and no warning."""
    import warnings

    rows = [{"epoch": 0, "eval/sample_text": "a red circle"}]
    rows += [{"epoch": e, "reward/total_mean": 0.1 * e} for e in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_curves(tmp_path).exists()
