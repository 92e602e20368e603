"""Image backends on tiny SD3 / FLUX / SD1.5 pipelines: recorded log-probs are reproduced (ratio 1),
stacked steps equal single steps, windows, groups, seeds, prompt caching, gradients, loading."""

import numpy as np
import pytest
import torch
from imagetiny import (
    FAMILIES,
    PROMPTS,
    SIZE,
    STOCHASTIC_SDE_TYPES,
    fresh_backend,
    max_abs_diff,
    tiny_backend,
    tiny_rollout,
)

from flowrl.families import detect_family, family_names, load_image_backend
from flowrl.families.flux import FluxBackend
from flowrl.families.sd3 import SD3Backend
from flowrl.families.sd15 import SD15Backend
from flowrl.sampling import SDEWindow, Trajectory

CASES = [(family, sde_type) for family in FAMILIES for sde_type in STOCHASTIC_SDE_TYPES[family]]


@pytest.mark.parametrize("family,sde_type", CASES)
def test_recomputed_log_probs_equal_recorded(family, sde_type):
    backend = tiny_backend(family)
    traj = tiny_rollout(backend, sde_type=sde_type, record_means=True)
    assert traj.sde_mask.all() and traj.log_probs.dtype == torch.float32
    steps = traj.train_steps
    # a real, non-constant log-prob was recorded (CPS's last step, sigma_next = 0, is deterministic: 0)
    assert torch.isfinite(traj.log_probs).all() and traj.log_probs[:, 0].abs().min() > 1e-3
    out = backend.step_log_prob(traj, steps)
    assert out.log_prob.shape == (4, 4)
    assert max_abs_diff(out.log_prob, traj.log_probs[:, steps]) <= 1e-5  # ratio exp(0) = 1
    assert max_abs_diff(out.mean, traj.means[:, steps]) <= 1e-5
    assert out.std.shape == (4, 4, *[1] * (traj.latents.ndim - 2))
    assert max_abs_diff(out.std.reshape(4, 4), traj.stds[steps].expand(4, -1)) <= 1e-7


@pytest.mark.parametrize("family", FAMILIES)
def test_stacked_steps_equal_one_call_per_step(family):
    backend = tiny_backend(family)
    traj = tiny_rollout(backend, num_steps=5, seed=1)
    steps, rows = [0, 2, 3], [3, 1]
    stacked = backend.step_log_prob(traj, steps, sample_indices=rows)
    assert stacked.log_prob.shape == (2, 3) and stacked.mean.shape == (2, 3, *traj.latents.shape[2:])
    for k, s in enumerate(steps):
        single = backend.step_log_prob(traj, s, sample_indices=rows)
        assert single.log_prob.shape == (2,) and single.mean.shape == (2, *traj.latents.shape[2:])
        assert max_abs_diff(stacked.log_prob[:, k], single.log_prob) <= 1e-6
        assert max_abs_diff(stacked.mean[:, k], single.mean) <= 1e-6
        assert torch.equal(stacked.std[:, k], single.std)
        assert max_abs_diff(single.log_prob, traj.log_probs[rows, s]) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_selected_samples_score_like_the_full_batch(family):
    backend = tiny_backend(family)
    traj = tiny_rollout(backend, seed=2)
    sub = traj.select([3, 0])
    out = backend.step_log_prob(sub, [1, 2])
    assert max_abs_diff(out.log_prob, traj.log_probs[[3, 0]][:, [1, 2]]) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_log_prob_has_gradient_through_the_denoiser(family):
    backend = fresh_backend(family)
    traj = tiny_rollout(backend, seed=3)
    assert not traj.latents.requires_grad and not traj.log_probs.requires_grad  # rollout is no_grad
    out = backend.step_log_prob(traj, [0, 1])
    assert out.log_prob.requires_grad
    out.log_prob.mean().backward()
    grads = [p.grad for p in backend.denoiser.parameters() if p.grad is not None]
    assert grads and sum(g.abs().sum().item() for g in grads) > 0


