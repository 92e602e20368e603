"""The Wan text-to-video family beyond the shared guarantees of tests/test_families.py: frame counts checked
before loading, videos decoded as the pipeline decodes them, the checkpoints' UniPC solver swapped for Euler
sigmas, Wan2.2's second expert refused."""

import numpy as np
import pytest
import torch

from flowrl.families import ImageModelError, load_image_backend, preflight_image_model, tiny_pipeline
from flowrl.families.wan import WanBackend

torch.set_num_threads(1)
SIZE = 32


@pytest.fixture(scope="module")
def backend():
    return load_image_backend("tiny-wan", max_sequence_length=16)


def test_frame_counts_are_4k_plus_1_and_image_families_make_one():
    assert WanBackend.check_num_frames(0) == 81 and WanBackend.check_num_frames(9) == 9
    with pytest.raises(ImageModelError, match="4k \\+ 1 frames .* got sample.num_frames=7; nearest valid: 5, 9"):
        WanBackend.check_num_frames(7)
    assert preflight_image_model("tiny-wan", height=SIZE, width=SIZE, num_frames=5) == "wan"
    with pytest.raises(ImageModelError, match="sd3 makes images: sample.num_frames must be 1"):
        preflight_image_model("tiny-sd3", height=SIZE, width=SIZE, num_frames=5)


def test_a_bad_frame_count_stops_the_run_before_the_model_loads(monkeypatch):
    from flowrl import families
    from flowrl.config import load_config
    from flowrl.preflight import PreflightError, preflight

    monkeypatch.setattr(families, "load_image_backend", lambda *a, **k: pytest.fail("preflight loaded a model"))
    cfg = load_config(None, ["model.path=tiny-wan", "sample.height=32", "sample.width=32", "sample.num_frames=6"])
    with pytest.raises(PreflightError, match="model.path=tiny-wan: wan makes 4k \\+ 1 frames"):
        preflight(cfg)


def test_rollouts_have_5d_latents_and_decode_to_the_pipelines_frames(backend):
    traj = backend.rollout(["a red ball rolls"], 2, num_steps=2, seed=0, height=SIZE, width=48, num_frames=9)
    assert traj.latents.shape == (2, 3, 16, 3, SIZE // 8, 48 // 8)  # [B, S+1, C, F', H', W'], F' = (9 - 1) / 4 + 1
    video = traj.images[0]
    assert video.shape == (9, SIZE, 48, 3) and video.dtype == np.uint8
    pipe = backend.pipe
    config = pipe.vae.config
    z = traj.final_latents[:1].float()
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():  # WanPipeline's own decoding
        decoded = pipe.vae.decode(z / inv_std + mean, return_dict=False)[0]
    frames = pipe.video_processor.postprocess_video(decoded, output_type="np")[0]
    assert np.abs(video.astype(np.int16) - np.round(frames * 255).astype(np.int16)).max() <= 1


def test_the_checkpoints_unipc_solver_becomes_euler_with_its_flow_shift():
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    pipe = tiny_pipeline("tiny-wan")
    pipe.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    backend = WanBackend(pipe, max_sequence_length=16)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler) and pipe.scheduler.config.shift == 5.0
    pipe.scheduler = UniPCMultistepScheduler(prediction_type="epsilon")
    with pytest.raises(ImageModelError, match="prediction_type 'epsilon', not 'flow_prediction'"):
        WanBackend(pipe)
    del backend


def test_wan22s_second_expert_is_refused():
    pipe = tiny_pipeline("tiny-wan")
    pipe.register_modules(transformer_2=pipe.transformer)
    with pytest.raises(ImageModelError, match="two experts"):
        WanBackend(pipe)
