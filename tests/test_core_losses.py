"""Policy losses and aggregation: hand arithmetic, gradients where clipping binds, loop references."""

import math

import pytest
import torch

from flowrl.core import aggregate_loss, get_policy_loss, gspo_loss, ppo_clip_loss, sequence_log_ratio

TOL = dict(rtol=0, atol=1e-9)
E = math.e


def t(x, **kw):
    return torch.tensor(x, dtype=torch.float64, **kw)


def test_ppo_clip_positive_advantage_by_hand():
    logp = t([0.5, -0.5, 0.1], requires_grad=True)
    old = t([0.0, 0.0, 0.0])
    loss, stats = ppo_clip_loss(logp, old, t([1.0, 1.0, 1.0]), clip_low=0.2)
    # ratio = [e^.5 = 1.6487, e^-.5 = 0.6065, e^.1 = 1.1052]
    # unclipped -A r = [-1.6487, -0.6065, -1.1052]; clipped -A clip(r, .8, 1.2) = [-1.2, -0.8, -1.1052]
    # max -> [-1.2, -0.6065, -1.1052]; clipping binds only on the first element
    torch.testing.assert_close(loss, t([-1.2, -math.exp(-0.5), -math.exp(0.1)]), **TOL)
    assert stats["clipfrac"].item() == pytest.approx(1 / 3, abs=1e-12)
    loss.sum().backward()
    # d(-A r)/d logp = -A r; the clipped branch (A > 0, r > 1 + eps) has zero gradient
    torch.testing.assert_close(logp.grad, t([0.0, -math.exp(-0.5), -math.exp(0.1)]), **TOL)


def test_ppo_clip_negative_advantage_and_dual_clip_by_hand():
    logp = t([0.5, -0.5, 0.1, 2.0], requires_grad=True)
    old = torch.zeros(4, dtype=torch.float64)
    adv = t([-1.0, -1.0, -1.0, -1.0])
    loss, _ = ppo_clip_loss(logp, old, adv)
    # unclipped r = [1.6487, .6065, 1.1052, 7.389]; clipped [1.2, .8, 1.1052, 1.2] -> max
    torch.testing.assert_close(loss, t([math.exp(0.5), 0.8, math.exp(0.1), math.exp(2.0)]), **TOL)
    loss_dc, stats = ppo_clip_loss(logp, old, adv, dual_clip=3.0)
    # dual clip caps the loss at -A c = 3 for A < 0: only e^2 = 7.389 exceeds it
    torch.testing.assert_close(loss_dc, t([math.exp(0.5), 0.8, math.exp(0.1), 3.0]), **TOL)
    assert stats["dual_clipfrac"].item() == pytest.approx(0.25, abs=1e-12)
    loss_dc.sum().backward()
    # grads: d(-A r) = r for the unclipped A<0 elements; 0 where clip (r < 1 - eps) or dual clip binds
    torch.testing.assert_close(logp.grad, t([math.exp(0.5), 0.0, math.exp(0.1), 0.0]), **TOL)


def test_dual_clip_leaves_positive_advantages_alone():
    logp = t([3.0])
    loss, _ = ppo_clip_loss(logp, t([0.0]), t([2.0]), dual_clip=3.0)
    torch.testing.assert_close(loss, t([-2.0 * 1.2]), **TOL)


def test_clip_higher_by_hand():
    logp = t([math.log(1.25), math.log(0.75)])
    old = t([0.0, 0.0])
    adv = t([1.0, -1.0])
    sym, _ = ppo_clip_loss(logp, old, adv, clip_low=0.2)
    # symmetric: r=1.25, A=1 -> -1.2 (clipped); r=.75, A=-1 -> max(.75, .8) = .8
    torch.testing.assert_close(sym, t([-1.2, 0.8]), **TOL)
    dapo, stats = ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    # clip-higher: 1.25 < 1.28 is no longer clipped -> -1.25; the low side is unchanged
    torch.testing.assert_close(dapo, t([-1.25, 0.8]), **TOL)
    assert stats["clipfrac"].item() == pytest.approx(0.5, abs=1e-12)


def test_ppo_ratio_one_on_policy_and_stats():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    adv = torch.randn(4, generator=gen, dtype=torch.float64)
    loss, stats = ppo_clip_loss(logp, logp.clone(), adv)
    torch.testing.assert_close(loss, (-adv)[:, None].expand(4, 6), **TOL)
    assert stats["ratio_mean"].item() == 1.0 and stats["approx_kl"].item() == 0.0
    assert stats["clipfrac"].item() == 0.0


