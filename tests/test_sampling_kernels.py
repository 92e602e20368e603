"""Step kernels: each formula against a hand computation or an independent derivation."""

import math

import pytest
import torch

from flowrl.sampling import (
    FLOW_KERNELS,
    dance_transition,
    ddim_step,
    flow_grpo_transition,
    flow_sde_step,
    gaussian_log_density,
)

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)  # 0.9189385332


def full(value, shape=(1, 1, 1, 1), dtype=torch.float32):
    return torch.full(shape, value, dtype=dtype)


# ---- Flow-GRPO "sde" --------------------------------------------------------------------------------


def test_flow_grpo_mean_std_by_hand():
    # x = 1, v = 0.5, sigma = 0.5, sigma_next = 0.25, a = 0.7:
    # dt = -0.25, s_t = 0.7 sqrt(0.5 / 0.5) = 0.7, s_t^2 = 0.49
    # mean = 1 (1 + 0.49 (-0.25) / 1) + 0.5 (1 + 0.49 * 0.5 / 1)(-0.25) = 0.8775 - 0.155625 = 0.721875
    # std  = 0.7 sqrt(0.25) = 0.35
    out = flow_sde_step(full(0.5), full(1.0), 0.5, 0.25, noise_level=0.7, sde_type="sde", generator=torch.Generator())
    assert out.mean.item() == pytest.approx(0.721875, abs=1e-6)
    assert out.std.item() == pytest.approx(0.35, abs=1e-7)
    assert out.std.shape == (1, 1, 1, 1)


def test_flow_grpo_first_step_uses_sigma_next_in_denominator():
    # sigma = 1: s_t = 0.7 sqrt(1 / (1 - 0.75)) = 1.4, std = 1.4 sqrt(0.25) = 0.7
    # mean = x (1 + 1.96 (-0.25) / 2) + v (1 + 0) (-0.25) = 0.755 - 0.125 = 0.63
    out = flow_sde_step(full(0.5), full(1.0), 1.0, 0.75, noise_level=0.7, generator=torch.Generator().manual_seed(0))
    assert out.mean.item() == pytest.approx(0.63, abs=1e-6)
    assert out.std.item() == pytest.approx(0.7, abs=1e-6)
    assert torch.isfinite(out.log_prob).all()


def test_gaussian_log_prob_by_hand_mean_and_sum():
    # Two elements, one and two stds (0.35) above the mean 0.721875:
    # log N = -z^2/2 - log 0.35 - log sqrt(2 pi) = -0.5 + 1.0498221 - 0.9189385 = -0.3691164  (z = 1)
    #                                             = -2.0 + 1.0498221 - 0.9189385 = -1.8691164  (z = 2)
    v, x = full(0.5, (1, 2)), full(1.0, (1, 2))
    prev = torch.tensor([[0.721875 + 0.35, 0.721875 + 0.70]])
    mean_out = flow_sde_step(v, x, 0.5, 0.25, prev_latents=prev)
    sum_out = flow_sde_step(v, x, 0.5, 0.25, prev_latents=prev, logprob_reduce="sum")
    assert mean_out.log_prob.item() == pytest.approx((-0.3691164 - 1.8691164) / 2, abs=1e-5)
    assert sum_out.log_prob.item() == pytest.approx(-0.3691164 - 1.8691164, abs=1e-5)
    assert torch.equal(mean_out.prev_latents, prev)  # given, not sampled


def test_gaussian_log_density_matches_torch_distributions():
    g = torch.Generator().manual_seed(1)
    x, mean = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    std = torch.rand(3, 1, generator=g) + 0.1
    expected = torch.distributions.Normal(mean, std).log_prob(x)
    assert torch.allclose(gaussian_log_density(x, mean, std), expected, atol=1e-6)


# ---- DanceGRPO "dance" ------------------------------------------------------------------------------


def test_dance_mean_std_by_hand():
    # x = 1, v = 0.5, sigma = 0.5, sigma_next = 0.25, eta = 0.3:
    # x0_hat = 1 - 0.25 = 0.75, score = -(1 - 0.5 * 0.75) / 0.25 = -2.5
    # drift = 0.5 - 0.045 (-2.5) = 0.6125, mean = 1 + 0.6125 (-0.25) = 0.846875, std = 0.3 * 0.5 = 0.15
    out = flow_sde_step(full(0.5), full(1.0), 0.5, 0.25, noise_level=0.3, sde_type="dance", generator=torch.Generator())
    assert out.mean.item() == pytest.approx(0.846875, abs=1e-6)
    assert out.std.item() == pytest.approx(0.15, abs=1e-7)


