"""Log-probabilities and entropies of categorical policies from logits, without a float32 [B, T, V] copy."""

from __future__ import annotations

import torch
from torch import Tensor

#: Rows of the vocabulary processed at once; bounds the float32 scratch to ~ this many floats.
CHUNK_FLOATS = 1 << 24


def _row_chunks(n_rows: int, vocab: int):
    step = max(1, CHUNK_FLOATS // max(vocab, 1))
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))


class _TokenLogProb(torch.autograd.Function):
    """log softmax(z / tau)[y] computed row-chunk by row-chunk in float32; backward likewise.

    Both passes use torch's fused (log-)softmax kernels on each chunk: the forward keeps only the picked
    log-probs [N], the backward recomputes softmax(z / tau) per chunk and writes the gradient in place.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
        v = logits.shape[-1]
        flat = logits.reshape(-1, v)
        idx = tokens.reshape(-1, 1)
        out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        out = torch.empty(flat.shape[0], dtype=out_dtype, device=logits.device)
        for rows in _row_chunks(flat.shape[0], v):
            z = flat[rows].to(out_dtype)
            z = z / temperature if temperature != 1.0 else z
            out[rows] = torch.log_softmax(z, dim=-1).gather(1, idx[rows]).squeeze(1)
        ctx.save_for_backward(logits, tokens)
        ctx.temperature = temperature
        return out.view(tokens.shape)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, tokens = ctx.saved_tensors
        tau = ctx.temperature
        v = logits.shape[-1]
        flat = logits.reshape(-1, v)
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        g = grad_out.reshape(-1).to(dtype) / tau
        idx = tokens.reshape(-1, 1)
        grad = torch.empty_like(flat)
        # d/dz_k [z_y / tau - logsumexp(z / tau)] = (1[k = y] - softmax(z / tau)_k) / tau
        for rows in _row_chunks(flat.shape[0], v):
            z = flat[rows].to(dtype)
            p = torch.softmax(z / tau if tau != 1.0 else z, dim=-1)
            if grad.dtype == dtype:  # write straight into the gradient
                gr = torch.mul(p, g[rows, None].neg(), out=grad[rows])
                gr.scatter_add_(1, idx[rows], g[rows, None])
            else:
                p.mul_(g[rows, None].neg()).scatter_add_(1, idx[rows], g[rows, None])
                grad[rows] = p.to(grad.dtype)
        return grad.view_as(logits), None, None


def token_log_probs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log pi(y_t) = log softmax(logits_t / temperature)[y_t], in float32 (float64 stays float64).

    Row-wise logsumexp and a gather: no float32 [B, T, V] log-softmax is ever held, in the forward or the
    backward pass (both work in row chunks), so bf16 logits of a large vocabulary stay affordable.
    logits: [B, T, V]; tokens: [B, T] (long) -> [B, T].
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be tokens {tuple(tokens.shape)} + [V]")
    return _TokenLogProb.apply(logits, tokens.long(), float(temperature))


def sample_categorical(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per row from softmax(logits), by inverse CDF: [B, V] -> [B] long.

    Row b's token is the first k whose cumulative probability (float64) exceeds u_b * total_b, u_b ~ U[0, 1): one
    uniform per row, where torch.multinomial draws V exponentials per row (on a CPU, tens of ms for 64 x 32k).
    Tokens of probability 0 (logits -inf, e.g. outside a top-p nucleus) are never drawn. A row without any finite
    probability mass is an error.
    """
    probs = torch.softmax(logits.float() if logits.dtype != torch.float64 else logits, dim=-1)
    cdf = probs.cumsum(-1, dtype=torch.float64)  # [B, V]
    total = cdf[:, -1:]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        bad = (~((total > 0) & torch.isfinite(total))).flatten().nonzero().flatten().tolist()
        raise ValueError(
            f"rows {bad[:8]} of the logits have no finite probability mass (NaN, or every logit -inf): "
            "nothing can be sampled; every row needs at least one finite logit"
        )
    u = torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device, generator=generator) * total
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1).squeeze(1)


class _Entropy(torch.autograd.Function):
    """H(softmax(z / tau)) computed row-chunk by row-chunk in float32; backward likewise (softmax recomputed).

    With s = z / tau and p = softmax(s): H = logsumexp(s) - sum_k p_k s_k, and
    dH/dz_k = -(p_k / tau) (s_k - sum_j p_j s_j). A token of probability 0 (logit -inf) adds nothing to either.
    """

    @staticmethod
    def _chunk(z: Tensor, tau: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(p, s with p = 0 entries zeroed, E_p[s], logsumexp(s)) of one chunk of rows."""
        s = z / tau if tau != 1.0 else z
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[:, None])
        s = torch.where(p > 0, s, torch.zeros((), dtype=s.dtype, device=s.device))
        return p, s, (p * s).sum(-1), lse

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float) -> Tensor:
        v = logits.shape[-1]
        flat = logits.reshape(-1, v)
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        out = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
        for rows in _row_chunks(flat.shape[0], v):
            _, _, mean_s, lse = _Entropy._chunk(flat[rows].to(dtype), temperature)
            out[rows] = lse - mean_s
        ctx.save_for_backward(logits)
        ctx.temperature = temperature
        return out.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (logits,) = ctx.saved_tensors
        tau = ctx.temperature
        v = logits.shape[-1]
        flat = logits.reshape(-1, v)
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        g = grad_out.reshape(-1).to(dtype) / tau
        grad = torch.empty_like(flat)
        for rows in _row_chunks(flat.shape[0], v):
            p, s, mean_s, _ = _Entropy._chunk(flat[rows].to(dtype), tau)
            grad[rows] = (p * (s - mean_s[:, None]) * g[rows, None].neg()).to(grad.dtype)
        return grad.view_as(logits), None


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) over the last dim: H = logsumexp(s) - sum_k softmax(s)_k s_k,
    s = logits / temperature.

    In float32 (float64 stays float64), in row chunks in both passes: no float32 [..., V] copy of the logits is
    held for the backward (the gradient, in the logits' dtype, is the only [..., V] tensor). logits: [..., V] ->
    [...].
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _Entropy.apply(logits, float(temperature))