def test_lora_adapter_is_what_runs():
    from peft import LoraConfig

    backend = fresh_backend("sd3")
    before = tiny_rollout(backend, seed=4)
    backend.denoiser.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    with torch.no_grad():  # lora_B starts at zero; make the adapter do something
        for name, p in backend.denoiser.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    # the adapted policy differs from the recorded one ...
    after = backend.step_log_prob(before, [0, 1])
    assert max_abs_diff(after.log_prob, before.log_probs[:, [0, 1]]) > 1e-4
    # ... and a rollout of the adapted model is reproduced exactly, with gradients on the LoRA weights
    traj = tiny_rollout(backend, seed=4)
    out = backend.step_log_prob(traj, [0, 1])
    assert max_abs_diff(out.log_prob, traj.log_probs[:, [0, 1]]) <= 1e-5
    out.log_prob.sum().backward()
    lora_grads = [p.grad for n, p in backend.denoiser.named_parameters() if "lora_B" in n]
    assert lora_grads and all(g is not None for g in lora_grads) and any(g.abs().sum() > 0 for g in lora_grads)


def test_concatenated_rollouts_score_like_their_parts():
    backend = tiny_backend("flux")
    a = tiny_rollout(backend, seed=15)
    b = backend.rollout(["a blue dog", "a green bird"], 1, num_steps=4, seed=16, height=SIZE, width=SIZE, decode=False)
    joined = Trajectory.cat([a, b])
    assert joined.group_ids.tolist() == [0, 0, 1, 1, 2, 3]
    assert joined.prompt_encodings.prompts == ["a red cat", "a blue dog", "a green bird"]
    out = backend.step_log_prob(joined, torch.tensor(1))  # a 0-d tensor is one step index
    assert out.log_prob.shape == (6,)
    assert max_abs_diff(out.log_prob, torch.cat([a.log_probs[:, 1], b.log_probs[:, 1]])) <= 1e-5


def test_same_noise_per_group():
    backend = tiny_backend("sd3")
    traj = tiny_rollout(backend, group_size=3, same_noise_per_group=True, seed=5)
    x0 = traj.latents[:, 0]
    assert torch.equal(x0[0], x0[1]) and torch.equal(x0[0], x0[2]) and torch.equal(x0[3], x0[5])
    assert not torch.equal(x0[0], x0[3])
    assert not torch.equal(traj.latents[0, 1], traj.latents[1, 1])  # the SDE noise is per sample
    assert traj.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    independent = tiny_rollout(backend, group_size=3, seed=5)
    assert not torch.equal(independent.latents[0, 0], independent.latents[1, 0])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_shared_noise_group_is_denoised_once_until_its_first_stochastic_step(family):
    """With one initial noise per group the rows of a group are equal up to the first SDE step, so the model
    runs on one row per group there; the path and the recorded log-probs are those of the full batch."""
    backend = tiny_backend(family)
    rows = []
    predict = backend._predict
    backend._predict = lambda x, *a, **k: (rows.append(x.shape[0]), predict(x, *a, **k))[1]
    a = tiny_rollout(backend, group_size=3, num_steps=5, sde_window=(2, 2), same_noise_per_group=True, seed=9)
    assert rows == [2, 2, 2, 6, 6]  # 2 prompts x 3: steps 0, 1 (ODE) and 2 (the first SDE step) per group
    rows.clear()
    b = tiny_rollout(backend, group_size=3, num_steps=5, sde_window=(2, 2), latents=a.latents[:, 0], seed=10)
    assert rows == [6] * 5  # given latents may differ within a group: every row computed
    assert max_abs_diff(a.latents[:, :3], b.latents[:, :3]) <= 1e-6  # the shared ODE steps: the same path
    assert not torch.equal(a.latents[0, 3], a.latents[1, 3])  # step 2's noise is still per sample
    # the full batch re-scores the steps computed per group: ratio 1
    assert max_abs_diff(backend.step_log_prob(a, [2, 3]).log_prob, a.log_probs[:, [2, 3]]) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_steps_outside_the_window_are_deterministic_and_untrained(family):
    backend = tiny_backend(family)
    noise = tiny_rollout(backend, num_steps=5, seed=6).latents[:, 0]
    a = tiny_rollout(backend, num_steps=5, sde_window=SDEWindow.fixed(2, 2), latents=noise, seed=7)
    b = tiny_rollout(backend, num_steps=5, sde_window=(2, 2), latents=noise, seed=8)
    assert a.sde_mask.tolist() == [False, False, True, True, False] and a.train_steps == [2, 3]
    assert torch.equal(a.latents[:, :3], b.latents[:, :3])  # ODE steps 0, 1: same start, same path
    assert not torch.equal(a.latents[:, 3], b.latents[:, 3])  # step 2 samples
    assert a.log_probs[:, [0, 1, 4]].abs().max() == 0 and a.stds[[0, 1, 4]].abs().max() == 0
    assert (a.stds[[2, 3]] > 0).all()
    assert max_abs_diff(backend.step_log_prob(a, [2, 3]).log_prob, a.log_probs[:, [2, 3]]) <= 1e-5
    with pytest.raises(ValueError, match=r"Stochastic steps: \[2, 3\]"):
        backend.step_log_prob(a, 1)


