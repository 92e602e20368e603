"""The forward-process objectives (train.objective nft / awm / dpo / elbo / crd / dgpo) in the one training loop,
on every family's tiny pipeline:
- the backend primitive `flow_prediction` is the velocity the family's own sampler steps with (flow and DDPM
  families alike), its DDPM conversion equals a hand computation, and its gradient reaches the LoRA;
- GRPO's rollout records every step's log-prob, the other objectives' only the final latents;
- one epoch of each objective on each family trains the LoRA with a finite loss and writes a checkpoint that loads
  (and a resumed run equals an uninterrupted one); offline DPO too, on pairs of generated images (latents for a
  video family) written per family;
- NFT: the old policy samples, starts as a copy (so the first loss is nft_loss's hand value with v_old = v_theta)
  and is soft-updated by exactly the decay formula; AWM's EMA policy likewise; DPO pairs each group's best and worst
  sample with one noise and time.
"""

import contextlib
import json
import math
from types import SimpleNamespace

import pytest
import torch
from conditioned import condition_images, pair_data, prompt_data
from conftest import count_reference_entries, perturb_lora_b

from flowrl import core
from flowrl.config import ConfigError, describe, load_config
from flowrl.families import family, family_names
from flowrl.objectives import get_objective
from flowrl.objectives._forward import random_order
from flowrl.run.checkpoint import read_checkpoint
from flowrl.sampling import ddpm_flow_time, ddpm_velocity
from flowrl.train import Trainer

torch.set_num_threads(1)

FAMILIES = [*family_names(), "flux2-klein"]
OBJECTIVES = ("nft", "awm", "dpo", "elbo", "crd", "dgpo")
#: the shadow policies an objective keeps in its checkpoint (objective.safetensors) with the loop tests' settings
SHADOWS = {"nft": ("old",), "elbo": ("old",), "crd": ("old", "sampling"), "dgpo": ("old",)}
FAMILY_LOOP = (*OBJECTIVES, "dpo_offline")  # offline DPO reads pairs (`pair_data`): its rollout samples nothing
TINY = [
    "sample.height=32",
    "sample.width=32",
    "sample.num_steps=4",
    "sample.max_sequence_length=16",
    "sample.prompts_per_epoch=2",
    "sample.group_size=4",
    "eval.num_steps=2",
    "eval.num_prompts=1",
    "eval.before=false",
    "eval.grid=false",
    "log.progress=false",
    "model.device=cpu",
    "train.lr=3e-3",
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """model.path of a family's tiny model; FLUX.2 klein (base, true CFG) is a tiny Flux2KleinPipeline saved once."""
    saved = {}

    def path(name: str) -> str:
        if name != "flux2-klein":
            return f"tiny-{name}"
        if name not in saved:
            from flowrl.families.flux2 import tiny_flux2_pipeline

            d = tmp_path_factory.mktemp("klein")
            tiny_flux2_pipeline(klein=True).save_pretrained(d)
            saved[name] = str(d)
        return saved[name]

    return path


def frames(name: str) -> str:
    """The override giving a family's tiny model its frame count (a video family's few frames; images: 1)."""
    return f"sample.num_frames={family(name).tiny_num_frames if name in family_names() else 1}"


def tiny_cfg(run_dir, *extra):
    return load_config(None, [*TINY, f"log.run_dir={run_dir}", *extra])


def trained(tr) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.named_params.items()}


def shadow(tr, name: str) -> dict[str, torch.Tensor]:
    return {n: w.detach().clone() for n, w in tr.policy.shadow_parameters(name).items()}


