"""Advantage estimators against hand arithmetic and loop re-derivations (float64, tol 1e-9)."""

import math
import statistics

import pytest
import torch

from flowrl.core import (
    PerPromptStatTracker,
    gae_advantages,
    gdpo_advantages,
    get_advantage_estimator,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

TOL = dict(rtol=0, atol=1e-9)
EPS = 1e-6


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_group_advantages_by_hand():
    r = t([1.0, 2.0, 3.0, 10.0, 10.0, 7.0])
    g = ["a", "a", "a", "b", "b", "c"]
    adv = group_advantages(r, g)
    # group a: mean 2, unbiased std sqrt(((-1)^2 + 0 + 1^2) / 2) = 1  -> [-1, 0, 1] / (1 + eps)
    # group b: all equal -> exactly 0;  group c: one sample -> 0
    expected = t([-1 / (1 + EPS), 0.0, 1 / (1 + EPS), 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, **TOL)
    assert adv[3] == 0 and adv[4] == 0 and adv[5] == 0


def test_group_advantages_batch_and_none_scales_by_hand():
    r = t([1.0, 2.0, 3.0, 10.0, 10.0])
    g = torch.tensor([0, 0, 0, 1, 1])
    # batch mean 5.2; squared deviations 17.64 + 10.24 + 4.84 + 23.04 + 23.04 = 78.8; /4 = 19.7
    batch_std = math.sqrt(19.7)
    adv = group_advantages(r, g, scale="batch")
    torch.testing.assert_close(adv, t([-1, 0, 1, 0, 0]) / (batch_std + EPS), **TOL)
    # biased std: 78.8 / 5 = 15.76
    adv_b = group_advantages(r, g, scale="batch", unbiased=False)
    torch.testing.assert_close(adv_b, t([-1, 0, 1, 0, 0]) / (math.sqrt(15.76) + EPS), **TOL)
    # Dr.GRPO: mean subtracted only
    torch.testing.assert_close(group_advantages(r, g, scale="none"), t([-1, 0, 1, 0, 0]), **TOL)
    torch.testing.assert_close(get_advantage_estimator("dr_grpo")(r, g), t([-1, 0, 1, 0, 0]), **TOL)


def test_group_advantages_biased_std_and_eps():
    r = t([0.0, 4.0])
    # population std of [0, 4] = 2; A = [-2, 2] / (2 + 0.5)
    adv = group_advantages(r, [7, 7], unbiased=False, eps=0.5)
    torch.testing.assert_close(adv, t([-0.8, 0.8]), **TOL)


def test_all_equal_rewards_exactly_zero_no_nan():
    r = torch.full((8,), 0.1, dtype=torch.float32)
    for scale in ("group", "batch", "none"):
        adv = group_advantages(r, [0] * 4 + [1] * 4, scale=scale)
        assert torch.equal(adv, torch.zeros(8)), scale
    adv = group_advantages(torch.tensor([0.3]), ["solo"])
    assert torch.equal(adv, torch.zeros(1))


def _loop_group_advantages(r, g, scale, unbiased, eps):
    groups = {}
    for i, gi in enumerate(g):
        groups.setdefault(gi, []).append(i)
    vals = r.tolist()
    std_fn = statistics.stdev if unbiased else statistics.pstdev
    batch_std = std_fn(vals)
    out = [0.0] * len(vals)
    for idx in groups.values():
        xs = [vals[i] for i in idx]
        if len(xs) < 2 or max(xs) == min(xs):
            continue
        mu = sum(xs) / len(xs)
        denom = {"group": std_fn(xs) + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        for i in idx:
            out[i] = (vals[i] - mu) / denom
    return t(out)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("unbiased", [True, False])
def test_group_advantages_match_loop(scale, unbiased):
    gen = torch.Generator().manual_seed(0)
    for trial in range(5):
        n = 24
        r = torch.randn(n, generator=gen, dtype=torch.float64)
        g = torch.randint(0, 6, (n,), generator=gen).tolist()
        g[0] = 99  # a group of one
        got = group_advantages(r, g, scale=scale, unbiased=unbiased)
        torch.testing.assert_close(got, _loop_group_advantages(r, g, scale, unbiased, EPS), **TOL)


def test_dtype_preserved():
    for dtype in (torch.float32, torch.float64):
        r = torch.tensor([1.0, 2.0, 4.0, 0.0], dtype=dtype)
        assert group_advantages(r, [0, 0, 1, 1]).dtype == dtype
        assert rloo_advantages(r, [0, 0, 1, 1]).dtype == dtype


def test_rloo_by_hand_and_loop():
    r = t([1.0, 2.0, 3.0, 5.0])
    # group [1,2,3]: 1 - (2+3)/2 = -1.5; 2 - (1+3)/2 = 0; 3 - (1+2)/2 = 1.5; group [5] alone -> 0
    torch.testing.assert_close(rloo_advantages(r, ["x", "x", "x", "y"]), t([-1.5, 0.0, 1.5, 0.0]), **TOL)
    gen = torch.Generator().manual_seed(1)
    r = torch.randn(30, generator=gen, dtype=torch.float64)
    g = torch.randint(0, 5, (30,), generator=gen)
    got = rloo_advantages(r, g)
    for i in range(30):
        others = [r[j].item() for j in range(30) if g[j] == g[i] and j != i]
        want = r[i].item() - sum(others) / len(others) if others else 0.0
        assert abs(got[i].item() - want) < 1e-9


def test_reinforce_pp_matches_loop():
    gen = torch.Generator().manual_seed(2)
    r = torch.randn(16, generator=gen, dtype=torch.float64)
    g = [i // 4 for i in range(16)]
    got = reinforce_pp_advantages(r, g)
    centred = []
    for i in range(16):
        grp = [r[j].item() for j in range(16) if g[j] == g[i]]
        centred.append(r[i].item() - sum(grp) / len(grp))
    mu, sd = statistics.mean(centred), statistics.stdev(centred)
    torch.testing.assert_close(got, t([(c - mu) / math.sqrt(sd**2 + 1e-8) for c in centred]), **TOL)
    assert get_advantage_estimator("reinforce_pp") is reinforce_pp_advantages


def test_reinforce_pp_group_of_one_is_zero():
    r = t([1.0, 3.0, 2.0, 6.0, 100.0])
    adv = reinforce_pp_advantages(r, [0, 0, 1, 1, 2])
    assert adv[4] == 0
    # centred: [-1, 1, -2, 2]; mean 0; unbiased var (1+1+4+4)/3 = 10/3
    torch.testing.assert_close(adv[:4], t([-1, 1, -2, 2]) / math.sqrt(10 / 3 + 1e-8), **TOL)


def test_gdpo_by_hand():
    # one group of four samples, two binary rewards
    r = t([[1, 0], [0, 1], [1, 1], [0, 0]])
    # each column: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 / sqrt(1/3) = +-sqrt(3)/2 (eps aside)
    h = 0.5 / (math.sqrt(1 / 3) + EPS)
    summed = [h - h, -h + h, 2 * h, -2 * h]  # [0, 0, 2h, -2h]; batch mean 0; unbiased var 8h^2/3
    sd = math.sqrt(8 * h * h / 3 + 1e-8)
    torch.testing.assert_close(gdpo_advantages(r, [0, 0, 0, 0]), t([s / sd for s in summed]), **TOL)
    # GRPO on the summed reward [1, 1, 2, 0] cannot tell (1, 0) from (0, 1): same advantage
    grpo = group_advantages(r.sum(1), [0] * 4)
    assert grpo[0] == grpo[1]


def test_gdpo_weights():
    gen = torch.Generator().manual_seed(3)
    r = torch.randn(12, 3, generator=gen, dtype=torch.float64)
    g = [i // 4 for i in range(12)]
    w = [1.0, 0.5, 2.0]
    per = torch.stack([group_advantages(r[:, k], g) for k in range(3)], 1)
    s = (per * t(w)).sum(1)
    want = (s - s.mean()) / torch.sqrt(s.var() + 1e-8)
    torch.testing.assert_close(gdpo_advantages(r, g, weights=w), want, **TOL)
    with pytest.raises(ValueError, match="3 entries"):
        gdpo_advantages(r, g, weights=[1.0])


def test_gae_by_hand():
    rewards = t([[0.0, 0.0, 1.0]])
    values = t([[0.5, 0.5, 0.5]])
    mask = t([[1, 1, 1]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    # d2 = 1 + 0 - .5 = .5 ; d1 = 0 + .9*.5 - .5 = -.05 ; d0 = -.05
    # A2 = .5 ; A1 = -.05 + .72*.5 = .31 ; A0 = -.05 + .72*.31 = .1732
    torch.testing.assert_close(adv, t([[0.1732, 0.31, 0.5]]), **TOL)
    torch.testing.assert_close(ret, t([[0.6732, 0.81, 1.0]]), **TOL)


def _loop_gae(rewards, values, mask, gamma, lam):
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        pos = [i for i in range(rewards.shape[1]) if mask[b, i] > 0]
        nxt_v, nxt_a = 0.0, 0.0
        for i in reversed(pos):
            delta = rewards[b, i].item() + gamma * nxt_v - values[b, i].item()
            nxt_a = delta + gamma * lam * nxt_a
            nxt_v = values[b, i].item()
            adv[b, i] = nxt_a
    return adv


def test_gae_masked_matches_loop_and_whitens():
    gen = torch.Generator().manual_seed(4)
    B, T = 4, 9
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64)
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=gen) > 0.3).double()
    mask[2] = 0  # a fully masked row
    raw = _loop_gae(rewards, values, mask, 0.95, 0.9)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.95, lam=0.9, whiten=False)
    torch.testing.assert_close(adv, raw, **TOL)
    torch.testing.assert_close(ret, (raw + values) * mask, **TOL)
    wadv, _ = gae_advantages(rewards, values, mask, gamma=0.95, lam=0.9, whiten=True)
    vals = raw[mask > 0]
    want = torch.zeros_like(raw)
    want[mask > 0] = (vals - vals.mean()) / torch.sqrt(vals.var() + 1e-8)
    torch.testing.assert_close(wadv, want, **TOL)
    assert torch.isfinite(wadv).all()


def test_per_prompt_stat_tracker_by_hand():
    tr = PerPromptStatTracker(buffer_size=3, min_count=2)
    adv = tr.update(["a", "a", "b"], t([1.0, 3.0, 5.0]))
    # a: history [1, 3] (2 >= min_count): mean 2, pop std 1 -> [-1, 1] / (1 + eps)
    # b: history [5] (< min_count): batch mean 3, pop std sqrt(8/3) -> 2 / sqrt(8/3)
    torch.testing.assert_close(adv, t([-1 / (1 + EPS), 1 / (1 + EPS), 2 / (math.sqrt(8 / 3) + EPS)]), **TOL)
    adv = tr.update(["a"], t([5.0]))  # a: [1, 3, 5] -> mean 3, std sqrt(8/3)
    torch.testing.assert_close(adv, t([2 / (math.sqrt(8 / 3) + EPS)]), **TOL)
    state = tr.state_dict()
    adv = tr.update(["a"], t([7.0]))  # buffer 3 drops the 1: [3, 5, 7] -> mean 5
    torch.testing.assert_close(adv, t([2 / (math.sqrt(8 / 3) + EPS)]), **TOL)
    restored = PerPromptStatTracker(buffer_size=99, min_count=99)
    restored.load_state_dict(state)
    torch.testing.assert_close(restored.update(["a"], t([7.0])), adv, **TOL)
    tr.clear()
    assert tr.history == {}


def test_unknown_estimator_lists_names():
    with pytest.raises(ValueError) as e:
        get_advantage_estimator("grpoo")
    msg = str(e.value)
    assert "'grpo'" in msg and "rloo" in msg and "reinforce_pp" in msg


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="scale"):
        group_advantages(t([1.0, 2.0]), [0, 0], scale="global")
    with pytest.raises(ValueError, match="entries"):
        group_advantages(t([1.0, 2.0]), [0])
