"""The lr multiplier of `lr_lambda` against values worked out by hand."""

import math

import pytest

from flowrl.train.optim import lr_lambda


def test_constant_with_linear_warmup():
    f = lr_lambda(4, 100, "constant")
    assert [f(k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert f(99) == 1.0


def test_cosine_over_the_whole_run_after_warmup():
    f = lr_lambda(10, 110, "cosine")  # 100 steps of decay: slot 10 + j sits at j / 100 of it
    assert f(9) == 1.0 and f(10) == 1.0
    assert f(35) == pytest.approx((1 + math.cos(math.pi / 4)) / 2, abs=1e-12)  # 0.8536
    assert f(60) == pytest.approx(0.5, abs=1e-12)
    assert f(110) == pytest.approx(0.0, abs=1e-12) and f(500) == pytest.approx(0.0, abs=1e-12)


def test_warmup_stable_decay():
    """decay_frac 0.375 of 320 slots: 200 slots at the full lr, then a cosine over the last 120."""
    f = lr_lambda(0, 320, "cosine", decay_frac=0.375)
    assert f(0) == 1.0 and f(199) == 1.0 and f(200) == 1.0
    assert f(230) == pytest.approx(0.853553, abs=1e-6)  # a quarter of the way: (1 + cos 45 deg) / 2
    assert f(260) == pytest.approx(0.5, abs=1e-12)
    assert f(290) == pytest.approx(0.146447, abs=1e-6)
    g = lr_lambda(20, 120, "cosine", decay_frac=0.5)  # warm-up 20, then 50 stable, then 50 of decay
    assert g(4) == pytest.approx(0.25) and g(69) == 1.0 and g(70) == 1.0
    assert g(95) == pytest.approx(0.5, abs=1e-12)
    assert lr_lambda(0, 320, "cosine", decay_frac=1.0)(160) == pytest.approx(0.5, abs=1e-12)


def test_a_time_budget_moves_the_cosine_when_it_is_further_along_than_the_steps():
    """fn(k, b): the cosine's position is the larger of the steps' and the budget's (b - (1 - f)) / f."""
    f = lr_lambda(0, 1_000_000, "cosine")  # steps barely move: the budget leads
    assert f(10, 0.0) == pytest.approx(1.0, abs=1e-9)
    assert f(10, 0.25) == pytest.approx((1 + math.cos(math.pi / 4)) / 2, abs=1e-6)  # 0.8536
    assert f(10, 0.5) == pytest.approx(0.5, abs=1e-6)
    assert f(10, 1.0) == pytest.approx(0.0, abs=1e-12) and f(10, 1.7) == pytest.approx(0.0, abs=1e-12)
    g = lr_lambda(0, 100, "cosine", decay_frac=0.5)  # stable for the first half of either end
    assert g(10, 0.4) == 1.0 and g(10, 0.75) == pytest.approx(0.5, abs=1e-12)
    assert g(75, 0.1) == pytest.approx(0.5, abs=1e-12)  # the steps lead: the budget does not hold it back
    h = lr_lambda(5, 1_000_000, "cosine")
    assert h(2, 0.9) == pytest.approx(0.6)  # warm-up is by steps whatever the budget
    assert lr_lambda(0, 10, "constant")(3, 0.9) == 1.0


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 10, "linear"), "unknown lr schedule 'linear'; valid: constant, cosine"),
        ((0, 10, "cosine", 0.0), r"decay fraction must be in \(0, 1\]"),
        ((0, 10, "cosine", 1.5), r"decay fraction must be in \(0, 1\]"),
    ],
)
def test_bad_schedules_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        lr_lambda(*args)