def max_change(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


# ------------------------------------------------------------------------------------ the backend primitive


@pytest.mark.parametrize("name", FAMILIES)
def test_flow_prediction_is_the_velocity_the_sampler_steps_with(name, model_path, tmp_path):
    """From a CFG-free ODE rollout (the family's own sampler, its own time scaling and sign): step i moves the
    flow-path point y (the latent itself for a flow family, x / (alpha + sigma) for a DDPM one, whose deterministic
    DDIM step is Euler's on that path) by (t_{i+1} - t_i) v. Re-noising an x0 that lands exactly on latents[:, i] at
    t_i must give that v, x_t = y and x0 = x_t - t target. And the prediction's gradient reaches the LoRA."""
    policy = sampler_step_matches(name, model_path, tmp_path, guidance=None)
    # the gradient of anything of the velocity reaches the trained LoRA (lora_B starts at 0: its gradient is not)
    pred = policy.last_prediction
    pred.velocity.square().mean().backward()
    grads = {n: p.grad for n, p in policy.named_trainable_parameters()}
    assert grads and all("lora" in n for n in grads)
    assert any(g is not None and g.abs().max() > 0 for n, g in grads.items() if "lora_B" in n)


@pytest.mark.parametrize("name", ["sd3", "sd15", "sdxl", "flux2-klein", "qwen_image", "wan"])
def test_a_guided_flow_prediction_is_the_velocity_the_guided_sampler_steps_with(name, model_path, tmp_path):
    """flow_prediction(guidance_scale=g) is a CFG-guided teacher: the velocity a rollout at guidance g steps with
    (true CFG, flow and DDPM families)."""
    sampler_step_matches(name, model_path, tmp_path, guidance=3.0)


def sampler_step_matches(name, model_path, tmp_path, guidance):
    """Checks flow_prediction against one step of an ODE rollout at `guidance` (None: the CFG-free value)."""
    from flowrl.policies.image import ImagePolicy

    policy = ImagePolicy(tiny_cfg(tmp_path, f"model.path={model_path(name)}", frames(name)), "cpu")
    backend = policy.backend
    g = backend.training_guidance_scale(backend.default_guidance_scale) if guidance is None else guidance
    traj = backend.rollout(
        ["a red cat", "a blue dog"],
        2,
        num_steps=4,
        sde_type="ode",
        guidance_scale=g,
        seed=0,
        height=32,
        width=32,
        decode=False,
        num_frames=policy.cfg.sample.num_frames,
        images=condition_images(name, 2),
    )
    times = backend.flow_times(traj)
    i = 1
    x_i, x_next = traj.latents[:, i].float(), traj.latents[:, i + 1].float()
    eps = torch.randn(x_i.shape, generator=torch.Generator().manual_seed(1))
    if traj.sigmas is not None:  # flow: x_t = (1 - t) x0 + t eps
        t_next = times[i + 1]
        x0 = (x_i - times[i] * eps) / (1 - times[i])
        y_i, y_next = x_i, x_next
    else:  # DDPM: x = alpha x0 + sigma eps
        a, s = traj.alphas_cumprod[i].sqrt(), (1 - traj.alphas_cumprod[i]).sqrt()
        a2, s2 = traj.alphas_cumprod_prev[i].sqrt(), (1 - traj.alphas_cumprod_prev[i]).sqrt()
        x0 = (x_i - s * eps) / a
        y_i, y_next, t_next = x_i / (a + s), x_next / (a2 + s2), s2 / (a2 + s2)
        assert math.isclose(float(times[i]), float(s / (a + s)), rel_tol=1e-6)
    v_sampler = (y_next - y_i) / (t_next - times[i])
    pred = backend.flow_prediction(
        x0,
        eps,
        times[i],
        traj.prompt_ids,
        traj.prompt_encodings,
        traj.sampler,
        traj.conditions,
        guidance_scale=guidance,
    )
    scale = max(1.0, v_sampler.abs().max().item())
    assert (pred.velocity.detach() - v_sampler).abs().max().item() <= 2e-5 * scale
    assert torch.equal(pred.t, times[i].expand(len(x0)))  # a schedule time is used as it is (DDPM: its timestep)
    assert (pred.x_t - y_i).abs().max().item() <= 2e-6 * max(1.0, y_i.abs().max().item())
    torch.testing.assert_close(pred.target, eps - x0)
    torch.testing.assert_close(
        pred.x_t - pred.t.view(-1, *[1] * (x0.ndim - 1)) * pred.target,
        x0,
        rtol=0,
        atol=2e-6 * max(1.0, x0.abs().max().item()),
    )
    policy.last_prediction = pred
    return policy


def test_ddpm_velocity_by_hand():
    """x = alpha x0 + sigma eps with alpha = 0.6, sigma = 0.8: an epsilon (or v) prediction becomes
    v_hat = eps_hat - x0_hat with x0_hat = (x - sigma eps_hat) / alpha, computed here number by number; the exact
    prediction gives v = eps - x0, and eps - eps_hat = (1 - t)(v - v_hat) with t = sigma / (alpha + sigma)."""
    alpha, sigma = torch.tensor([0.6]), torch.tensor([0.8])
    x0, eps = torch.tensor([[2.0, -1.0]]), torch.tensor([[0.5, 1.5]])
    x = 0.6 * x0 + 0.8 * eps  # [[1.6, 0.6]]
    eps_hat = torch.tensor([[1.0, 2.0]])
    # x0_hat = ((1.6 - 0.8) / 0.6, (0.6 - 1.6) / 0.6) = (4/3, -5/3); v_hat = eps_hat - x0_hat = (-1/3, 11/3)
    torch.testing.assert_close(ddpm_velocity(eps_hat, x, alpha, sigma), torch.tensor([[-1 / 3, 11 / 3]]))
    torch.testing.assert_close(ddpm_velocity(eps, x, alpha, sigma), eps - x0)
    v_model = 0.6 * eps - 0.8 * x0  # the v-prediction target
    torch.testing.assert_close(ddpm_velocity(v_model, x, alpha, sigma, "v_prediction"), eps - x0)
    t = ddpm_flow_time(torch.tensor(0.36))
    assert math.isclose(float(t), 0.8 / 1.4, rel_tol=1e-6)
    v_hat = ddpm_velocity(eps_hat, x, alpha, sigma)
    torch.testing.assert_close(eps - eps_hat, (1 - t) * ((eps - x0) - v_hat))
    with pytest.raises(ValueError, match="sample"):
        ddpm_velocity(eps_hat, x, alpha, sigma, "sample")


# ------------------------------------------------------------------------------------ rollouts


def test_grpo_records_log_probs_and_the_other_objectives_only_final_latents(tmp_path):
    grpo = Trainer(tiny_cfg(tmp_path / "grpo"))
    traj = grpo.rollout(epoch=0).traj
    assert traj.records_steps and traj.log_probs.shape == (8, 4) and traj.latents.shape[1] == 5
    assert traj.sde_mask.all() and traj.sampler.sde_type == "sde" and traj.log_probs.abs().sum() > 0
    for name in OBJECTIVES:
        tr = Trainer(tiny_cfg(tmp_path / name, f"train.objective={name}"))
        batch = tr.rollout(epoch=0)
        traj = batch.traj
        assert not traj.records_steps and traj.log_probs is None and traj.stds is None and traj.means is None
        assert traj.latents.shape[:2] == (8, 1) and traj.num_steps == 4
        assert traj.sampler.sde_type == "ode" and not traj.sde_mask.any()
        assert traj.sampler.guidance_scale == tr.cfg.sample.guidance_scale  # the user's CFG at rollout
        assert len(batch.images) == 8  # decoded for the rewards
        with pytest.raises(ValueError, match="final sample"):
            tr.policy.backend.step_log_prob(traj, [0])


def test_nft_samples_with_the_old_policy(tmp_path):
    tr = Trainer(tiny_cfg(tmp_path, "train.objective=nft"))
    with torch.no_grad():
        for p in tr.params:
            p.add_(0.3 * torch.randn_like(p))  # the trained adapter leaves the old one
    policy = tr.policy

    def final(fn):
        return fn(["a red cat"] * 2, [{}] * 2, epoch=0, generator=torch.Generator().manual_seed(0)).traj.final_latents

    nft = final(tr.objective.rollout)
    with policy.shadow("old"):
        old = final(lambda *a, **k: policy.rollout(*a, **k, final_only=True))
    current = final(lambda *a, **k: policy.rollout(*a, **k, final_only=True))
    assert torch.equal(nft, old)
    assert (nft - current).abs().max() > 1e-4


# ------------------------------------------------------------------------------------ one epoch, every family


@pytest.mark.parametrize("objective", FAMILY_LOOP)
@pytest.mark.parametrize("name", FAMILIES)
def test_one_epoch_trains_and_checkpoints(name, objective, model_path, tmp_path):
    run = tmp_path / "run"
    prompts = ["a red cat", "a blue dog"]
    data = (
        pair_data(name, tmp_path / "data", prompts, int(frames(name).split("=")[1]))
        if objective == "dpo_offline"
        else prompt_data(name, tmp_path / "data", prompts)
    )
    tr = Trainer(
        tiny_cfg(
            run,
            f"model.path={model_path(name)}",
            f"train.objective={objective}",
            "train.epochs=1",
            "train.minibatch_size=4",
            # a micro-batch of 2 samples, or of one whole group for an objective with group-level terms
            f"train.micro_batch_size={4 if get_objective(objective).group_batches else 2}",
            frames(name),
            *data,
        )
    )
    before = trained(tr)
    tr.fit()
    after = trained(tr)
    assert max_change(after, before) > 1e-6, f"{objective} did not change the LoRA of {name}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epoch = next(r for r in rows if "policy/loss" in r)
    assert math.isfinite(epoch["policy/loss"]) and epoch["policy/skipped_nonfinite"] == 0
    assert epoch["policy/trained_units"] > 0
    assert epoch.get("policy/ratio_first") == (1.0 if objective == "elbo" else None)  # ELBO: on-policy check
    ckpt = run / "ckpt-000001"
    assert (ckpt / "trainable.safetensors").exists() and (ckpt / "lora").is_dir()
    names = SHADOWS.get(objective, ())
    assert (ckpt / "objective.safetensors").exists() == bool(names)
    # loading it restores the trained weights (and the shadow policies: NFT's old, CRD's two) after they changed
    kept = {n: shadow(tr, n) for n in names}
    with torch.no_grad():
        for p in tr.params:
            p.add_(1.0)
        for n in names:
            for w in tr.policy.shadow_parameters(n).values():
                w.add_(1.0)
    tr.load(ckpt, read_checkpoint(ckpt))
    assert max_change(trained(tr), after) == 0.0
    for n in names:
        assert max_change(shadow(tr, n), kept[n]) == 0.0


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_resume_equals_an_uninterrupted_run(objective, tmp_path):
    extra = [
        f"train.objective={objective}",
        "train.epochs=2",
        "checkpoint.every=1",
        "checkpoint.keep=0",
        "train.nft.decay_rate=0.3",
        "train.crd.sampling_decay_start=0",
        "train.crd.sampling_decay_rate=0.3",
        "train.dgpo.ema_decay_rate=0.3",
        "train.dgpo.switch_ema_ref=1",  # the second epoch samples with DGPO's old policy
        "train.minibatch_size=4",
        # the eval before training encodes the 8 prompts in one call (the rollouts: 2 a call), and the run trains
        # with those encodings: the resumed run, which does not repeat that eval, encodes them as it did
        "eval.before=true",
        "eval.num_prompts=8",
    ]
    straight = Trainer(tiny_cfg(tmp_path / "a", *extra))
    straight.fit()
    resumed = Trainer(tiny_cfg(tmp_path / "b", *extra, f"checkpoint.resume={tmp_path / 'a' / 'ckpt-000001'}"))
    resumed.fit()
    assert resumed.state.epochs_done == 2
    assert max_change(trained(resumed), trained(straight)) == 0.0  # bit for bit
    for n in SHADOWS.get(objective, ()):
        assert max_change(shadow(resumed, n), shadow(straight, n)) == 0.0


# ------------------------------------------------------------------------------------ NFT, AWM, DPO


def _epoch_inputs(tr, epoch=0):
    batch = tr.rollout(epoch)
    scores, _ = tr.score(batch, epoch)
    adv, keep, _ = tr.advantages(batch, scores, epoch)
    return batch, scores, adv, keep


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_an_update_moves_the_model_toward_the_best_and_away_from_the_worst(objective, tmp_path):
    """The direction of every objective: after one epoch's update the flow-matching error ||v_hat - v||^2 (at the
    epoch's own times and noise) of each group's best sample went down and that of its worst went up (measured:
    -2e-4 / +9e-4 for all three; the same signs under seeds 0-2)."""
    tr = Trainer(tiny_cfg(tmp_path, f"train.objective={objective}"))
    batch, _, adv, keep = _epoch_inputs(tr)
    obj, g = tr.objective, batch.group_ids
    best = torch.stack([(g == k).nonzero().flatten()[adv[g == k].argmax()] for k in g.unique()])
    worst = torch.stack([(g == k).nonzero().flatten()[adv[g == k].argmin()] for k in g.unique()])

    def error(rows):
        obj.prepare(batch, adv, keep, epoch=0, process_index=0)
        r, t, noise = obj.inputs(batch, rows, list(range(obj.plan.steps.shape[1])))
        with torch.no_grad():
            pred = tr.policy.flow_prediction(batch, r, t, noise)
        return (pred.velocity - pred.target).square().mean().item()

    best_before, worst_before = error(best), error(worst)
    tr.update(batch, adv, keep, epoch=0)
    assert error(best) < best_before and error(worst) > worst_before


def test_nft_old_policy_is_soft_updated_by_the_decay_formula(tmp_path):
    """After the epoch's update: old = lambda old_before + (1 - lambda) theta_after, lambda =
    min(decay_rate x optimizer steps, decay_cap); here 2 steps x 0.2 = 0.4."""
    tr = Trainer(tiny_cfg(tmp_path, "train.objective=nft", "train.nft.decay_rate=0.2", "train.minibatch_size=4"))
    batch, _, adv, keep = _epoch_inputs(tr)
    old_before = shadow(tr, "old")
    theta_before = trained(tr)
    assert max_change(old_before, theta_before) == 0.0  # the old policy starts as a copy
    metrics = tr.update(batch, adv, keep, epoch=0)
    assert tr.state.optimizer_steps == 2 and metrics["objective/nft_old_decay"] == pytest.approx(0.4)
    theta_after, old_after = trained(tr), shadow(tr, "old")
    assert max_change(theta_after, theta_before) > 1e-6
    for n in old_after:
        want = old_before[n] * 0.4 + theta_after[n] * (1 - 0.4)
        torch.testing.assert_close(old_after[n], want, rtol=0, atol=1e-7)
    # a second epoch: lambda = min(0.2 x 4, 0.5) = 0.5 (the cap)
    batch, _, adv, keep = _epoch_inputs(tr, 1)
    old_before = shadow(tr, "old")
    assert tr.update(batch, adv, keep, epoch=1)["objective/nft_old_decay"] == pytest.approx(0.5)
    theta_after = trained(tr)
    for n, w in shadow(tr, "old").items():
        torch.testing.assert_close(w, old_before[n] * 0.5 + theta_after[n] * 0.5, rtol=0, atol=1e-7)


def test_nft_full_fine_tuning_keeps_a_frozen_copy_as_the_old_policy(tmp_path):
    tr = Trainer(
        tiny_cfg(
            tmp_path,
            "train.objective=nft",
            "lora.enabled=false",
            "train.lr=1e-4",
            "train.epochs=1",
            "train.nft.decay_rate=0.2",
        )
    )
    module, weights = tr.policy.shadows["old"]
    assert module is not None and module is not tr.policy.module and tr.policy.ref_copy is not None
    assert set(weights) == set(tr.named_params) and not any(w.requires_grad for w in weights.values())
    theta_before = trained(tr)
    tr.fit()
    theta_after = trained(tr)
    assert tr.state.optimizer_steps == 1 and max_change(theta_after, theta_before) > 1e-6
    saved = read_checkpoint(tmp_path / "ckpt-000001")["objective"]
    assert set(saved) == {f"old/{n}" for n in theta_before}
    for n, w in shadow(tr, "old").items():  # lambda = min(0.2 x 1, 0.5)
        want = theta_before[n] * 0.2 + theta_after[n] * 0.8
        torch.testing.assert_close(w, want, rtol=0, atol=1e-7)
        torch.testing.assert_close(saved[f"old/{n}"], w, rtol=0, atol=0)


def test_nft_first_loss_is_the_hand_value_with_v_old_equal_to_v_theta(tmp_path):
    """Before any update the old adapter is a copy of the trained one: v_old = v_theta at every point, so v+ = v- =
    v_theta and, whatever r, nft_loss is policy_scale / beta x t ||v - v_theta||^2 / sg(t mean |v - v_theta|) (its
    adaptive weight, in x0-space), the reference KL 0 (lora_B = 0: the adapter off changes nothing). Checked
    against the objective's loss of one unit, computed here from the primitive's outputs by hand."""
    tr = Trainer(tiny_cfg(tmp_path, "train.objective=nft", "train.nft.beta=0.5", "train.nft.policy_scale=5"))
    batch, _, adv, keep = _epoch_inputs(tr)
    obj, policy = tr.objective, tr.policy
    keep = obj.prepare(batch, adv, keep, epoch=0, process_index=0)
    idx, unit = torch.arange(len(keep)), [0, 1]
    loss, stats = obj.unit_loss(batch, idx, unit, adv, keep, None)
    rows, t, noise = obj.inputs(batch, idx, unit)
    with torch.no_grad():
        pred = policy.flow_prediction(batch, rows, t, noise)
        with policy.shadow("old"):
            v_old = policy.flow_prediction(batch, rows, t, noise).velocity
    assert torch.equal(v_old, pred.velocity)
    err = pred.t.view(-1, 1, 1, 1) * (pred.target - pred.velocity)  # x0+ - x0 = -t (v+ - v)
    per_row = err.square().flatten(1).mean(1) / err.abs().flatten(1).mean(1)
    hand = 5 / 0.5 * per_row.mean()
    torch.testing.assert_close(loss.detach(), hand, rtol=1e-5, atol=0)
    assert stats["nft_old_deviation"] == 0 and stats["nft_kl"] == 0
    # the times of a sample are distinct steps of its rollout's schedule (3 of 4 by default)
    assert obj.plan.steps.shape == (8, 3) and all(len(set(r.tolist())) == 3 for r in obj.plan.steps)


def test_awm_ema_policy_is_soft_updated_after_every_optimizer_step(tmp_path):
    tr = Trainer(
        tiny_cfg(
            tmp_path,
            "train.objective=awm",
            "train.awm.ema_kl_coef=1",
            "train.awm.ema_decay_rate=0.1",
            "train.minibatch_size=4",
        )
    )
    batch, _, adv, keep = _epoch_inputs(tr)
    ema = shadow(tr, "ema")
    thetas = []
    step = tr.opt.step

    def step_and_keep():
        step()
        thetas.append(trained(tr))

    tr.opt.step = step_and_keep
    metrics = tr.update(batch, adv, keep, epoch=0)
    assert tr.state.optimizer_steps == 2 and math.isfinite(metrics["policy/awm_ema_kl"])
    for k, theta in enumerate(thetas, start=1):  # lambda = min(0.1 k, 0.3)
        ema = {n: ema[n] * (0.1 * k) + theta[n] * (1 - 0.1 * k) for n in ema}
    for n, w in shadow(tr, "ema").items():
        torch.testing.assert_close(w, ema[n], rtol=0, atol=1e-7)


def test_dpo_pairs_each_groups_best_and_worst_sample(tmp_path):
    # weighting=velocity: no time weighs 0, so every row of a unit is computed (see the test of the t = 1 rows)
    tr = Trainer(tiny_cfg(tmp_path, "train.objective=dpo", "train.dpo.weighting=velocity"))
    batch, scores, adv, keep = _epoch_inputs(tr)
    obj = tr.objective
    winners = obj.prepare(batch, adv, keep, epoch=0, process_index=0)
    total = scores[:, 0]
    for g in batch.group_ids.unique():
        members = (batch.group_ids == g).nonzero().flatten()
        best, worst = members[total[members].argmax()], members[total[members].argmin()]
        assert winners[members].tolist() == [bool(i == best) for i in members]
        assert obj.partner[best] == worst
    # from the advantages of the batch: ties go to the first, a group whose values all tie has no pair, and a
    # sample without a finite reward (keep False) takes no part
    adv = torch.tensor([0.1, 0.9, -0.5, 0.3, 0.2, 0.2, 0.2, 0.2])
    keep = torch.ones(8, dtype=torch.bool)
    assert obj.prepare(batch, adv, keep, epoch=0, process_index=0).nonzero().flatten().tolist() == [1]
    assert obj.partner.tolist() == [-1, 2, -1, -1, -1, -1, -1, -1]
    keep[1] = False
    assert obj.prepare(batch, adv, keep, epoch=0, process_index=0).nonzero().flatten().tolist() == [3]
    assert obj.partner[3] == 2
    # winner and loser are evaluated at one noise and time: the rows of a pass are [winners; losers]
    seen = []
    predict = tr.policy.flow_prediction

    def spy(batch_, rows, t, noise):
        seen.append((rows, t, noise))
        return predict(batch_, rows, t, noise)

    tr.policy.flow_prediction = spy
    obj.unit_loss(batch, torch.tensor([3]), [0, 1], adv, keep, None)
    for rows, t, noise in seen:
        assert rows.tolist() == [3, 3, 2, 2]
        assert torch.equal(t[:2], t[2:]) and torch.equal(noise[:2], noise[2:]) and not torch.equal(t[0], t[1])


def test_dpo_ranked_pairing_trains_several_pairs_a_group(tmp_path):
    """train.dpo.pairing=ranked: in a group of 4 the best over the worst and the second best over the second worst
    (when strictly better), each winner bringing its own loser; one epoch trains with them."""
    tr = Trainer(tiny_cfg(tmp_path, "train.objective=dpo", "train.dpo.pairing=ranked"))
    batch, scores, adv, keep = _epoch_inputs(tr)
    obj = tr.objective
    assert batch.group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    adv = torch.tensor([0.1, 0.9, -0.5, 0.3, 1.0, 0.0, 1.0, 0.0])
    winners = obj.prepare(batch, adv, keep, epoch=0, process_index=0)
    # group 0: 1 over 2, then 3 over 0; group 1 (0/1): 4 over 5, 6 over 7
    assert winners.nonzero().flatten().tolist() == [1, 3, 4, 6]
    assert obj.partner.tolist() == [-1, 2, -1, 0, 5, -1, 7, -1] and obj.pairs == 4
    before = {n: p.detach().clone() for n, p in tr.named_params.items()}
    metrics = tr.update(batch, adv, keep, epoch=0)
    assert metrics["objective/dpo_pairs"] == 4.0
    assert any(not torch.equal(before[n], p) for n, p in tr.named_params.items())
    with pytest.raises(ConfigError, match="train.dpo_offline.pairing=ranked"):
        tiny_cfg(tmp_path, "train.objective=dpo_offline", "train.dpo_offline.pairing=ranked")


@pytest.fixture
def coloured_reward():
    """A test-only image reward with free-attribute counts: 1 for the images whose mean red exceeds the batch's
    median, else 0, and per image one free 'object' counted under the colour its index gives (red for even
    indices, blue for odd), as a GenEval-style reward reports what the prompt left free."""
    import numpy as np

    from rewards.registry import REWARDS, register

    name = "test_coloured"

    @register(name, kind="image", counts=("color",))
    def factory(**kwargs):
        class Fn:
            last_components: dict = {}

            def __call__(self, images, prompts, **metadata):
                red = torch.tensor(
                    [float(np.asarray(im.convert("RGB"), dtype=np.float32)[..., 0].mean()) for im in images]
                )
                even = (torch.arange(len(images)) % 2 == 0).float()
                self.last_components = {"free_color=red": even, "free_color=blue": 1 - even}
                return (red > red.median()).float()

        return Fn()

    yield name
    REWARDS._items.pop(name, None)


def test_dpo_matched_pairing_pairs_images_of_one_free_colour(tmp_path, coloured_reward):
    """train.dpo.pairing=matched: the trainer hands the rewards' free counts to the pairing (batch.free_counts
    [B, F], columns in sorted name order), which takes ranked's pair count in each group with a winner and a loser
    of the same free colour where one exists; the pairs' mean count distance is logged, and an epoch trains.
    With a reward that could not say whether it counts (counts=None) and does not, the pairing fails with a line
    that names the components it needs (rewards that declare none fail before the model loads: test_cli_errors)."""
    tr = Trainer(
        tiny_cfg(
            tmp_path / "a", "train.objective=dpo", "train.dpo.pairing=matched", f"rewards=[{{name: {coloured_reward}}}]"
        )
    )
    batch, adv, keep, metrics, _ = tr.scored_rollout(0)
    even = (torch.arange(8) % 2 == 0).float()
    assert torch.equal(batch.free_counts, torch.stack([1 - even, even], 1))  # blue, then red
    adv = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0])  # group 0: 0, 1 beat 2, 3; group 1: 4, 7 beat 5, 6
    keep = torch.ones(8, dtype=torch.bool)
    tr.objective.prepare(batch, adv, keep, epoch=0, process_index=0)
    # ranked would pair 0-2, 1-3 and 4-5, 7-6; matched pairs even with even and odd with odd: 0-2, 1-3, 4-6, 7-5
    assert tr.objective.partner.tolist() == [2, 3, -1, -1, 6, -1, -1, 5]
    before = trained(tr)
    out = tr.update(batch, adv, keep, epoch=0)
    assert out["objective/dpo_pairs"] == 4.0 and out["objective/dpo_pair_free_distance"] == 0.0
    assert max_change(before, trained(tr)) > 0
    # 4 pairs x the schedule's 4 steps, the one at pure noise (t = 1, weight 0 under weighting=noise) not computed
    assert tr.objective.plan.times[0] == 1.0 and out["policy/trained_units"] == 4 * 3
    ranked = Trainer(
        tiny_cfg(
            tmp_path / "b", "train.objective=dpo", "train.dpo.pairing=ranked", f"rewards=[{{name: {coloured_reward}}}]"
        )
    )
    batch, *_ = ranked.scored_rollout(0)
    ranked.objective.prepare(batch, adv, keep, epoch=0, process_index=0)
    assert ranked.objective.partner.tolist() == [2, 3, -1, -1, 5, -1, -1, 6]
    assert ranked.objective.pair_distance == 1.0  # 4-5 and 7-6 differ in colour, 0-2 and 1-3 do not
    from rewards.registry import REWARDS, register

    @register("test_uncounted", kind="image", counts=None)  # cannot say before it runs: left to the update
    def uncounted(**kwargs):
        return lambda images, prompts, **metadata: torch.zeros(len(images))

    try:
        plain = Trainer(
            tiny_cfg(
                tmp_path / "c", "train.objective=dpo", "train.dpo.pairing=matched", "rewards=[{name: test_uncounted}]"
            )
        )
    finally:
        REWARDS._items.pop("test_uncounted", None)
    batch, *_ = plain.scored_rollout(0)
    assert batch.free_counts is None
    with pytest.raises(ValueError, match=r"pairing=matched .* '<reward>/free_<attribute>=<value>'.* pairing=ranked"):
        plain.objective.prepare(batch, adv, keep, epoch=0, process_index=0)