def test_dance_with_flow_grpo_schedule_is_flow_grpo():
    # Both discretise dx = (v - eta^2/2 score) dsigma + eta dw; Flow-GRPO's eta is a sqrt(sigma / (1 - sigma)).
    # Derived independently (score form vs. expanded form), they must agree when eta = s_t.
    g = torch.Generator().manual_seed(2)
    v, x = torch.randn(2, 4, 3, 3, generator=g), torch.randn(2, 4, 3, 3, generator=g)
    sigma, sigma_next, a = torch.full((2, 1, 1, 1), 0.6), torch.full((2, 1, 1, 1), 0.45), 0.8
    eta = a * math.sqrt(0.6 / 0.4)
    mean_sde, std_sde = flow_grpo_transition(v, x, sigma, sigma_next, a)
    mean_dance, std_dance = dance_transition(v, x, sigma, sigma_next, eta)
    assert torch.allclose(mean_sde, mean_dance, atol=1e-6)
    assert torch.allclose(std_sde, std_dance, atol=1e-7)


# ---- CPS ----------------------------------------------------------------------------------------------


def test_cps_by_hand():
    # x = 1, v = 0.5, sigma = 0.5, sigma_next = 0.25, a = 0.5:
    # std = 0.25 sin(pi / 4) = 0.1767767, x0 = 0.75, x1 = 1.25, sqrt(0.0625 - 0.03125) = 0.1767767
    # mean = 0.75 * 0.75 + 0.1767767 * 1.25 = 0.7834709; log-prob of mean + 0.1 is -(0.1)^2 = -0.01
    prev = full(0.7834709 + 0.1)
    out = flow_sde_step(full(0.5), full(1.0), 0.5, 0.25, noise_level=0.5, sde_type="cps", prev_latents=prev)
    assert out.mean.item() == pytest.approx(0.7834709, abs=1e-6)
    assert out.std.item() == pytest.approx(0.1767767, abs=1e-6)
    assert out.log_prob.item() == pytest.approx(-0.01, abs=1e-5)


def test_cps_preserves_coefficients_with_exact_velocity():
    # With the exact velocity of x = (1 - s) x0 + s x1, the CPS mean is (1 - s') x0 + sqrt(s'^2 - std^2) x1,
    # and the sample minus its signal part (1 - s') x0 is noise of variance (s'^2 - std^2) + std^2 = s'^2:
    # here s' = 0.4, so 0.16 (over 4 x 4096 draws, +- 3%).
    g = torch.Generator().manual_seed(3)
    x0, x1 = torch.randn(4, 4096, generator=g), torch.randn(4, 4096, generator=g)
    s, s_next, a = 0.7, 0.4, 0.6
    x = (1 - s) * x0 + s * x1
    out = flow_sde_step(x1 - x0, x, s, s_next, noise_level=a, sde_type="cps", generator=g)
    std = s_next * math.sin(a * math.pi / 2)
    assert torch.allclose(out.mean, (1 - s_next) * x0 + math.sqrt(s_next**2 - std**2) * x1, atol=1e-5)
    noise_part = out.prev_latents - (1 - s_next) * x0
    assert noise_part.var().item() == pytest.approx(0.16, rel=0.03)


def test_cps_last_step_is_deterministic():
    out = flow_sde_step(full(0.5), full(1.0), 0.3, 0.0, noise_level=0.7, sde_type="cps", generator=torch.Generator())
    assert out.std.item() == 0.0 and out.log_prob.item() == 0.0
    assert out.prev_latents.item() == pytest.approx(1.0 - 0.3 * 0.5, abs=1e-7)  # x0_hat


# ---- ODE ----------------------------------------------------------------------------------------------


def test_ode_is_plain_euler():
    # x + dt v = 1 + (-0.25)(0.5) = 0.875, no noise, no density
    out = flow_sde_step(full(0.5), full(1.0), 0.5, 0.25, sde_type="ode")
    assert out.prev_latents.item() == pytest.approx(0.875, abs=1e-7)
    assert out.log_prob.item() == 0.0 and out.std.item() == 0.0


def test_ode_matches_diffusers_euler_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(5)
    g = torch.Generator().manual_seed(4)
    x, v = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    for i, t in enumerate(scheduler.timesteps):
        expected = scheduler.step(v, t, x, return_dict=False)[0]
        got = flow_sde_step(v, x, scheduler.sigmas[i], scheduler.sigmas[i + 1], sde_type="ode").prev_latents
        assert torch.allclose(got, expected, atol=1e-6)


