"""Centered Reward Distillation (train.objective=crd, flowrl.core.crd): the formulas against numbers worked out by
hand, and the objective in the training loop (its two snapshots, its within-prompt centring, its refusals). The
family x objective epoch and resume tests are tests/test_objectives_loop.py's."""

import math

import pytest
import torch
from test_objectives_loop import TINY as LOOP_TINY

from flowrl import core
from flowrl.config import ConfigError, load_config
from flowrl.core.crd import crd_decay, crd_implicit_reward, crd_loss, group_centred, group_mean, group_softmax
from flowrl.train import Trainer

torch.set_num_threads(1)

D = torch.float64


def t(*rows):
    return torch.tensor(rows, dtype=D)


# ------------------------------------------------------------------------------------ the formulas


def test_the_implicit_reward_by_hand():
    """Two samples of two elements, target v:
    sample 0: v_theta - v = (0, 4), v_old - v = (1, 1): ||.||^2 = 8 and 1, mean |.| = 2 and 1;
    sample 1: v_theta = v, v_old - v = (-0.5, 0.5): ||.||^2 = 0 and 0.25, mean |.| = 0 (floored) and 0.5.
    plain: r_theta = -(8 - 1) = -7 and -(0 - 0.25) = 0.25; adaptive: -(8/2 - 1/1) = -3 and -(0 - 0.25/0.5) = 0.5."""
    target = t([1.0, 1.0], [2.0, -1.0])
    v = t([1.0, 5.0], [2.0, -1.0]).requires_grad_()
    v_old = t([2.0, 2.0], [1.5, -0.5])
    torch.testing.assert_close(crd_implicit_reward(v, v_old, target, adaptive=False), t(-7.0, 0.25))
    r = crd_implicit_reward(v, v_old, target)
    torch.testing.assert_close(r, t(-3.0, 0.5))
    # the weights are detached: d r_0 / d v_0 = -2 (v_0 - v) / (2 elements x w = 2) = (0, -2)
    (grad,) = torch.autograd.grad(r[0], v)
    torch.testing.assert_close(grad, t([0.0, -2.0], [0.0, 0.0]))
    assert crd_implicit_reward(v.float(), v_old.float(), target.float()).dtype == torch.float32


def test_centring_is_within_each_group():
    """Groups 7 and 9 interleaved: x = 1, 4, 2, 4, 6, 10 -> group 7 (1, 2, 6) has mean 3, group 9 (4, 4, 10) mean 6."""
    x = t(1.0, 4.0, 2.0, 4.0, 6.0, 10.0)
    ids = torch.tensor([7, 9, 7, 9, 7, 9])
    torch.testing.assert_close(group_mean(x, ids), t(3.0, 6.0, 3.0, 6.0, 3.0, 6.0))
    torch.testing.assert_close(group_centred(x, ids), t(-2.0, -2.0, -1.0, -2.0, 3.0, 4.0))
    torch.testing.assert_close(group_centred(x, ["a", "b", "a", "b", "a", "b"]), group_centred(x, ids))
    # the softmax weights within a group: x = (0, ln 3) at T = 1 -> (1/4, 3/4); at T = 2 -> (1, sqrt 3) / (1 + sqrt 3)
    y, pair = t(0.0, math.log(3.0), 5.0), torch.tensor([0, 0, 1])
    torch.testing.assert_close(group_softmax(y, pair, 1.0), t(0.25, 0.75, 1.0))
    s3 = math.sqrt(3.0)
    torch.testing.assert_close(group_softmax(y, pair, 2.0), t(1 / (1 + s3), s3 / (1 + s3), 1.0))
    torch.testing.assert_close(group_softmax(y, pair, -1.0), t(0.5, 0.5, 1.0))
    # weighted: (0, ln 3) under (1/4, 3/4) -> mean 3/4 ln 3
    torch.testing.assert_close(group_mean(y, pair, group_softmax(y, pair, 1.0))[0], t(0.75 * math.log(3.0))[0])


def _four(a):
    """A group of 4 scalar samples with target 0 and v_old = 1: r_theta = -(a^2 - 1) = 1 - a^2 (no adaptive
    weight), and advantages 5, 0, -2.5, -10 -> r = clip(A / 5) / 2 + 1/2 = 1, 0.5, 0.25, 0."""
    v = t(*[[x] for x in a]).requires_grad_()
    r = core.optimality_probability(t(5.0, 0.0, -2.5, -10.0), clip=5.0)
    torch.testing.assert_close(r, t(1.0, 0.5, 0.25, 0.0))
    return v, torch.ones_like(v), torch.zeros_like(v), r, torch.zeros(4, dtype=torch.long)