def test_training_rollouts_free_colours_are_measured_against_eval_free_reference(tmp_path, coloured_reward):
    """eval.free_reference applies to the training rollouts' counts too: the test reward draws red for the even
    images and blue for the odd (4 and 4 of 8), so against a reference of red 3 : blue 1 the TV is
    (|0.5 - 0.75| + |0.5 - 0.25|) / 2 = 0.25; off, nothing is logged."""
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({f"{coloured_reward}/color": {"red": 3, "blue": 1}}))
    key = f"reward/diversity/{coloured_reward}/color"
    for extra, expected in ((f"eval.free_reference={ref}", 0.25), ("eval.free_reference=", None)):
        tr = Trainer(tiny_cfg(tmp_path / "r", f"rewards=[{{name: {coloured_reward}}}]", extra))
        *_, metrics, _ = tr.scored_rollout(0)
        assert metrics[f"{key}_count"] == 8 and metrics[f"{key}_entropy_bits"] == pytest.approx(1.0)
        assert metrics.get(f"{key}_tv_from_reference") == (None if expected is None else pytest.approx(expected))


def test_dpo_free_anchor_leans_matched_pairs_back_to_the_first_epochs_colours(tmp_path, coloured_reward):
    """train.dpo.free_anchor: the base distribution is the first free_anchor_epochs epochs' summed counts (every
    process's totals, batch.free_count_totals), d = q_base - q_now of the epoch's, handed to core.matched_pairs;
    objective/dpo_free_shift logs TV(q_now, q_base); the kept counts go into the checkpoint and come back; and
    the anchor without matched pairs is refused when the config loads."""
    args = ("train.objective=dpo", "train.dpo.pairing=matched", "train.dpo.free_anchor=10")
    tr = Trainer(
        tiny_cfg(tmp_path / "a", *args, "train.dpo.free_anchor_epochs=1", f"rewards=[{{name: {coloured_reward}}}]")
    )
    batch, *_ = tr.scored_rollout(0)
    names = [f"{coloured_reward}/free_color=blue", f"{coloured_reward}/free_color=red"]
    assert batch.free_count_names == names and batch.free_count_totals.tolist() == [4.0, 4.0]
    obj, keep = tr.objective, torch.ones(8, dtype=torch.bool)
    adv = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    obj.prepare(batch, adv, keep, epoch=0, process_index=0)  # the base is this epoch: d = 0, plain matching
    assert obj.anchor_counts == dict(zip(names, [4.0, 4.0])) and obj.anchor_epochs == 1 and obj.free_shift == 0.0
    assert obj.partner.tolist() == [2, -1, -1, -1, -1, 7, -1, -1]  # even (red) with even, odd (blue) with odd
    # epoch 1: group 0 has winner 0 (blue, red = 0, 1) and losers 1 (1, 1), 2 (0, 2), 3 (2, 0); the epoch draws red 6
    # of 8 against the base's 4 of 8: d = (0.25, -0.25), and the loser whose extra object is red is chosen
    batch.free_counts = torch.tensor(
        [[0, 1], [1, 1], [0, 2], [2, 0], [0, 0], [0, 0], [0, 0], [0, 0]], dtype=torch.float32
    )
    batch.free_count_totals = torch.tensor([2.0, 6.0])
    obj.prepare(batch, adv, keep, epoch=1, process_index=0)
    assert obj.partner.tolist() == [2, -1, -1, -1, 7, -1, -1, -1] and obj.free_shift == pytest.approx(0.25)
    assert obj.anchor_counts == dict(zip(names, [4.0, 4.0])) and obj.anchor_epochs == 1  # one epoch's base: kept
    metrics = tr.update(batch, adv, keep, epoch=1)
    assert metrics["objective/dpo_free_shift"] == pytest.approx(0.25)
    state = obj.state_dict()
    assert state["free_anchor/epochs"].item() == 1 and state[f"free_anchor/{names[1]}"].item() == 4.0
    tr.state.epochs_done = 2
    path = tr.save()
    other = Trainer(tiny_cfg(tmp_path / "b", *args, f"rewards=[{{name: {coloured_reward}}}]"))
    assert other.objective.anchor_epochs == 0
    other.load(path, read_checkpoint(path))
    assert other.objective.anchor_counts == obj.anchor_counts and other.objective.anchor_epochs == 1
    # free_anchor_epochs=4 (the default): the base sums the epochs until it holds four
    other.objective.prepare(batch, adv, keep, epoch=2, process_index=0)
    assert other.objective.anchor_epochs == 2 and other.objective.anchor_counts[names[1]] == 10.0
    assert other.objective.free_shift == pytest.approx(abs(10 / 16 - 6 / 8))
    with pytest.raises(ConfigError, match=r"free_anchor=10 .*pairing=ranked .*use train.dpo.pairing=matched"):
        tiny_cfg(tmp_path, "train.objective=dpo", "train.dpo.pairing=ranked", "train.dpo.free_anchor=10")
    with pytest.raises(ConfigError, match="train.dpo.free_anchor_epochs"):
        tiny_cfg(tmp_path, "train.objective=dpo", "train.dpo.free_anchor_epochs=0")