def test_ppo_matches_elementwise_loop_with_mask_stats():
    gen = torch.Generator().manual_seed(1)
    logp = torch.randn(5, 7, generator=gen, dtype=torch.float64) * 0.4
    old = torch.randn(5, 7, generator=gen, dtype=torch.float64) * 0.4
    adv = torch.randn(5, generator=gen, dtype=torch.float64)
    mask = (torch.rand(5, 7, generator=gen) > 0.4).double()
    loss, stats = ppo_clip_loss(logp, old, adv, clip_low=0.1, clip_high=0.3, dual_clip=2.5, mask=mask)
    clipped_n = kl_sum = 0.0
    for b in range(5):
        for s in range(7):
            r = math.exp(logp[b, s].item() - old[b, s].item())
            a = adv[b].item()
            l1, l2 = -a * r, -a * min(max(r, 0.9), 1.3)
            want = max(l1, l2)
            if a < 0:
                want = min(want, -a * 2.5)
            assert abs(loss[b, s].item() - want) < 1e-12
            if mask[b, s]:
                clipped_n += l2 > l1
                kl_sum += (r - 1) - math.log(r)
    n = mask.sum().item()
    assert abs(stats["clipfrac"].item() - clipped_n / n) < 1e-12
    assert abs(stats["approx_kl"].item() - kl_sum / n) < 1e-12


def test_ppo_float32_in_float32_out_and_bf16_upcast():
    logp = torch.zeros(3, dtype=torch.bfloat16)
    loss, _ = ppo_clip_loss(logp, logp, torch.ones(3))
    assert loss.dtype == torch.float32
    loss32, _ = ppo_clip_loss(torch.zeros(3), torch.zeros(3), torch.ones(3))
    assert loss32.dtype == torch.float32


def test_huge_log_ratio_stays_finite():
    loss, stats = ppo_clip_loss(t([500.0, -500.0]), t([0.0, 0.0]), t([-1.0, 1.0]))
    assert torch.isfinite(loss).all() and all(torch.isfinite(v) for v in stats.values())


def test_bad_clip_arguments():
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(t([0.0]), t([0.0]), t([1.0]), dual_clip=0.5)
    with pytest.raises(ValueError, match=">= 0"):
        ppo_clip_loss(t([0.0]), t([0.0]), t([1.0]), clip_low=-0.1)


def test_sequence_log_ratio_value_and_gradient():
    logp = t([[0.2, -0.4, 1.0], [0.3, 0.1, 0.0]], requires_grad=True)
    old = t([[0.0, 0.0, 0.0], [0.1, 0.1, 0.1]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    slr = sequence_log_ratio(logp, old, mask)
    # row 0: mean of (0.2, -0.4) = -0.1 ; row 1: mean of (0.2, 0.0, -0.1) = 0.1/3
    torch.testing.assert_close(slr.detach(), t([[-0.1] * 3, [0.1 / 3] * 3]), **TOL)
    slr.sum().backward()
    torch.testing.assert_close(logp.grad, torch.ones(2, 3, dtype=torch.float64), **TOL)


def test_gspo_gradient_equals_sequence_objective():
    # GSPO's objective per sequence: -A_i * s_i with s_i = exp(mean_t log ratio), aggregated over sequences.
    # With no clipping (wide range) its gradient must equal the GSPO-token loss with seq-mean-token-mean.
    gen = torch.Generator().manual_seed(2)
    logp = (torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.1).requires_grad_()
    old = torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.1
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    adv = t([1.0, -0.5, 2.0])
    loss, _ = gspo_loss(logp, old, adv, mask=mask, clip_low=10.0, clip_high=10.0)
    aggregate_loss(loss, mask, "seq-mean-token-mean").backward()
    g_token = logp.grad.clone()
    logp.grad = None
    s = torch.exp(((logp - old) * mask).sum(1) / mask.sum(1))
    (-(adv * s)).mean().backward()
    torch.testing.assert_close(g_token, logp.grad, **TOL)
    assert get_policy_loss("gspo") is gspo_loss


def test_gspo_clips_on_the_sequence_ratio():
    logp = t([[0.01, 0.01]])
    loss, stats = gspo_loss(logp, torch.zeros(1, 2, dtype=torch.float64), t([1.0]))
    # s = e^0.01 = 1.01005 > 1 + 4e-4 -> clipped for A > 0: loss = -(1 + 4e-4) at both tokens
    torch.testing.assert_close(loss, t([[-(1 + 4e-4)] * 2]), **TOL)
    assert stats["clipfrac"].item() == 1.0


def test_aggregate_loss_modes_by_hand():
    loss = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row is fully masked
    # token-mean: (1 + 2 + 4) / 3
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 3, abs=1e-12)
    # seq-mean-token-sum: rows with tokens: (3 + 4) / 2
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(3.5, abs=1e-12)
    # seq-mean-token-mean: (3/2 + 4/1) / 2
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.75, abs=1e-12)
    # seq-mean-token-sum-norm (verl): (1 + 2 + 4) / 3, no division by B; with horizon 10: 7 / 10
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(7 / 3, abs=1e-12)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", horizon=10).item() == pytest.approx(0.7, abs=1e-12)
    # seq-mean-token-sum-max-len (Dr.GRPO's 1/G): (3/3 + 4/3) / 2 ; with horizon 10: (3/10 + 4/10) / 2
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-max-len").item() == pytest.approx(7 / 6, abs=1e-12)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-max-len", horizon=10).item() == pytest.approx(0.35, abs=1e-12)


