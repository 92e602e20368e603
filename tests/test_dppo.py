"""Flow-DPPO (train.grpo.policy_loss=dppo): the trust-region mask against a hand table, its gradient, the step KL
the image policy computes against an independent re-derivation, and on every family's tiny model one epoch that
trains on policy at first (ratio 1), masks later minibatches' steps that left the region, and resumes exactly."""

import json
import math

import pytest
import torch
from conditioned import prompt_data
from test_objectives_loop import FAMILIES, frames, max_change, model_path, tiny_cfg, trained  # noqa: F401

from flowrl import core
from flowrl.config import ConfigError, load_config
from flowrl.train import Trainer

torch.set_num_threads(1)


def test_the_mask_by_hand():
    """Four steps outside the region (KL 0.5 >= 0.1) and one inside: masked where the ratio already moves the
    advantage's way (r > 1 with A > 0, r < 1 with A < 0), kept where it moves back or sits inside."""
    lp = torch.tensor([[0.5, 0.5, -0.5, -0.5, 0.5]], requires_grad=True)
    old = torch.zeros(1, 5)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0]])
    kl = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.05]])
    loss, stats = core.dppo_loss(lp, old, adv, step_kl=kl, kl_threshold=0.1)
    r = math.exp(0.5)
    expected = [0.0, r, 0.0, -1 / r, -r]  # masked, -A r, masked, -A r, inside: -A r
    torch.testing.assert_close(loss.detach(), torch.tensor([expected]))
    loss.sum().backward()
    # d(-A r)/d log r = -A r where kept; 0 where masked
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, r, 0.0, -1 / r, -r]]))
    assert stats["clipfrac"].item() == pytest.approx(2 / 5) and stats["step_kl_mean"].item() == pytest.approx(0.41)
    with pytest.raises(ValueError, match="KL threshold must be > 0"):
        core.dppo_loss(lp, old, adv, step_kl=kl, kl_threshold=0.0)
    with pytest.raises(ValueError, match="step_kl \\(1, 4\\) and log_prob \\(1, 5\\) differ"):
        core.dppo_loss(lp, old, adv, step_kl=kl[:, :4])


def test_on_policy_it_is_the_plain_policy_gradient():
    """With the sampling policy's own weights (KL 0, ratio 1) nothing is masked and the loss is -A."""
    adv = torch.tensor([[2.0, -1.0]])
    loss, stats = core.dppo_loss(torch.zeros(1, 2), torch.zeros(1, 2), adv, step_kl=torch.zeros(1, 2))
    torch.testing.assert_close(loss, -adv)
    assert stats["clipfrac"].item() == 0.0


def test_the_config_refuses_text_and_ratio_norm_and_a_bad_threshold():
    with pytest.raises(ConfigError, match="policy_loss=dppo masks by each denoising step's Gaussian KL"):
        load_config(None, ["backend=text", "model.path=tiny-gpt2", "train.grpo.policy_loss=dppo"])
    with pytest.raises(ConfigError, match="dppo and step_weighting=ratio_norm both replace the ratio"):
        load_config(None, ["train.grpo.policy_loss=dppo", "train.grpo.step_weighting=ratio_norm"])
    with pytest.raises(ConfigError, match="trust_region_kl"):
        load_config(None, ["train.grpo.policy_loss=dppo", "train.grpo.trust_region_kl=0"])


def dppo_cfg(run, *extra):
    return tiny_cfg(
        run,
        "train.objective=grpo",
        "train.grpo.policy_loss=dppo",
        "train.grpo.trust_region_kl=1e-7",  # tiny models move little: a threshold the later minibatches cross
        "train.minibatch_size=4",
        "train.inner_epochs=2",
        *extra,
    )


def test_the_step_kl_is_the_gaussian_kl_of_the_recorded_and_current_means(tmp_path):
    """policy.unit_log_probs' step_kl against a re-derivation from the rollout's recorded means and the step's
    recomputed mean and std (backend.step_log_prob), after the LoRA moved."""
    tr = Trainer(dppo_cfg(tmp_path))
    batch = tr.rollout(0)
    assert batch.traj.means is not None  # dppo records the transition means
    with torch.no_grad():
        for p in tr.params:
            p.add_(torch.randn_like(p) * 0.05)
    idx, unit = torch.arange(4), [0, 1]
    out = tr.policy.unit_log_probs(batch, idx, unit, with_reference=False)
    _, mean, std = tr.policy.backend.step_log_prob(batch.traj, unit, sample_indices=idx)
    old = batch.traj.means[idx][:, unit]
    expected = (mean.float() - old.float()) ** 2 / (2 * std.float().reshape(4, 2, *[1] * (mean.ndim - 2)) ** 2)
    expected = expected.flatten(2).mean(-1)
    torch.testing.assert_close(out.step_kl, expected.detach(), rtol=1e-5, atol=1e-12)
    assert (out.step_kl > 0).all()


@pytest.mark.parametrize("name", FAMILIES)
def test_one_epoch_on_every_family(name, model_path, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    tr = Trainer(
        dppo_cfg(
            run,
            f"model.path={model_path(name)}",
            "train.epochs=1",
            frames(name),
            *prompt_data(name, tmp_path / "data", ["a red cat", "a blue dog"]),
        )
    )
    before = trained(tr)
    tr.fit()
    assert max_change(trained(tr), before) > 1e-7, f"dppo did not change the LoRA of {name}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epoch = next(r for r in rows if "policy/loss" in r)
    assert math.isfinite(epoch["policy/loss"]) and epoch["policy/skipped_nonfinite"] == 0
    assert epoch["policy/ratio_first_dev"] <= 1e-5  # the first minibatch: the sampling policy itself


def test_resume_equals_an_uninterrupted_run(tmp_path):
    extra = ["train.epochs=2", "checkpoint.every=1", "checkpoint.keep=0"]
    straight = Trainer(dppo_cfg(tmp_path / "a", *extra))
    straight.fit()
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if "policy/loss" in r]
    # the second inner epoch's steps have left the (tiny) trust region: some are masked
    assert all(r["policy/clipfrac"] > 0 and r["policy/step_kl_mean"] > 0 for r in epochs), epochs
    resumed = Trainer(dppo_cfg(tmp_path / "b", *extra, f"checkpoint.resume={tmp_path / 'a' / 'ckpt-000001'}"))
    resumed.fit()
    assert resumed.state.epochs_done == 2 and max_change(trained(resumed), trained(straight)) <= 1e-6