def test_dpo_kl_coef_adds_the_penalty_on_both_images_of_each_pair(tmp_path):
    """train.dpo.kl_coef: the same pairs, times and noise give the loss without it plus kl_coef x the pair's summed
    deviation from the reference (2 x the reported mean over images, policy/dpo_kl); with the adapter perturbed
    (lora_B starts at 0, where the deviation is 0) it is positive, and an epoch trains with it."""
    # weighting=velocity: at kl_coef 0 too every row is computed (none weighs 0), so both see the same rows
    tr = Trainer(
        tiny_cfg(
            tmp_path,
            "train.objective=dpo",
            "train.dpo.pairing=ranked",
            "train.dpo.kl_coef=0.5",
            "train.dpo.weighting=velocity",
        )
    )
    assert tr.objective.settings.kl_coef == 0.5
    batch, _, adv, keep = _epoch_inputs(tr)
    obj = tr.objective
    winners = obj.prepare(batch, adv, keep, epoch=0, process_index=0).nonzero().flatten()
    assert len(winners) > 0
    perturb_lora_b(tr)
    with torch.no_grad():
        obj.settings.kl_coef = 0.0
        plain, stats = obj.unit_loss(batch, winners, [0, 1], adv, keep, None)
        obj.settings.kl_coef = 0.5
        penalised, stats_kl = obj.unit_loss(batch, winners, [0, 1], adv, keep, None)
    assert stats["dpo_kl"] > 0 and torch.equal(stats["dpo_kl"], stats_kl["dpo_kl"])
    torch.testing.assert_close(penalised, plain + 0.5 * 2 * stats["dpo_kl"], rtol=1e-6, atol=1e-7)
    metrics = tr.update(batch, adv, keep, epoch=0)
    assert metrics["policy/dpo_kl"] > 0 and math.isfinite(metrics["policy/loss"])
    with pytest.raises(ConfigError, match="train.dpo.kl_coef"):
        tiny_cfg(tmp_path, "train.objective=dpo", "train.dpo.kl_coef=-1")


