"""A deterministic rollout (sde_type="ode", DDIM eta = 0) is the diffusers pipeline's own sampling:
every intermediate latent of `pipe(...)` for the same initial latents, and the decoded images."""

import numpy as np
import pytest
import torch
from imagetiny import FAMILIES, PROMPTS, SIZE, max_abs_diff, tiny_backend, tiny_rollout

GUIDANCE = {"sd3": [1.0, 4.5], "flux": [3.5], "sd15": [1.0, 5.0]}  # with and without CFG where it exists
CASES = [(family, g) for family in FAMILIES for g in GUIDANCE[family]]


def pipe_steps(backend, latents, num_steps, guidance_scale):
    """Run pipe(...) from `latents`, returning every step's latents [B, S, ...] and the PIL images."""
    captured = []

    def keep(pipe, i, t, tensors):
        captured.append(tensors["latents"].clone())
        return {}

    kwargs = dict(
        num_images_per_prompt=2,
        num_inference_steps=num_steps,
        guidance_scale=guidance_scale,
        height=SIZE,
        width=SIZE,
        latents=latents.clone(),
        callback_on_step_end=keep,
        callback_on_step_end_tensor_inputs=["latents"],
        output_type="pil",
    )
    if backend.family == "sd15":
        kwargs["eta"] = 0.0
    else:
        kwargs["max_sequence_length"] = backend.max_sequence_length
    images = backend.pipe(PROMPTS, **kwargs).images
    return torch.stack(captured, dim=1), images


@pytest.mark.parametrize("family,guidance_scale", CASES)
def test_ode_rollout_is_the_pipeline(family, guidance_scale):
    backend = tiny_backend(family)
    num_steps = 5
    traj = tiny_rollout(
        backend, num_steps=num_steps, sde_type="ode", guidance_scale=guidance_scale, decode=True, seed=20
    )
    assert not traj.sde_mask.any()
    expected, images = pipe_steps(backend, traj.latents[:, 0], num_steps, guidance_scale)
    assert expected.shape == traj.latents[:, 1:].shape
    assert max_abs_diff(traj.latents[:, 1:], expected) <= 1e-4
    assert traj.latents[:, -1].abs().max() > 0.1  # something was generated
    # the decoded images too (uint8: allow one level where rounding straddles a boundary)
    for ours, theirs in zip(traj.images, images, strict=True):
        assert np.abs(np.asarray(ours, dtype=int) - np.asarray(theirs, dtype=int)).max() <= 1


def test_stochastic_rollout_leaves_the_pipeline_path():
    # the same check on an SDE rollout must fail: the test above can tell the two apart
    backend = tiny_backend("sd3")
    traj = tiny_rollout(backend, num_steps=5, sde_type="sde", guidance_scale=4.5, seed=20)
    expected, _ = pipe_steps(backend, traj.latents[:, 0], 5, 4.5)
    assert max_abs_diff(traj.latents[:, 1:], expected) > 1e-2