# ---- DDIM ----------------------------------------------------------------------------------------------


def test_ddim_by_hand():
    # a_t = 0.5, a_prev = 0.8, eps = 0.2, x = 1, eta = 1:
    # x0_hat = (1 - sqrt(0.5) 0.2) / sqrt(0.5) = 1.2142136
    # sigma_t = sqrt(0.2 / 0.5) sqrt(1 - 0.5 / 0.8) = sqrt(0.4 * 0.375) = sqrt(0.15) = 0.3872983
    # mean = sqrt(0.8) 1.2142136 + sqrt(1 - 0.8 - 0.15) 0.2 = 1.0860256 + 0.0447214 = 1.1307470
    out = ddim_step(full(0.2), full(1.0), 0.5, 0.8, eta=1.0, prev_latents=full(1.1307470 + 0.3872983))
    assert out.mean.item() == pytest.approx(1.1307470, abs=1e-6)
    assert out.std.item() == pytest.approx(0.3872983, abs=1e-6)
    # one std above the mean: -0.5 - log(0.3872983) - 0.9189385 = -0.5 + 0.9485599 - 0.9189385 = -0.4703786
    assert out.log_prob.item() == pytest.approx(-0.4703786, abs=1e-5)


def test_ddim_matches_diffusers_scheduler_with_same_noise():
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    scheduler.set_timesteps(4)
    g = torch.Generator().manual_seed(5)
    x, eps = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    for t in scheduler.timesteps:
        prev_t = t - 1000 // 4
        a_t = scheduler.alphas_cumprod[t]
        a_prev = scheduler.alphas_cumprod[prev_t] if prev_t >= 0 else scheduler.final_alpha_cumprod
        noise = torch.randn(x.shape, generator=g)
        expected = scheduler.step(eps, t, x, eta=0.8, variance_noise=noise, return_dict=False)[0]
        ours = ddim_step(eps, x, a_t, a_prev, eta=0.8, prev_latents=expected)
        assert torch.allclose(ours.mean + ours.std * noise, expected, atol=1e-5)
        # the log-prob of diffusers' sample, from its noise: mean over dims of -eps^2/2 - log std - log sqrt(2 pi)
        by_noise = (-(noise**2) / 2).mean(dim=(1, 2, 3)) - torch.log(ours.std.flatten()) - LOG_SQRT_2PI
        assert torch.allclose(ours.log_prob, by_noise, atol=1e-4)


def test_ddim_eta_zero_is_deterministic():
    out = ddim_step(full(0.2), full(1.0), 0.5, 0.8, eta=0.0)
    # eta = 0: mean = sqrt(0.8) 1.2142136 + sqrt(0.2) 0.2 = 1.0860256 + 0.0894427 = 1.1754683
    assert out.prev_latents.item() == pytest.approx(1.1754683, abs=1e-6)
    assert out.log_prob.item() == 0.0 and out.std.item() == 0.0


# ---- shared behaviour of the stochastic kernels ---------------------------------------------------------

STOCHASTIC = [("sde", 0.7), ("cps", 0.7), ("dance", 0.3), ("ddim", 1.0)]


def step(kind, model_output, x, noise_level, **kwargs):
    if kind == "ddim":
        return ddim_step(model_output, x, 0.3, 0.6, eta=noise_level, **kwargs)
    return flow_sde_step(model_output, x, 0.6, 0.4, noise_level=noise_level, sde_type=kind, **kwargs)


@pytest.mark.parametrize("kind,noise_level", STOCHASTIC)
def test_sampling_then_scoring_gives_the_same_log_prob(kind, noise_level):
    g = torch.Generator().manual_seed(6)
    v, x = torch.randn(3, 4, 6, 6, generator=g), torch.randn(3, 4, 6, 6, generator=g)
    sampled = step(kind, v, x, noise_level, generator=g)
    scored = step(kind, v, x, noise_level, prev_latents=sampled.prev_latents)
    assert torch.equal(sampled.log_prob, scored.log_prob)
    assert sampled.log_prob.shape == (3,) and sampled.log_prob.dtype == torch.float32


@pytest.mark.parametrize("kind,noise_level", STOCHASTIC)
def test_sample_has_the_stated_std(kind, noise_level):
    # (x' - mean) / std must be standard normal: over 4 x 4096 elements, mean ~ 0 +- 0.01, var ~ 1 +- 0.02
    g = torch.Generator().manual_seed(7)
    v, x = torch.randn(4, 4, 32, 32, generator=g), torch.randn(4, 4, 32, 32, generator=g)
    out = step(kind, v, x, noise_level, generator=g)
    z = (out.prev_latents - out.mean) / out.std
    assert abs(z.mean().item()) < 0.02 and abs(z.var().item() - 1) < 0.03


