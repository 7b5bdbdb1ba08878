"""Seeded random rotations shared by the codecs (TurboQuant, PolarQuant).

* ``"haar"``: a Haar-random orthogonal matrix (QR of a Gaussian matrix with the
  signs of R's diagonal moved into Q, so the law is exactly Haar), drawn in
  float64 on the CPU from a seeded ``torch.Generator``.
* ``"hadamard"``: ``H D_R ... H D_1`` with random signs, applied in O(n log n).

Vectors of dimension d are zero-padded to ``n = out_dim`` first (``n = d`` for
Haar unless ``pad_pow2``; the next power of two for Hadamard), so a rotated unit
vector is a point of S^{n-1}.  ``inverse(apply(x)) == x`` up to float error.
"""

from __future__ import annotations

import functools

import torch

from qjl.core.devices import on_device
from qjl.core.validation import check_choice, check_positive_int
from qjl.core.hadamard import hadamard_rotate, hadamard_rotate_t, next_pow2, random_signs

__all__ = ["Rotation", "ROTATIONS"]

ROTATIONS = ("haar", "hadamard")


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
        kind: "haar" or "hadamard".
        seed: seed; the same seed gives the same rotation in every process.
        pad_pow2: pad to the next power of two also for "haar" (PolarQuant needs it).
        rounds: sign + Hadamard rounds for "hadamard" (3, as for the QJL sketch).
    """

    def __init__(self, dim: int, kind: str = "haar", seed: int = 0, pad_pow2: bool = False, rounds: int = 3):
        self.dim = check_positive_int("dim", dim)
        check_choice("rotation", kind, ROTATIONS)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.kind, self.seed = kind, seed
        if kind == "haar":
            self.out_dim = next_pow2(dim) if pad_pow2 else dim
            self._matrix = _seeded_haar(self.out_dim, seed)  # [n, n], shared by rotations of one seed
        else:
            gen = torch.Generator().manual_seed(seed)
            self.out_dim = next_pow2(dim)
            if self.out_dim < 32:
                raise ValueError(f"rotation='hadamard' needs dim > 16 (small Hadamard transforms are far from "
                                 f"Haar); got dim={dim}: use rotation='haar'")
            self._signs = random_signs(gen, check_positive_int("rounds", rounds), self.out_dim)

    def __repr__(self):
        return f"Rotation(dim={self.dim}, kind={self.kind!r}, seed={self.seed}, out_dim={self.out_dim})"

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] float32 -> [..., out_dim]."""
        if self.kind == "hadamard":
            return hadamard_rotate(x, on_device(self._signs, x.device))
        pad = self.out_dim - self.dim
        x = torch.nn.functional.pad(x, (0, pad)) if pad else x
        return torch.matmul(x, on_device(self._matrix, x.device).T)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """y: [..., out_dim] -> [..., dim] (the transpose, then the padding dropped)."""
        if self.kind == "hadamard":
            return hadamard_rotate_t(y, on_device(self._signs, y.device), self.dim)
        return torch.matmul(y, on_device(self._matrix, y.device))[..., : self.dim]

    def matrix(self) -> torch.Tensor:
        """Dense [out_dim, dim] float32 map (for tests and references)."""
        return self.apply(torch.eye(self.dim)).T.contiguous()