def test_the_mse_loss_by_hand_and_its_gradient_through_the_own_implicit_reward_only():
    """a = 0, 1, 0, 2: r_theta = 1, 0, 1, -3 (mean -1/4): R_theta_c = 1.25, 0.25, 1.25, -2.75; R_c = r - 7/16 =
    0.5625, 0.0625, -0.1875, -0.4375. beta 0.5: diff = beta R_theta_c - R_c = 0.0625, 0.0625, 0.8125, -0.9375;
    loss = 5 / 0.5 x diff^2. d loss_i / d a_i = 10 x 2 diff_i x beta x (-2 a_i) = -20 diff_i a_i = 0, -1.25, 0, 37.5."""
    v, v_old, target, r, ids = _four([0.0, 1.0, 0.0, 2.0])
    loss, stats = crd_loss(v, v_old, target, r, ids, beta=0.5, adaptive_weight=False, scale=5.0)
    torch.testing.assert_close(loss, 10 * t(0.0625, 0.0625, 0.8125, -0.9375) ** 2)
    torch.testing.assert_close(stats["r_theta_mean"], t(-0.25)[0])
    (grad,) = torch.autograd.grad(loss.sum(), v, retain_graph=True)
    torch.testing.assert_close(grad.flatten(), t(0.0, -1.25, 0.0, 37.5))
    # sample 3's loss has no gradient through the others' implicit rewards (the group mean is detached)
    (grad,) = torch.autograd.grad(loss[3], v)
    torch.testing.assert_close(grad.flatten(), t(0.0, 0.0, 0.0, 37.5))


def test_the_bce_loss_by_hand():
    """BCE with logit x = beta R_theta_c and target y = sigmoid(R_c): -(y log sigmoid(x) + (1 - y) log(1 - sigmoid(x)))
    x 5 / beta, with the numbers of the MSE test."""
    v, v_old, target, r, ids = _four([0.0, 1.0, 0.0, 2.0])
    loss, _ = crd_loss(v, v_old, target, r, ids, beta=0.5, loss_type="bce", adaptive_weight=False)
    want = []
    for x, rc in zip([0.625, 0.125, 0.625, -1.375], [0.5625, 0.0625, -0.1875, -0.4375]):
        s, y = 1 / (1 + math.exp(-x)), 1 / (1 + math.exp(-rc))
        want.append(-10 * (y * math.log(s) + (1 - y) * math.log(1 - s)))
    torch.testing.assert_close(loss, t(*want))
    with pytest.raises(ValueError, match="unknown CRD loss"):
        crd_loss(v, v_old, target, r, ids, loss_type="l1")


def test_the_two_direction_centring_by_hand():
    """A group of 2 with r = 1, 0 and T = 1 / ln 3: p+ = softmax(r / T) = (3/4, 1/4), p- = (1/4, 3/4). a = 0, 1:
    r_theta = 1, 0. R_c+ = R_theta_c+ = (1/4, -3/4), R_c- = R_theta_c- = (3/4, -1/4); beta 1/2: diff+ = -R_c+ / 2,
    diff- = -R_c- / 2, loss = 10 x (diff+^2 + diff-^2) / 2 = 10 x (1/64 + 9/64) / 2 = 0.78125 each."""
    v = t([0.0], [1.0]).requires_grad_()
    loss, _ = crd_loss(
        v,
        torch.ones_like(v),
        torch.zeros_like(v),
        t(1.0, 0.0),
        torch.tensor([0, 0]),
        beta=0.5,
        weight_temp=1 / math.log(3.0),
        adaptive_weight=False,
    )
    torch.testing.assert_close(loss, t(0.78125, 0.78125))


def test_the_reward_adaptive_kl_by_hand():
    """||v_theta - v_ref||^2 = 1, 4, 1, 1 and r = 1, 0.5, 0.25, 0; kl_beta 0.1: m = 1e-4 / 0.1 = 1e-3, the weight
    0.1 (m + r (1 - m)) = 1e-4 + r (0.1 - 1e-4) = 0.1, 0.05005, 0.025075, 1e-4; without adaptive_kl: 0.1 each."""
    v, v_old, target, r, ids = _four([0.0, 1.0, 0.0, 2.0])
    ref = v.detach() - t([1.0], [-2.0], [1.0], [1.0])
    base, _ = crd_loss(v, v_old, target, r, ids, adaptive_weight=False)
    with_kl, stats = crd_loss(v, v_old, target, r, ids, adaptive_weight=False, ref_velocity=ref, kl_beta=0.1)
    torch.testing.assert_close(with_kl - base, t(0.1, 0.05005 * 4, 0.025075, 1e-4))
    torch.testing.assert_close(stats["kl"], t(1.75)[0])
    flat, _ = crd_loss(
        v, v_old, target, r, ids, adaptive_weight=False, ref_velocity=ref, kl_beta=0.1, adaptive_kl=False
    )
    torch.testing.assert_close(flat - base, t(0.1, 0.4, 0.1, 0.1))