def test_dpo_sft_coef_adds_the_winners_own_error(tmp_path):
    """train.dpo.sft_coef: the same pairs, times and noise give the loss without it plus sft_coef x the winners'
    mean velocity error (weighting=velocity: w = 1; the reported policy/dpo_model_error_w), and an epoch trains
    with it; the reference note names it."""
    tr = Trainer(
        tiny_cfg(
            tmp_path,
            "train.objective=dpo",
            "train.dpo.pairing=ranked",
            "train.dpo.sft_coef=2.0",
            "train.dpo.weighting=velocity",
        )
    )
    assert tr.objective.settings.sft_coef == 2.0
    assert "sft_coef 2" in type(tr.objective).reference_note(tr.objective.settings)[1]
    batch, _, adv, keep = _epoch_inputs(tr)
    obj = tr.objective
    winners = obj.prepare(batch, adv, keep, epoch=0, process_index=0).nonzero().flatten()
    assert len(winners) > 0
    perturb_lora_b(tr)
    with torch.no_grad():
        obj.settings.sft_coef = 0.0
        plain, stats = obj.unit_loss(batch, winners, [0, 1], adv, keep, None)
        obj.settings.sft_coef = 2.0
        pulled, stats_sft = obj.unit_loss(batch, winners, [0, 1], adv, keep, None)
    assert stats["dpo_model_error_w"] > 0 and torch.equal(stats["dpo_margin"], stats_sft["dpo_margin"])
    torch.testing.assert_close(pulled, plain + 2.0 * stats["dpo_model_error_w"], rtol=1e-6, atol=1e-7)
    metrics = tr.update(batch, adv, keep, epoch=0)
    assert math.isfinite(metrics["policy/loss"])
    with pytest.raises(ConfigError, match="train.dpo.sft_coef"):
        tiny_cfg(tmp_path, "train.objective=dpo", "train.dpo.sft_coef=-1")


def test_dpo_guidance_scale_compares_the_guided_velocities(tmp_path):
    """train.dpo.guidance_scale > 1: the pairs' losses are core.dpo_loss of the policy's and the reference's
    CFG-guided velocities, here re-derived from guidance's linearity in its scale (u + g (c - u): the scale-3
    velocity is 2 x the scale-2 one minus the CFG-free one), not from the scale-3 pass itself; they differ from the
    CFG-free losses, an epoch trains with them, and 1 (the default) is the CFG-free loss to the bit. The planner
    counts the doubled rows, and a model that cannot be guided is refused in one line."""
    from flowrl.objectives.dpo import DPO

    base = ["train.objective=dpo", "train.dpo.pairing=ranked", "train.dpo.weighting=velocity"]
    tr = Trainer(tiny_cfg(tmp_path / "a", *base, "train.dpo.guidance_scale=3"))
    obj, policy = tr.objective, tr.policy
    batch, _, adv, keep = _epoch_inputs(tr)
    winners = obj.prepare(batch, adv, keep, epoch=0, process_index=0).nonzero().flatten()
    assert len(winners) > 0
    perturb_lora_b(tr)
    rows_w, t, noise = obj.inputs(batch, winners, [0, 1])
    rows_l = obj.partner[winners].repeat(2)
    keys = obj.row_keys(winners, [0, 1]), obj.row_keys(obj.partner[winners], [0, 1], noise_of=winners)

    def guided3(rows, reference):
        with torch.no_grad(), policy.reference() if reference else contextlib.nullcontext():
            plain = policy.flow_prediction(batch, rows, t, noise).velocity
            return 2 * policy.flow_prediction(batch, rows, t, noise, guidance_scale=2.0).velocity - plain

    with torch.no_grad():
        loss, _ = obj.pair_losses(batch, rows_w, rows_l, t, noise, keys)
        obj.settings.guidance_scale = 1.0
        plain, _ = obj.pair_losses(batch, rows_w, rows_l, t, noise, keys)
        obj.settings.guidance_scale = 3.0
        # compared at beta 1: the default beta (5000) multiplies the float32 rounding of the velocities' errors
        # (the scale-3 pass against the re-derivation differ in their last bits) into ~1e-3 of a loss on some CPUs
        obj.settings.beta, beta = 1.0, obj.settings.beta
        at_beta_1, _ = obj.pair_losses(batch, rows_w, rows_l, t, noise, keys)
        obj.settings.beta = beta
    by_hand, _ = core.dpo_loss(
        guided3(rows_w, False),
        guided3(rows_l, False),
        guided3(rows_w, True),
        guided3(rows_l, True),
        obj.clean(batch, rows_w),
        obj.clean(batch, rows_l),
        noise,
        t,
        beta=1.0,
        weight=None,
    )
    torch.testing.assert_close(at_beta_1, by_hand, rtol=1e-5, atol=1e-7)
    assert (loss - plain).abs().max() > 1e-2  # guidance changes the velocities the loss compares
    metrics = tr.update(batch, adv, keep, epoch=0)
    assert math.isfinite(metrics["policy/loss"])

    cfg_free = Trainer(tiny_cfg(tmp_path / "b", *base, "train.dpo.guidance_scale=1"))
    default = Trainer(tiny_cfg(tmp_path / "c", *base))
    for run in (cfg_free, default):
        b, _, a, k = _epoch_inputs(run)
        w = run.objective.prepare(b, a, k, epoch=0, process_index=0).nonzero().flatten()
        perturb_lora_b(run)
        with torch.no_grad():
            run.last = run.objective.unit_loss(b, w, [0, 1], a, k, None)[0]
    assert torch.equal(cfg_free.last, default.last)

    cfg = tiny_cfg(tmp_path / "d", *base, "train.dpo.guidance_scale=3")
    assert DPO.memory_terms(cfg, 2).rows == 2 * DPO.memory_terms(default.cfg, 2).rows
    assert "x 2 (CFG at 3)" in DPO.memory_terms(cfg, 2).rows_note
    # a true-CFG family rolled out unguided still runs two rows a velocity for the guided loss; a guidance-embedding
    # family (FLUX.1) runs one
    assert DPO.memory_terms(cfg, 1, true_cfg=True).rows == DPO.memory_terms(cfg, 2).rows
    assert DPO.memory_terms(cfg, 1, true_cfg=False).rows == DPO.memory_terms(default.cfg, 1).rows
    backend = SimpleNamespace(uses_cfg_encodings=False, training_guidance_scale=lambda g: 1.0)  # FLUX.1 schnell
    stub = SimpleNamespace(backend=backend, add_shadow=lambda name: None, ensure_reference=lambda: None)
    with pytest.raises(ConfigError, match=r"train.dpo.guidance_scale=3: .*use train.dpo.guidance_scale=1") as e:
        DPO(cfg, stub)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="train.dpo.guidance_scale"):
        tiny_cfg(tmp_path, "train.objective=dpo", "train.dpo.guidance_scale=-1")


