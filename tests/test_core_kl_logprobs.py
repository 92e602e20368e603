"""KL estimators, Gaussian KL, entropy and token log-probs against hand arithmetic and torch references."""

import ast
import math
from pathlib import Path

import pytest
import torch

import flowrl.core.logprobs as logprobs_mod
from flowrl.core import (
    entropy_from_logits,
    gaussian_kl,
    kl_estimate,
    masked_mean,
    masked_var,
    masked_whiten,
    token_log_probs,
)

TOL = dict(rtol=0, atol=1e-9)


def t(x, **kw):
    return torch.tensor(x, dtype=torch.float64, **kw)


def test_kl_estimators_by_hand():
    logp, ref = t([0.5, -1.0]), t([0.0, 0.0])  # d = [0.5, -1]
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), t([0.5, -1.0]), **TOL)
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), t([0.125, 0.5]), **TOL)
    # k3 = exp(-d) + d - 1: exp(-.5) - .5 = 0.1065306597 ; exp(1) - 2 = 0.7182818285
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), t([math.exp(-0.5) - 0.5, math.e - 2]), **TOL)
    torch.testing.assert_close(kl_estimate(logp, ref, "abs"), t([0.5, 1.0]), **TOL)
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_exactly_over_a_categorical():
    # E_{x~pi}[k] summed exactly over the support must equal KL(pi || ref) for k1 and k3.
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(10, generator=gen, dtype=torch.float64), 0)
    ref = torch.log_softmax(torch.randn(10, generator=gen, dtype=torch.float64), 0)
    kl = (logp.exp() * (logp - ref)).sum()
    for kind in ("k1", "k3"):
        est = (logp.exp() * kl_estimate(logp, ref, kind)).sum()
        assert abs(est.item() - kl.item()) < 1e-12, kind
    assert (kl_estimate(logp, ref, "k3") >= 0).all()


def test_k3_clamped_no_overflow():
    out = kl_estimate(torch.tensor([-1000.0, 1000.0]), torch.tensor([0.0, 0.0]), "k3")
    assert torch.isfinite(out).all()
    # d = -1000 -> u = -d clamped to 20: exp(20) - 1 - 20
    assert out[0].item() == pytest.approx(math.exp(20) - 21, rel=1e-6)


def test_gaussian_kl_by_hand_and_against_torch():
    mean = t([[[1.0, 2.0]], [[0.0, 0.0]]])  # [B=2, 1, 2]
    ref = t([[[0.0, 0.0]], [[3.0, 1.0]]])
    std = t([2.0, 0.5])
    # b0: ((1)^2 + (2)^2) / (2 * 4) / 2 = 5/16 ; b1: (9 + 1) / (2 * 0.25) / 2 = 10
    torch.testing.assert_close(gaussian_kl(mean, ref, std), t([5 / 16, 10.0]), **TOL)
    gen = torch.Generator().manual_seed(1)
    m, r = (
        torch.randn(3, 4, 5, generator=gen, dtype=torch.float64),
        torch.randn(3, 4, 5, generator=gen, dtype=torch.float64),
    )
    s = 0.3
    want = torch.distributions.kl_divergence(torch.distributions.Normal(m, s), torch.distributions.Normal(r, s))
    torch.testing.assert_close(gaussian_kl(m, r, s), want.mean((1, 2)), **TOL)


def test_gaussian_kl_float32_for_half_inputs():
    out = gaussian_kl(torch.ones(2, 3, dtype=torch.bfloat16), torch.zeros(2, 3, dtype=torch.bfloat16), 1.0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.full((2,), 0.5))


def test_entropy_against_categorical():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64) * 3
    want = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), want, **TOL)
    # uniform over 4 -> log 4
    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4), abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_entropy_and_its_gradient_equal_autograd_of_the_definition(temperature, monkeypatch):
    """The fused entropy against -sum p log p of softmax(z / tau) differentiated by autograd, across many chunks;
    a -inf logit (a masked token) contributes nothing; bf16 logits get a float32 entropy and a bf16 gradient."""
    monkeypatch.setattr(logprobs_mod, "CHUNK_FLOATS", 40)  # V=13 -> 3 rows per chunk
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(3, 5, 13, generator=gen, dtype=torch.float64) * 2
    logits, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
    got = entropy_from_logits(logits, temperature)
    p = torch.softmax(ref / temperature, -1)
    want = -(p * torch.log_softmax(ref / temperature, -1)).sum(-1)
    torch.testing.assert_close(got, want, **TOL)
    w = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    (got * w).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(logits.grad, ref.grad, **TOL)
    masked = base[0, 0].clone()
    masked[[2, 7]] = -math.inf
    kept = masked[torch.isfinite(masked)]
    torch.testing.assert_close(
        entropy_from_logits(masked, temperature),
        torch.distributions.Categorical(logits=kept / temperature).entropy(),
        **TOL,
    )
    half = base.to(torch.bfloat16).requires_grad_()
    out = entropy_from_logits(half, temperature)
    out.sum().backward()
    assert out.dtype == torch.float32 and half.grad.dtype == torch.bfloat16 and torch.isfinite(half.grad).all()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        entropy_from_logits(base, 0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_log_probs_equal_log_softmax_gather_and_grad(temperature, monkeypatch):
    monkeypatch.setattr(logprobs_mod, "CHUNK_FLOATS", 40)  # V=13 -> 3 rows per chunk: many chunks
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 5, 13, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    tokens = torch.randint(0, 13, (3, 5), generator=gen)
    ref_logits = logits.detach().clone().requires_grad_()
    got = token_log_probs(logits, tokens, temperature)
    want = torch.log_softmax(ref_logits / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(got, want, **TOL)
    w = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    (got * w).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, **TOL)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_token_log_probs_grad_in_place_per_chunk(dtype, atol, monkeypatch):
    """Lower-precision logits, many chunks: values and gradients equal a float64 log-softmax's."""
    monkeypatch.setattr(logprobs_mod, "CHUNK_FLOATS", 40)
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(4, 3, 13, generator=gen) * 2).to(dtype).requires_grad_()
    tokens = torch.randint(0, 13, (4, 3), generator=gen)
    w = torch.randn(4, 3, generator=gen)
    got = token_log_probs(logits, tokens, 0.7)
    (got * w).sum().backward()
    ref = logits.detach().double().requires_grad_()
    want = torch.log_softmax(ref / 0.7, -1).gather(-1, tokens[..., None]).squeeze(-1)
    (want * w.double()).sum().backward()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.double(), ref.grad, rtol=0, atol=atol)