@pytest.mark.parametrize("kind,noise_level", STOCHASTIC)
def test_bf16_inputs_float32_math(kind, noise_level):
    g = torch.Generator().manual_seed(8)
    v, x = torch.randn(2, 4, 6, 6, generator=g).bfloat16(), torch.randn(2, 4, 6, 6, generator=g).bfloat16()
    out = step(kind, v, x, noise_level, generator=g)
    assert out.prev_latents.dtype == torch.bfloat16
    assert out.mean.dtype == out.log_prob.dtype == out.std.dtype == torch.float32
    # the math is the float32 math on the upcast inputs, not bf16 arithmetic ...
    ref = step(kind, v.float(), x.float(), noise_level, prev_latents=out.prev_latents.float())
    assert torch.equal(out.mean, ref.mean)
    # ... and the log-prob scores the stored (bf16-rounded) sample, so rescoring it reproduces it exactly
    rescored = step(kind, v, x, noise_level, prev_latents=out.prev_latents)
    assert torch.equal(rescored.log_prob, out.log_prob)
    assert torch.equal(ref.log_prob, out.log_prob)


@pytest.mark.parametrize("kind,noise_level", STOCHASTIC)
def test_fp16_inputs_float32_math(kind, noise_level):
    g = torch.Generator().manual_seed(9)
    v, x = torch.randn(2, 4, 6, 6, generator=g).half(), torch.randn(2, 4, 6, 6, generator=g).half()
    out = step(kind, v, x, noise_level, generator=g)
    assert out.prev_latents.dtype == torch.float16 and out.log_prob.dtype == torch.float32
    assert torch.equal(step(kind, v, x, noise_level, prev_latents=out.prev_latents).log_prob, out.log_prob)


def test_per_row_sigmas_equal_per_row_calls():
    # rows of a stacked batch at different steps: sigma, sigma_next as [B] tensors
    g = torch.Generator().manual_seed(10)
    v, x, prev = (torch.randn(3, 4, 5, 5, generator=g) for _ in range(3))
    sigma, sigma_next = torch.tensor([1.0, 0.7, 0.3]), torch.tensor([0.8, 0.5, 0.0])
    for kind in ("sde", "cps", "dance"):
        stacked = flow_sde_step(v, x, sigma, sigma_next, sde_type=kind, prev_latents=prev)
        for i in range(3):
            row = flow_sde_step(
                v[i : i + 1],
                x[i : i + 1],
                sigma[i].item(),
                sigma_next[i].item(),
                sde_type=kind,
                prev_latents=prev[i : i + 1],
            )
            assert torch.allclose(stacked.log_prob[i], row.log_prob[0], atol=1e-6, rtol=0)
            assert torch.allclose(stacked.mean[i], row.mean[0], atol=1e-7)


def test_generator_per_sample_matches_single_draws():
    v, x = torch.zeros(2, 3), torch.zeros(2, 3)
    gens = [torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)]
    out = flow_sde_step(v, x, 0.5, 0.25, generator=gens)
    for i, seed in enumerate((11, 12)):
        noise = torch.randn(1, 3, generator=torch.Generator().manual_seed(seed))
        assert torch.allclose(out.prev_latents[i], (out.mean[i] + out.std[i] * noise[0]), atol=1e-7)


def test_errors_name_the_fix():
    v = x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="Valid: cps, dance, ode, sde"):
        flow_sde_step(v, x, 0.5, 0.25, sde_type="sdee")
    with pytest.raises(ValueError, match="noise_level > 0"):
        flow_sde_step(v, x, 0.5, 0.25, noise_level=0.0)
    with pytest.raises(ValueError, match="logprob_reduce"):
        flow_sde_step(v, x, 0.5, 0.25, logprob_reduce="avg")
    with pytest.raises(ValueError, match="shape"):
        flow_sde_step(v, x, 0.5, 0.25, prev_latents=torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"\[B\]=1"):
        flow_sde_step(v, x, torch.tensor([0.5, 0.4]), 0.25)
    with pytest.raises(ValueError, match="eta"):
        ddim_step(v, x, 0.5, 0.8, eta=-1.0)
    assert FLOW_KERNELS.names() == ["cps", "dance", "ode", "sde"]
