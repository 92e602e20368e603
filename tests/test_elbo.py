"""ELBO-likelihood RL (train.objective=elbo, Choi et al. arXiv 2602.04663):
- core.elbo_estimate and core.elbo_loss against numbers worked out by hand, and every loss's on-policy gradient is
  -A grad ELBO (so a step raises the ELBO of a sample with A > 0);
- in the training loop the first minibatch's ratio is exactly 1 (theta's own estimate, no second forward pass) and
  a later minibatch's is exp(ELBO_theta - ELBO_old) recomputed from the weights of that moment and of the epoch's
  start; with old_decay_rate > 0 the old policy samples and is soft-updated;
- a config it cannot train is refused before the model loads, in one line.
(One epoch on every family and resuming: tests/test_objectives_loop.py, whose OBJECTIVES include elbo.)
"""

import math

import pytest
import torch
from test_objectives_loop import TINY as LOOP_TINY

from flowrl import core
from flowrl.config import ConfigError, load_config
from flowrl.train import Trainer

torch.set_num_threads(1)

TINY = [*LOOP_TINY, "train.objective=elbo"]  # the objectives loop tests' tiny run


def tiny_cfg(run_dir, *extra):
    return load_config(None, [*TINY, f"log.run_dir={run_dir}", *extra])


def weights(tr) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.named_params.items()}


# ------------------------------------------------------------------------------------ the core, by hand


def test_elbo_estimate_by_hand():
    """Row 0: x0 = (1, 2), eps = (0, -1), t = 1/2, v_hat = (1/2, 1/2): target eps - x0 = (-1, -3), error
    v_hat - target = (3/2, 7/2); x_t = (1/2, 1/2), x0_hat = x_t - t v_hat = (1/4, 1/4), x0_hat - x0 = (-3/4, -7/4).
    Row 1: x0 = (0, 0), eps = (1, 1), t = 1/4, v_hat = (0, 2): error (-1, 1), x0_hat - x0 = (1/4, -1/4)."""
    x0 = torch.tensor([[1.0, 2.0], [0.0, 0.0]], dtype=torch.float64)
    eps = torch.tensor([[0.0, -1.0], [1.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 0.5], [0.0, 2.0]], dtype=torch.float64)
    t = torch.tensor([0.5, 0.25], dtype=torch.float64)
    want = {
        "uniform": [-(2.25 + 12.25) / 2, -1.0],  # mean of the squared velocity error
        "t": [-(0.5625 + 3.0625) / 2, -0.0625],  # mean of the squared x0 error
        "adaptive": [-1.8125 / 1.25, -0.0625 / 0.25],  # ... over its mean absolute value
        "exact": [-0.5 / 0.501 * 7.25, -0.75 / 0.251 * 1.0],  # (1 - t) / (t + 1e-3) x uniform's
    }
    for weighting, values in want.items():
        got = core.elbo_estimate(v, x0, eps, t, weighting)
        torch.testing.assert_close(got, torch.tensor(values, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="unknown ELBO weighting"):
        core.elbo_estimate(v, x0, eps, t, "snr")


def test_elbo_losses_by_hand():
    """One element, uniform weighting: x0 = 0, eps = 1 (target 1), v_theta = 0 -> ELBO = -1; v_old = 1/2 -> ELBO_old =
    -1/4; log rho = -3/4; A = 2; dELBO/dv = -2 (v - 1) = 2. v_ref = 3/10 and kl_coef 1/2 add 0.045 and d/dv -0.3."""
    x0, eps, t = torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64), torch.tensor([0.3])
    old, ref, adv = torch.full((1, 1), 0.5, dtype=torch.float64), torch.full((1, 1), 0.3, dtype=torch.float64), 2.0
    rho = math.exp(-0.75)
    want = {  # (loss, d loss / d v_theta)
        "epg": (2 * rho, -rho * 2 * 2),
        "pepg": (2.75 * rho, -rho * 2.75 * 2),
        "par": (0.5 * rho * 2.75**2, -rho * 2.75 * 2),
        "ppo_clip": (-2 * rho, -2 * rho * 2),  # rho = 0.47 < 1 - 0.1 with A > 0: the unclipped branch
    }
    for loss, (value, grad) in want.items():
        v = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
        out, stats = core.elbo_loss(
            v, x0, eps, t, torch.tensor([adv]), old_velocity=old, loss=loss, weighting="uniform", clip_range=0.1
        )
        out.sum().backward()
        assert out.item() == pytest.approx(value, rel=1e-12), loss
        assert v.grad.item() == pytest.approx(grad, rel=1e-12), loss
        assert stats["ratio_min"].item() == stats["ratio_max"].item() == pytest.approx(rho, rel=1e-12)
        assert stats["estimate"].item() == -1.0 and stats["log_ratio"].item() == pytest.approx(-0.75)
        v.grad = None
        out, stats = core.elbo_loss(
            v, x0, eps, t, torch.tensor([adv]), old_velocity=old, loss=loss, weighting="uniform", clip_range=0.1,
            ref_velocity=ref, kl_coef=0.5,
        )  # fmt: skip
        out.sum().backward()
        assert out.item() == pytest.approx(value + 0.045, rel=1e-12) and stats["kl"].item() == pytest.approx(0.09)
        assert v.grad.item() == pytest.approx(grad - 0.3, rel=1e-12), loss