def test_token_log_probs_gradcheck():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 3), generator=gen)
    assert torch.autograd.gradcheck(lambda z: token_log_probs(z, tokens, 0.9), (logits,))


def test_token_log_probs_bf16_in_float32_out():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 4, 50, generator=gen).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 50, (2, 4), generator=gen)
    got = token_log_probs(logits, tokens)
    assert got.dtype == torch.float32
    want = torch.log_softmax(logits.detach().float(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    got.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_token_log_probs_bad_shapes():
    with pytest.raises(ValueError, match="tokens"):
        token_log_probs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_log_probs(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), 0.0)


def test_masked_stats_by_hand():
    x = t([1.0, 2.0, 3.0, 100.0])
    m = t([1, 1, 1, 0])
    assert masked_mean(x, m).item() == 2.0
    assert masked_var(x, m).item() == pytest.approx(1.0, abs=1e-12)  # ((1)+(0)+(1)) / 2
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(2 / 3, abs=1e-12)
    torch.testing.assert_close(masked_whiten(x, m, eps=0.0)[:3], t([-1.0, 0.0, 1.0]), **TOL)
    torch.testing.assert_close(masked_whiten(x, m, shift_mean=False, eps=0.0)[:3], t([1.0, 2.0, 3.0]), **TOL)
    assert masked_mean(x, torch.zeros(4)).item() == 0.0
    assert masked_var(x, t([0, 1, 0, 0])).item() == 0.0
    # per-dim mean
    torch.testing.assert_close(masked_mean(t([[1.0, 3.0], [5.0, 7.0]]), t([[1, 1], [0, 1]]), dim=1), t([2.0, 7.0]))


def test_core_imports_no_backend():
    """The core is pure torch: no diffusers, transformers, peft or accelerate import in flowrl/core."""
    core = Path(__file__).resolve().parents[1] / "flowrl" / "core"
    stdlib = {"math", "collections", "typing", "difflib", "__future__", "types", "dataclasses", "importlib", "pkgutil"}
    allowed = {"torch", *stdlib}  # (importlib, pkgutil: the registry discovers the modules that register into it)
    for py in core.glob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for n in names:
                assert n.split(".")[0] in allowed, f"{py.name} imports {n}"


def test_sample_categorical_draws_softmax_frequencies():
    """Inverse-CDF draws match softmax(logits) row by row (4.5 binomial sigmas), never a -inf token."""
    from flowrl.core import sample_categorical

    g = torch.Generator().manual_seed(3)
    logits = torch.tensor(
        [[2.0, 0.5, -1.0, 0.0, float("-inf"), 1.0], [float("-inf"), 0.0, float("-inf"), -3.0, 4.0, 0.2]]
    )
    n = 40000
    draws = sample_categorical(logits.repeat_interleave(n, 0), generator=g).view(2, n)
    probs = torch.exp(logits.double() - torch.logsumexp(logits.double(), -1, keepdim=True))  # independent softmax
    for row in range(2):
        freq = torch.bincount(draws[row], minlength=6).double() / n
        sigma = (probs[row] * (1 - probs[row]) / n).sqrt()
        assert ((freq - probs[row]).abs() <= 4.5 * sigma + 1e-12).all(), (row, freq, probs[row])
        assert freq[probs[row] == 0].sum() == 0
    # a wrong sampler would be caught: uniform draws over the finite tokens are far outside those bounds
    uniform = torch.isfinite(logits[0]).double() / torch.isfinite(logits[0]).sum()
    assert ((uniform - probs[0]).abs() > 4.5 * (probs[0] * (1 - probs[0]) / n).sqrt()).any()


def test_sample_categorical_refuses_rows_without_mass():
    from flowrl.core import sample_categorical

    bad = torch.tensor([[0.0, 1.0], [float("-inf"), float("-inf")], [float("nan"), 0.0]])
    with pytest.raises(ValueError, match=r"rows \[1, 2\] of the logits have no finite probability mass"):
        sample_categorical(bad)
