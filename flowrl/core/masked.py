"""Statistics over the positions a mask selects (mask: 1 = counts, 0 = padding)."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x * mask` over `dim` (all elements when None)."""
    xm = x * mask
    return xm.sum() if dim is None else xm.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over the positions where `mask` is 1.

    An all-zero mask gives 0, not NaN (the count is clamped to at least 1).
    x, mask: same shape (mask is broadcast); returns a scalar, or `x` reduced over `dim`.
    """
    mask = mask.to(x.dtype)
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked elements of `x` (scalar); Bessel-corrected when `unbiased`.

    With fewer than two masked elements (unbiased) or none (biased) it is 0.
    """
    mask = mask.to(x.dtype)
    n = mask.sum()
    mean = masked_mean(x, mask)
    sq = masked_sum((x - mean) ** 2, mask)
    denom = n - 1 if unbiased else n
    return torch.where(denom > 0, sq / denom.clamp(min=1), torch.zeros_like(sq))


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """`(x - mean) / sqrt(var + eps)` with mean and (unbiased) variance over the masked elements.

    With `shift_mean=False` the mean is added back after scaling (only the scale changes).
    Masked-out positions are returned as computed (callers multiply by the mask if they need zeros).
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean
