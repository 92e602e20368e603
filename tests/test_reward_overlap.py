"""rollout.overlap_rewards: each rollout call's images are scored on a thread while the next call samples, by the
rewards that declare `per_sample`; the others score the whole batch after the rollout. Everything after (scores,
advantages, metrics, the trained weights) equals the sequential path's; a reward's error and an abandoned rollout
leave no thread behind."""

import re
import threading
from types import SimpleNamespace

import pytest
import torch
from imagetiny import TINY_RUN

from flowrl.config import load_config
from flowrl.train import Trainer
from flowrl.train.scoring import Scorer
from flowrl.train.signals import Abandoned

TINY = [
    *TINY_RUN,
    "sample.rollout_batch_size=2",  # 4 rollout calls per epoch
    "train.epochs=1",
    "train.lr=3e-3",
    "train.steps_per_forward=3",
    "eval.before=false",
    "eval.num_steps=2",
    "eval.num_prompts=2",
]

PLUGIN = '''
import threading

import numpy as np
import torch

CALLS = []  # (reward, thread name, images)


def chunked(images, prompts):
    """Mean luminance, image by image: declares per_sample."""
    CALLS.append(("chunked", threading.current_thread().name, len(images)))
    return torch.tensor([np.asarray(x.convert("L"), dtype=np.float64).mean() / 255 for x in images])


chunked.per_sample = True


def relative(images, prompts):
    """Red minus the batch's mean red: needs the whole batch (no per_sample)."""
    CALLS.append(("relative", threading.current_thread().name, len(images)))
    red = torch.tensor([np.asarray(x, dtype=np.float64)[..., 0].mean() / 255 for x in images])
    return red - red.mean()


def failing(images, prompts):
    CALLS.append(("failing", threading.current_thread().name, len(images)))
    if len(CALLS) > 2:
        raise ValueError("no score for these")
    return torch.zeros(len(images))


failing.per_sample = True
'''


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "overlap_rewards.py"
    path.write_text(PLUGIN)
    return path


def calls(trainer) -> list:
    return next(fn.reward.__globals__["CALLS"] for fn in trainer.scorer.fns if hasattr(fn.reward, "__globals__"))


def overlap_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "flowrl-reward-overlap"]


def one_epoch(run_dir, plugin, overlap: bool, *extra):
    rewards = (
        f"rewards=[{{name: jpeg_compressibility}}, {{name: '{plugin}:chunked', weight: 0.5}}, "
        f"{{name: '{plugin}:relative', weight: 2.0}}]"
    )
    cfg = load_config(None, [*TINY, f"log.run_dir={run_dir}", rewards, f"rollout.overlap_rewards={overlap}", *extra])
    tr = Trainer(cfg)
    seen = {}
    score, advantages = tr.score, tr.advantages

    def record_score(batch, epoch=0, scored=None):
        seen["scores"], seen["components"] = score(batch, epoch, scored=scored)
        return seen["scores"], seen["components"]

    def record_advantages(batch, scores, epoch=0):
        seen["adv"], seen["keep"], seen["invalid"] = advantages(batch, scores, epoch)
        return seen["adv"], seen["keep"], seen["invalid"]

    tr.score, tr.advantages = record_score, record_advantages
    calls(tr).clear()
    metrics = tr.train_epoch(0)
    weights = {n: p.detach().clone() for n, p in tr.named_params.items()}
    return metrics, seen, weights, list(calls(tr))


