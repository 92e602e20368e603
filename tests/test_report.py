"""Run-directory plots."""

import json

import pytest
from PIL import Image

from flowrl.report import plot_curves


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