def test_dpo_reference_decay_measures_the_margins_against_a_shadow_that_follows_the_weights(tmp_path):
    """train.dpo.reference_decay < 1: the reference is a shadow adapter that starts as the base model (the pairs'
    loss as with the adapter off, the trained weights perturbed), and after each epoch's update moves to
    d ref + (1 - d) theta, parameter by parameter; at d = 0 it is the trained policy itself, so every pair's margin
    is 0 and its loss log 2. The shadow is in the checkpoint's objective state; at d = 1 (the default) there is
    none."""
    base = ["train.objective=dpo", "train.dpo.pairing=ranked", "train.dpo.weighting=velocity"]
    tr = Trainer(tiny_cfg(tmp_path / "a", *base, "train.dpo.reference_decay=0.25"))
    obj = tr.objective
    shadow = tr.policy.shadow_parameters("reference")
    assert set(shadow) == set(tr.named_params)
    batch, _, adv, keep = _epoch_inputs(tr)
    winners = obj.prepare(batch, adv, keep, epoch=0, process_index=0).nonzero().flatten()
    assert len(winners) > 0
    perturb_lora_b(tr)
    with torch.no_grad():
        against_shadow, _ = obj.unit_loss(batch, winners, [0, 1], adv, keep, None)
        obj.settings.reference_decay = 1.0  # the adapter off
        against_base, _ = obj.unit_loss(batch, winners, [0, 1], adv, keep, None)
        obj.settings.reference_decay = 0.25
    torch.testing.assert_close(against_shadow, against_base, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(against_base, torch.tensor(math.log(2.0)))  # the perturbed adapter has margins

    before = {n: w.detach().clone() for n, w in shadow.items()}
    metrics = tr.update(batch, adv, keep, epoch=0)  # trains, then after_update moves the shadow
    assert math.isfinite(metrics["policy/loss"])
    for n, p in tr.named_params.items():
        torch.testing.assert_close(shadow[n], 0.25 * before[n] + 0.75 * p.detach(), rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(shadow[n], before[n]) for n in shadow)
    assert {f"reference/{n}" for n in shadow} <= set(obj.state_dict())

    obj.settings.reference_decay = 0.0
    obj.after_update(tr.state.optimizer_steps)  # the shadow is now the trained weights
    with torch.no_grad():
        same, stats = obj.unit_loss(batch, winners, [0, 1], adv, keep, None)
    torch.testing.assert_close(same, torch.tensor(math.log(2.0)), rtol=0, atol=1e-6)

    assert not Trainer(tiny_cfg(tmp_path / "b", *base)).policy.shadows
    full = Trainer(tiny_cfg(tmp_path / "c", *base, "lora.enabled=false", "train.dpo.reference_decay=0.5"))
    assert full.policy.ref_copy is None and "reference" in full.policy.shadows  # the shadow is the reference
    assert math.isfinite(full.update(*[_epoch_inputs(full)[i] for i in (0, 2, 3)], epoch=0)["policy/loss"])
    with pytest.raises(ConfigError, match="train.dpo.reference_decay"):
        tiny_cfg(tmp_path, "train.objective=dpo", "train.dpo.reference_decay=1.5")


def test_a_resume_that_turns_the_dpo_reference_shadow_on_says_where_it_starts(tmp_path):
    """A run of reference_decay 1 (no shadow) resumed with 0.5: the checkpoint has no shadow, which then starts from
    the checkpoint's trained weights; the warning says so and why, not that another objective wrote it alone."""
    base = ["train.objective=dpo", "train.dpo.pairing=ranked", "checkpoint.resume=auto"]
    Trainer(tiny_cfg(tmp_path, *base, "train.epochs=1")).fit()
    with pytest.warns(
        UserWarning,
        match=r"holds no 'reference' policy of train\.objective=dpo \(it was written by another objective, or with "
        r"the setting that keeps 'reference' off, e\.g\. train\.dpo\.reference_decay=1\): 'reference' starts from the "
        r"checkpoint's trained weights, not from the base model as in a new run",
    ):
        tr = Trainer(tiny_cfg(tmp_path, *base, "train.epochs=2", "train.dpo.reference_decay=0.5"))
        tr.fit()
    assert tr.state.epochs_done == 2 and "reference" in tr.policy.shadows


def test_fresh_noise_per_pass_draws_new_noise_after_the_first_pass(tmp_path):
    """train.fresh_noise_per_pass: pass 0 noises a (sample, time slot) as without it; each later pass with noise of
    its own (without it, every pass the first one's); the training times stay; an epoch of two passes trains. GRPO,
    which noises nothing at update time, and the reference cache, which reuses the first pass's points, refuse it."""
    base = ["train.objective=dpo", "train.dpo.pairing=ranked", "train.inner_epochs=2"]
    fresh = Trainer(tiny_cfg(tmp_path, *base, "train.fresh_noise_per_pass=true"))
    plain = Trainer(tiny_cfg(tmp_path, *base))
    draws = {}
    for name, tr in (("fresh", fresh), ("plain", plain)):
        batch, _, adv, keep = _epoch_inputs(tr)
        tr.objective.prepare(batch, adv, keep, epoch=3, process_index=0)
        shape = tr.policy.sample_shape(batch)
        for k in (0, 1):
            tr.objective.begin_pass(k)
            draws[name, k] = tr.objective.noise(2, 1, shape)
        draws[name, "steps"] = tr.objective.plan.steps.clone()
    assert torch.equal(draws["fresh", 0], draws["plain", 0]) and torch.equal(draws["plain", 1], draws["plain", 0])
    assert not torch.allclose(draws["fresh", 1], draws["fresh", 0])
    assert abs(float(draws["fresh", 1].std()) - 1) < 0.3  # a standard normal draw, not a copy shifted
    assert torch.equal(draws["fresh", "steps"], draws["plain", "steps"])
    batch, _, adv, keep = _epoch_inputs(fresh)
    metrics = fresh.update(batch, adv, keep, epoch=0)
    assert math.isfinite(metrics["policy/loss"]) and fresh.objective.pass_index == 1
    with pytest.raises(ConfigError, match="train.objective=grpo noises no sample at update time"):
        tiny_cfg(tmp_path, "train.fresh_noise_per_pass=true")
    with pytest.raises(ConfigError, match="train.cache_reference reuses the first pass's points"):
        tiny_cfg(tmp_path, *base, "train.fresh_noise_per_pass=true", "train.cache_reference=true")


# ------------------------------------------------------------------------------------ config


def test_the_objectives_refuse_what_they_cannot_take(tmp_path):
    def problems(*extra):
        with pytest.raises(ConfigError) as e:
            tiny_cfg(tmp_path, *extra)
        return str(e.value)

    assert "train.objective=grpo" in problems("backend=text", "train.objective=dpo")
    assert "at most 4" in problems("train.objective=nft", "train.nft.timesteps=5")
    assert "train.objective" in problems("train.objective=ppo") and "Did you mean" in problems("train.objective=nfp")
    assert tiny_cfg(tmp_path, "train.objective=dpo", "train.dpo.timesteps=4").train.dpo.timesteps == 4
    # GRPO's section is GRPO's: its relations are checked under GRPO and ignored under another objective
    grpo_only = [
        "train.grpo.window.kind=fixed",
        "train.grpo.window.size=0",
        "train.grpo.beta=0.1",
        "train.grpo.same_noise_per_group=true",
        "train.grpo.step_weighting=ratio_norm",
        "train.grpo.sde_type=cps",
    ]
    assert "train.grpo.window" in problems(*grpo_only) and "ratio_norm" in problems(*grpo_only)
    for name in OBJECTIVES:
        cfg = tiny_cfg(tmp_path, f"train.objective={name}", *grpo_only)
        assert cfg.train.objective == name and cfg.train.grpo.beta == 0.1
    # ... and a value outside its range is refused in any section, in use or not
    assert "train.grpo.beta must be >= 0" in problems("train.objective=nft", "train.grpo.beta=-1")
    assert "train.nft.decay_cap must be in [0, 1]" in problems("train.nft.decay_cap=2")
    # DPO pairs within a process: groups may not span two
    from flowrl.objectives.dpo import DPO

    cfg = tiny_cfg(tmp_path, "train.objective=dpo", "sample.prompts_per_epoch=3")
    stub = SimpleNamespace(ensure_reference=lambda: None)
    with pytest.raises(ValueError, match="splits groups"):
        DPO(cfg, stub, num_processes=2)
    DPO(cfg, stub, num_processes=3)


def test_help_documents_the_objectives():
    docs = {key: doc for key, _, _, doc in describe()}
    assert "DiffusionNFT" in docs["train.objective"] and "grpo" in docs["train.objective"]
    for key in (
        "train.nft.beta",
        "train.nft.decay_rate",
        "train.nft.timesteps",
        "train.awm.weighting",
        "train.awm.kl_coef",
        "train.dpo.beta",
        "train.dpo.weighting",
        "train.crd.kl_cfg",
        "train.dgpo.beta",
        "train.dgpo.kl_coef",
    ):
        assert "reference" in docs[key] or "paper" in docs[key] or "Flow-DPO" in docs[key], key
    from flowrl.objectives import OBJECTIVES as REGISTRY

    assert REGISTRY.names() == sorted(["grpo", *FAMILY_LOOP])
    assert sorted(core.OBJECTIVE_LOSSES.names()) == sorted(OBJECTIVES)  # offline DPO's loss is online DPO's
    # each objective names itself in reports and the demo's banner, and no two alike
    titles = [REGISTRY.get(name).title for name in REGISTRY.names()]
    assert len(set(titles)) == len(titles) and REGISTRY.get("dpo").title == "online Diffusion-DPO"


def _epochs_with_and_without_the_reference_cache(tmp_path, *extra):
    """One two-pass epoch's update (minibatches of 4, lora_B off zero) without and with train.cache_reference:
    {cached: (trainer, entries into the reference, trained weights, batch)}."""
    runs = {}
    for cached in (False, True):
        cfg = tiny_cfg(
            tmp_path / str(cached),
            *extra,
            "train.inner_epochs=2",
            "train.minibatch_size=4",
            f"train.cache_reference={str(cached).lower()}",
        )
        tr = Trainer(cfg)
        perturb_lora_b(tr)
        calls = count_reference_entries(tr.policy)
        start = trained(tr)
        batch, _, adv, keep = _epoch_inputs(tr)
        tr.update(batch, adv, keep, epoch=0)
        assert max_change(trained(tr), start) > 1e-4  # it trained
        runs[cached] = (tr, len(calls), trained(tr), batch)
    return runs


@pytest.mark.parametrize(
    "objective, extra",
    [
        ("dpo", ("train.dpo.pairing=ranked",)),
        ("dpo", ("train.dpo.pairing=ranked", "train.dpo.continuous_times=true")),
        ("nft", ("train.nft.kl_coef=0.1",)),
    ],
    ids=["dpo", "dpo-continuous-times", "nft"],
)
def test_cache_reference_runs_the_reference_once_an_epoch_with_the_same_result(objective, extra, tmp_path):
    """train.cache_reference with two passes: the reference runs in the first pass only (the second reads each row's
    velocity by its key), and the epoch trains the same weights as without the cache, up to a batched forward's
    rounding; the cache is the epoch's (the next epoch's draw starts it again) and off with one pass."""
    runs = _epochs_with_and_without_the_reference_cache(tmp_path, f"train.objective={objective}", *extra)
    (_, plain_calls, plain_w, _), (cached_tr, cached_calls, cached_w, batch) = runs[False], runs[True]
    assert plain_calls > 0 and cached_calls * 2 == plain_calls
    obj = cached_tr.objective
    assert obj.reference_hits > 0 and len(obj.reference_cache) == obj.reference_hits
    assert max_change(cached_w, plain_w) <= 1e-5
    # a cached velocity is the reference's at its key's point
    key = next(iter(obj.reference_cache))
    owner, slot, sample = key[:3]
    rows, t, noise = obj.inputs(batch, torch.tensor([owner]), [slot])
    with torch.no_grad(), obj.policy.reference():
        fresh = obj.policy.flow_prediction(batch, torch.tensor([sample]), t, noise).velocity[0]
    torch.testing.assert_close(obj.reference_cache[key], fresh, rtol=1e-5, atol=1e-6)
    batch, _, adv, keep = _epoch_inputs(cached_tr, epoch=1)
    obj.prepare(batch, adv, keep, epoch=1, process_index=0)
    assert obj.reference_cache == {} and obj.reference_hits == 0
    one_pass = Trainer(tiny_cfg(tmp_path / "one", f"train.objective={objective}", *extra, "train.cache_reference=true"))
    batch, _, adv, keep = _epoch_inputs(one_pass)
    one_pass.objective.prepare(batch, adv, keep, epoch=0, process_index=0)
    assert one_pass.objective.reference_cache is None


def test_grpo_cache_reference_runs_the_reference_once_an_epoch_with_the_same_result(tmp_path):
    """GRPO with a KL term and two passes: train.cache_reference keeps each trained step's reference mean (at the
    recorded latent: the same input in both passes) from the first pass, so the reference runs half as often, and
    the epoch trains the same weights as without the cache, up to a batched forward's rounding."""
    runs = _epochs_with_and_without_the_reference_cache(tmp_path, "train.objective=grpo", "train.grpo.beta=0.5")
    (_, plain_calls, plain_w, _), (tr, cached_calls, cached_w, batch) = runs[False], runs[True]
    assert plain_calls > 0 and cached_calls * 2 == plain_calls
    obj = tr.objective
    steps = len(batch.traj.train_steps)
    assert len(obj.reference_cache) == len(batch.prompts) * steps == obj.reference_hits
    assert max_change(cached_w, plain_w) <= 1e-5
    # a kept mean is the reference's step mean at its sample's recorded latent
    (sample, step), kept = next(iter(obj.reference_cache.items()))
    with torch.no_grad(), tr.policy.reference():
        fresh = tr.policy.backend.step_log_prob(batch.traj, [step], sample_indices=torch.tensor([sample]))[1][0, 0]
    torch.testing.assert_close(kept, fresh, rtol=1e-5, atol=1e-6)
    # the next epoch starts a new cache; without a KL term there is nothing to keep
    batch, _, adv, keep = _epoch_inputs(tr, epoch=1)
    obj.prepare(batch, adv, keep, epoch=1, process_index=0)
    assert obj.reference_cache == {} and obj.reference_hits == 0
    no_kl = Trainer(tiny_cfg(tmp_path / "nokl", "train.inner_epochs=2", "train.cache_reference=true"))
    no_kl.objective.prepare(batch, adv, keep, epoch=1, process_index=0)
    assert no_kl.objective.reference_cache is None


@pytest.mark.parametrize(
    "objective, extra",
    [("dpo", "train.dpo.pairing=ranked train.dpo.beta=100"), ("nft", "train.nft.kl_coef=0.1")],
    ids=["dpo", "nft"],
)
def test_steps_per_forward_batches_the_times_without_changing_the_update(objective, extra, tmp_path):
    """train.steps_per_forward only groups a sample's training times into fewer, larger forward passes: one time a
    forward and every time in one forward give the same gradient at every optimizer step of an epoch's update
    (each time's noise is keyed by its sample and slot, not by the forward it runs in), up to a batched forward's
    rounding, and so the same weights. DPO at the demo's beta: its loss multiplies the difference of two squared
    errors by beta, and at the paper's 5000 that turns the rounding (1e-7) into ~4e-4 of the gradient."""
    runs = {}
    for spf in (1, 8):
        tr = Trainer(
            tiny_cfg(
                tmp_path / str(spf),
                f"train.objective={objective}",
                *extra.split(),
                "train.inner_epochs=2",
                "train.cache_reference=true",
                f"train.steps_per_forward={spf}",
            )
        )
        perturb_lora_b(tr)  # lora_B starts at 0, where the trained model is its reference
        start = trained(tr)
        batch, _, adv, keep = _epoch_inputs(tr)
        grads, units = [], []
        step, unit_fn = tr.dist.step, tr.objective.train_units

        def recorded(step=step, grads=grads):
            grads.append([p.grad.clone() for p in tr.params])
            step()

        def counted(b, n, unit_fn=unit_fn, units=units):
            out = unit_fn(b, n)
            units.append(len(out))
            return out

        tr.dist.step, tr.objective.train_units = recorded, counted
        tr.update(batch, adv, keep, epoch=0)
        assert max_change(trained(tr), start) > 1e-4  # it trained
        runs[spf] = (grads, units, tr.objective.plan.steps.shape[1], trained(tr))
    (g1, units1, times, w1), (g8, units8, _, w8) = runs[1], runs[8]
    assert times > 1 and units1 == [times] and units8 == [1]  # a forward per time, then one for all of them
    assert len(g1) == len(g8) > 1
    for step1, step8 in zip(g1, g8):
        assert any(g.abs().max() > 0 for g in step1)
        for a, b in zip(step1, step8):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
    assert max_change(w1, w8) <= 1e-4  # Adam's g / sqrt(v) magnifies the rounding of weights with tiny gradients


def test_dpo_max_time_trains_only_the_steps_at_or_below_it(tmp_path):
    """train.dpo.max_time: the training times are drawn from the schedule's steps at t <= max_time only (all of them
    with timesteps 0, in a random order per sample); 1, the default, draws as before from every step; more times
    than it leaves is a one-line error naming both settings."""
    tr = Trainer(tiny_cfg(tmp_path, "train.objective=dpo", "train.dpo.max_time=0.7"))
    batch, _, adv, keep = _epoch_inputs(tr)
    obj = tr.objective
    obj.prepare(batch, adv, keep, epoch=0, process_index=0)
    times = obj.plan.times
    assert times.tolist() == pytest.approx([1.0, 0.8577, 0.6022, 0.0089], abs=1e-4)  # the tiny SD3's shifted 4 steps
    assert obj.plan.steps.shape == (8, 2)
    assert all(sorted(row) == [2, 3] for row in obj.plan.steps.tolist())
    assert {tuple(r) for r in obj.plan.steps.tolist()} == {(2, 3), (3, 2)}  # each sample's own order
    before = trained(tr)
    tr.update(batch, adv, keep, epoch=0)
    assert max_change(trained(tr), before) > 0
    g = torch.Generator().manual_seed(5)
    obj.settings.max_time = 1.0
    assert torch.equal(obj.draw_steps(8, times, g), random_order(8, 4, 4, torch.Generator().manual_seed(5)))
    obj.settings.max_time, obj.settings.timesteps = 0.7, 3
    with pytest.raises(ValueError, match=r"train.dpo.max_time=0.7 leaves 2 of the schedule's 4 steps .* timesteps=3"):
        obj.draw_steps(8, times, g)
    with pytest.raises(ConfigError, match="train.dpo.max_time"):
        tiny_cfg(tmp_path, "train.objective=dpo", "train.dpo.max_time=0")


def test_dpo_continuous_times_train_anywhere_in_each_steps_interval(tmp_path):
    """train.dpo.continuous_times: each slot keeps the schedule step it drew (the same steps as without), and its
    time lies anywhere in that step's interval (t_{k+1}, t_k] (0 after the last step), drawn again each epoch from
    the seed alone (a resumed run's epoch draws the same); the update trains; off, the times are the steps' own."""
    plain = Trainer(tiny_cfg(tmp_path / "plain", "train.objective=dpo"))
    tr = Trainer(tiny_cfg(tmp_path / "cont", "train.objective=dpo", "train.dpo.continuous_times=true"))
    batch, _, adv, keep = _epoch_inputs(tr)
    winners = tr.objective.prepare(batch, adv, keep, epoch=0, process_index=0).nonzero().flatten()
    plain.objective.prepare(batch, adv, keep, epoch=0, process_index=0)
    plan, plain_plan = tr.objective.plan, plain.objective.plan
    assert plain_plan.within is None and torch.equal(plan.steps, plain_plan.steps)
    times, slots = plan.times, list(range(plan.steps.shape[1]))
    ends = torch.cat([times[1:], torch.zeros(1)])
    rows, t, _ = tr.objective.inputs(batch, winners, slots)
    steps = plan.steps[rows, torch.tensor(slots).repeat_interleave(len(winners))]
    assert ((t <= times[steps]) & (t > ends[steps])).all()
    assert not torch.isin(t, times).any()  # (a draw of u = 0 exactly would be the step's own time)
    _, t_plain, _ = plain.objective.inputs(batch, winners, slots)
    assert torch.equal(t_plain, times[steps])
    tr.objective.prepare(batch, adv, keep, epoch=0, process_index=0)
    assert torch.equal(tr.objective.inputs(batch, winners, slots)[1], t)  # the epoch's draw, again
    tr.objective.prepare(batch, adv, keep, epoch=1, process_index=0)
    assert not torch.equal(tr.objective.inputs(batch, winners, slots)[1], t)
    tr.objective.prepare(batch, adv, keep, epoch=0, process_index=0)
    perturb_lora_b(tr)
    before = trained(tr)
    tr.update(batch, adv, keep, epoch=0)
    assert max_change(trained(tr), before) > 0


def test_dpo_weighting_gives_the_loss_its_time_weight(tmp_path, monkeypatch):
    """train.dpo.weighting: core.dpo_loss gets w(t) = (1 - t)^2 (noise), 1 - t (linear) or none (velocity, w = 1) at
    each pair's training time."""
    tr = Trainer(tiny_cfg(tmp_path, "train.objective=dpo"))
    batch, _, adv, keep = _epoch_inputs(tr)
    obj = tr.objective
    winners = obj.prepare(batch, adv, keep, epoch=0, process_index=0).nonzero().flatten()
    seen = {}
    dpo_loss = core.dpo_loss

    def spy(*args, weight=None, **kwargs):
        seen["t"], seen["weight"] = args[7], weight
        return dpo_loss(*args, weight=weight, **kwargs)

    monkeypatch.setattr(core, "dpo_loss", spy)
    expected = {"noise": lambda t: (1 - t) ** 2, "linear": lambda t: 1 - t, "velocity": None}
    for name, w in expected.items():
        obj.settings.weighting = name
        obj.unit_loss(batch, winners, [0, 1], adv, keep, None)
        t = seen["t"]
        computed = 2 * len(winners) if w is None else int((obj.inputs(batch, winners, [0, 1])[1] < 1).sum())
        assert len(t) == computed and len(t.unique()) > 1
        if w is None:
            assert seen["weight"] is None
        else:
            torch.testing.assert_close(seen["weight"], w(t), rtol=0, atol=0)


@pytest.mark.parametrize("weighting", ["noise", "linear"])
def test_dpo_rows_at_pure_noise_are_not_computed_and_change_nothing(weighting, tmp_path):
    """Under weighting noise or linear a pair's row at t = 1 weighs w = 0: its inside is 0 whatever the model, so
    its loss is log 2 and its gradient 0. It is left out of the forward passes (the policy's and the reference's)
    and kept in the loss's mean: the per-row losses and the gradient equal those of every row computed (up to a
    batched forward's rounding); with kl_coef > 0 (a penalty at every time) every row is computed."""
    tr = Trainer(
        tiny_cfg(tmp_path, "train.objective=dpo", "train.dpo.pairing=ranked", f"train.dpo.weighting={weighting}")
    )
    perturb_lora_b(tr)
    batch, _, adv, keep = _epoch_inputs(tr)
    obj = tr.objective
    winners = obj.prepare(batch, adv, keep, epoch=0, process_index=0).nonzero().flatten()
    unit = list(range(obj.plan.steps.shape[1]))  # every time of the 4-step schedule in one forward: t = 1 among them
    rows_w, t, noise = obj.inputs(batch, winners, unit)
    assert (t == 1).sum() == len(winners) and len(winners) > 1  # each winner's row at pure noise
    seen = []
    predict = tr.policy.flow_prediction

    def spy(batch_, rows, t_, noise_, **kwargs):
        seen.append(t_)
        return predict(batch_, rows, t_, noise_, **kwargs)

    tr.policy.flow_prediction = spy

    def losses_and_grads(fn):
        tr.opt.zero_grad(set_to_none=True)
        seen.clear()
        loss, stats = fn()
        loss.mean().backward()
        return loss.detach(), [p.grad.clone() for p in tr.params], list(seen)

    skipped, g_skipped, calls = losses_and_grads(lambda: obj.row_losses(batch, winners, unit, adv))
    assert len(calls) == 2 and all(len(c) == 2 * (len(t) - len(winners)) and (c < 1).all() for c in calls)
    losers = obj.partner[winners].repeat(len(unit))
    keys = obj.row_keys(winners, unit), obj.row_keys(obj.partner[winners], unit, noise_of=winners)
    every, g_every, calls = losses_and_grads(lambda: obj.pair_losses(batch, rows_w, losers, t, noise, keys))
    assert len(calls) == 2 and all(len(c) == 2 * len(t) for c in calls)  # the policy's and the reference's pass
    assert torch.equal(skipped[t == 1], torch.full_like(skipped[t == 1], math.log(2.0)))
    torch.testing.assert_close(every[t == 1], skipped[t == 1], rtol=0, atol=1e-7)  # -log sigmoid(0)
    torch.testing.assert_close(skipped, every, rtol=1e-5, atol=1e-7)
    assert any(g.abs().max() > 0 for g in g_every)
    for a, b in zip(g_skipped, g_every):  # (the rounding of a batch of other rows, on elements near zero)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    obj.settings.kl_coef = 0.1
    losses_and_grads(lambda: obj.row_losses(batch, winners, unit, adv))
    assert all(len(c) == 2 * len(t) for c in seen)