def test_sliding_window_follows_the_epoch():
    backend = tiny_backend("flux")
    window = SDEWindow.sliding(2, stride=1, every=2)
    masks = [tiny_rollout(backend, num_steps=4, sde_window=window, epoch=e).sde_mask.tolist() for e in (0, 2, 4, 6)]
    assert masks == [
        [True, True, False, False],
        [False, True, True, False],
        [False, False, True, True],
        [True, True, False, False],
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_seed_makes_rollouts_reproducible(family):
    backend = tiny_backend(family)
    a, b, c = (tiny_rollout(backend, seed=s) for s in (9, 9, 10))
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.latents[:, 0], c.latents[:, 0]) and not torch.equal(a.latents[:, 2], c.latents[:, 2])


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_are_encoded_once_per_distinct_prompt(family):
    backend = fresh_backend(family)
    encoded = []
    original = backend._encode_text

    def counting(prompts):
        encoded.append(list(prompts))
        return original(prompts)

    backend._encode_text = counting
    traj = backend.rollout(["x", "y", "x"], 2, num_steps=2, seed=0, height=SIZE, width=SIZE, decode=False)
    expected = [["x", "y"]] + ([[""]] if backend.uses_cfg_encodings else [])  # the unconditional one, once
    assert encoded == expected
    assert traj.prompts == ["x", "x", "y", "y", "x", "x"] and traj.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert traj.prompt_encodings.prompts == ["x", "y"] and traj.prompt_ids.tolist() == [0, 0, 1, 1, 0, 0]
    backend.rollout(["y", "x"], 1, num_steps=2, seed=0, height=SIZE, width=SIZE, decode=False)
    assert encoded == expected  # cached across calls
    # the cached encoding is the pipeline's own for that prompt
    direct, _ = original(["y"])
    for name, t in direct.items():
        assert max_abs_diff(traj.prompt_encodings.per_prompt[name][1:2], t) <= 1e-6


def test_prompt_cache_drops_least_recently_used():
    backend = fresh_backend("sd15", prompt_cache_size=2)
    for prompts in (["a"], ["b"], ["a"], ["c"]):
        backend.encode_prompts(prompts)
    assert list(backend._prompt_cache) == ["a", "c"]


def test_sum_reduction_is_mean_times_elements():
    backend = tiny_backend("sd3")
    mean = tiny_rollout(backend, seed=11)
    total = tiny_rollout(backend, seed=11, logprob_reduce="sum")
    elements = mean.latents[0, 0].numel()  # 4 x 16 x 16 = 1024
    assert torch.equal(mean.latents, total.latents)
    assert torch.allclose(total.log_probs, mean.log_probs * elements, rtol=1e-4, atol=1e-3)
    assert max_abs_diff(backend.step_log_prob(total, [1]).log_prob, total.log_probs[:, [1]]) <= 1e-3  # 1e-6 x 1024


@pytest.mark.parametrize("family", FAMILIES)
def test_images_are_decoded(family):
    backend = tiny_backend(family)
    traj = tiny_rollout(backend, decode=True, seed=12)
    assert len(traj.images) == 4 and all(im.size == (SIZE, SIZE) for im in traj.images)
    again = backend.decode(traj.final_latents, height=SIZE, width=SIZE)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(again, traj.images, strict=True))


