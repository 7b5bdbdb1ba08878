"""Fast Walsh-Hadamard transform and randomized Hadamard rotations.

``fwht`` is the orthonormal transform ``H / sqrt(n)`` (symmetric, its own
inverse) in O(n log n).  A randomized rotation applies ``rounds`` times
"multiply by random signs, then H": ``T = H D_R ... H D_1``.  Vectors whose
length ``d`` is not a power of two are zero-padded to ``n = next_pow2(d)``.
"""

from __future__ import annotations

import torch

__all__ = ["next_pow2", "fwht", "random_signs", "hadamard_rotate", "hadamard_rotate_t"]


def next_pow2(d: int) -> int:
    return 1 << max(0, (d - 1).bit_length())


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last axis.

    x: [..., n] with n a power of two -> [..., n] (same dtype).
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"fwht: last dimension must be a power of two, got {n}")
    lead = x.shape[:-1]
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).view(-1, n)
        h *= 2
    return (y * (n ** -0.5)).reshape(*lead, n)


def random_signs(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """+1/-1 float32 tensor of ``shape`` drawn from ``generator`` (CPU)."""
    bits = torch.randint(0, 2, shape, generator=generator, dtype=torch.int64)
    return (bits * 2 - 1).to(torch.float32)


def hadamard_rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Apply ``T = H D_R ... H D_1`` to zero-padded vectors.

    x: [..., d] float; signs: [*S, R, n] with n = next_pow2(d) >= d, broadcasting
    against x's leading axes (x: [..., 1, d] with signs [B, R, n] applies B independent
    rotations at once) -> [..., n].
    """
    n = signs.shape[-1]
    d = x.shape[-1]
    y = torch.nn.functional.pad(x, (0, n - d)) if n != d else x
    for r in range(signs.shape[-2]):
        y = fwht(y * signs[..., r, :])
    return y


def hadamard_rotate_t(y: torch.Tensor, signs: torch.Tensor, d: int) -> torch.Tensor:
    """Apply ``T^T = D_1 H ... D_R H`` and drop the padding.

    y: [..., n]; signs: [*S, R, n] broadcasting against y's leading axes -> [..., d].
    """
    for r in reversed(range(signs.shape[-2])):
        y = fwht(y) * signs[..., r, :]
    return y[..., :d]