def test_at_the_first_step_the_gradient_is_the_centred_reward_times_the_fit():
    """old == theta: r_theta = 0, the loss is scale / beta x R_c^2 and its gradient -2 scale R_c d r_theta / dv with
    d r_theta / dv = -2 (v - target) / (n w), w = mean |v - target|: a better-than-average sample's error is pushed
    down (the gradient step moves v toward the target), a worse one's up."""
    v = t([1.0, -3.0], [0.5, 0.5], [2.0, 0.0], [-1.0, 1.0]).requires_grad_()
    target = torch.zeros_like(v)
    r = t(1.0, 0.5, 0.25, 0.0)
    loss, stats = crd_loss(v, v.detach().clone(), target, r, torch.zeros(4), beta=0.5, scale=5.0)
    rc = r - 0.4375
    torch.testing.assert_close(loss.detach(), 10 * rc**2)
    assert stats["r_theta_mean"] == 0
    (grad,) = torch.autograd.grad(loss.sum(), v)
    w = v.detach().abs().mean(1, keepdim=True)
    torch.testing.assert_close(grad, -2 * 5 * rc[:, None] * (-2 * v.detach() / (2 * w)))
    step = v.detach() - 0.01 * grad  # a descent step: the best sample's error goes down, the worst's up
    assert step[0].square().sum() < v[0].detach().square().sum() and step[3].square().sum() > 2.0


def test_the_decay_schedule_by_hand():
    """start-initial-rate-cap 0-0.25-0.005-0.999: 0.25, 0.30 at step 10, the cap at 200; 75-0-0.0075-0.999: 0 up to
    step 75, 0.1875 at 100; with initial 0 it is DiffusionNFT's soft_update_decay."""
    old = dict(start=0, initial=0.25, rate=0.005, cap=0.999)
    assert (
        crd_decay(0, **old) == 0.25 and crd_decay(10, **old) == pytest.approx(0.30) and crd_decay(200, **old) == 0.999
    )
    sampling = dict(start=75, initial=0.0, rate=0.0075, cap=0.999)
    assert crd_decay(74, **sampling) == 0.0 == crd_decay(75, **sampling)
    assert crd_decay(100, **sampling) == pytest.approx(0.1875) and crd_decay(500, **sampling) == 0.999
    assert crd_decay(3, start=5, initial=0.4, rate=0.1, cap=0.9) == 0.4  # before the start: the initial value
    for step in (0, 3, 10, 600):
        assert crd_decay(step, start=2, initial=0.0, rate=0.001, cap=0.5) == core.soft_update_decay(
            step, rate=0.001, cap=0.5, start=2
        )


# ------------------------------------------------------------------------------------ the objective

TINY = [*LOOP_TINY, "train.objective=crd"]  # the objectives loop tests' tiny run


def tiny(run_dir, *extra):
    return Trainer(load_config(None, [*TINY, f"log.run_dir={run_dir}", *extra]))


def weights(named) -> dict[str, torch.Tensor]:
    return {n: w.detach().clone() for n, w in named.items()}


def epoch_inputs(tr, epoch=0):
    batch = tr.rollout(epoch)
    scores, _ = tr.score(batch, epoch)
    adv, keep, _ = tr.advantages(batch, scores, epoch)
    return batch, adv, keep


def test_both_snapshots_follow_their_schedules_and_the_sampling_one_samples(tmp_path):
    """Two optimizer steps (minibatch 4 of 8): old lambda = min(0.25 + 0.1 x 2, 0.999) = 0.45; sampling (start 1,
    rate 0.2): 0.2 x (2 - 1) = 0.2. Each snapshot = lambda x before + (1 - lambda) x theta after."""
    tr = tiny(
        tmp_path,
        "train.minibatch_size=4",
        "train.crd.old_decay_rate=0.1",
        "train.crd.sampling_decay_start=1",
        "train.crd.sampling_decay_rate=0.2",
    )
    policy = tr.policy
    batch, adv, keep = epoch_inputs(tr)
    before = {n: weights(policy.shadow_parameters(n)) for n in ("old", "sampling")}
    theta = weights(tr.named_params)
    assert all(torch.equal(before[s][n], theta[n]) for s in before for n in theta)  # both start as copies
    metrics = tr.update(batch, adv, keep, epoch=0)
    assert tr.state.optimizer_steps == 2
    assert metrics["objective/crd_old_decay"] == pytest.approx(0.45)
    assert metrics["objective/crd_sampling_decay"] == pytest.approx(0.2)
    theta = weights(tr.named_params)
    for name, lam in (("old", 0.45), ("sampling", 0.2)):
        for n, w in policy.shadow_parameters(name).items():
            torch.testing.assert_close(w, before[name][n] * lam + theta[n] * (1 - lam), rtol=0, atol=1e-7)
    assert max((theta[n] - before["old"][n]).abs().max() for n in theta) > 1e-6

    # the rollout is the sampling snapshot's, not the trained policy's
    def final(fn):
        return fn(["a red cat"] * 2, [{}] * 2, epoch=0, generator=torch.Generator().manual_seed(0)).traj.final_latents

    crd = final(tr.objective.rollout)
    with policy.shadow("sampling"):
        sampled = final(lambda *a, **k: policy.rollout(*a, **k, final_only=True))
    assert (
        torch.equal(crd, sampled)
        and (crd - final(lambda *a, **k: policy.rollout(*a, **k, final_only=True))).abs().max() > 1e-5
    )