@pytest.mark.parametrize("loss", core.ELBO_LOSSES)
@pytest.mark.parametrize("weighting", core.ELBO_WEIGHTINGS)
def test_on_policy_gradient_is_minus_advantage_times_the_elbo_gradient(loss, weighting):
    """At rho = 1 (no old velocity, or the old one equal to v_theta) every loss's gradient is -A grad ELBO_theta, the
    ELBO's gradient taken on its own; a small step along it raises the ELBO of the sample with A > 0 and lowers that
    of the one with A < 0."""
    g = torch.Generator().manual_seed(0)
    x0, eps, v0 = (torch.randn(3, 4, 2, 2, generator=g, dtype=torch.float64) for _ in range(3))
    t = torch.tensor([0.2, 0.6, 0.95], dtype=torch.float64)
    adv = torch.tensor([1.5, -0.7, 0.0], dtype=torch.float64)
    v = v0.clone().requires_grad_(True)
    core.elbo_estimate(v, x0, eps, t, weighting).backward(-adv)  # sum_i -A_i grad ELBO_i
    want = v.grad.clone()
    for old in (None, v0):
        v = v0.clone().requires_grad_(True)
        out, stats = core.elbo_loss(v, x0, eps, t, adv, old_velocity=old, loss=loss, weighting=weighting)
        out.sum().backward()
        torch.testing.assert_close(v.grad, want, rtol=1e-10, atol=1e-12)
        assert stats["ratio_min"].item() == stats["ratio_max"].item() == 1.0
    before = core.elbo_estimate(v0, x0, eps, t, weighting)
    after = core.elbo_estimate(v0 - 1e-3 * want, x0, eps, t, weighting)
    assert after[0] > before[0] and after[1] < before[1]


# ------------------------------------------------------------------------------------ in the training loop


def _epoch_inputs(tr, epoch=0):
    batch = tr.rollout(epoch)
    scores, _ = tr.score(batch, epoch)
    adv, keep, _ = tr.advantages(batch, scores, epoch)
    return batch, adv, keep


