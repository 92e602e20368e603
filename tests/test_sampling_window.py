"""SDE windows, the recording loop and Trajectory bookkeeping (no diffusers)."""

import pytest
import torch

from flowrl.sampling import (
    PromptEncodings,
    SamplerSettings,
    SDEWindow,
    StepOutput,
    Trajectory,
    as_sde_window,
    flow_sde_step,
    record_chain,
)


def steps_of(window, num_steps, epoch=0):
    return list(window.steps(num_steps, epoch))


def test_all_and_fixed_windows():
    assert steps_of(SDEWindow(), 4) == [0, 1, 2, 3]
    assert steps_of(SDEWindow.fixed(2, 3), 10) == [2, 3, 4]
    assert SDEWindow.fixed(2, 3).mask(6).tolist() == [False, False, True, True, True, False]
    assert steps_of(as_sde_window((1, 2)), 5) == [1, 2] and steps_of(as_sde_window(None), 2) == [0, 1]
    with pytest.raises(ValueError, match="does not fit"):
        SDEWindow.fixed(8, 3).steps(10)


def test_sliding_window_moves_and_rolls_back():
    # S = 10, size 4, stride 2, moving every 3 epochs: starts 0, 2, 4, 6 (6 + 4 = 10 is the last fit), then 0
    window = SDEWindow.sliding(4, stride=2, every=3)
    starts = [window.steps(10, epoch).start for epoch in range(14)]
    assert starts == [0, 0, 0, 2, 2, 2, 4, 4, 4, 6, 6, 6, 0, 0]
    # limit 7, start 1, stride 1: starts 1, 2, 3 (3 + 4 = 7), then back to 1
    window = SDEWindow.sliding(4, start=1, limit=7)
    assert [window.steps(10, e).start for e in range(5)] == [1, 2, 3, 1, 2]
    assert window.mask(10, 1).tolist() == [False, False, True, True, True, True, False, False, False, False]


def test_window_errors():
    with pytest.raises(ValueError, match="kind"):
        SDEWindow("random")
    with pytest.raises(ValueError, match="size >= 1"):
        SDEWindow("fixed", size=0)
    with pytest.raises(ValueError, match="does not fit"):
        SDEWindow.sliding(5, start=3).steps(6)
    with pytest.raises(ValueError, match="sde_window"):
        as_sde_window(3)


def toy_chain(sde_mask, record_means=False, seed=0):
    # velocity v(x) = -x: a deterministic "model"; flow sigmas 1 -> 0 in S steps
    num_steps = len(sde_mask)
    sigmas = torch.linspace(1, 0, num_steps + 1)
    g = torch.Generator().manual_seed(seed)

    def step(v, x, i, stochastic):
        return flow_sde_step(v, x, sigmas[i], sigmas[i + 1], sde_type="sde" if stochastic else "ode", generator=g)

    x0 = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(100))
    return record_chain(lambda x, i: -x, step, x0, torch.tensor(sde_mask), record_means=record_means), sigmas, x0


def test_record_chain_records_each_step():
    chain, sigmas, x0 = toy_chain([True, False, True, True], record_means=True)
    assert chain.latents.shape == (3, 5, 2, 4, 4) and chain.log_probs.shape == (3, 4)
    assert torch.equal(chain.latents[:, 0], x0)
    # each recorded transition rescored from the stored latents gives the recorded log-prob and mean
    for i in range(4):
        x = chain.latents[:, i]
        kind = "ode" if i == 1 else "sde"
        out = flow_sde_step(-x, x, sigmas[i], sigmas[i + 1], sde_type=kind, prev_latents=chain.latents[:, i + 1])
        assert torch.equal(out.log_prob, chain.log_probs[:, i])
        assert torch.equal(out.mean, chain.means[:, i])
        assert chain.stds[i].item() == pytest.approx(out.std.flatten()[0].item())
    # the deterministic step is the Euler step, with no log-prob and no std
    assert torch.allclose(chain.latents[:, 2], chain.latents[:, 1] + (sigmas[2] - sigmas[1]) * -chain.latents[:, 1])
    assert chain.log_probs[:, 1].abs().max() == 0 and chain.stds[1] == 0
    assert (chain.stds[[0, 2, 3]] > 0).all()


