"""Truncated importance sampling for the engine / trainer mismatch (flowrl.core.mismatch), against hand values."""

import math

import pytest
import torch

from flowrl.core import mismatch_metrics, truncated_is_weights

TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, -1.0]])
ENGINE = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -2.0, -9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_level_weights_are_the_capped_per_token_ratios():
    w = truncated_is_weights(TRAINER, ENGINE, MASK, "token", cap=1.5)
    # exp(0.5)=1.6487 -> 1.5 (capped), exp(-1)=0.3679, exp(0)=1; exp(-0.1)=0.9048, exp(-1)=0.3679, masked -> 1
    expected = torch.tensor([[1.5, math.exp(-1.0), 1.0], [math.exp(-0.1), math.exp(-1.0), 1.0]])
    torch.testing.assert_close(w, expected)
    assert not w.requires_grad


def test_sequence_level_weights_are_the_capped_sequence_ratio_on_every_token():
    w = truncated_is_weights(TRAINER, ENGINE, MASK, "sequence", cap=2.0)
    # row 0: 0.5 - 1 + 0 = -0.5 -> exp(-0.5); row 1: -0.1 - 1 (the masked token's 8.0 left out) -> exp(-1.1)
    expected = torch.tensor([[math.exp(-0.5)] * 3, [math.exp(-1.1), math.exp(-1.1), 1.0]])
    torch.testing.assert_close(w, expected)
    capped = truncated_is_weights(ENGINE, TRAINER, MASK, "sequence", cap=2.0)  # row 1: exp(1.1) = 3.0 -> 2
    assert capped[1, 0].item() == pytest.approx(2.0) and capped[0, 0].item() == pytest.approx(math.exp(0.5))


def test_equal_log_probs_give_weight_one_and_no_mismatch():
    w = truncated_is_weights(TRAINER, TRAINER.clone(), MASK, "token", cap=2.0)
    assert torch.equal(w, torch.ones_like(w))
    m = mismatch_metrics(TRAINER, TRAINER.clone(), MASK, "token", 2.0)
    assert m == {"kl": 0.0, "max_abs": 0.0, "is_weight_mean": 1.0, "is_truncated_fraction": 0.0}


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(TRAINER, ENGINE, MASK, "token", 1.5)
    r = [0.5, -1.0, 0.0, -0.1, -1.0]  # the five completion tokens' log pi_old - log mu
    assert m["kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in r) / 5)
    assert m["max_abs"] == pytest.approx(1.0)  # the masked 8.0 does not count
    assert m["is_truncated_fraction"] == pytest.approx(1 / 5)
    assert m["is_weight_mean"] == pytest.approx((1.5 + math.exp(-1) + 1 + math.exp(-0.1) + math.exp(-1)) / 5)
    s = mismatch_metrics(ENGINE, TRAINER, MASK, "sequence", 2.0)
    assert s["is_truncated_fraction"] == pytest.approx(1 / 2)  # row 1's exp(1.1) is over the cap, row 0's not


def test_bad_level_or_cap_is_refused():
    with pytest.raises(ValueError, match="one of token, sequence"):
        truncated_is_weights(TRAINER, ENGINE, MASK, "tokens", 2.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(TRAINER, ENGINE, MASK, "token", 0.0)