def test_verl_token_sum_norm_scales_with_the_batch_and_dr_grpo_form_does_not():
    # verl's seq-mean-token-sum-norm is a sum over the batch: doubling the batch (same rows twice) doubles it;
    # Dr.GRPO's 1/G form is a mean over sequences: unchanged
    loss = t([[0.5, -1.0, 2.0, 0.25]])
    mask = t([[1, 1, 1, 0]])
    once = aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item()
    assert once == pytest.approx((0.5 - 1.0 + 2.0) / 4, abs=1e-12)
    twice = aggregate_loss(loss.repeat(2, 1), mask.repeat(2, 1), "seq-mean-token-sum-norm").item()
    assert twice == pytest.approx(2 * once, abs=1e-12)
    drg = aggregate_loss(loss.repeat(2, 1), mask.repeat(2, 1), "seq-mean-token-sum-max-len").item()
    assert drg == pytest.approx(once, abs=1e-12)


@pytest.mark.parametrize(
    "mode",
    [
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
        "seq-mean-token-sum-max-len",
    ],
)
def test_aggregate_fully_masked_never_nan(mode):
    loss = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    out = aggregate_loss(loss, torch.zeros(2, 4), mode)
    assert out.item() == 0.0
    out.backward()
    assert torch.isfinite(loss.grad).all()


def test_aggregate_matches_loop_on_random_masks():
    gen = torch.Generator().manual_seed(3)
    loss = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, 8, generator=gen) > 0.5).double()
    mask[1] = 0
    rows = [[loss[b, s].item() for s in range(8) if mask[b, s]] for b in range(6)]
    nonempty = [r for r in rows if r]
    flat = [x for r in rows for x in r]
    want = {
        "token-mean": sum(flat) / len(flat),
        "seq-mean-token-sum": sum(sum(r) for r in nonempty) / len(nonempty),
        "seq-mean-token-mean": sum(sum(r) / len(r) for r in nonempty) / len(nonempty),
        "seq-mean-token-sum-norm": sum(flat) / 8,
        "seq-mean-token-sum-max-len": sum(sum(r) / 8 for r in nonempty) / len(nonempty),
    }
    for mode, w in want.items():
        assert abs(aggregate_loss(loss, mask, mode).item() - w) < 1e-12, mode


def test_unknown_names():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "mean")
    with pytest.raises(ValueError, match="ppo_clip"):
        get_policy_loss("ppo")


@pytest.mark.parametrize(
    "mode",
    [
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
        "seq-mean-token-sum-max-len",
    ],
)
def test_micro_batches_with_the_minibatch_normalizer_add_up_to_the_minibatch(mode):
    """Split a minibatch's rows in micro-batches: with the whole minibatch's normalizer, their aggregates (and so
    their gradients) sum to the minibatch's aggregate, whatever the masks."""
    from flowrl.core import loss_normalizer

    gen = torch.Generator().manual_seed(11)
    loss = torch.randn(8, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(8, 6, generator=gen) > 0.4).double()
    mask[3] = 0  # a fully masked row
    whole = aggregate_loss(loss, mask, mode)
    norm = loss_normalizer(mask, mode, length=6)
    parts = [
        aggregate_loss(loss[rows], mask[rows], mode, normalizer=norm)
        for rows in (slice(0, 3), slice(3, 5), slice(5, 8))
    ]
    assert abs(sum(p.item() for p in parts) - whole.item()) < 1e-12
    (g_whole,) = torch.autograd.grad(whole, loss)
    (g_parts,) = torch.autograd.grad(sum(parts), loss)
    torch.testing.assert_close(g_parts, g_whole, rtol=0, atol=1e-12)
    # a micro-batch's own normalizer would not do for the modes that count: the test can tell the two apart
    own = sum(aggregate_loss(loss[r], mask[r], mode) for r in (slice(0, 3), slice(3, 5), slice(5, 8)))
    if mode != "seq-mean-token-sum-norm":
        assert abs(own.item() - whole.item()) > 1e-6
