r"""PolarQuant (arXiv:2502.02617; seed 003): quantize the angles of a recursive polar transform.

After a random rotation (zero-padded to n = 2^L), the vector is mapped to its
norm and n - 1 angles:

* level 1: pairs ``(y_{2i}, y_{2i+1})`` -> radius and angle ``atan2`` in [0, 2 pi);
* level l >= 2: pairs of radii of level l-1 -> radius and angle in [0, pi/2];

until one radius, ``||x||``, remains.  For a Gaussian (or, the angles being scale
invariant, a uniform-on-the-sphere) vector the angles are independent: uniform at
level 1, with density proportional to ``sin^(2^(l-1)-1)(2 psi)`` at level l.  Each
level gets its own Lloyd-Max codebook and bit width; the norm is stored in
``norm_dtype``.  Bits per vector: ``sum_l (n / 2^l) b_l`` (each level packed
densely) plus the norm.
"""

from __future__ import annotations

import math

import torch

from qjl.codecs.base import BitBudget, Codec, Codes
from qjl.codecs.params import Param, bits_sequence, choice, seed as seed_param
from qjl.core.lloyd_max import bucket, polar_codebook
from qjl.core.packing import pack_bits, packed_size, unpack_bits
from qjl.core.rotation import ROTATIONS, Rotation
from qjl.core.validation import NORM_DTYPES, check_fits, check_positive_int, check_vectors, storage_dtype

__all__ = ["PolarQuant", "polar_transform", "inverse_polar_transform"]


def polar_transform(y: torch.Tensor):
    """y: [..., n] (n = 2^L) -> (radius [...], [angles level 1 [..., n/2], ..., level L [..., 1]])."""
    n = y.shape[-1]
    if n < 2 or n & (n - 1):
        raise ValueError(f"polar_transform needs a power-of-two length >= 2, got {n}")
    a, b = y[..., 0::2], y[..., 1::2]
    angles = [torch.remainder(torch.atan2(b, a), 2 * math.pi)]
    r = torch.hypot(a, b)
    while r.shape[-1] > 1:
        a, b = r[..., 0::2], r[..., 1::2]
        angles.append(torch.atan2(b, a))
        r = torch.hypot(a, b)
    return r.squeeze(-1), angles


def inverse_polar_transform(radius: torch.Tensor, angles: list) -> torch.Tensor:
    """Exact inverse of :func:`polar_transform`: radius [...], angles per level -> [..., n]."""
    r = radius.unsqueeze(-1)
    for psi in reversed(angles):
        r = torch.stack((r * torch.cos(psi), r * torch.sin(psi)), dim=-1).flatten(-2)
    return r


class PolarQuant(Codec):
    """Rotation + recursive polar transform + per-level Lloyd-Max angle codebooks.

    Args:
        dim: vector dimension d (padded to the next power of two n >= 2).
        bits_per_level: an int for every level, or a sequence (b_1, b_2, ...); levels past its
            end reuse its last entry.  Default (4, 2): 4 bits at level 1, 2 bits above (the
            PolarQuant paper's setting, ~3 bits per coordinate plus the norm).
        rotation: "haar" (default) or "hadamard".
        seed, norm_dtype: as for the other codecs.
    """

    name = "polarquant"
    params = {"bits_per_level": Param(bits_sequence(1, 8)), "rotation": Param(choice(*ROTATIONS)),
              "seed": Param(seed_param), "norm_dtype": Param(choice(*NORM_DTYPES, *NORM_DTYPES.values()))}

    def __init__(self, dim: int, bits_per_level=(4, 2), rotation: str = "haar", seed: int = 0, norm_dtype="fp16"):
        self.dim = check_positive_int("dim", dim)
        if dim < 2:
            raise ValueError(f"dim must be >= 2, got {dim}")
        self.check_params(dict(bits_per_level=bits_per_level, rotation=rotation, seed=seed, norm_dtype=norm_dtype))
        self.rotation = Rotation(dim, rotation, seed, pad_pow2=True)
        n = self.rotation.out_dim
        self.levels = n.bit_length() - 1
        spec = [bits_per_level] if isinstance(bits_per_level, int) else list(bits_per_level)
        self.bits = tuple(spec[min(i, len(spec) - 1)] for i in range(self.levels))
        self.books = [polar_codebook(level + 1, b) for level, b in enumerate(self.bits)]
        self._tables = [book.tensors() for book in self.books]
        self.norm_dtype = storage_dtype("norm_dtype", norm_dtype, NORM_DTYPES)

    def __repr__(self):
        return f"PolarQuant(dim={self.dim}, bits_per_level={self.bits}, rotation={self.rotation.kind!r})"

    def _count(self, level: int) -> int:
        return self.rotation.out_dim >> (level + 1)

    def quantize(self, x: torch.Tensor) -> Codes:
        """x: [..., dim] -> Codes(level0..level{L-1} packed angle indices, norm)."""
        check_vectors("x", x, self.dim)
        xf = x.float()
        norm = torch.linalg.vector_norm(xf, dim=-1)
        check_fits("norm of x", norm, self.norm_dtype)
        _, angles = polar_transform(self.rotation.apply(xf))
        fields = {}
        for level, (psi, (_, bounds)) in enumerate(zip(angles, self._tables)):
            idx = bucket(psi.contiguous(), bounds.to(psi.device))
            fields[f"level{level}"] = pack_bits(idx, self.bits[level])
        fields["norm"] = norm.to(self.norm_dtype)
        return Codes(tuple(x.shape[:-1]), fields)

    def norm_limit(self) -> float:
        return torch.finfo(self.norm_dtype).max

    def dequantize(self, codes: Codes) -> torch.Tensor:
        self._check_codes(codes, *(f"level{i}" for i in range(self.levels)), "norm", kind=repr(self))
        angles = []
        for level, (cents, _) in enumerate(self._tables):
            packed = codes.fields[f"level{level}"]
            idx = unpack_bits(packed, self.bits[level], self._count(level))
            angles.append(cents.to(packed.device)[idx])
        y = inverse_polar_transform(codes.fields["norm"].float(), angles)
        return self.rotation.inverse(y)

    def bit_budget(self) -> BitBudget:
        per_vector = {f"level{i}": 8 * packed_size(self._count(i), b) for i, b in enumerate(self.bits)}
        per_vector["norm"] = torch.finfo(self.norm_dtype).bits
        return BitBudget(self.dim, per_vector)
