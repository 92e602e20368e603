"""Run-directory plots."""

import json

import pytest
from PIL import Image

from flowrl.report import headline_eval_keys, plot_curves, result_keys, write_before_after


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


def test_result_keys_put_the_grouped_strict_mean_first_and_skip_what_was_not_logged():
    rows = [{"epoch": 0, "eval/g_mean": 0.4, "eval/g/strict_mean": 0.2, "eval/g/strict_family_mean": 0.3,
             "eval/g_family_mean": 0.35}, {"epoch": 1, "reward/total_mean": 0.5}]
    assert result_keys(rows, "g", "family") == [
        "eval/g/strict_family_mean", "eval/g_family_mean", "eval/g/strict_mean", "eval/g_mean"]
    assert result_keys(rows, "g") == ["eval/g/strict_mean", "eval/g_mean"]
    assert result_keys([{"epoch": 0, "eval/h_mean": 0.1}], "h", "family") == ["eval/h_mean"]
    assert result_keys(rows, "other") == []


def test_before_after_is_captioned_with_the_headline_and_needs_both_grids(tmp_path):
    rows = [{"epoch": 0, "eval/g_mean": 0.25}, {"epoch": 5, "eval/g_mean": 0.5, "final": True}]
    Image.new("RGB", (40, 30), (255, 0, 0)).save(tmp_path / "eval-epoch000000.png")
    assert write_before_after(tmp_path, rows, "eval/g_mean") is None  # no final grid (a text run, or eval.grid off)
    Image.new("RGB", (40, 30), (0, 0, 255)).save(tmp_path / "eval-final.png")
    out = write_before_after(tmp_path, rows, "eval/g_mean")
    assert out == tmp_path / "before_after.png"
    with Image.open(out) as im:
        im = im.convert("RGB")
        assert im.width > 80 and im.height > 30
        # the first grid on the left, the final one on the right, below the caption strip
        assert im.getpixel((10, im.height - 10)) == (255, 0, 0)
        assert im.getpixel((im.width - 10, im.height - 10)) == (0, 0, 255)