def test_bf16_pipeline_records_float32_log_probs_with_ratio_one():
    backend = fresh_backend("sd3", dtype=torch.bfloat16)
    traj = tiny_rollout(backend, seed=13)
    assert traj.latents.dtype == torch.bfloat16 and traj.log_probs.dtype == torch.float32
    out = backend.step_log_prob(traj, [0, 1, 2, 3])
    assert out.log_prob.dtype == torch.float32
    assert max_abs_diff(out.log_prob, traj.log_probs) <= 1e-5


def test_family_detection_and_loading(tmp_path):
    assert isinstance(tiny_backend("sd3"), SD3Backend) and isinstance(tiny_backend("flux"), FluxBackend)
    assert isinstance(tiny_backend("sd15"), SD15Backend)
    assert detect_family(tiny_backend("flux").pipe) == "flux"
    with pytest.raises(ValueError, match="supported pipelines"):
        detect_family(object())
    with pytest.raises(ValueError, match=f"Valid: {', '.join(family_names())}"):
        load_image_backend(tiny_backend("sd3").pipe, family="nosuchfamily")
    with pytest.raises(ValueError, match="pass family='sd3'"):
        load_image_backend(tiny_backend("sd3").pipe, family="flux")
    # a local directory loads through DiffusionPipeline.from_pretrained (offline) and behaves the same
    tiny_backend("flux").pipe.save_pretrained(tmp_path / "flux")
    loaded = load_image_backend(str(tmp_path / "flux"))
    assert isinstance(loaded, FluxBackend) and loaded.max_sequence_length == 16
    a, b = tiny_rollout(tiny_backend("flux"), seed=14), tiny_rollout(loaded, seed=14)
    assert max_abs_diff(a.latents, b.latents) <= 1e-6 and max_abs_diff(a.log_probs, b.log_probs) <= 1e-6


def test_sd15_gets_a_ddim_scheduler():
    from diffusers import DDIMScheduler, PNDMScheduler

    pipe = fresh_backend("sd15").pipe
    pipe.scheduler = PNDMScheduler.from_config(pipe.scheduler.config)
    backend = load_image_backend(pipe)
    assert isinstance(backend.pipe.scheduler, DDIMScheduler)


def test_rollout_errors_name_the_fix():
    sd3 = tiny_backend("sd3")
    with pytest.raises(ValueError, match=r"valid: \('sde', 'cps', 'dance', 'ode'\)"):
        tiny_rollout(sd3, sde_type="ddim")
    assert sd3.check_image_size() == (32, 32) and sd3.check_image_size(64, 48) == (64, 48)
    with pytest.raises(ValueError, match="divisible by 4"):
        sd3.rollout(PROMPTS, num_steps=2, height=30, width=32)
    with pytest.raises(ValueError, match="divisible by 4"):
        tiny_backend("flux").check_image_size(32, 34)
    with pytest.raises(ValueError, match=r"latents must have shape \(4, 4, 16, 16\)"):
        tiny_rollout(sd3, latents=torch.zeros(2, 4, 16, 16))
    with pytest.raises(ValueError, match="either seed or generator"):
        tiny_rollout(sd3, generator=torch.Generator())
    traj = tiny_rollout(tiny_backend("flux"), num_steps=2)
    with pytest.raises(ValueError, match="recorded by a flux backend"):
        sd3.step_log_prob(traj, 0)
    with pytest.raises(IndexError, match="out of range"):
        tiny_backend("flux").step_log_prob(traj, 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_pipelines_are_deterministic_and_leave_the_rng_alone(family):
    from flowrl.families import tiny_models

    build = tiny_models()[f"tiny-{family}"].tiny_pipeline
    state = torch.random.get_rng_state()
    a, b, c = build(0), build(0), build(1)
    assert torch.equal(torch.random.get_rng_state(), state)
    name = "unet" if family == "sd15" else "transformer"
    weights = [getattr(p, name).state_dict() for p in (a, b, c)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # same seed, same weights
    assert any(not torch.equal(weights[0][k], weights[2][k]) for k in weights[0])  # another seed, others
    assert not any(m.training for m in a.components.values() if isinstance(m, torch.nn.Module))
    # CLIP pools at the tokenizer's end token, so the two must agree
    ids = a.tokenizer("a cat").input_ids
    assert (
        ids[0] == a.tokenizer.bos_token_id and ids[-1] == a.tokenizer.eos_token_id == a.text_encoder.config.eos_token_id
    )