def test_first_minibatch_ratio_is_one_and_a_later_one_is_the_recomputed_ratio(tmp_path):
    """Two minibatches of 4: the first trains before any step (old = theta: ratio exactly 1, no forward pass of the
    old policy); the second after one, where each row's ratio is exp(ELBO_theta - ELBO_old), recomputed here from
    the weights at that moment and at the epoch's start with the adaptive ELBO written out."""
    tr = Trainer(tiny_cfg(tmp_path, "train.minibatch_size=4", "train.elbo.kl_coef=0", "train.elbo.loss=epg"))
    batch, adv, keep = _epoch_inputs(tr)
    obj, start = tr.objective, weights(tr)
    seen, old_passes = [], []
    unit_loss, shadow_velocity = obj.unit_loss, obj.shadow_velocity

    def spy_unit(batch, idx, unit, *rest):
        total, stats = unit_loss(batch, idx, unit, *rest)
        seen.append((idx.clone(), list(unit), weights(tr), {k: float(v) for k, v in stats.items()}))
        return total, stats

    def spy_old(*args):
        old_passes.append(len(seen))
        return shadow_velocity(*args)

    obj.unit_loss, obj.shadow_velocity = spy_unit, spy_old
    metrics = tr.update(batch, adv, keep, epoch=0)
    assert tr.state.optimizer_steps == 2 and metrics["policy/ratio_first"] == 1.0
    first = [s for s in seen if max((s[2][n] - start[n]).abs().max() for n in start) == 0]
    later = seen[len(first) :]
    assert first and later and min(old_passes) == len(first)  # the old policy runs only after the first step
    for *_, stats in first:
        assert stats["ratio_min"] == stats["ratio_max"] == stats["elbo_ratio_mean"] == 1.0

    def elbo(at: dict, rows, t, noise):
        with torch.no_grad():
            for n, p in tr.named_params.items():
                p.copy_(at[n])
            pred = tr.policy.flow_prediction(batch, rows, t, noise)
        x0 = batch.traj.final_latents[rows].float()
        err = pred.x_t - pred.t.view(-1, *[1] * (x0.ndim - 1)) * pred.velocity - x0  # x0_hat - x0
        return -err.square().flatten(1).mean(1) / err.abs().flatten(1).mean(1)

    for idx, unit, now, stats in later:
        rows, t, noise = obj.inputs(batch, idx, unit)
        ratio = torch.exp(elbo(now, rows, t, noise) - elbo(start, rows, t, noise))
        assert (ratio - 1).abs().max() > 1e-6  # one step moved the policy
        assert stats["elbo_ratio_min"] == pytest.approx(ratio.min().item(), rel=1e-5)
        assert stats["elbo_ratio_max"] == pytest.approx(ratio.max().item(), rel=1e-5)
        assert stats["ratio_min"] == stats["elbo_ratio_min"]  # what the trainer's check reads
    # the next epoch's update starts from the weights that sample it: "old" is set to them
    obj.unit_loss, obj.shadow_velocity = unit_loss, shadow_velocity
    with torch.no_grad():
        for n, p in tr.named_params.items():
            p.copy_(later[-1][2][n])
    assert max((w - tr.named_params[n]).abs().max() for n, w in tr.policy.shadow_parameters("old").items()) > 0
    obj.prepare(batch, adv, keep, epoch=1, process_index=0)
    assert all(torch.equal(w, tr.named_params[n]) for n, w in tr.policy.shadow_parameters("old").items())


def test_a_lagging_old_policy_samples_and_is_soft_updated(tmp_path):
    """old_decay_rate > 0 (the reference's runs): "old" samples the rollout and after the update old = lambda
    old_before + (1 - lambda) theta_after, lambda = min(0.2 x 2 steps, 0.5); its ratio is not the on-policy check's."""
    tr = Trainer(tiny_cfg(tmp_path, "train.minibatch_size=4", "train.elbo.old_decay_rate=0.2"))
    assert tr.objective.sampling_shadow == "old"
    batch, adv, keep = _epoch_inputs(tr)
    old_before = {n: w.clone() for n, w in tr.policy.shadow_parameters("old").items()}
    metrics = tr.update(batch, adv, keep, epoch=0)
    assert metrics["objective/elbo_old_decay"] == pytest.approx(0.4) and "policy/ratio_first" not in metrics
    theta = weights(tr)
    for n, w in tr.policy.shadow_parameters("old").items():
        torch.testing.assert_close(w, old_before[n] * 0.4 + theta[n] * 0.6, rtol=0, atol=1e-7)
    with torch.no_grad():
        for p in tr.params:
            p.add_(0.3 * torch.randn_like(p))  # the trained adapter leaves the old one further

    def final(fn):
        return fn(["a red cat"] * 2, [{}] * 2, epoch=0, generator=torch.Generator().manual_seed(0)).traj.final_latents

    sampled = final(tr.objective.rollout)
    with tr.policy.shadow("old"):
        assert torch.equal(sampled, final(lambda *a, **k: tr.policy.rollout(*a, **k, final_only=True)))


# ------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["backend=text"], "train.objective=elbo trains image models only"),
        (["train.elbo.timesteps=5"], "train.elbo.timesteps=5 exceeds sample.num_steps=4"),
        (["train.elbo.loss=grpo"], "train.elbo.loss"),
        (["train.elbo.old_decay_cap=2"], "train.elbo.old_decay_cap must be in [0, 1]"),
        (["train.elbo.clip_range=0"], "train.elbo.clip_range must be > 0"),
    ],
)
def test_a_config_it_cannot_train_is_refused_before_the_model_loads(extra, message, tmp_path):
    with pytest.raises(ConfigError) as e:
        tiny_cfg(tmp_path, *extra)
    lines = str(e.value).splitlines()  # one line, or "invalid config:" and one line per problem
    problems = [line for line in lines if line.startswith("  - ")] or lines
    assert len(problems) == 1 and message in problems[0]  # one problem, one line
