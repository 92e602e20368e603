"""data.skip_no_signal: a prompt whose last N groups all scored alike is left out of the draws (for
data.skip_epochs epochs, or the rest of the run); the draws otherwise walk the same order, resume exactly, and
with nothing left out are the plain draws."""

import math
import random
import warnings
from pathlib import Path

import pytest
import torch

from flowrl.config import ConfigError, load_config
from flowrl.data import PromptSet
from flowrl.train.prompts import PromptDraws, groups_with_signal

FAMILIES = ["a"] * 5 + ["b"] * 2 + ["c"] * 3


def _set(n: int = 10) -> PromptSet:
    return PromptSet([f"p{i}" for i in range(n)], [{"family": FAMILIES[i % len(FAMILIES)]} for i in range(n)])


def _idx(names: list[str]) -> list[int]:
    return [int(p[1:]) for p in names]


@pytest.mark.parametrize("balance_by", ["", "family"])
def test_with_nothing_left_out_the_draws_are_the_plain_draws(balance_by):
    ps = _set()
    draws = PromptDraws(ps, 3, seed=7, balance_by=balance_by, skip_after=2)
    for epoch in range(12):
        assert draws.draw(epoch) == ps.draw(3, epoch, 7, balance_by)
        draws.observe(epoch, [True, True, True])
    # started later (a resumed run whose checkpoint has no draw state): in place, where the plain draws are
    late = PromptDraws(ps, 3, seed=7, balance_by=balance_by, skip_after=2)
    assert [late.draw(e) for e in (5, 6)] == [ps.draw(3, e, 7, balance_by) for e in (5, 6)]


def test_a_prompt_without_signal_twice_in_a_row_is_left_out_and_the_walk_goes_on():
    ps = _set()
    draws = PromptDraws(ps, 4, seed=3, skip_after=2)
    stream = [ps.walk(3, k) for k in range(200)]  # the plain order: 4 per epoch
    first = _idx(draws.draw(0)[0])
    assert first == stream[:4]
    target = first[0]
    draws.observe(0, [False, True, True, True])  # one group without signal: not yet
    seen = list(first)
    epoch = 1
    while seen.count(target) < 2:  # until the target's second group, every group has signal but the target's
        idx = _idx(draws.draw(epoch)[0])
        seen += idx
        draws.observe(epoch, [i != target for i in idx])
        epoch += 1
    assert seen == stream[: len(seen)]  # nothing was left out so far
    later = []
    for e in range(epoch, epoch + 10):
        later += _idx(draws.draw(e)[0])
        draws.observe(e, [True] * 4)
    assert target not in later and len(later) == 40
    rest = [i for i in stream[len(seen) :] if i != target]  # the same order with the target taken out
    assert later == rest[:40]


def test_a_group_with_signal_resets_the_count_and_skip_epochs_brings_a_prompt_back():
    ps = PromptSet(["x", "y", "z"])
    draws = PromptDraws(ps, 3, seed=0, skip_after=2, skip_epochs=3)
    draws.draw(0)
    draws.observe(0, [n != "x" for n in draws.draw(0)[0]])  # x: 1 without signal
    draws.draw(1)
    draws.observe(1, [True, True, True])  # x: back to 0
    draws.draw(2)
    assert "x" in draws.draw(2)[0]
    m = draws.observe(2, [n != "x" for n in draws.draw(2)[0]])  # x: 1
    assert m["data/prompts_skipped"] == 0 and m["data/groups_without_signal"] == pytest.approx(1 / 3)
    draws.draw(3)
    m = draws.observe(3, [n != "x" for n in draws.draw(3)[0]])  # x: 2 in a row -> out for epochs 4, 5, 6
    assert m["data/prompts_skipped"] == 1
    for e in (4, 5, 6):
        prompts = draws.draw(e)[0]
        assert "x" not in prompts and len(prompts) == 3
        draws.observe(e, [True] * 3)
    assert "x" in draws.draw(7)[0]


def test_balanced_a_value_left_out_whole_sits_out_the_rounds_and_the_others_stay_equal():
    ps = _set(30)
    draws = PromptDraws(ps, 6, seed=1, balance_by="family", skip_after=1)
    b_prompts = {i for i, m in enumerate(ps.metadata) if m["family"] == "b"}
    counts = {"a": 0, "b": 0, "c": 0}
    for epoch in range(40):
        names, meta = draws.draw(epoch)
        idx = _idx(names)
        if epoch >= 10:
            for m in meta:
                counts[m["family"]] += 1
        draws.observe(epoch, [i not in b_prompts for i in idx])  # b's groups never have a signal
    assert counts["b"] == 0  # every b prompt was drawn once within 10 epochs (2 rounds of each of 6 b prompts)
    assert abs(counts["a"] - counts["c"]) <= 1 and counts["a"] + counts["c"] == 30 * 6


def test_every_prompt_left_out_draws_them_all_again_with_a_warning():
    ps = PromptSet(["x", "y"])
    draws = PromptDraws(ps, 2, seed=0, skip_after=1)
    draws.draw(0)
    draws.observe(0, [False, False])
    with pytest.warns(UserWarning, match=r"every training prompt had 1 groups in a row without signal .* lower"):
        assert sorted(draws.draw(1)[0]) == ["x", "y"]
    assert draws.readmitted == 1


