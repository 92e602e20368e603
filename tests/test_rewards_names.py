"""A reward's name in the metrics (metrics.jsonl, TensorBoard, W&B all log the same keys): a registered reward's
name, a plug-in's function name (not its path), or the label the config gives it (`name`, with `reward` the
reward built); two rewards of one name are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowrl.config import load_config, to_dict
from flowrl.errors import ConfigError

torch.set_num_threads(1)

TINY_CFG = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml")
SCORES = """
import numpy as np


def brightness_mean(images, prompts, gain=1.0):
    return [gain * np.asarray(x.convert("L"), dtype=np.float64).mean() / 255 for x in images]
"""


@pytest.fixture
def plugin(tmp_path) -> str:
    path = tmp_path / "my_scores.py"
    path.write_text(SCORES)
    return f"{path}:brightness_mean"  # an absolute path, as a user gives it


def test_a_plugin_given_by_path_is_named_by_its_function_and_a_label_wins(plugin):
    cfg = load_config(TINY_CFG, [f"rewards=[{{name: '{plugin}'}}, {{name: dim, reward: '{plugin}', weight: 0}}]"])
    (a, b) = cfg.rewards
    assert (a.name, a.target) == ("brightness_mean", plugin)
    assert (b.name, b.target) == ("dim", plugin)
    again = load_config(None, [f"rewards={json.dumps(to_dict(cfg)['rewards'])}"])  # a saved config reads back
    assert [(r.name, r.target) for r in again.rewards] == [("brightness_mean", plugin), ("dim", plugin)]
    registered = load_config(TINY_CFG, []).rewards[0]
    assert (registered.name, registered.target) == ("jpeg_compressibility", "jpeg_compressibility")


def test_two_rewards_of_one_name_are_refused(plugin, tmp_path):
    other = tmp_path / "other.py"
    other.write_text(SCORES)
    with pytest.raises(ConfigError, match=r"rewards\[0\] and rewards\[1\] are both named 'brightness_mean'") as info:
        load_config(TINY_CFG, [f"rewards=[{{name: '{plugin}'}}, {{name: '{other}:brightness_mean'}}]"])
    assert f"{{name: brightness_mean_2, reward: {other}:brightness_mean}}" in str(info.value)
    with pytest.raises(ConfigError, match=r"rewards\[0\] and rewards\[1\] are both named 'jpeg_compressibility'"):
        load_config(TINY_CFG, ["rewards=[{name: jpeg_compressibility}, {name: jpeg_compressibility, weight: 0}]"])
    with pytest.raises(ConfigError, match=r"rewards\[0\].name='a/b': a reward's name in the metrics has no '/'"):
        load_config(TINY_CFG, [f"rewards=[{{name: a/b, reward: '{plugin}'}}]"])
    with pytest.raises(ConfigError, match=r"names a file but no function in it; a plug-in is '.*scores\.py:FUNCTION'"):
        load_config(TINY_CFG, [f"rewards.0.name={plugin.rpartition(':')[0]}"])  # the file, its function left out


def test_a_reward_labelled_total_or_nothing_is_refused(plugin):
    """`total` is the metrics' own label (reward/total_mean: the weighted sum of the rewards): a reward of that name
    would write its mean over it, so it is refused, as an empty label (metrics named `eval/_mean`) is."""
    with pytest.raises(ConfigError, match=r"rewards\[1\]\.name='total' is reserved: reward/total_mean is") as info:
        load_config(TINY_CFG, [f"rewards=[{{name: jpeg_compressibility}}, {{name: total, reward: '{plugin}'}}]"])
    assert f"{{name: total_score, reward: {plugin}}}" in str(info.value)
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.name is empty"):
        load_config(TINY_CFG, ["rewards.0.name="])
    assert (
        load_config(TINY_CFG, [f"rewards=[{{name: total_score, reward: '{plugin}'}}]"]).rewards[0].name == "total_score"
    )


def test_a_runs_metrics_name_a_plugin_by_its_function(plugin, tmp_path):
    from flowrl.train import Trainer

    run = tmp_path / "run"
    overrides = [
        "train.epochs=1",
        "sample.num_steps=2",
        "sample.group_size=2",
        "sample.prompts_per_epoch=2",
        "eval.num_steps=2",
        "eval.num_prompts=1",
        "log.progress=false",
        f"log.run_dir={run}",
        f"rewards=[{{name: '{plugin}'}}, {{name: dim, reward: '{plugin}', weight: 0, kwargs: {{gain: 0.5}}}}]",
    ]
    Trainer(load_config(TINY_CFG, overrides)).fit()
    keys = {k for line in (run / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}
    assert {"reward/brightness_mean_mean", "reward/dim_mean", "eval/brightness_mean_mean", "eval/dim_mean"} <= keys
    assert not [k for k in keys if "//" in k or str(tmp_path) in k or ".py" in k]