@pytest.mark.parametrize("objective", ["grpo", "dpo"])
def test_overlap_gives_what_the_sequential_path_gives(tmp_path, plugin, objective):
    extra = [f"train.objective={objective}"]
    m_off, off, w_off, calls_off = one_epoch(tmp_path / "off", plugin, False, *extra)
    m_on, on, w_on, calls_on = one_epoch(tmp_path / "on", plugin, True, *extra)

    # the per_sample rewards scored the 4 rollout calls on the thread; the whole-batch one the 8 images after it
    assert ("chunked", "flowrl-reward-overlap", 2) in calls_on
    assert [c for c in calls_on if c[0] == "chunked"] == [("chunked", "flowrl-reward-overlap", 2)] * 4
    assert [c for c in calls_on if c[0] == "relative"] == [("relative", "MainThread", 8)]
    assert [c[2] for c in calls_off] == [8, 8]  # without it: each on the whole batch (jpeg is not a plug-in)

    assert torch.equal(on["scores"], off["scores"])
    assert on["components"].keys() == off["components"].keys() and on["components"]
    assert all(torch.equal(on["components"][k], off["components"][k]) for k in off["components"])
    assert torch.equal(on["adv"], off["adv"]) and torch.equal(on["keep"], off["keep"])
    assert w_on.keys() == w_off.keys() and all(torch.equal(w_on[n], w_off[n]) for n in w_off)
    assert any((w_on[n] != 0).any() for n in w_on)
    timeless = {k: v for k, v in m_off.items() if not k.startswith(("time/", "perf/"))}
    assert {k: m_on[k] for k in timeless} == pytest.approx(timeless, nan_ok=True, rel=0, abs=0)
    assert "time/reward_wait" in m_on and "time/reward_thread" in m_on
    assert "time/reward_wait" not in m_off
    assert not overlap_threads()


def test_a_reward_error_surfaces_as_without_overlap(tmp_path, plugin):
    rewards = f"rewards=[{{name: '{plugin}:failing'}}]"
    messages = []
    for overlap in (False, True):
        cfg = load_config(
            None, [*TINY, f"log.run_dir={tmp_path / str(overlap)}", rewards, f"rollout.overlap_rewards={overlap}"]
        )
        tr = Trainer(cfg)
        calls(tr).clear()
        calls(tr).extend([("before", "", 0)] * 2)  # the next call fails
        with pytest.raises(Exception) as info:
            tr.train_epoch(0)
        messages.append((type(info.value), str(info.value)))
        if overlap:  # it raised during the rollout, at the next chunk, on the main thread
            assert [c[1] for c in calls(tr)[2:]] == ["flowrl-reward-overlap"]
    assert messages[0] == messages[1]
    assert re.search(
        r":failing' failed: ValueError: no score for these \(at .*overlap_rewards.py:\d+, in failing\)$", messages[0][1]
    )
    assert not overlap_threads()


def test_an_abandoned_rollout_ends_the_scoring_thread(tmp_path, plugin):
    rewards = f"rewards=[{{name: '{plugin}:chunked'}}]"
    cfg = load_config(None, [*TINY, f"log.run_dir={tmp_path}", rewards, "rollout.overlap_rewards=true"])
    tr = Trainer(cfg)
    calls(tr).clear()
    asked = []

    def stop_point():  # a stop signal arrives after the second rollout call
        asked.append(1)
        if len(asked) == 3:
            raise Abandoned()

    tr.stop_point = stop_point
    with pytest.raises(Abandoned):
        tr.train_epoch(0)
    assert not overlap_threads()
    assert all(c[1] == "flowrl-reward-overlap" and c[2] == 2 for c in calls(tr)) and len(calls(tr)) <= 2
    tr.stop_point = lambda: None
    tr.train_epoch(0)  # the next epoch scores as usual
    assert not overlap_threads()


def test_no_overlap_for_text_offloaded_or_undeclared_rewards():
    declared = SimpleNamespace(per_sample=True)

    def scorer(kind="image", overlap=True, parked=None, fns=(declared,)):
        cfg = SimpleNamespace(rollout=SimpleNamespace(overlap_rewards=overlap))
        return SimpleNamespace(
            cfg=cfg, policy=SimpleNamespace(reward_kind=kind), fns=list(fns), parked=[parked] * len(fns)
        )

    assert Scorer.overlapped(scorer()) == [0]
    assert Scorer.overlapped(scorer(fns=(declared, SimpleNamespace(), SimpleNamespace(per_sample="yes")))) == [0]
    assert Scorer.overlapped(scorer(overlap=False)) == []
    assert Scorer.overlapped(scorer(kind="text")) == []  # no effect on text models
    assert Scorer.overlapped(scorer(parked=object())) == []  # train.offload parks it: scored after the rollout


def test_overlap_rewards_is_refused_for_text_before_the_model_loads():
    from flowrl.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.overlap_rewards .* set rollout.overlap_rewards=false"):
        load_config(None, ["backend=text", "model.path=tiny-gpt2", "rollout.overlap_rewards=true"])