@pytest.mark.parametrize("balance_by", ["", "family"])
def test_the_state_resumes_the_same_draws_including_an_epoch_drawn_ahead(balance_by):
    ps = _set(20)
    rng = random.Random(0)
    signals = [[rng.random() < 0.6 for _ in range(4)] for _ in range(30)]

    def run(draws, epochs, ahead=False):
        out = []
        for e in epochs:
            out.append(draws.draw(e)[0])
            if ahead:
                draws.draw(e + 1)  # rollout.async asks for the next epoch before this one is scored
            draws.observe(e, signals[e])
        return out

    straight = PromptDraws(ps, 4, seed=5, balance_by=balance_by, skip_after=1, skip_epochs=4)
    all_draws = run(straight, range(30), ahead=True)
    first = PromptDraws(ps, 4, seed=5, balance_by=balance_by, skip_after=1, skip_epochs=4)
    run(first, range(12), ahead=True)
    state = first.state_dict()
    assert list(state["pending"]) == ["12"]  # epoch 12 was drawn ahead and not yet scored
    resumed = PromptDraws(ps, 4, seed=5, balance_by=balance_by, skip_after=1, skip_epochs=4)
    resumed.load_state_dict(state)
    assert run(resumed, range(12, 30), ahead=True) == all_draws[12:]
    plain = [ps.draw(4, e, 5, balance_by)[0] for e in range(30)]
    assert all_draws[12:] != plain[12:]  # prompts were left out after the resume point: the state mattered


def test_a_state_that_names_prompts_the_set_lacks_is_not_used():
    big = PromptDraws(_set(20), 4, seed=0, skip_after=1)
    for e in range(6):
        big.draw(e)
        big.observe(e, [False] * 4)
    small = PromptDraws(_set(5), 4, seed=0, skip_after=1)
    with pytest.warns(UserWarning, match=r"beyond the 5 of data.train_prompts .* starts over"):
        small.load_state_dict(big.state_dict())
    assert small.position is None and small.skipped == {}
    assert small.draw(3) == _set(5).draw(4, 3, 0)  # where the plain draws are


def test_groups_with_signal_compares_each_reward_within_each_group():
    nan = math.nan
    scores = torch.tensor(
        [
            [1.0, 0.0],
            [1.0, 0.0],  # group 0: both rewards alike -> no signal
            [0.0, 2.0],
            [0.0, 3.0],  # group 1: the second reward differs
            [1.0, nan],
            [0.0, nan],  # group 2: the first differs, the second does not apply
            [5.0, nan],  # group 3: one sample only
            [nan, 1.0],
            [nan, 1.0],  # group 4: only alike scores where they apply
        ]
    )
    gids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 4])
    assert groups_with_signal(scores, gids, 6) == [False, True, True, False, False, False]  # group 5: no samples


def test_the_config_keys_are_checked():
    with pytest.raises(ConfigError, match=r"data.skip_no_signal must be"):
        load_config(None, ["data.skip_no_signal=-1"])
    cfg = load_config(None, ["data.skip_no_signal=2", "data.skip_epochs=10"])
    assert (cfg.data.skip_no_signal, cfg.data.skip_epochs) == (2, 10)
    with pytest.raises(ConfigError, match=r"data.skip_epochs=10 says .* data.skip_no_signal is 0 \(off\); set"):
        load_config(None, ["data.skip_epochs=10"])


def test_a_run_skips_a_prompt_that_always_scores_alike_and_resumes_exactly(tmp_path):
    """A tiny SD3 run whose reward gives one prompt the same score on every image: that prompt is drawn until its
    two groups without signal, then never; the metrics say so; a resume from the middle draws what the straight
    run drew."""
    from flowrl.train import Trainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a flat square\na red circle\na blue ring\n")
    plugin = tmp_path / "flat.py"
    plugin.write_text(
        "import numpy as np\n"
        "def score(images, prompts):\n"
        "    bright = [np.asarray(x.convert('L'), dtype=np.float64).mean() / 255 for x in images]\n"
        "    return [0.5 if p == 'a flat square' else b for p, b in zip(prompts, bright)]\n"
    )
    common = [
        "sample.height=32",
        "sample.width=32",
        "sample.num_steps=2",
        "sample.max_sequence_length=16",
        "sample.prompts_per_epoch=2",
        "sample.group_size=2",
        "eval.every=0",
        "eval.num_prompts=1",
        "eval.num_steps=2",
        "log.progress=false",
        "model.device=cpu",
        "train.epochs=6",
        "checkpoint.every=3",
        "checkpoint.keep=0",
        f"data.train_prompts={prompts}",
        "data.skip_no_signal=2",
        f"rewards=[{{name: '{plugin}:score'}}]",
    ]
    straight = Trainer(load_config(None, [*common, f"log.run_dir={tmp_path / 'a'}"]))
    straight.fit()
    rows = [r for r in _metrics(tmp_path / "a") if "data/groups_without_signal" in r]
    assert len(rows) == 6
    assert rows[-1]["data/prompts_skipped"] == 1.0
    assert straight.draws.skipped == {0: -1}  # 'a flat square', for the rest of the run
    assert max(r["data/groups_without_signal"] for r in rows) == 0.5
    resumed = Trainer(
        load_config(
            None, [*common, f"log.run_dir={tmp_path / 'b'}", f"checkpoint.resume={tmp_path / 'a' / 'ckpt-000003'}"]
        )
    )
    resumed.fit()
    assert resumed.draws.state_dict() == straight.draws.state_dict()
    for n, p in straight.named_params.items():
        torch.testing.assert_close(resumed.named_params[n].detach(), p.detach(), rtol=0, atol=1e-6)


def _metrics(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_draws_module_warns_nothing_when_off():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        draws = PromptDraws(PromptSet(["x"]), 2, seed=0)
        assert draws.draw(0)[0] == ["x", "x"]
        assert draws.observe(0, [False, False]) == {"data/groups_without_signal": 1.0}
