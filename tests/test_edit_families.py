"""The conditioned families beyond the shared guarantees of tests/test_families.py (which give every family one
generated source image per prompt):
- Qwen-Image-Edit-Plus with several source images: `pipe(image=[a, b])` is its rollout, and rows of different source
  layouts in one batch each sample as they do alone, at ratio 1;
- an instruction longer than its budget is an error saying what to raise;
- Wan I2V's first-frame condition: the mask marks the first latent frame's four sub-frames, the latents are the
  VAE's of the image followed by black frames;
- FLUX.1-Kontext's source tokens are appended (the policy's latents stay the generated tokens only)."""

import contextlib

import pytest
import torch
from conditioned import source_image

from flowrl.families import load_image_backend

torch.set_num_threads(1)
SIZE = 32


# two source images of two shapes, reused so that the backend's cache spares their ~1 megapixel VAE passes
SOURCES = [source_image(seed=1), source_image(size=48, seed=2).crop((0, 0, 48, 32))]


@pytest.fixture(scope="module")
def qwen_edit():
    return load_image_backend("tiny-qwen_image_edit", max_sequence_length=16)


def test_qwen_edit_with_two_source_images_is_the_pipelines_own_sampling(qwen_edit):
    images = SOURCES
    traj = qwen_edit.rollout(
        ["put them together"],
        2,
        num_steps=3,
        sde_type="ode",
        guidance_scale=4.0,
        seed=0,
        height=SIZE,
        width=SIZE,
        decode=False,
        images=[images],
    )
    captured = []

    def keep(pipe, i, t, tensors):
        captured.append(tensors["latents"].clone())
        return {}

    qwen_edit.pipe(
        **qwen_edit.pipeline_batches(["put them together"], 2)[0],
        num_inference_steps=3,
        height=SIZE,
        width=SIZE,
        latents=traj.latents[:, 0].clone(),
        callback_on_step_end=keep,
        callback_on_step_end_tensor_inputs=["latents"],
        output_type="latent",
        **qwen_edit.pipeline_call_kwargs(4.0),
        **qwen_edit.pipeline_condition_kwargs(images, SIZE, SIZE),
    )
    expected = torch.stack(captured, dim=1)
    assert (traj.latents[:, 1:] - expected).abs().max().item() <= 1e-5
    shapes = traj.conditions["source_shapes"][0].tolist()
    assert shapes[0] != shapes[1] and shapes[2] == [0, 0]  # two layouts, the third image slot empty


def test_qwen_edit_rows_of_different_source_layouts_sample_as_they_do_alone(qwen_edit):
    one, two = SOURCES[:1], SOURCES
    kwargs = dict(num_steps=2, sde_type="ode", guidance_scale=4.0, height=SIZE, width=SIZE, decode=False)
    noise = torch.randn(2, *qwen_edit._latent_shape(_settings(qwen_edit)), generator=torch.Generator().manual_seed(0))
    both = qwen_edit.rollout(["make it blue", "add a square"], 1, images=[one, two], latents=noise, **kwargs)
    alone = [
        qwen_edit.rollout([p], 1, images=[ims], latents=noise[k : k + 1], **kwargs).final_latents
        for k, (p, ims) in enumerate([("make it blue", one), ("add a square", two)])
    ]
    assert (both.final_latents - torch.cat(alone)).abs().max().item() <= 1e-5
    traj = qwen_edit.rollout(
        ["make it blue", "add a square"],
        2,
        images=[one, two],
        num_steps=2,
        seed=1,
        height=SIZE,
        width=SIZE,
        decode=False,
        guidance_scale=4.0,
    )
    lp, _, _ = qwen_edit.step_log_prob(traj, traj.train_steps)
    assert (lp - traj.log_probs[:, traj.train_steps]).abs().max().item() <= 1e-5


def _settings(backend, num_frames: int = 1):
    from flowrl.sampling import SamplerSettings

    return SamplerSettings(
        family=backend.family,
        sde_type="ode",
        noise_level=0.0,
        guidance_scale=4.0,
        logprob_reduce="mean",
        height=SIZE,
        width=SIZE,
        num_frames=num_frames,
    )


def test_qwen_edit_refuses_an_instruction_longer_than_its_budget(qwen_edit):
    with pytest.raises(ValueError, match="raise sample.max_sequence_length"):
        qwen_edit.rollout(
            ["a very long instruction " * 4],
            1,
            images=[SOURCES[:1]],
            num_steps=1,
            height=SIZE,
            width=SIZE,
            decode=False,
        )


def test_wan_i2v_first_frame_condition_is_the_mask_then_the_images_latents():
    backend = load_image_backend("tiny-wan_i2v", max_sequence_length=16)
    pipe = backend.pipe
    image = source_image()
    pixels = pipe.video_processor.preprocess(image, height=SIZE, width=SIZE)
    condition = backend._first_frame_condition(pixels, 9)  # 9 frames: 3 latent frames
    t = pipe.vae_scale_factor_temporal
    assert condition.shape == (1, t + 16, 3, SIZE // 8, SIZE // 8)
    mask = condition[:, :t]
    assert torch.equal(mask[:, :, 0], torch.ones_like(mask[:, :, 0])) and not mask[:, :, 1:].any()
    clip = torch.cat([pixels.unsqueeze(2), torch.zeros(1, 3, 8, SIZE, SIZE)], dim=2)
    with torch.no_grad():
        latents = pipe.vae.encode(clip).latent_dist.mode()
    config = pipe.vae.config
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(condition[:, t:], (latents - mean) / std, rtol=1e-5, atol=1e-5)


def test_kontext_samples_the_generated_tokens_and_conditions_on_the_sources():
    backend = load_image_backend("tiny-flux_kontext", max_sequence_length=16)
    traj = backend.rollout(
        ["make it blue"], 1, num_steps=1, seed=0, height=SIZE, width=48, decode=False, images=[[source_image()]]
    )
    patch = backend.pipe.vae_scale_factor * 2  # 2x2 packed patches of the VAE's latents
    tokens = (SIZE // patch) * (48 // patch)
    assert traj.latents.shape[2] == tokens and traj.conditions["image_latents"].shape[1] == tokens


@pytest.mark.parametrize("name", ["flux_kontext", "wan_i2v", "qwen_image_edit"])
def test_offloaded_encoders_and_vae_visit_their_device_around_the_conditions(name, monkeypatch):
    """With train.offload, what encodes the conditioning images (a vision-language or vision encoder, the VAE) is
    brought to the compute device around `_encode_conditions` and parked after, as around the prompts' encoding."""
    from flowrl.offload import Parked

    backend = load_image_backend(f"tiny-{name}", max_sequence_length=16)
    backend.offload("cpu")
    visits = []
    real_visit = Parked.visit

    def visit(self):
        visits.append(("in", id(self)))
        with real_visit(self):
            yield
        visits.append(("out", id(self)))

    monkeypatch.setattr(Parked, "visit", contextlib.contextmanager(visit))
    real_encode = backend._encode_conditions

    def encode(*args, **kwargs):
        visits.append(("encode",))
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(backend, "_encode_conditions", encode)
    backend.encode_conditions([SOURCES[:1]], 1, _settings(backend, backend.tiny_num_frames), prompts=["make it blue"])
    k = visits.index(("encode",))
    for parked in (backend._parked_text, backend._parked_vae):
        assert ("in", id(parked)) in visits[:k] and ("out", id(parked)) in visits[k:]
