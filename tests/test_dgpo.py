"""DGPO (train.objective=dgpo): the core formula against numbers worked out by hand, its gradient, the DSM clip, and
the objective's own parts (shared times and group noise, the EMA old policy's decay, the unit's loss re-derived
from the model's predictions, the refusals). The one-epoch run of every tiny family, resume and the direction of an
update are test_objectives_loop's (its OBJECTIVES include dgpo)."""

import math
from types import SimpleNamespace

import pytest
import torch
from test_objectives_loop import _epoch_inputs, shadow, tiny_cfg, trained

from flowrl import core
from flowrl.config import ConfigError
from flowrl.train import Trainer

torch.set_num_threads(1)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# ------------------------------------------------------------------------------------ the core formula


def hand_case():
    """Four samples of two elements, x0 = eps (target velocity 0), so l_i = mean(v_i^2):
    l = [1, 4, 0, 1], l_ref = [1, 1, 1, 4]; A = [1, -1, 0.5, -0.5]; groups {0, 1} (id 7) and {2, 3} (id 3); G = 2."""
    x0 = torch.tensor([[0.5, -0.5], [1.0, 2.0], [0.0, 3.0], [-1.0, 1.0]], dtype=torch.float64)
    noise = x0.clone()
    v = torch.tensor([[1.0, -1.0], [2.0, 2.0], [0.0, 0.0], [1.0, 1.0]], dtype=torch.float64, requires_grad=True)
    v_ref = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [2.0, 2.0]], dtype=torch.float64)
    t = torch.tensor([0.9, 0.9, 0.5, 0.5], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    return v, v_ref, x0, noise, t, adv, torch.tensor([7, 7, 3, 3])


def test_group_weights_and_loss_are_the_hand_values():
    v, v_ref, x0, noise, t, adv, groups = hand_case()
    # s_7 = (1 * 2 * (1 - 1) + (-1) * 2 * (4 - 1)) / 2 = -3;  s_3 = (0.5 * 2 * (0 - 1) + (-0.5) * 2 * (1 - 4)) / 2 = 1
    w7, w3 = sigmoid(-3.0), sigmoid(1.0)
    l = core.dsm_error(v, x0, noise, t)
    assert l.tolist() == [1.0, 4.0, 0.0, 1.0]
    w, s = core.group_preference_weights(l, core.dsm_error(v_ref, x0, noise, t), adv, groups, beta=2.0, group_size=2)
    assert s.tolist() == [-3.0, -3.0, 1.0, 1.0]
    torch.testing.assert_close(w, torch.tensor([w7, w7, w3, w3], dtype=torch.float64), rtol=1e-12, atol=0)
    assert not w.requires_grad
    loss, stats = core.dgpo_loss(v, v_ref, x0, noise, t, adv, groups, beta=2.0, group_size=2)
    want = [w7 * 1 * 1, w7 * -1 * 4, w3 * 0.5 * 0, w3 * -0.5 * 1]
    torch.testing.assert_close(loss.detach(), torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    assert stats["weight_mean"].item() == pytest.approx((w7 + w3) / 2, rel=1e-12)
    assert "clipfrac" not in stats and "kl" not in stats
    # the weights are constants: the gradient of mean(L) is w_g A_i grad l_i / N, grad l_i = 2 (v_i - 0) / 2
    loss.mean().backward()
    coef = torch.tensor([w7 * 1, w7 * -1, w3 * 0.5, w3 * -0.5], dtype=torch.float64)[:, None]
    torch.testing.assert_close(v.grad, coef * v.detach() / 4, rtol=1e-12, atol=0)


def test_a_group_missing_samples_still_divides_by_the_group_size_and_the_kl_adds():
    v, v_ref, x0, noise, t, adv, groups = hand_case()
    # group 7 of G = 4 configured samples holds two here: s_7 = -6 / 4
    w, s = core.group_preference_weights(
        core.dsm_error(v, x0, noise, t), core.dsm_error(v_ref, x0, noise, t), adv, groups, beta=2.0, group_size=4
    )
    assert s.tolist() == [-1.5, -1.5, 0.5, 0.5]
    kl_target = torch.zeros_like(v_ref)  # kl_i = mean(v_i^2) = l_i here
    loss, stats = core.dgpo_loss(
        v, v_ref, x0, noise, t, adv, groups, beta=2.0, group_size=4, kl_velocity=kl_target, kl_coef=0.1
    )
    l = torch.tensor([1.0, 4.0, 0.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(loss.detach(), w * adv * l + 0.1 * l, rtol=1e-12, atol=0)
    assert stats["kl"].item() == pytest.approx(1.5)


def test_the_dsm_clip_detaches_exactly_the_samples_the_rule_names():
    """rho = exp(l_old - l): A > 0 and rho > 1 + 0.05, or A < 0 and rho < 1 - 0.05, is clipped (detached)."""
    l = torch.ones(6, dtype=torch.float64)
    gap = torch.tensor([0.1, 0.01, -0.1, -0.01, 0.1, -0.1], dtype=torch.float64)  # rho = 1.105, 1.010, 0.905, ...
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, 0.0], dtype=torch.float64)
    mask = core.dsm_clip_mask(l, l + gap, adv, clip_low=0.05, clip_high=0.05)
    assert mask.tolist() == [True, False, True, False, False, False]
    # asymmetric: a low range of 0.2 lets sample 2 (rho 0.905) through
    assert core.dsm_clip_mask(l, l + gap, adv, clip_low=0.2, clip_high=0.05).tolist()[2] is False
    # in the loss: one element per sample, x0 = eps, so l = v^2 and l_old = v_old^2
    x0 = torch.zeros(6, 1, dtype=torch.float64)
    v = torch.ones(6, 1, dtype=torch.float64, requires_grad=True)
    old = (1 + gap).sqrt()[:, None]
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    args = (v, torch.ones_like(old), x0, x0, torch.full((6,), 0.5, dtype=torch.float64), adv, groups)
    clipped, stats = core.dgpo_loss(*args, beta=1.0, group_size=2, old_velocity=old)
    plain, _ = core.dgpo_loss(*args, beta=1.0, group_size=2)
    torch.testing.assert_close(clipped.detach(), plain.detach(), rtol=0, atol=0)  # the value stays
    assert stats["clipfrac"].item() == pytest.approx(2 / 6)
    (grad,) = torch.autograd.grad(clipped.sum(), v)
    (full,) = torch.autograd.grad(plain.sum(), v)
    assert grad[:, 0].tolist() == [0.0, full[1, 0].item(), 0.0, full[3, 0].item(), 0.0, 0.0]
    assert full[[0, 1, 2, 3], 0].abs().min() > 0


# ------------------------------------------------------------------------------------ the objective


def test_times_are_shared_by_the_epoch_and_noise_by_a_group(tmp_path):
    tr = Trainer(tiny_cfg(tmp_path, "train.objective=dgpo", "train.dgpo.timesteps=3", "sample.num_steps=10"))
    batch, _, adv, keep = _epoch_inputs(tr)
    obj, g = tr.objective, batch.group_ids
    draws = set()
    for epoch in range(6):
        obj.prepare(batch, adv, keep, epoch=epoch, process_index=1)
        other_process = obj.plan.steps
        obj.prepare(batch, adv, keep, epoch=epoch, process_index=0)
        steps = obj.plan.steps
        assert torch.equal(steps, other_process)  # every process draws the same times
        assert steps.shape == (8, 3) and (steps == steps[0]).all()  # ... for every sample
        # from the noisiest 60% of the flow times (t >= 0.4), one per stratum
        assert (obj.plan.times[steps[0]] >= 0.4).all() and steps[0].tolist() == sorted(steps[0].tolist())
        draws.add(tuple(steps[0].tolist()))
    assert len(draws) > 1  # drawn per epoch
    obj.prepare(batch, adv, keep, epoch=0, process_index=0)
    steps = obj.plan.steps
    rows, t, noise = obj.inputs(batch, torch.arange(8), [0, 1, 2])
    by_row = {(int(r), k // 8): noise[k] for k, r in enumerate(rows)}
    for slot in range(3):
        for i in range(8):
            for j in range(8):
                same = torch.equal(by_row[i, slot], by_row[j, slot])
                assert same == bool(g[i] == g[j]), (slot, i, j)
    assert not torch.equal(by_row[0, 0], by_row[0, 1])  # fresh noise per time slot
    # another process draws the same noise for a group; another epoch other noise
    obj.prepare(batch, adv, keep, epoch=0, process_index=1)
    assert torch.equal(obj.inputs(batch, torch.arange(8), [0, 1, 2])[2], noise)
    obj.prepare(batch, adv, keep, epoch=1, process_index=0)
    assert not torch.equal(obj.inputs(batch, torch.arange(8), [0, 1, 2])[2], noise)
    # shared_noise=false: every sample its own
    tr.objective.settings.shared_noise = False
    obj.prepare(batch, adv, keep, epoch=0, process_index=0)
    own = obj.inputs(batch, torch.arange(8), [0])[2]
    assert not any(torch.equal(own[i], own[j]) for i in range(8) for j in range(i))


def test_a_units_loss_is_the_group_preference_re_derived_from_the_predictions(tmp_path):
    """With the trained LoRA moved off the base, the unit's loss equals, computed here by hand from the primitive's
    predictions: per (time slot, group) s = sum A beta (l - l_ref) / G, w = sigmoid(s), then the mean over rows of
    w A l + kl_coef ||v - v_ref||^2."""
    tr = Trainer(
        tiny_cfg(
            tmp_path,
            "train.objective=dgpo",
            "train.dgpo.clip_dsm=false",
            "train.dgpo.beta=30",
            "train.dgpo.adv_clip=0.5",
            "train.dgpo.kl_coef=0.5",
        )
    )
    with torch.no_grad():
        for p in tr.params:
            p.add_(0.3 * torch.randn_like(p))
    batch, _, adv, keep = _epoch_inputs(tr)
    obj, policy = tr.objective, tr.policy
    assert "old" not in policy.shadows  # clip_dsm off and the base as the reference: no old policy
    keep = obj.prepare(batch, adv, keep, epoch=0, process_index=0)
    idx, unit = torch.arange(8), [0, 1]
    loss, stats = obj.unit_loss(batch, idx, unit, adv, keep, None)
    rows, t, noise = obj.inputs(batch, idx, unit)
    with torch.no_grad():
        pred = policy.flow_prediction(batch, rows, t, noise)
        with policy.reference():
            ref = policy.flow_prediction(batch, rows, t, noise).velocity
    l = (pred.velocity - pred.target).square().flatten(1).mean(1).tolist()
    l_ref = (ref - pred.target).square().flatten(1).mean(1).tolist()
    kl = (pred.velocity - ref).square().flatten(1).mean(1).tolist()
    a = [max(-0.5, min(0.5, float(adv[r]))) for r in rows]
    assert max(abs(float(x)) for x in adv) > 0.5  # the clip binds
    total, weights = 0.0, []
    for k, r in enumerate(rows.tolist()):
        slot, group = k // 8, int(batch.group_ids[r])
        members = [j for j in range(len(rows)) if j // 8 == slot and int(batch.group_ids[rows[j]]) == group]
        s = sum(a[j] * 30 * (l[j] - l_ref[j]) / 4 for j in members)
        weights.append(sigmoid(s))
        total += sigmoid(s) * a[k] * l[k] + 0.5 * kl[k]
    assert loss.item() == pytest.approx(total / len(rows), rel=1e-4)
    assert stats["dgpo_weight_mean"].item() == pytest.approx(sum(weights) / len(weights), rel=1e-4)
    # no weight saturates, and the groups' weights differ
    assert 0.05 < min(weights) and max(weights) < 0.95 and max(weights) - min(weights) > 0.05


def test_the_old_policy_follows_the_ema_decay_after_every_optimizer_step(tmp_path):
    """After optimizer step k: old = lambda_k old + (1 - lambda_k) theta_k, lambda_k = min(0.1 (k - 1), 0.3)."""
    tr = Trainer(tiny_cfg(tmp_path, "train.objective=dgpo", "train.dgpo.ema_decay_rate=0.1", "train.minibatch_size=4"))
    batch, _, adv, keep = _epoch_inputs(tr)
    old = shadow(tr, "old")
    assert max((old[n] - w).abs().max().item() for n, w in trained(tr).items()) == 0.0  # a copy at the start
    thetas = []
    step = tr.opt.step

    def step_and_keep():
        step()
        thetas.append(trained(tr))

    tr.opt.step = step_and_keep
    metrics = tr.update(batch, adv, keep, epoch=0)
    assert tr.state.optimizer_steps == 2 and 0 <= metrics["policy/dgpo_clipfrac"] <= 1
    for k, theta in enumerate(thetas, start=1):
        lam = min(0.1 * (k - 1), 0.3)
        old = {n: old[n] * lam + theta[n] * (1 - lam) for n in old}
    assert max((thetas[1][n] - thetas[0][n]).abs().max().item() for n in old) > 1e-6
    for n, w in shadow(tr, "old").items():
        torch.testing.assert_close(w, old[n], rtol=0, atol=1e-7)
    assert tr.objective.optimizer_steps == 2


def test_the_old_policy_samples_after_switch_ema_ref_steps(tmp_path):
    """The trained policy samples until more than switch_ema_ref optimizer steps were taken, then the old one; a
    checkpoint keeps the count (the resume test of test_objectives_loop runs the switch)."""
    tr = Trainer(tiny_cfg(tmp_path, "train.objective=dgpo", "train.dgpo.switch_ema_ref=1"))
    with torch.no_grad():
        for p in tr.params:
            p.add_(0.3 * torch.randn_like(p))  # the trained adapter leaves the old one
    obj, policy = tr.objective, tr.policy

    def final(fn):
        return fn(["a red cat"] * 2, [{}] * 2, epoch=0, generator=torch.Generator().manual_seed(0)).traj.final_latents

    with policy.shadow("old"):
        old = final(lambda *a, **k: policy.rollout(*a, **k, final_only=True))
    current = final(lambda *a, **k: policy.rollout(*a, **k, final_only=True))
    assert (old - current).abs().max() > 1e-4
    for steps, want in ((0, current), (1, current), (2, old)):
        obj.optimizer_steps = steps
        assert torch.equal(final(obj.rollout), want), steps
    state = obj.state_dict()
    assert int(state["dgpo/optimizer_steps"]) == 2
    obj.optimizer_steps = 0
    obj.load_state_dict(state)
    assert obj.optimizer_steps == 2


# ------------------------------------------------------------------------------------ refusals


def test_refusals_before_the_model_loads(tmp_path):
    def problem(*extra):
        with pytest.raises(ConfigError) as e:
            tiny_cfg(tmp_path, "train.objective=dgpo", *extra)
        return str(e.value)

    assert "train.micro_batch_size=2" in problem("train.micro_batch_size=2")
    assert "multiple of sample.group_size=4" in problem("train.minibatch_size=6")
    assert "train.dgpo.beta" in problem("train.dgpo.beta=0")
    assert "train.dgpo.timestep_fraction" in problem("train.dgpo.timestep_fraction=0")
    assert "train.dgpo.ema_decay_cap" in problem("train.dgpo.ema_decay_cap=2")
    assert "train.dgpo.timesteps" in problem("train.dgpo.timesteps=0")
    # more training times than steps are fine: the strata repeat steps
    assert tiny_cfg(tmp_path, "train.objective=dgpo", "train.dgpo.timesteps=9").train.dgpo.timesteps == 9


def test_a_guided_reference_needs_a_model_that_can_be_guided(tmp_path):
    """kl_cfg > 1 needs true CFG or a guidance embedding; a model with neither is refused in one line when the
    objective is built (its family's class cannot tell: FLUX.1 dev has the embedding, schnell nothing)."""
    from flowrl.objectives.dgpo import DGPO

    cfg = tiny_cfg(tmp_path, "train.objective=dgpo", "train.dgpo.kl_cfg=4.5")

    def stub(true_cfg, embedded):
        backend = SimpleNamespace(uses_cfg_encodings=true_cfg, training_guidance_scale=lambda g: g if embedded else 1.0)
        return SimpleNamespace(backend=backend, add_shadow=lambda name: None, ensure_reference=lambda: None)

    with pytest.raises(ConfigError, match=r"train.dgpo.kl_cfg=4.5: .*use train.dgpo.kl_cfg=1") as e:
        DGPO(cfg, stub(False, False))
    assert "\n" not in str(e.value)
    DGPO(cfg, stub(True, False))  # true CFG (SD3, klein base, Qwen-Image, ...)
    DGPO(cfg, stub(False, True))  # FLUX.1 / FLUX.2 dev's guidance embedding
