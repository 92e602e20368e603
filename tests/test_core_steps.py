"""Step weights and GRPO-Guard's RatioNorm against hand arithmetic and an algebraic re-derivation."""

import math

import pytest
import torch

from flowrl.core import inverse_dt_step_weights, noise_step_weights, ratio_norm_log_ratio

TOL = dict(rtol=0, atol=1e-10)


def gauss_logp(x, mu, s):  # Flow-GRPO's log-prob: the Gaussian log-density averaged over the latent's dims
    return (-((x - mu) ** 2) / (2 * s**2) - math.log(s) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)


def test_noise_weights_by_hand():
    # stds [0.1, 0.2, 0.3]: mean 0.2 -> weights [0.5, 1, 1.5]
    w = noise_step_weights(torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64))
    torch.testing.assert_close(w, torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64), **TOL)
    with pytest.raises(ValueError, match="stds > 0"):
        noise_step_weights(torch.tensor([0.0, 1.0]))


def test_inverse_dt_weights_by_hand():
    # |dt| [0.1, 0.4]: 1/|dt| = [10, 2.5], mean 6.25 -> [1.6, 0.4]
    w = inverse_dt_step_weights(torch.tensor([-0.1, -0.4], dtype=torch.float64))
    torch.testing.assert_close(w, torch.tensor([1.6, 0.4], dtype=torch.float64), **TOL)


def test_ratio_norm_by_hand_one_element():
    # one latent element: x = 1, mu_old = 0, mu = 0.5, s = 0.5
    # logp - logp_old = (x-mu_old)^2/(2s^2) - (x-mu)^2/(2s^2) = (1 - 0.25) / 0.5 = 1.5
    # b = (0.5)^2 / (2 * 0.25) = 0.5 ; log rho = (1.5 + 0.5) * 0.5 = 1.0
    x, mu_old, mu, s = (torch.tensor([[v]], dtype=torch.float64) for v in (1.0, 0.0, 0.5, 0.5))
    got = ratio_norm_log_ratio(
        gauss_logp(x, mu, 0.5), gauss_logp(x, mu_old, 0.5), mu, mu_old, torch.tensor([0.5], dtype=torch.float64)
    )
    torch.testing.assert_close(got, torch.tensor([1.0], dtype=torch.float64), **TOL)


def test_ratio_norm_equals_mean_of_noise_times_drift():
    # Re-derivation: with x = mu_old + s eps, (log p - log p_old + b) s = mean_d(eps * (mu - mu_old)):
    # the recentred ratio has zero mean under the rollout policy and a spread free of s.
    gen = torch.Generator().manual_seed(0)
    B, K = 3, 2
    for s in (0.05, 0.7):
        mu_old = torch.randn(B, K, 4, 5, generator=gen, dtype=torch.float64)
        mu = mu_old + 0.1 * torch.randn(B, K, 4, 5, generator=gen, dtype=torch.float64)
        eps = torch.randn(B, K, 4, 5, generator=gen, dtype=torch.float64)
        x = mu_old + s * eps
        lp = gauss_logp(x.flatten(0, 1), mu.flatten(0, 1), s).view(B, K)
        lp_old = gauss_logp(x.flatten(0, 1), mu_old.flatten(0, 1), s).view(B, K)
        std = torch.full((B, K, 1, 1), s, dtype=torch.float64)
        got = ratio_norm_log_ratio(lp, lp_old, mu, mu_old, std)
        want = (eps * (mu - mu_old)).flatten(2).mean(-1)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
