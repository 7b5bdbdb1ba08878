"""Fast Walsh-Hadamard transform and randomized Hadamard rotations.

``fwht`` is the orthonormal transform ``H / sqrt(n)`` (symmetric, its own
inverse) in O(n log n).  A randomized rotation applies ``rounds`` times
"multiply by random signs, then H": ``T = H D_R ... H D_1``.  Vectors whose
length ``d`` is not a power of two are zero-padded to ``n = next_pow2(d)``.

:func:`kron_hadamard` is an orthonormal Hadamard transform of order ``d = m 2^k`` itself for
``m`` in 1, 12, 20 -- ``(H_m (x) H_{2^k}) / sqrt(d)`` with ``H_m`` Paley's construction (a
Kronecker product of Hadamard matrices is one) -- so dimensions such as 96, 384, 768 or 1,536 need
no padding: ``d (m + 2^k)`` multiply-adds per vector instead of ``d^2`` for a dense rotation.
"""

from __future__ import annotations

import functools

import torch

from qjl.core.devices import on_device

__all__ = ["next_pow2", "fwht", "random_signs", "hadamard_rotate", "hadamard_rotate_t", "kron_orders",
           "paley_hadamard", "kron_hadamard", "kron_hadamard_t"]

KRON_ORDERS = (1, 12, 20)  # m of d = m 2^k: Paley orders q + 1 for the primes q = 11, 19 (q = 3 mod 4)


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


def hadamard_rotate(x: torch.Tensor, signs: torch.Tensor, transform=fwht) -> torch.Tensor:
    """Apply ``T = H D_R ... H D_1`` to zero-padded vectors.

    x: [..., d] float; signs: [*S, R, n] with n = next_pow2(d) >= d, broadcasting
    against x's leading axes (x: [..., 1, d] with signs [B, R, n] applies B independent
    rotations at once) -> [..., n].  ``transform``: the orthonormal H (:func:`fwht`, or
    :func:`kron_hadamard` with n = d).
    """
    n = signs.shape[-1]
    d = x.shape[-1]
    y = torch.nn.functional.pad(x, (0, n - d)) if n != d else x
    for r in range(signs.shape[-2]):
        y = transform(y * signs[..., r, :])
    return y


def hadamard_rotate_t(y: torch.Tensor, signs: torch.Tensor, d: int, transform_t=fwht) -> torch.Tensor:
    """Apply ``T^T = D_1 H^T ... D_R H^T`` and drop the padding.

    y: [..., n]; signs: [*S, R, n] broadcasting against y's leading axes -> [..., d].  ``transform_t``: H^T
    (:func:`fwht` is its own; :func:`kron_hadamard_t`).
    """
    for r in reversed(range(signs.shape[-2])):
        y = transform_t(y) * signs[..., r, :]
    return y[..., :d]


def kron_orders(d: int):
    """``(m, p)`` with ``d = m p``, ``m`` in 1, 12, 20 and ``p`` a power of two (the smallest such ``m``), or None."""
    for m in KRON_ORDERS:
        if d % m == 0 and d // m >= 1 and not (d // m) & (d // m - 1):
            return m, d // m
    return None


@functools.lru_cache(maxsize=None)
def paley_hadamard(m: int) -> torch.Tensor:
    """The orthonormal Hadamard matrix ``H_m / sqrt(m)`` float32 [m, m] (m = 1, 12 or 20: Paley's construction
    I from the quadratic residues mod q = m - 1).  Not symmetric for m > 1: its inverse is its transpose."""
    if m == 1:
        return torch.ones(1, 1)
    if m not in KRON_ORDERS:
        raise ValueError(f"m must be one of {KRON_ORDERS}, got {m!r}")
    q = m - 1
    chi = [0] + [1 if pow(i, (q - 1) // 2, q) == 1 else -1 for i in range(1, q)]
    h = torch.zeros(m, m, dtype=torch.float64)
    h[0, 1:], h[1:, 0] = 1.0, -1.0
    h[1:, 1:] = torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)], dtype=torch.float64)
    h += torch.eye(m, dtype=torch.float64)
    return (h / m ** 0.5).float()


@functools.lru_cache(maxsize=None)
def _paley_t(m: int) -> torch.Tensor:
    """The transpose (= inverse) of :func:`paley_hadamard`, contiguous, built once."""
    return paley_hadamard(m).T.contiguous()


@functools.lru_cache(maxsize=None)
def _sylvester(p: int) -> torch.Tensor:
    """``H_p / sqrt(p)`` float32 [p, p] (symmetric), for the dense small-``p`` path of :func:`kron_hadamard`."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < p:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / p ** 0.5).float()


_DENSE_P = 128  # up to this p, H_p is applied as one small matrix product (faster than log2(p) torch passes)


def _pow2_part(y: torch.Tensor, p: int) -> torch.Tensor:
    """y [N, p] -> y H_p / sqrt(p) (H_p symmetric)."""
    if p == 1:
        return y
    return torch.matmul(y, on_device(_sylvester(p), y.device)) if p <= _DENSE_P else fwht(y)


def _kron_shape(x: torch.Tensor, name: str) -> tuple:
    """``(m, p)`` of x's last dimension (:func:`kron_orders`), or a ValueError naming ``name``."""
    mp = kron_orders(x.shape[-1])
    if mp is None:
        raise ValueError(f"{name}: the last dimension must be m * 2^k with m in {KRON_ORDERS}, got {x.shape[-1]}")
    return mp


def kron_hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x -> (H_m (x) H_p) x / sqrt(d)`` over the last axis, ``d = m p`` (:func:`kron_orders`); x: [..., d] float
    -> [..., d].  The coordinate ``i p + j`` is the pair ``(i, j)``."""
    m, p = _kron_shape(x, "kron_hadamard")
    d, lead = x.shape[-1], x.shape[:-1]
    y = _pow2_part(x.reshape(-1, p), p).view(-1, m, p)
    if m > 1:
        y = torch.matmul(on_device(paley_hadamard(m), y.device), y)  # [m, m] @ [N, m, p]
    return y.reshape(*lead, d)


def kron_hadamard_t(y: torch.Tensor) -> torch.Tensor:
    """The transpose (= inverse) of :func:`kron_hadamard`: y [..., d] -> [..., d]."""
    m, p = _kron_shape(y, "kron_hadamard_t")
    d, lead = y.shape[-1], y.shape[:-1]
    z = y.reshape(-1, m, p)
    if m > 1:
        z = torch.matmul(on_device(_paley_t(m), z.device), z)
    return _pow2_part(z.reshape(-1, p), p).reshape(*lead, d)