def make_traj(batch=4, steps=3):
    g = torch.Generator().manual_seed(0)
    enc = PromptEncodings(
        ["a", "b"],
        {"prompt_embeds": torch.randn(2, 5, 8, generator=g)},
        {"ids": torch.zeros(5, 3)},
        {"prompt_embeds": torch.zeros(1, 5, 8)},
    )
    return Trajectory(
        latents=torch.randn(batch, steps + 1, 4, 2, 2, generator=g),
        log_probs=torch.randn(batch, steps, generator=g),
        stds=torch.rand(steps, generator=g),
        timesteps=torch.tensor([1000.0, 600.0, 200.0]),
        sde_mask=torch.tensor([True, True, False]),
        prompts=["a", "a", "b", "b"],
        prompt_ids=torch.tensor([0, 0, 1, 1]),
        group_ids=torch.tensor([0, 0, 1, 1]),
        prompt_encodings=enc,
        sampler=SamplerSettings("sd3", "sde", 0.7, 4.5, "mean", 32, 32),
        sigmas=torch.tensor([1.0, 0.6, 0.2, 0.0]),
        means=torch.randn(batch, steps, 4, 2, 2, generator=g),
        images=["img0", "img1", "img2", "img3"],
    )


def test_trajectory_select_subsets_samples_only():
    traj = make_traj()
    sub = traj.select([3, 0])
    assert len(sub) == 2 and sub.num_steps == 3
    assert torch.equal(sub.latents, traj.latents[[3, 0]]) and torch.equal(sub.log_probs, traj.log_probs[[3, 0]])
    assert torch.equal(sub.means, traj.means[[3, 0]])
    assert sub.prompts == ["b", "a"] and sub.images == ["img3", "img0"]
    assert sub.prompt_ids.tolist() == [1, 0] and sub.group_ids.tolist() == [1, 0]
    assert sub.prompt_encodings is traj.prompt_encodings  # shared, not copied
    assert sub.stds is traj.stds and sub.sigmas is traj.sigmas and sub.sampler == traj.sampler
    assert traj.train_steps == [0, 1]
    with pytest.raises(IndexError):
        traj.select([4])


def test_trajectory_to_moves_every_tensor():
    traj = make_traj().to("meta")
    assert traj.latents.device.type == "meta" and traj.sigmas.device.type == "meta"
    assert traj.prompt_encodings.per_prompt["prompt_embeds"].device.type == "meta"
    assert traj.prompt_encodings.shared["ids"].device.type == "meta"
    assert traj.prompt_encodings.negative["prompt_embeds"].device.type == "meta"
    assert traj.images == ["img0", "img1", "img2", "img3"]


def test_prompt_encodings_gather():
    enc = make_traj().prompt_encodings
    rows = enc.gather(enc.ids_for(["b", "a", "b"]))
    assert torch.equal(rows["prompt_embeds"], enc.per_prompt["prompt_embeds"][[1, 0, 1]])
    assert enc.negative_rows(3)["prompt_embeds"].shape == (3, 5, 8)
    with pytest.raises(KeyError, match="not encoded"):
        enc.ids_for(["c"])


def test_step_output_is_a_named_tuple():
    out = StepOutput(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1))
    prev, log_prob, mean, std = out
    assert out._fields == ("prev_latents", "log_prob", "mean", "std")


def test_trajectory_cat_offsets_groups_and_merges_prompts():
    a = make_traj()
    b = make_traj().select([2, 3, 0])  # prompts b, b, a
    b.prompt_encodings = PromptEncodings(["b", "c"], {"prompt_embeds": torch.randn(2, 5, 8)})
    b.prompt_ids, b.prompts = torch.tensor([0, 0, 1]), ["b", "b", "c"]
    joined = Trajectory.cat([a, b])
    assert len(joined) == 7 and torch.equal(joined.latents, torch.cat([a.latents, b.latents]))
    assert joined.group_ids.tolist() == [0, 0, 1, 1, 3, 3, 2]  # b's groups 1, 1, 0 shifted by a's 2 groups
    assert joined.prompt_encodings.prompts == ["a", "b", "c"] and joined.prompts == a.prompts + b.prompts
    merged = joined.prompt_encodings.gather(joined.prompt_ids)["prompt_embeds"]
    assert torch.equal(merged[:4], a.prompt_encodings.gather(a.prompt_ids)["prompt_embeds"])
    assert torch.equal(merged[6], b.prompt_encodings.per_prompt["prompt_embeds"][1])  # "c" came from b
    assert joined.images == a.images + b.images
    other = make_traj()
    other.sde_mask = torch.tensor([True, False, False])
    with pytest.raises(ValueError, match="SDE mask"):
        Trajectory.cat([a, other])
