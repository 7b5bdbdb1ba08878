"""Seeded random rotations shared by the codecs (TurboQuant, PolarQuant).

* ``"haar"``: a Haar-random orthogonal matrix (QR of a Gaussian matrix with the
  signs of R's diagonal moved into Q, so the law is exactly Haar), drawn in
  float64 on the CPU from a seeded ``torch.Generator``.
* ``"hadamard"``: ``H D_R ... H D_1`` with random signs, applied in O(n log n).
* ``"hadamard-kron"``: the same with a Hadamard transform of order ``d`` itself,
  ``H = (H_m (x) H_{2^k}) / sqrt(d)`` for ``d = m 2^k``, ``m`` in 1, 12, 20
  (:func:`qjl.core.hadamard.kron_hadamard`): no padding (384 stays 384), ``d (m + 2^k)``
  multiply-adds per round instead of a dense rotation's ``d^2``.

Vectors of dimension d are zero-padded to ``n = out_dim`` first (``n = d`` for
Haar unless ``pad_pow2``; the next power of two for Hadamard; ``d`` for
hadamard-kron), so a rotated unit vector is a point of S^{n-1}.  ``inverse(apply(x)) == x`` up to float error.
"""

from __future__ import annotations

import functools

import torch

from qjl.core.devices import on_device
from qjl.core.validation import check_choice, check_positive_int
from qjl.core.hadamard import (hadamard_rotate, hadamard_rotate_t, kron_hadamard, kron_hadamard_t, kron_orders,
                               next_pow2, random_signs)

__all__ = ["Rotation", "ROTATIONS"]

ROTATIONS = ("haar", "hadamard", "hadamard-kron")


def haar_matrix(generator: torch.Generator, n: int) -> torch.Tensor:
    """Haar-random n x n orthogonal matrix, float64."""
    g = torch.randn(n, n, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


@functools.lru_cache(maxsize=512)
def _seeded_haar(n: int, seed: int) -> torch.Tensor:
    """The float32 Haar matrix of (n, seed), built once per process: a cache builds the same rotations for
    every layer of every new cache, and the width allocation builds each layer's candidates with one seed.
    Read-only: callers never modify it."""
    return haar_matrix(torch.Generator().manual_seed(seed), n).float()


class Rotation:
    """Random rotation of R^d (zero-padded to R^n).

    Args:
        dim: input dimension d.
        kind: "haar", "hadamard" or "hadamard-kron" (``dim = m 2^k``, m in 1, 12, 20; dim >= 32).
        seed: seed; the same seed gives the same rotation in every process.
        pad_pow2: pad to the next power of two also for "haar" (PolarQuant needs it).
        rounds: sign + Hadamard rounds (default: 3 for "hadamard", as for the QJL sketch; 2 for "hadamard-kron",
            whose search-index recall matched the dense Haar rotation's at 1 and 2 rounds alike: docs/search.md,
            "Rotation").
    """

    def __init__(self, dim: int, kind: str = "haar", seed: int = 0, pad_pow2: bool = False, rounds: int | None = None):
        self.dim = check_positive_int("dim", dim)
        check_choice("rotation", kind, ROTATIONS)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.kind, self.seed = kind, seed
        if kind == "haar":
            self.out_dim = next_pow2(dim) if pad_pow2 else dim
            self._matrix = _seeded_haar(self.out_dim, seed)  # [n, n], shared by rotations of one seed
        elif kind == "hadamard-kron":
            if pad_pow2:
                raise ValueError("rotation='hadamard-kron' keeps the dimension; a codec that needs a power of two "
                                 "takes rotation='hadamard' (zero-padded) or 'haar'")
            if kron_orders(dim) is None or dim < 32:
                raise ValueError(f"rotation='hadamard-kron' needs dim = m * 2^k with m in 1, 12 or 20 and dim >= 32 "
                                 f"(e.g. 96, 384, 768), got dim={dim}: use rotation='hadamard' (zero-padded) or 'haar'")
            self.out_dim = dim
            rounds = 2 if rounds is None else rounds
            self._signs = random_signs(torch.Generator().manual_seed(seed), check_positive_int("rounds", rounds), dim)
        else:
            gen = torch.Generator().manual_seed(seed)
            self.out_dim = next_pow2(dim)
            if self.out_dim < 32:
                raise ValueError(f"rotation='hadamard' needs dim > 16 (small Hadamard transforms are far from "
                                 f"Haar); got dim={dim}: use rotation='haar'")
            self._signs = random_signs(gen, check_positive_int("rounds", 3 if rounds is None else rounds), self.out_dim)

    def __repr__(self):
        return f"Rotation(dim={self.dim}, kind={self.kind!r}, seed={self.seed}, out_dim={self.out_dim})"

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] float32 -> [..., out_dim]."""
        if self.kind == "hadamard":
            return hadamard_rotate(x, on_device(self._signs, x.device))
        if self.kind == "hadamard-kron":
            return hadamard_rotate(x, on_device(self._signs, x.device), kron_hadamard)
        pad = self.out_dim - self.dim
        x = torch.nn.functional.pad(x, (0, pad)) if pad else x
        return torch.matmul(x, on_device(self._matrix, x.device).T)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """y: [..., out_dim] -> [..., dim] (the transpose, then the padding dropped)."""
        if self.kind == "hadamard":
            return hadamard_rotate_t(y, on_device(self._signs, y.device), self.dim)
        if self.kind == "hadamard-kron":
            return hadamard_rotate_t(y, on_device(self._signs, y.device), self.dim, kron_hadamard_t)
        return torch.matmul(y, on_device(self._matrix, y.device))[..., : self.dim]

    def matrix(self) -> torch.Tensor:
        """Dense [out_dim, dim] float32 map (for tests and references)."""
        return self.apply(torch.eye(self.dim)).T.contiguous()