def test_a_units_loss_is_the_hand_value_centred_per_prompt_and_time_slot(tmp_path):
    """With the trained adapter moved away from the old one (r_theta != 0), one unit's loss for the whole batch,
    recomputed here from the primitive's velocities (trained, old, and the base model guided at kl_cfg 3) with plain
    tensor ops: the means over each prompt's group at each training-time slot. It equals the mean of the losses of
    the groups taken one at a time (a micro-batch of whole groups), which centring over the micro-batch would not."""
    tr = tiny(tmp_path, "train.crd.kl_cfg=3", "train.crd.beta=0.5")
    batch, adv, keep = epoch_inputs(tr)
    obj, policy = tr.objective, tr.policy
    with torch.no_grad():
        for p in tr.params:
            p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    obj.prepare(batch, adv, keep, epoch=0, process_index=0)
    idx, unit = torch.arange(len(keep)), [0, 1]
    loss, stats = obj.unit_loss(batch, idx, unit, adv, keep, None)
    rows, times, noise = obj.inputs(batch, idx, unit)
    with torch.no_grad():
        pred = policy.flow_prediction(batch, rows, times, noise)
        with policy.shadow("old"):
            v_old = policy.flow_prediction(batch, rows, times, noise).velocity
        with policy.reference():
            v_ref = policy.flow_prediction(batch, rows, times, noise, guidance_scale=3.0).velocity
            v_plain = policy.flow_prediction(batch, rows, times, noise).velocity
    assert (v_ref - v_plain).abs().max() > 1e-4  # the guided teacher is not the CFG-free pass

    def fit(v):
        e = (v - pred.target).flatten(1)
        return e.square().mean(1) / e.abs().mean(1).clamp(min=1e-5)

    r_theta = -(fit(pred.velocity) - fit(v_old))
    r = (adv[rows].clamp(-5, 5) / 5) / 2 + 0.5
    hand = torch.zeros(len(rows))
    g = batch.group_ids[rows]
    slot = torch.arange(len(unit)).repeat_interleave(len(idx))
    for k in range(len(unit)):
        for gid in g.unique():
            m = (slot == k) & (g == gid)
            rc, rtc = r[m] - r[m].mean(), r_theta[m] - r_theta[m].mean()
            hand[m] = 5 / 0.5 * (0.5 * rtc - rc) ** 2
    kl = (pred.velocity - v_ref).flatten(1).square().mean(1)
    hand = hand + (1e-4 + r * (0.1 - 1e-4)) * kl
    torch.testing.assert_close(loss.detach(), hand.mean(), rtol=1e-5, atol=1e-7)
    assert abs(stats["crd_r_theta_mean"]) > 0 and stats["crd_kl"] > 0
    per_group = [
        obj.unit_loss(batch, (batch.group_ids == gid).nonzero().flatten(), unit, adv, keep, None)[0]
        for gid in batch.group_ids.unique()
    ]
    torch.testing.assert_close(loss.detach(), torch.stack(per_group).mean().detach(), rtol=1e-5, atol=1e-7)


def test_refusals_before_the_model_loads_are_one_line(tmp_path):
    def problem(*extra):
        with pytest.raises(ConfigError) as e:
            load_config(None, [*TINY, f"log.run_dir={tmp_path}", *extra])
        text = str(e.value).removeprefix("invalid config:\n  - ")  # one problem: one line
        assert "\n" not in text, text
        return text

    assert "train.crd.weight_temp=0" in problem("train.crd.weight_temp=0")
    assert "multiple of sample.group_size=4" in problem("train.micro_batch_size=2")
    assert "at most 4" in problem("train.crd.timesteps=5")
    assert "train.crd.old_decay_cap must be in [0, 1]" in problem("train.crd.old_decay_cap=1.5")
    assert "train.crd.loss" in problem("train.crd.loss=l1")
    assert load_config(None, [*TINY, "train.crd.weight_temp=0.5", "train.micro_batch_size=8"]).train.crd.weight_temp
