"""Forward-process objectives (DiffusionNFT, AWM, online Diffusion-DPO): hand arithmetic, element loops in plain
Python, the NFT optimum re-derived, gradient directions, pair selection edge cases and dtypes."""

import math

import pytest
import torch

from flowrl.core import (
    OBJECTIVE_LOSSES,
    attribute_shift,
    awm_loss,
    awm_matching_loss,
    best_worst_pairs,
    crd_loss,
    dpo_loss,
    forward_noising,
    get_objective_loss,
    group_advantages,
    matched_pairs,
    nft_loss,
    optimality_probability,
    ranked_pairs,
    soft_update_,
    soft_update_decay,
    stratified_times,
)

TOL = dict(rtol=0, atol=1e-12)


def t64(x, **kw):
    return torch.tensor(x, dtype=torch.float64, **kw)


def randn(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def msq(xs):  # the per-sample ||.||^2 of the module, as a plain-Python mean of squares
    return sum(x * x for x in xs) / len(xs)


# --------------------------------------------------------------------------------------------- forward process


def test_forward_noising_by_hand():
    # x0 = [1, -1], eps = [.5, .5], t = .5: x_t = .5 x0 + .5 eps = [.75, -.25]; v = eps - x0 = [-.5, 1.5]
    # second sample at t = 1 is pure noise: x_t = eps = [2, 3]
    x_t, v = forward_noising(t64([[1.0, -1.0], [4.0, 4.0]]), t64([[0.5, 0.5], [2.0, 3.0]]), t64([0.5, 1.0]))
    torch.testing.assert_close(x_t, t64([[0.75, -0.25], [2.0, 3.0]]), **TOL)
    torch.testing.assert_close(v, t64([[-0.5, 1.5], [-2.0, -1.0]]), **TOL)
    # x0 = x_t - t v recovers the data
    torch.testing.assert_close(x_t - t64([[0.5], [1.0]]) * v, t64([[1.0, -1.0], [4.0, 4.0]]), **TOL)


def test_stratified_times_by_hand():
    # the schedule 1, .75, .5, .25 (0 after its last step): step 0 spans (.75, 1], step 3 (0, .25]
    times = t64([1.0, 0.75, 0.5, 0.25])
    steps = torch.tensor([[0, 3], [1, 2]])
    u = t64([[0.5, 0.2], [0.0, 0.999]])
    got = stratified_times(times, steps, u)
    # t_k - u (t_k - t_{k+1}): 1 - .5 x .25, .25 - .2 x .25; u = 0 is the step's own time; u -> 1 nears t_{k+1}
    torch.testing.assert_close(got, t64([[0.875, 0.2], [0.75, 0.5 - 0.999 * 0.25]]), **TOL)
    assert got.dtype == torch.float64


def test_stratified_times_fill_each_interval_uniformly():
    # an uneven (shifted) schedule: u uniform on a grid of 1000 points puts the times evenly in each interval, and
    # every time stays inside its own step's interval (the last step's down to 0)
    times = torch.tensor([1.0, 0.9, 0.6, 0.1])
    ends = [0.9, 0.6, 0.1, 0.0]
    u = (torch.arange(1000, dtype=torch.float32) + 0.5) / 1000
    for k in range(4):
        got = stratified_times(times, torch.full((1000,), k), u)
        assert float(got.max()) <= float(times[k]) and float(got.min()) > ends[k]
        assert float(got.mean()) == pytest.approx((float(times[k]) + ends[k]) / 2, abs=1e-5)


@pytest.mark.parametrize(
    "times, u, match",
    [
        ([1.0, 1.0, 0.5], 0.5, "decrease strictly"),
        ([0.5, 0.75], 0.5, "decrease strictly"),
        ([1.0, 0.5, 0.0], 0.5, "decrease strictly"),
        ([1.5, 0.5], 0.5, "decrease strictly"),
        ([1.0, 0.5], 1.0, r"u must lie in \[0, 1\)"),
        ([1.0, 0.5], -0.1, r"u must lie in \[0, 1\)"),
    ],
)
def test_stratified_times_refuses_what_is_not_a_flow_schedule(times, u, match):
    with pytest.raises(ValueError, match=match):
        stratified_times(torch.tensor(times), torch.tensor([0]), torch.tensor([u]))
    with pytest.raises(ValueError, match="one shape"):
        stratified_times(torch.tensor([1.0, 0.5]), torch.tensor([0, 1]), torch.tensor([0.5]))


# -------------------------------------------------------------------------------------------------- NFT: r


def test_optimality_probability_by_hand_and_clipping():
    adv = t64([-7.0, -5.0, -2.5, 0.0, 1.0, 5.0, 12.0])
    # r = 1/2 + 1/2 clip(A / 5, -1, 1): A <= -5 -> 0, A >= 5 -> 1, A = 0 -> 1/2
    torch.testing.assert_close(optimality_probability(adv), t64([0.0, 0.0, 0.25, 0.5, 0.6, 1.0, 1.0]), **TOL)
    torch.testing.assert_close(optimality_probability(t64([1.0, -3.0]), clip=2.0), t64([0.75, 0.0]), **TOL)
    with pytest.raises(ValueError, match="clip"):
        optimality_probability(adv, clip=0.0)


def test_optimality_probability_matches_the_papers_r_with_global_std():
    # the reference's r: 1/2 + 1/2 clip((r_raw - mean of the prompt) / Z, -1, 1) with Z = 5 (population std of
    # the whole batch + 1e-4), recomputed here element by element
    raw = [0.1, 0.9, 0.4, 2.0, 2.5, -1.0, 7.0, 7.5]
    ids = ["a", "a", "a", "b", "b", "b", "c", "c"]
    mu = sum(raw) / len(raw)
    std = math.sqrt(sum((x - mu) ** 2 for x in raw) / len(raw))
    want = []
    for x, g in zip(raw, ids):
        group = [y for y, h in zip(raw, ids) if h == g]
        z = (x - sum(group) / len(group)) / (5 * (std + 1e-4))
        want.append(0.5 + 0.5 * max(-1.0, min(1.0, z)))
    adv = group_advantages(t64(raw), ids, scale="batch", unbiased=False, eps=1e-4)
    torch.testing.assert_close(optimality_probability(adv), t64(want), **TOL)


# ----------------------------------------------------------------------------------------------- NFT: loss


def nft_case():
    # one sample: x0 = [1, -1], eps = [.5, .5], t = .5 -> x_t = [.75, -.25], v = [-.5, 1.5]
    # v_theta = [0, 1], v_old = [1, 0]
    return dict(
        velocity=t64([[0.0, 1.0]]),
        old_velocity=t64([[1.0, 0.0]]),
        x0=t64([[1.0, -1.0]]),
        noise=t64([[0.5, 0.5]]),
        t=t64([0.5]),
    )


def test_nft_unweighted_by_hand():
    # beta = .5: v+ = .5 v_old + .5 v_theta = [.5, .5]; v- = 1.5 v_old - .5 v_theta = [1.5, -.5]
    # v+ - v = [1, -1] -> ||.||^2 = 1;  v- - v = [2, -2] -> 4
    # r = .75: (.75 * 1 + .25 * 4) / beta = 1.75 / .5 = 3.5
    loss, stats = nft_loss(**nft_case(), r=t64([0.75]), beta=0.5, adaptive_weight=False)
    torch.testing.assert_close(loss, t64([3.5]), **TOL)
    assert stats["positive_loss"].item() == pytest.approx(1.0, abs=1e-12)
    assert stats["negative_loss"].item() == pytest.approx(4.0, abs=1e-12)
    # ||v_theta - v_old||^2 = ([-1, 1]^2).mean() = 1
    assert stats["old_deviation"].item() == pytest.approx(1.0, abs=1e-12)
    assert stats["r_mean"].item() == pytest.approx(0.75, abs=1e-12)


def test_nft_adaptive_weight_by_hand():
    # x0-space: x0+ = x_t - t v+ = [.75 - .25, -.25 - .25] = [.5, -.5]; x0+ - x0 = [-.5, .5]
    #   ||.||^2 = .25, mean |.| = .5 -> .5
    # x0- = x_t - t v- = [.75 - .75, -.25 + .25] = [0, 0]; x0- - x0 = [-1, 1] -> 1 / 1 = 1
    # r = .75, beta = .5: (.75 * .5 + .25 * 1) / .5 = 1.25; policy_scale 5 -> 6.25
    loss, stats = nft_loss(**nft_case(), r=t64([0.75]), beta=0.5)
    torch.testing.assert_close(loss, t64([1.25]), **TOL)
    assert stats["positive_loss"].item() == pytest.approx(0.5, abs=1e-12)
    assert stats["negative_loss"].item() == pytest.approx(1.0, abs=1e-12)
    scaled, _ = nft_loss(**nft_case(), r=t64([0.75]), beta=0.5, policy_scale=5.0)
    torch.testing.assert_close(scaled, t64([6.25]), **TOL)


def test_nft_kl_term_by_hand():
    # v_theta - v_ref = [0, 1] - [2, 1] = [-2, 0] -> ||.||^2 = 2; kl_coef .1 adds .2 to the 3.5 above
    loss, stats = nft_loss(
        **nft_case(), r=t64([0.75]), beta=0.5, adaptive_weight=False, ref_velocity=t64([[2.0, 1.0]]), kl_coef=0.1
    )
    torch.testing.assert_close(loss, t64([3.7]), **TOL)
    assert stats["kl"].item() == pytest.approx(2.0, abs=1e-12)


@pytest.mark.parametrize("adaptive", [False, True])
def test_nft_matches_elementwise_loop(adaptive):
    gen = torch.Generator().manual_seed(3)
    B, C, H = 4, 2, 3
    v, v_old, v_ref = randn(B, C, H, gen=gen), randn(B, C, H, gen=gen), randn(B, C, H, gen=gen)
    x0, eps = randn(B, C, H, gen=gen), randn(B, C, H, gen=gen)
    t = torch.rand(B, generator=gen, dtype=torch.float64)
    r = t64([0.0, 0.3, 0.8, 1.0])
    beta, kl_coef, scale = 0.3, 0.05, 2.0
    loss, _ = nft_loss(
        v,
        v_old,
        x0,
        eps,
        t,
        r,
        beta=beta,
        adaptive_weight=adaptive,
        ref_velocity=v_ref,
        kl_coef=kl_coef,
        policy_scale=scale,
    )
    for b in range(B):
        tb = t[b].item()
        pos_err, neg_err, kl = [], [], []
        for c in range(C):
            for h in range(H):
                vt, vo, x, e = v[b, c, h].item(), v_old[b, c, h].item(), x0[b, c, h].item(), eps[b, c, h].item()
                xt = (1 - tb) * x + tb * e
                vp = (1 - beta) * vo + beta * vt
                vn = (1 + beta) * vo - beta * vt
                if adaptive:  # errors of the x0 predictions
                    pos_err.append(xt - tb * vp - x)
                    neg_err.append(xt - tb * vn - x)
                else:  # errors against the target velocity
                    pos_err.append(vp - (e - x))
                    neg_err.append(vn - (e - x))
                kl.append(vt - v_ref[b, c, h].item())
        pos, neg = msq(pos_err), msq(neg_err)
        if adaptive:
            pos /= max(sum(abs(a) for a in pos_err) / len(pos_err), 1e-5)
            neg /= max(sum(abs(a) for a in neg_err) / len(neg_err), 1e-5)
        rb = r[b].item()
        want = scale * (rb * pos + (1 - rb) * neg) / beta + kl_coef * msq(kl)
        assert abs(loss[b].item() - want) < 1e-12


def test_nft_beta_one_positive_policy_is_the_trained_one():
    # beta = 1: v+ = v_theta, so r = 1 is plain flow matching: loss ||v_theta - v||^2, gradient 2 (v_theta - v) / D
    gen = torch.Generator().manual_seed(4)
    v = randn(2, 6, gen=gen).requires_grad_()
    v_old, x0, eps = randn(2, 6, gen=gen), randn(2, 6, gen=gen), randn(2, 6, gen=gen)
    t = t64([0.3, 0.9])
    loss, _ = nft_loss(v, v_old, x0, eps, t, t64([1.0, 1.0]), beta=1.0, adaptive_weight=False)
    target = eps - x0
    torch.testing.assert_close(loss, ((v - target) ** 2).mean(1), **TOL)
    loss.sum().backward()
    torch.testing.assert_close(v.grad, 2 * (v - target).detach() / 6, **TOL)


@pytest.mark.parametrize("adaptive", [False, True])
def test_nft_gradient_moves_toward_target_for_r1_and_away_for_r0(adaptive):
    gen = torch.Generator().manual_seed(5)
    x0, eps = randn(3, 8, gen=gen), randn(3, 8, gen=gen)
    t = t64([0.2, 0.5, 0.8])
    target = eps - x0
    v_old = target + randn(3, 8, gen=gen)  # the old policy misses the target
    for r_value, closer in ((1.0, True), (0.0, False)):
        v = v_old.clone().requires_grad_()  # on-policy start: v_theta = v_old
        loss, _ = nft_loss(
            v, v_old, x0, eps, t, torch.full((3,), r_value, dtype=torch.float64), beta=0.5, adaptive_weight=adaptive
        )
        loss.sum().backward()
        step = -1e-3 * v.grad
        before = ((v_old - target) ** 2).sum(1)
        after = ((v_old + step - target) ** 2).sum(1)
        assert bool((after < before).all()) if closer else bool((after > before).all())
        # the step is along the target direction: +(v - v_old) for r = 1, +(v_old - v) for r = 0
        direction = (target - v_old) if closer else (v_old - target)
        cos = torch.nn.functional.cosine_similarity(step, direction, dim=1)
        torch.testing.assert_close(cos, torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-12)


def test_nft_minimiser_is_the_papers_optimum():
    # One shared x_t whose K data targets u_k carry optimality r_k. With v_old = E[u] (the old policy fits its own
    # data), the paper's optimum is v* = v_old + (2 / beta) (E[r u] - E[r] E[u]). The unweighted loss averaged over
    # the K samples is quadratic in v_theta with curvature 2 beta / D per coordinate (the 1/beta scaling included),
    # so one Newton step from any start lands on the minimiser.
    gen = torch.Generator().manual_seed(6)
    K, D, beta = 7, 5, 0.4
    u = randn(K, D, gen=gen)
    r = torch.rand(K, generator=gen, dtype=torch.float64)
    v_old = u.mean(0, keepdim=True).expand(K, D)
    start = randn(1, D, gen=gen).requires_grad_()
    # eps = 0 and x0 = -u make the target eps - x0 = u; t does not enter the unweighted loss
    loss, _ = nft_loss(
        start.expand(K, D),
        v_old,
        -u,
        torch.zeros(K, D, dtype=torch.float64),
        torch.full((K,), 0.5, dtype=torch.float64),
        r,
        beta=beta,
        adaptive_weight=False,
    )
    loss.mean().backward()
    v_star = start.detach() - start.grad * D / (2 * beta)
    want = u.mean(0) + 2 / beta * ((r[:, None] * u).mean(0) - r.mean() * u.mean(0))
    torch.testing.assert_close(v_star[0], want, rtol=0, atol=1e-12)


def test_nft_adaptive_weight_is_detached_and_t_scaled():
    # r = 1, beta = 1: loss = t ||e||^2 / sg(mean |e|) with e = v_theta - v (x0-space error = -t e);
    # gradient with the denominator held constant: 2 t e / (D mean |e|)
    gen = torch.Generator().manual_seed(7)
    v = randn(2, 4, gen=gen).requires_grad_()
    x0, eps, v_old = randn(2, 4, gen=gen), randn(2, 4, gen=gen), randn(2, 4, gen=gen)
    t = t64([0.25, 0.75])
    loss, _ = nft_loss(v, v_old, x0, eps, t, t64([1.0, 1.0]), beta=1.0)
    e = (v - (eps - x0)).detach()
    scale = e.abs().mean(1)
    torch.testing.assert_close(loss, t * (e**2).mean(1) / scale, **TOL)
    loss.sum().backward()
    torch.testing.assert_close(v.grad, 2 * t[:, None] * e / (4 * scale[:, None]), **TOL)


def test_nft_floor_at_t_zero_and_no_gradient_to_the_old_policy():
    # t = 0: x0+ = x_t = x0 exactly, the error is 0 and its scale floors at 1e-5: loss 0, gradient 0, no NaN
    v = t64([[0.3, -0.2]], requires_grad=True)
    v_old = t64([[0.1, 0.4]], requires_grad=True)
    loss, stats = nft_loss(v, v_old, t64([[1.0, 2.0]]), t64([[0.0, 1.0]]), t64([0.0]), t64([0.5]))
    assert loss.item() == 0.0 and all(torch.isfinite(s) for s in stats.values())
    loss.sum().backward()
    assert torch.equal(v.grad, torch.zeros_like(v)) and v_old.grad is None


def test_nft_rejects_bad_arguments():
    case = nft_case()
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        nft_loss(**case, r=t64([1.2]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        nft_loss(**case, r=t64([-0.1]))
    with pytest.raises(ValueError, match="beta"):
        nft_loss(**case, r=t64([0.5]), beta=0.0)
    with pytest.raises(ValueError, match="shapes differ"):
        nft_loss(**{**case, "old_velocity": t64([[1.0, 0.0, 0.0]])}, r=t64([0.5]))
    with pytest.raises(ValueError, match="t must be"):
        nft_loss(**{**case, "t": t64([0.5, 0.5])}, r=t64([0.5]))


# ------------------------------------------------------------------------------------- NFT: old-policy update


def test_soft_update_decay_schedules():
    # default (reference decay_type 1): min(1e-3 step, .5)
    assert [soft_update_decay(s) for s in (0, 1, 100, 499, 500, 10_000)] == pytest.approx(
        [0.0, 0.001, 0.1, 0.499, 0.5, 0.5], abs=1e-15
    )
    # OCR (decay_type 2): 0 before step 75, then min(7.5e-3 (step - 75), .999)
    ocr = dict(rate=0.0075, cap=0.999, start=75)
    assert [soft_update_decay(s, **ocr) for s in (0, 74, 75, 175, 10_000)] == pytest.approx(
        [0.0, 0.0, 0.0, 0.75, 0.999], abs=1e-15
    )


def test_soft_update_by_hand_and_dtypes():
    old = [t64([1.0, 2.0]), torch.nn.Parameter(t64([[0.0]]))]
    new = [t64([3.0, 6.0]), torch.nn.Parameter(t64([[4.0]]))]
    soft_update_(old, new, 0.25)
    # .25 old + .75 new: [.25 + 2.25, .5 + 4.5] = [2.5, 5]; [0 + 3] = [3]
    torch.testing.assert_close(old[0], t64([2.5, 5.0]), **TOL)
    torch.testing.assert_close(old[1].detach(), t64([[3.0]]), **TOL)
    assert not old[1].requires_grad or old[1].grad is None
    # decay 1 keeps the old policy, decay 0 copies the current one
    soft_update_(old, new, 1.0)
    torch.testing.assert_close(old[0], t64([2.5, 5.0]), **TOL)
    soft_update_(old, new, 0.0)
    torch.testing.assert_close(old[0], new[0], **TOL)
    # a bf16 old copy stays bf16; the blend (computed in float32) of 1 and 2 at .5 is 1.5, exact in bf16
    low = [torch.ones(3, dtype=torch.bfloat16)]
    soft_update_(low, [torch.full((3,), 2.0)], 0.5)
    assert low[0].dtype == torch.bfloat16 and torch.equal(low[0].float(), torch.full((3,), 1.5))


def test_soft_update_rejects_bad_arguments():
    a = t64([1.0])
    with pytest.raises(ValueError, match="decay"):
        soft_update_([a], [t64([2.0])], 1.5)
    with pytest.raises(ValueError, match="old tensors"):
        soft_update_([a], [], 0.5)
    with pytest.raises(ValueError, match="shapes differ"):
        soft_update_([a], [t64([1.0, 2.0])], 0.5)
    with pytest.raises(ValueError, match="own copy"):
        soft_update_([a], [a], 0.5)


# ------------------------------------------------------------------------------------------------------- AWM


def test_awm_matching_loss_by_hand():
    fm, t = t64([0.25, 4.0]), t64([0.5, 0.5])
    d = 1e-10
    torch.testing.assert_close(awm_matching_loss(fm, t, "uniform"), t64([0.25, 4.0]), **TOL)
    torch.testing.assert_close(awm_matching_loss(fm, t, "t"), t64([0.125, 2.0]), **TOL)
    torch.testing.assert_close(awm_matching_loss(fm, t, "t2"), t64([0.0625, 1.0]), **TOL)
    # huber: t (sqrt(l + d) - sqrt(d))
    torch.testing.assert_close(
        awm_matching_loss(fm, t, "huber"),
        t64([0.5 * (math.sqrt(0.25 + d) - 1e-5), 0.5 * (math.sqrt(4 + d) - 1e-5)]),
        **TOL,
    )
    # ghuber p = .25: t / p ((l + d)^p - d^p) = 2 ((l + d)^.25 - 10^-2.5)
    torch.testing.assert_close(
        awm_matching_loss(fm, t, "ghuber", 0.25),
        t64([2 * ((0.25 + d) ** 0.25 - 10**-2.5), 2 * ((4 + d) ** 0.25 - 10**-2.5)]),
        **TOL,
    )
    # huber is ghuber at p = 1/2, halved
    torch.testing.assert_close(awm_matching_loss(fm, t, "huber"), awm_matching_loss(fm, t, "ghuber", 0.5) / 2, **TOL)
    with pytest.raises(ValueError, match="unknown AWM weighting"):
        awm_matching_loss(fm, t, "elbo")


def test_awm_ghuber_gradient_downweights_large_errors():
    # dm/dl = t (l + d)^(p - 1): a 16x larger error gets 16^-.75 = 1/8 of the weight at p = .25
    fm = t64([0.25, 4.0], requires_grad=True)
    t = t64([0.4, 0.4])
    awm_matching_loss(fm, t, "ghuber", 0.25).sum().backward()
    torch.testing.assert_close(fm.grad, 0.4 * (fm.detach() + 1e-10) ** -0.75, **TOL)
    assert fm.grad[1].item() == pytest.approx(fm.grad[0].item() / 8, rel=1e-9)


@pytest.mark.parametrize("weighting", ["uniform", "t", "t2", "huber", "ghuber"])
def test_awm_on_policy_value_and_gradient_are_advantage_weighted_matching(weighting):
    gen = torch.Generator().manual_seed(8)
    B, D = 3, 4
    v = randn(B, D, gen=gen).requires_grad_()
    x0, eps = randn(B, D, gen=gen), randn(B, D, gen=gen)
    t = t64([0.1, 0.5, 0.9])
    adv = t64([10.0, -2.5, 0.5])  # clipped to +-5 then / 5: [1, -.5, .1]
    loss, stats = awm_loss(v, x0, eps, t, adv, weighting=weighting)
    a = t64([1.0, -0.5, 0.1])
    torch.testing.assert_close(loss, -a, **TOL)  # on-policy: rho = 1, the surrogate's value is -A
    assert stats["ratio_mean"].item() == 1.0 and stats["clipfrac"].item() == 0.0
    loss.sum().backward()
    g = v.grad.clone()
    # independent: A * m(||v - (eps - x0)||^2, t) summed, differentiated directly
    v.grad = None
    m = awm_matching_loss(((v - (eps - x0)) ** 2).mean(1), t, weighting)
    (a * m).sum().backward()
    torch.testing.assert_close(g, v.grad, rtol=0, atol=1e-12)
    # advantage_clip=None passes A through unchanged
    raw, _ = awm_loss(v, x0, eps, t, adv, weighting=weighting, advantage_clip=None)
    torch.testing.assert_close(raw, -adv, **TOL)


def test_awm_gradient_direction_follows_the_advantage_sign():
    gen = torch.Generator().manual_seed(9)
    x0, eps = randn(2, 6, gen=gen), randn(2, 6, gen=gen)
    target = eps - x0
    v = (target + randn(2, 6, gen=gen)).requires_grad_()
    loss, _ = awm_loss(v, x0, eps, t64([0.5, 0.5]), t64([2.0, -2.0]))
    loss.sum().backward()
    moved = v.detach() - 1e-3 * v.grad
    before, after = ((v.detach() - target) ** 2).sum(1), ((moved - target) ** 2).sum(1)
    assert after[0] < before[0] and after[1] > before[1]  # A > 0: toward the target; A < 0: away


def test_awm_off_policy_ratio_clipping_by_loop():
    gen = torch.Generator().manual_seed(10)
    B, D = 4, 3
    v, v_old = randn(B, D, gen=gen), randn(B, D, gen=gen)
    x0, eps = randn(B, D, gen=gen), randn(B, D, gen=gen)
    t = t64([0.2, 0.4, 0.6, 0.8])
    adv = t64([1.0, -1.0, 3.0, -4.0])
    c = 0.05
    loss, stats = awm_loss(v, x0, eps, t, adv, old_velocity=v_old, weighting="t", clip_range=c, advantage_clip=None)
    clipped = 0
    for b in range(B):
        tb = t[b].item()
        target = [eps[b, j].item() - x0[b, j].item() for j in range(D)]
        m = tb * msq([v[b, j].item() - target[j] for j in range(D)])
        m_old = tb * msq([v_old[b, j].item() - target[j] for j in range(D)])
        rho, a = math.exp(m_old - m), adv[b].item()
        l1, l2 = -a * rho, -a * min(max(rho, 1 - c), 1 + c)
        assert abs(loss[b].item() - max(l1, l2)) < 1e-12
        clipped += l2 > l1
    assert stats["clipfrac"].item() == pytest.approx(clipped / B, abs=1e-12)
    assert 0 < clipped  # the case exercises the clip


def test_awm_kl_terms_by_hand():
    # one sample; the KL terms add kl_coef ||v - v_ref||^2 + ema_kl_coef ||v - v_ema||^2 to the policy term -A
    v = t64([[1.0, 1.0]])
    loss, stats = awm_loss(
        v,
        t64([[0.0, 0.0]]),
        t64([[1.0, 1.0]]),
        t64([0.5]),
        t64([5.0]),
        ref_velocity=t64([[0.0, 3.0]]),
        kl_coef=0.1,
        ema_velocity=t64([[1.0, 0.0]]),
        ema_kl_coef=1.0,
    )
    # A' = 1; ||[1, -2]||^2 = 2.5; ||[0, 1]||^2 = .5: -1 + .25 + .5 = -.25
    torch.testing.assert_close(loss, t64([-0.25]), **TOL)
    assert stats["kl"].item() == pytest.approx(2.5, abs=1e-12)
    assert stats["ema_kl"].item() == pytest.approx(0.5, abs=1e-12)
    # the target is eps - x0 = [1, 1] = v: no matching error
    assert stats["fm_error"].item() == 0.0


def test_awm_rejects_bad_arguments():
    v = t64([[1.0, 1.0]])
    args = (v, v, v, t64([0.5]), t64([1.0]))
    with pytest.raises(ValueError, match="clip_range"):
        awm_loss(*args, clip_range=-1.0)
    with pytest.raises(ValueError, match="advantage_clip"):
        awm_loss(*args, advantage_clip=0.0)
    with pytest.raises(ValueError, match="ghuber_power"):
        awm_loss(*args, ghuber_power=0.0)
    with pytest.raises(ValueError, match="shapes differ"):
        awm_loss(*args, ref_velocity=t64([[1.0]]))


# ----------------------------------------------------------------------------------------------- DPO: pairs


def test_best_worst_pairs_ties_singletons_and_flat_groups():
    rewards = t64([1.0, 3.0, 3.0, 0.0, 0.0, 2.0, 2.0, 5.0, 0.5, 0.7])
    ids = ["a", "a", "a", "a", "a", "b", "b", "c", "d", "d"]
    w, l = best_worst_pairs(rewards, ids)
    # a: best 3.0 first at 1, worst 0.0 first at 3; b: all equal -> none; c: one sample -> none; d: 9 beats 8
    assert w.tolist() == [1, 9] and l.tolist() == [3, 8]
    assert w.dtype == torch.long and l.dtype == torch.long


def test_ranked_pairs_by_hand():
    """Group a [0.9, 0.1, 0.5, 0.5]: best-first 0, 2, 3, 1 and worst-first 1, 2, 3, 0: (0 over 1), then 2 against
    itself is not strict. Group b (0/1 rewards, 3 of 8 correct): best-first 4, 6, 9, 5, ... worst-first 5, 7, 8, 10,
    ...: 3 pairs, min(3, 5). Group c [0.2, 0.7]: one pair. A group of one or all equal: none."""
    rewards = t64([0.9, 0.1, 0.5, 0.5, 1, 0, 1, 0, 0, 1, 0, 0, 0.2, 0.7, 3.0, 2.0, 2.0])
    ids = ["a"] * 4 + ["b"] * 8 + ["c"] * 2 + ["d"] + ["e"] * 2
    w, l = ranked_pairs(rewards, ids)
    assert w.tolist() == [0, 4, 6, 9, 13] and l.tolist() == [1, 5, 7, 8, 12]
    assert w.dtype == torch.long and l.dtype == torch.long
    assert ranked_pairs(t64([]), [])[0].numel() == 0
    with pytest.raises(ValueError, match="NaN"):
        ranked_pairs(t64([1.0, float("nan")]), [0, 0])


def test_ranked_pairs_are_disjoint_strict_and_start_with_best_worst():
    """Random groups with many ties: every pair strictly ordered, no sample in two pairs, each group's first pair
    is best_worst_pairs', and as many pairs as a brute-force count of the rank pairing gives."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(1, 30, (1,), generator=gen))
        rewards = torch.randint(0, 3, (n,), generator=gen).double()
        ids = torch.randint(0, 4, (n,), generator=gen)
        w, l = ranked_pairs(rewards, ids)
        assert bool((rewards[w] > rewards[l]).all()) and len(set(w.tolist()) | set(l.tolist())) == 2 * len(w)
        assert bool((ids[w] == ids[l]).all())
        bw, bl = best_worst_pairs(rewards, ids)
        firsts = {}
        for a, b in zip(w.tolist(), l.tolist()):
            firsts.setdefault(int(ids[a]), (a, b))
        assert sorted(firsts.values()) == sorted(zip(bw.tolist(), bl.tolist()))
        for g in ids.unique().tolist():  # the k-th highest reward against the k-th lowest, while strictly higher
            r = sorted(rewards[ids == g].tolist())
            expected = sum(1 for k in range(len(r) // 2) if r[-1 - k] > r[k])
            assert int((ids[w] == g).sum()) == expected


def test_matched_pairs_by_hand():
    """Group a, 0/1 rewards, correct 0, 2, 6 and incorrect 1, 3, 4, 5, 7, one-hot colours (red, blue; 5 has none):
    ranked pairs 0-1, 2-3, 6-4 (the first incorrect ones by index); matched pairs each winner with a loser of its own
    colour, distance 0, the lowest indices first: 0 (red) with 3, 2 (blue) with 1, 6 (red) with 4. Group b
    [0.9, 0.1, 0.5], red, blue, red: ranked's one pair is 0 over 1 (distance 2); matched's one pair is the closest
    strictly ordered one, 0 over 2 (distance 0)."""
    red, blue, none = [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]
    rewards = t64([1, 0, 1, 0, 0, 0, 1, 0, 0.9, 0.1, 0.5])
    ids = ["a"] * 8 + ["b"] * 3
    f = t64([red, blue, blue, red, red, none, red, blue, red, blue, red])
    w, l = matched_pairs(rewards, ids, f)
    assert w.tolist() == [0, 2, 6, 8] and l.tolist() == [3, 1, 4, 10]
    assert ranked_pairs(rewards, ids)[1].tolist() == [1, 3, 4, 9]
    # no features (nothing left free): every distance 0, and ranked's own pairs
    w0, l0 = matched_pairs(rewards, ids, torch.zeros(11, 0))
    assert (w0.tolist(), l0.tolist()) == tuple(x.tolist() for x in ranked_pairs(rewards, ids))
    with pytest.raises(ValueError, match=r"features must be \[N, F\]"):
        matched_pairs(rewards, ids, torch.zeros(10, 2))
    with pytest.raises(ValueError, match="NaN or inf"):
        matched_pairs(rewards, ids, torch.full((11, 1), float("nan")))
    assert matched_pairs(t64([]), [], torch.zeros(0, 3))[0].numel() == 0


def test_matched_pairs_count_and_distance_against_brute_force():
    """Random groups of 0/1 rewards and counts: ranked_pairs' count, every pair strict, no sample twice, a total
    distance at most ranked's, and (greedy, not exact) the smallest total distance over every choice of that many
    winners, losers and matching of them in at least 95% of the groups, never more than 2 above it."""
    import itertools

    gen = torch.Generator().manual_seed(1)
    optimal = tried = 0
    for _ in range(200):
        n = int(torch.randint(2, 9, (1,), generator=gen))
        rewards = torch.randint(0, 2, (n,), generator=gen).double()
        f = torch.randint(0, 3, (n, 2), generator=gen).double()
        w, l = matched_pairs(rewards, [0] * n, f)
        rw, rl = ranked_pairs(rewards, [0] * n)
        assert len(w) == len(rw)
        assert bool((rewards[w] > rewards[l]).all()) and len(set(w.tolist()) | set(l.tolist())) == 2 * len(w)
        cost = float((f[w] - f[l]).abs().sum())
        assert cost <= float((f[rw] - f[rl]).abs().sum()) + 1e-12
        if not len(w):
            continue
        good = [i for i in range(n) if rewards[i] == 1]
        bad = [i for i in range(n) if rewards[i] == 0]
        best = min(
            sum(float((f[a] - f[b]).abs().sum()) for a, b in zip(ws, ls))
            for ws in itertools.combinations(good, len(w))
            for ls in itertools.permutations(bad, len(w))
        )
        assert best <= cost <= best + 2
        tried, optimal = tried + 1, optimal + (cost == best)
    assert tried >= 150 and optimal >= 0.95 * tried


def test_best_worst_pairs_tensor_ids_empty_and_nan():
    w, l = best_worst_pairs(t64([0.2, 0.9, 0.4, 0.1]), torch.tensor([7, 3, 7, 3]))
    # tensor ids are numbered sorted: group 3 = {1, 3} first, then group 7 = {0, 2}
    assert w.tolist() == [1, 2] and l.tolist() == [3, 0]
    w, l = best_worst_pairs(t64([]), [])
    assert w.numel() == 0 and l.numel() == 0
    w, l = best_worst_pairs(t64([1.0, 1.0]), [0, 0])
    assert w.numel() == 0 and l.numel() == 0
    with pytest.raises(ValueError, match="NaN"):
        best_worst_pairs(t64([1.0, float("nan")]), [0, 0])


def test_best_worst_pairs_match_a_loop():
    gen = torch.Generator().manual_seed(11)
    rewards = torch.round(torch.rand(60, generator=gen, dtype=torch.float64) * 4)  # many ties
    ids = torch.randint(0, 15, (60,), generator=gen).tolist()
    w, l = best_worst_pairs(rewards, ids)
    want_w, want_l = [], []
    for g in dict.fromkeys(ids):  # order of first appearance, as group_index numbers sequences
        members = [i for i, h in enumerate(ids) if h == g]
        vals = [rewards[i].item() for i in members]
        if len(members) < 2 or max(vals) == min(vals):
            continue
        want_w.append(next(i for i in members if rewards[i].item() == max(vals)))
        want_l.append(next(i for i in members if rewards[i].item() == min(vals)))
    assert w.tolist() == want_w and l.tolist() == want_l


# ------------------------------------------------------------------------------------------------ DPO: loss


def dpo_case():
    # noise 0 -> targets v_w = -x0_w = [-1, 0], v_l = -x0_l = [0, -1]
    # model:     v_theta(x_w) = [-1, .2]  -> ||[0, .2]||^2 = .02;   v_theta(x_l) = [.6, -1] -> ||[.6, 0]||^2 = .18
    # reference: v_ref(x_w)   = [0, 0]    -> ||[1, 0]||^2  = .5;    v_ref(x_l)   = [1, -1]  -> ||[1, 0]||^2  = .5
    return dict(
        velocity_w=t64([[-1.0, 0.2]]),
        velocity_l=t64([[0.6, -1.0]]),
        ref_velocity_w=t64([[0.0, 0.0]]),
        ref_velocity_l=t64([[1.0, -1.0]]),
        x0_w=t64([[1.0, 0.0]]),
        x0_l=t64([[0.0, 1.0]]),
        noise=t64([[0.0, 0.0]]),
        t=t64([0.3]),
    )


def test_dpo_by_hand():
    # D = (.02 - .5) - (.18 - .5) = -.16; inside = -beta / 2 * D = -5 * -.16 = .8; loss = log(1 + e^-.8)
    loss, stats = dpo_loss(**dpo_case(), beta=10.0)
    torch.testing.assert_close(loss, t64([math.log1p(math.exp(-0.8))]), **TOL)
    assert stats["margin"].item() == pytest.approx(0.8, abs=1e-12)
    assert stats["implicit_acc"].item() == 1.0 and stats["num_pairs"].item() == 1.0
    assert stats["model_error_w"].item() == pytest.approx(0.02, abs=1e-12)
    assert stats["ref_error_l"].item() == pytest.approx(0.5, abs=1e-12)
    # w(t) = .5 halves the inside: log(1 + e^-.4)
    half, _ = dpo_loss(**dpo_case(), beta=10.0, weight=0.5)
    torch.testing.assert_close(half, t64([math.log1p(math.exp(-0.4))]), **TOL)
    # the model equal to the reference: D = 0, loss log 2 whatever beta
    case = dpo_case()
    same, _ = dpo_loss(**{**case, "velocity_w": case["ref_velocity_w"], "velocity_l": case["ref_velocity_l"]})
    torch.testing.assert_close(same, t64([math.log(2.0)]), **TOL)


def test_dpo_kl_penalty_by_hand():
    # ||v_w - ref_w||^2 = ||[-1, .2]||^2 = (1 + .04) / 2 = .52; ||v_l - ref_l||^2 = ||[-.4, 0]||^2 = .08: kl = .60 per
    # pair (stats: .30, the mean over both images), added times kl_coef to the loss of the pair
    plain, stats = dpo_loss(**dpo_case(), beta=10.0)
    assert stats["kl"].item() == pytest.approx(0.30, abs=1e-12)
    loss, stats_kl = dpo_loss(**dpo_case(), beta=10.0, kl_coef=0.5)
    torch.testing.assert_close(loss, t64([math.log1p(math.exp(-0.8)) + 0.5 * 0.60]), **TOL)
    assert stats_kl["kl"].item() == pytest.approx(0.30, abs=1e-12) and stats_kl["margin"] == stats["margin"]
    # its gradient: kl_coef * 2 (v - v_ref) / D on each image, added to the DPO term's
    case = dpo_case()
    grads = []
    for coef in (0.0, 0.5):
        vw = case["velocity_w"].clone().requires_grad_()
        vl = case["velocity_l"].clone().requires_grad_()
        dpo_loss(**{**case, "velocity_w": vw, "velocity_l": vl}, beta=10.0, kl_coef=coef)[0].sum().backward()
        grads.append((vw.grad, vl.grad))
    torch.testing.assert_close(grads[1][0] - grads[0][0], 0.5 * 2 * (case["velocity_w"] - case["ref_velocity_w"]) / 2)
    torch.testing.assert_close(grads[1][1] - grads[0][1], 0.5 * 2 * (case["velocity_l"] - case["ref_velocity_l"]) / 2)
    # the model equal to the reference: no penalty
    same, same_stats = dpo_loss(
        **{**case, "velocity_w": case["ref_velocity_w"], "velocity_l": case["ref_velocity_l"]}, kl_coef=3.0
    )
    torch.testing.assert_close(same, t64([math.log(2.0)]), **TOL)
    assert same_stats["kl"].item() == 0.0
    with pytest.raises(ValueError, match="kl_coef"):
        dpo_loss(**case, kl_coef=-1.0)


def test_dpo_winner_sft_term_by_hand():
    # the winner's own error ||v_w - v_theta(x_w)||^2 = .02 (dpo_case), times w(t) and sft_coef, added to the pair's
    # loss: at w = .5, inside .4 (test_dpo_by_hand), loss log(1 + e^-.4) + 3 * .5 * .02
    loss, stats = dpo_loss(**dpo_case(), beta=10.0, weight=0.5, sft_coef=3.0)
    torch.testing.assert_close(loss, t64([math.log1p(math.exp(-0.4)) + 3.0 * 0.5 * 0.02]), **TOL)
    assert stats["margin"].item() == pytest.approx(0.4, abs=1e-12)
    # its gradient: only on the winner's velocity, sft_coef * w * 2 (v_theta - v_w) / D with v_w = [-1, 0]
    case = dpo_case()
    grads = []
    for coef in (0.0, 3.0):
        vw = case["velocity_w"].clone().requires_grad_()
        vl = case["velocity_l"].clone().requires_grad_()
        dpo_loss(**{**case, "velocity_w": vw, "velocity_l": vl}, beta=10.0, weight=0.5, sft_coef=coef)[
            0
        ].sum().backward()
        grads.append((vw.grad, vl.grad))
    torch.testing.assert_close(grads[1][0] - grads[0][0], 3.0 * 0.5 * 2 * t64([[0.0, 0.2]]) / 2)
    torch.testing.assert_close(grads[1][1], grads[0][1])
    # at a time of weight 0 the term is 0 (so a skipped t = 1 row stays exact): log 2
    zero, _ = dpo_loss(**case, beta=10.0, weight=0.0, sft_coef=3.0)
    torch.testing.assert_close(zero, t64([math.log(2.0)]), **TOL)
    with pytest.raises(ValueError, match="sft_coef"):
        dpo_loss(**case, sft_coef=-1.0)


def test_dpo_gradient_lowers_the_winner_error_and_raises_the_loser_error():
    case = dpo_case()
    vw = case["velocity_w"].clone().requires_grad_()
    vl = case["velocity_l"].clone().requires_grad_()
    loss, _ = dpo_loss(**{**case, "velocity_w": vw, "velocity_l": vl}, beta=10.0)
    loss.sum().backward()
    target_w, target_l = t64([[-1.0, 0.0]]), t64([[0.0, -1.0]])
    # d loss / d v_w = sigmoid(-inside) * beta / 2 * 2 (v_w - target_w) / D: along the winner's error
    s = 1 / (1 + math.exp(0.8))
    torch.testing.assert_close(vw.grad, s * 10 / 2 * 2 * (vw.detach() - target_w) / 2, **TOL)
    torch.testing.assert_close(vl.grad, -s * 10 / 2 * 2 * (vl.detach() - target_l) / 2, **TOL)
    assert ((vw.detach() - 1e-2 * vw.grad - target_w) ** 2).sum() < ((vw.detach() - target_w) ** 2).sum()
    assert ((vl.detach() - 1e-2 * vl.grad - target_l) ** 2).sum() > ((vl.detach() - target_l) ** 2).sum()


def test_dpo_pairs_past_the_saturation_train_nothing_and_keep_their_loss():
    # dpo_case's inside is .08 beta: beta 370 -> 29.6 (live), 1375 -> 110 (met: sigmoid(-110) = 1.7e-48, which float32
    # holds only as 0 or, via the backward pass, as slow subnormals); the loss's value stays log(1 + e^-inside)
    target_w = t64([[-1.0, 0.0]])
    for dtype in (torch.float64, torch.float32):
        for beta, live in ((370.0, True), (1375.0, False)):
            case = {k: v.to(dtype) for k, v in dpo_case().items()}
            vw = case["velocity_w"].clone().requires_grad_()
            loss, _ = dpo_loss(**{**case, "velocity_w": vw}, beta=beta)
            inside = 0.08 * beta
            assert loss.item() == pytest.approx(math.log1p(math.exp(-inside)), rel=1e-5, abs=1e-30)
            loss.sum().backward()
            if live:  # sigmoid(-inside) * beta / 2 * 2 (v_w - target_w) / D, as above
                want = (vw.detach().double() - target_w) * beta / 2 / (1 + math.exp(inside))
                torch.testing.assert_close(vw.grad.double(), want, rtol=1e-4, atol=0.0)
                assert vw.grad.abs().max() > 0
            else:
                assert torch.equal(vw.grad, torch.zeros_like(vw.grad))
    # in a batch, a met pair leaves the live pairs' gradients as they are alone
    both = {k: torch.cat([v, v]) for k, v in dpo_case().items()}
    both["velocity_l"] = t64([[0.6, -1.0], [6.0, -1.0]])  # pair 2: its loser errs on (18 against .5): inside 89.9
    vw = both["velocity_w"].clone().requires_grad_()
    loss, stats = dpo_loss(**{**both, "velocity_w": vw}, beta=10.0)
    assert stats["implicit_acc"].item() == 1.0 and loss[1].item() == pytest.approx(math.exp(-89.9), rel=1e-9)
    loss.sum().backward()
    alone = dpo_case()
    v1 = alone["velocity_w"].clone().requires_grad_()
    dpo_loss(**{**alone, "velocity_w": v1}, beta=10.0)[0].sum().backward()
    torch.testing.assert_close(vw.grad[:1], v1.grad, rtol=0.0, atol=0.0)
    assert torch.equal(vw.grad[1], torch.zeros(2, dtype=torch.float64))


def test_dpo_with_noise_weighting_equals_the_papers_noise_error_form():
    # Re-derive the paper's loss on noise errors: eps_hat = x_t + (1 - t) v_hat (from x_t = (1 - t) x0 + t eps,
    # v = eps - x0), one pair at a time in plain Python; it equals dpo_loss with w(t) = (1 - t)^2.
    gen = torch.Generator().manual_seed(12)
    P, D, beta = 5, 6, 300.0
    vw, vl, rw, rl = (randn(P, D, gen=gen) for _ in range(4))
    x0w, x0l, eps = randn(P, D, gen=gen), randn(P, D, gen=gen), randn(P, D, gen=gen)
    t = torch.rand(P, generator=gen, dtype=torch.float64)
    loss, _ = dpo_loss(vw, vl, rw, rl, x0w, x0l, eps, t, beta=beta, weight=(1 - t) ** 2)
    for p in range(P):
        tp = t[p].item()

        def eps_error(v_hat, x0):
            errs = []
            for j in range(D):
                x_t = (1 - tp) * x0[p, j].item() + tp * eps[p, j].item()
                errs.append(eps[p, j].item() - (x_t + (1 - tp) * v_hat[p, j].item()))
            return msq(errs)

        delta = (eps_error(vw, x0w) - eps_error(rw, x0w)) - (eps_error(vl, x0l) - eps_error(rl, x0l))
        inside = -0.5 * beta * delta
        assert abs(loss[p].item() - math.log1p(math.exp(-inside))) < 1e-10


def test_dpo_zero_pairs_and_bad_arguments():
    empty = torch.zeros(0, 2, dtype=torch.float64)
    loss, stats = dpo_loss(empty, empty, empty, empty, empty, empty, empty, torch.zeros(0, dtype=torch.float64))
    assert loss.shape == (0,)
    assert all(torch.isfinite(s) and s.item() == 0.0 for s in stats.values())
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(**dpo_case(), beta=0.0)
    with pytest.raises(ValueError, match="shapes differ"):
        dpo_loss(**{**dpo_case(), "noise": t64([[0.0, 0.0, 0.0]])})
    with pytest.raises(ValueError, match="weight"):
        dpo_loss(**dpo_case(), weight=t64([1.0, 1.0]))


# --------------------------------------------------------------------------------------- registry and dtypes


def test_registry_names_and_unknown_name():
    assert OBJECTIVE_LOSSES.names() == ["awm", "crd", "dgpo", "dpo", "elbo", "nft"]
    assert get_objective_loss("nft") is nft_loss
    assert get_objective_loss("awm") is awm_loss
    assert get_objective_loss("crd") is crd_loss
    assert get_objective_loss("dpo") is dpo_loss
    with pytest.raises(ValueError, match="Did you mean 'dpo'"):
        get_objective_loss("dpoo")


def test_bf16_inputs_give_float32_losses_and_stats():
    gen = torch.Generator().manual_seed(13)

    def bf(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    t = torch.rand(3, generator=gen).to(torch.bfloat16)
    v = bf(3, 2, 4).requires_grad_()
    nft, nft_stats = nft_loss(
        v,
        bf(3, 2, 4),
        bf(3, 2, 4),
        bf(3, 2, 4),
        t,
        optimality_probability(bf(3)),
        ref_velocity=bf(3, 2, 4),
        kl_coef=1e-4,
    )
    awm, awm_stats = awm_loss(
        v,
        bf(3, 2, 4),
        bf(3, 2, 4),
        t,
        bf(3),
        ref_velocity=bf(3, 2, 4),
        ema_velocity=bf(3, 2, 4),
        kl_coef=1e-3,
        ema_kl_coef=1.0,
    )
    dpo, dpo_stats = dpo_loss(v, bf(3, 2, 4), bf(3, 2, 4), bf(3, 2, 4), bf(3, 2, 4), bf(3, 2, 4), bf(3, 2, 4), t)
    for loss, stats in ((nft, nft_stats), (awm, awm_stats), (dpo, dpo_stats)):
        assert loss.dtype == torch.float32 and loss.shape == (3,)
        assert all(s.dtype == torch.float32 and s.ndim == 0 for s in stats.values())
        assert torch.isfinite(loss).all()
    (nft.sum() + awm.sum() + dpo.sum()).backward()
    assert v.grad.dtype == torch.bfloat16 and torch.isfinite(v.grad.float()).all()
    x_t, target = forward_noising(bf(2, 3), bf(2, 3), t[:2])
    assert x_t.dtype == torch.float32 and target.dtype == torch.float32


def test_attribute_shift_by_hand():
    """Two attributes (colour: red, blue; shape: square, circle, ring): the reference draws red 3 of 4 and the
    current 1 of 4, so d = (0.75 - 0.25, 0.25 - 0.75) = (0.5, -0.5), TV 0.5; shapes: reference (2, 2, 0) -> (0.5, 0.5,
    0) against current (0, 1, 3) -> (0, 0.25, 0.75), so d = (0.5, 0.25, -0.75), TV 0.75. An attribute no side counts
    gives 0; one only the reference counts gives the reference's distribution."""
    attrs = ["c", "c", "s", "s", "s"]
    d = attribute_shift(t64([3, 1, 2, 2, 0]), t64([1, 3, 0, 1, 3]), attrs)
    assert torch.allclose(d, t64([0.5, -0.5, 0.5, 0.25, -0.75]), atol=1e-12)
    assert 0.5 * float(d[:2].abs().sum()) == pytest.approx(0.5) and 0.5 * float(d[2:].abs().sum()) == pytest.approx(
        0.75
    )
    assert attribute_shift(t64([0, 0, 1, 3]), t64([0, 0, 0, 0]), ["a", "a", "b", "b"]).tolist() == [0, 0, 0.25, 0.75]
    with pytest.raises(ValueError, match=r"\[F\] counts with one attribute each"):
        attribute_shift(t64([1, 2]), t64([1, 2, 3]), ["a", "a"])
    with pytest.raises(ValueError, match="finite and non-negative"):
        attribute_shift(t64([1, -1]), t64([1, 2]), ["a", "a"])


def test_matched_pairs_anchored_by_hand():
    """One group, winner 0 (counts blue, red = 0, 1) and losers 1 (1, 1: an extra blue), 2 (0, 2: an extra red), 3
    (2, 0): distances 1, 1, 3, so plain matching takes loser 1 (the lower index of the tie). With the current model
    drawing red too often (d = q_ref - q_now = (0.25, -0.25)), the costs 1 - anchor (f_w - f_l) . d are, at anchor
    10: 1 + 2.5, 1 - 2.5, 3 + 7.5: loser 2, whose extra object is of the colour drawn too often. The opposite shift
    (blue too often) costs them 1 - 2.5, 1 + 2.5, 3 - 7.5: loser 3, the bluest, though the farthest; anchor 0 with
    any shift is plain matching. With a second winner the greedy order follows the anchored costs (by hand below),
    not the distances."""
    rewards = t64([1, 0, 0, 0])
    f = t64([[0, 1], [1, 1], [0, 2], [2, 0]])
    d = t64([0.25, -0.25])
    assert matched_pairs(rewards, [0] * 4, f)[1].tolist() == [1]
    assert matched_pairs(rewards, [0] * 4, f, d, 10.0)[1].tolist() == [2]
    assert matched_pairs(rewards, [0] * 4, f, -d, 10.0)[1].tolist() == [3]
    assert matched_pairs(rewards, [0] * 4, f, -d, 1.0)[1].tolist() == [1]  # 1 - 0.25 against 3 - 0.75
    assert matched_pairs(rewards, [0] * 4, f, d, 0.0)[1].tolist() == [1]
    assert matched_pairs(rewards, [0] * 4, f, None, 0.0)[1].tolist() == [1]
    # winner 4 = (1, 0): against 1 (1, 1): distance 1, (f_w - f_l) . d = (0, -1) . d = 0.25 -> 1 - 2.5 = -1.5;
    # against 3 (2, 0): distance 1, (-1, 0) . d = -0.25 -> 3.5; against 2: distance 3, (1, -2) . d = 0.75 -> -4.5.
    # 0 against 1: 3.5, against 2: -1.5, against 3: distance 3, (-2, 1) . d = -0.75 -> 10.5. Greedy: 4-2 (-4.5), then
    # 0's cheapest free loser, 1 (3.5) before 3 (10.5).
    rewards5 = t64([1, 0, 0, 0, 1])
    f5 = torch.cat([f, t64([[1, 0]])])
    w, l = matched_pairs(rewards5, [0] * 5, f5, d, 10.0)
    assert (w.tolist(), l.tolist()) == ([4, 0], [2, 1])
    # plain: the distance-1 pairs first, by index: 0-1 (1), then 4-3 (1)
    assert tuple(x.tolist() for x in matched_pairs(rewards5, [0] * 5, f5)) == ([0, 4], [1, 3])
    with pytest.raises(ValueError, match="anchor must be >= 0"):
        matched_pairs(rewards, [0] * 4, f, None, 1.0)
    with pytest.raises(ValueError, match="anchor must be >= 0"):
        matched_pairs(rewards, [0] * 4, f, d, -1.0)
    with pytest.raises(ValueError, match=r"shift must be \[F\] with F = 2"):
        matched_pairs(rewards, [0] * 4, f, t64([1.0, 0, 0]), 1.0)
