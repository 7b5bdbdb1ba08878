r"""QJL: the 1-bit quantized Johnson-Lindenstrauss sketch (paper 001, Definition 3.1).

A key ``k`` is stored as ``sign(S k)`` (m bits, packed) and ``||k||`` (one
float).  A query ``q`` is projected but *not* quantized, and

    Prod(q, k) = c * ||k|| * <S q, sign(S k)>                          (Eq. 4)

is an unbiased estimate of ``<q, k>`` when ``c`` matches the row distribution
of ``S``.  Write ``q = (<q,k>/||k||^2) k + q_perp``.  For any row ``s`` whose
distribution is invariant under orthogonal maps (a reflection fixing ``k``
flips ``s.q_perp`` and keeps ``s.k``), ``E[s.q_perp sign(s.k)] = 0`` and

    E[Prod] = c * m * <q, k> * E|s.k| / ||k||.

So ``c = ||k|| / (m E|s.k|)``:

* ``"gaussian"``: ``s ~ N(0, I_d)``, ``s.k ~ N(0, ||k||^2)``, ``E|s.k| = ||k|| sqrt(2/pi)``,
  ``c = sqrt(pi/2) / m`` -- Lemma 3.2.
* ``"orthogonal"``: rows of Haar-random orthogonal blocks scaled to norm ``sqrt(d)``
  (Section 4.1).  ``s = sqrt(d) u`` with ``u`` uniform on the sphere S^{d-1}, so
  ``E|s.k| = sqrt(d) ||k|| E|u_1|`` with
  ``E|u_1| = Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2))`` and
  ``c = 1 / (m sqrt(d) E|u_1|)``.  This is below ``sqrt(pi/2)/m`` by 0.39% at d = 64
  and 0.20% at d = 128; using the Gaussian constant here biases every score.
  Rows inside one block are dependent, but each row is marginally uniform, and
  expectation is linear, so the estimator stays exactly unbiased.
* ``"hadamard"``: blocks ``sqrt(n) H D_3 H D_2 H D_1`` (``n = next_pow2(d)``,
  keys zero-padded) applied in O(n log n), with the orthogonal constant for
  dimension ``n``.  These rows are not exactly uniform on the sphere, so a small
  key-dependent bias remains.  Measured with ``benchmarks/hadamard_rounds.py``
  (d = 128, m = 256, q = k, 20,000 seeds): one round is +25% biased on a one-hot
  key and +1.9% on a key with four 12x outlier channels; two rounds -0.41% on the
  one-hot key (32 standard errors); three rounds (our default) +0.006%, -0.005% and
  +0.006% on Gaussian, one-hot and outlier keys, all within 0.6 standard errors
  (standard error 0.012%): no bias is detectable at that resolution.
  Small transforms are far from uniform (``benchmarks/hadamard_rounds.py --small-dims``, q = k: +5.1%
  at n = 4, +0.23% at n = 8), so the family needs ``next_pow2(dim) >= 32``.

Sketches with ``sketch_dim > dim`` stack independent blocks; the last block is
truncated.  The matrix is drawn in float64 on the CPU from a ``torch.Generator``
seeded with ``seed`` (the global RNG is never touched), then rounded to float32,
so a seed gives the same matrix in every process.
"""

from __future__ import annotations

import math

import torch

from qjl.codecs.base import BitBudget, Codec, Codes
from qjl.codecs.params import Param, choice, integer, multiple_of_8, seed as seed_param
from qjl.core.validation import NORM_DTYPES, check_fits, check_positive_int, check_vectors, storage_dtype
from qjl.core.hadamard import hadamard_rotate, hadamard_rotate_t, next_pow2, random_signs
from qjl.core.devices import on_device
from qjl.core.packing import pack_signs, unpack_signs

__all__ = ["QJLSketch", "KINDS", "sphere_abs_moment", "scale_constant", "DEFAULT_HADAMARD_ROUNDS"]

KINDS = ("gaussian", "orthogonal", "hadamard")
DEFAULT_HADAMARD_ROUNDS = 3
_HADAMARD_MIN_N = 32
_CHUNK = 8192  # vectors unpacked at once in inner_product / dequantize


def sphere_abs_moment(d: int) -> float:
    """E|u_1| for u uniform on the unit sphere S^{d-1}: Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2))."""
    return math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)


def scale_constant(kind: str, dim: int, sketch_dim: int) -> float:
    """The constant ``c`` of Eq. (4) that makes the estimator unbiased for ``kind`` (see module doc)."""
    if kind == "gaussian":
        return math.sqrt(math.pi / 2) / sketch_dim
    n = dim if kind == "orthogonal" else next_pow2(dim)
    return 1.0 / (sketch_dim * math.sqrt(n) * sphere_abs_moment(n))


def _haar_rows(generator: torch.Generator, d: int, rows: int) -> torch.Tensor:
    """``rows`` rows of independent Haar-random d x d orthogonal blocks, scaled to norm sqrt(d)."""
    blocks = []
    for _ in range(-(-rows // d)):
        g = torch.randn(d, d, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(g)
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # sign fix: Haar, not QR-biased
        blocks.append(q.T * math.sqrt(d))
    return torch.cat(blocks)[:rows]


class QJLSketch(Codec):
    """QJL key quantizer: packed sign bits of ``S x`` plus ``||x||``.

    Args:
        dim: input dimension d (head_dim).
        sketch_dim: m, the number of sign bits per vector; a multiple of 8.
        kind: "gaussian", "orthogonal" (default) or "hadamard" (module doc).
        seed: seed of the matrix; the same seed gives the same matrix everywhere.
        norm_dtype: storage of the norm: "fp16" (default), "bf16", "fp32" or "fp8" (float8 e4m3: 8 bits,
            relative error <= 2^-4).
        hadamard_rounds: sign+Hadamard rounds of the "hadamard" family.
    """

    name = "qjl"
    params = {"sketch_dim": Param(multiple_of_8(), per_dim=True), "kind": Param(choice(*KINDS)),
              "seed": Param(seed_param), "norm_dtype": Param(choice(*NORM_DTYPES, *NORM_DTYPES.values())),
              "hadamard_rounds": Param(integer(1))}

    def __init__(self, dim: int, sketch_dim: int, kind: str = "orthogonal", seed: int = 0,
                 norm_dtype="fp16", hadamard_rounds: int = DEFAULT_HADAMARD_ROUNDS):
        self.dim = check_positive_int("dim", dim)
        self.check_params(dict(sketch_dim=sketch_dim, kind=kind, seed=seed, norm_dtype=norm_dtype,
                               hadamard_rounds=hadamard_rounds))
        self.sketch_dim, self.kind, self.seed = sketch_dim, kind, seed
        self.norm_dtype = storage_dtype("norm_dtype", norm_dtype, NORM_DTYPES)
        self.hadamard_rounds = hadamard_rounds
        if kind == "hadamard" and next_pow2(dim) < _HADAMARD_MIN_N:
            raise ValueError(f"kind='hadamard' needs dim > {_HADAMARD_MIN_N // 2} (small Hadamard transforms are "
                             f"measurably biased); got dim={dim}: use kind='orthogonal'")
        self.scale = scale_constant(kind, dim, sketch_dim)
        gen = torch.Generator().manual_seed(seed)
        if kind == "gaussian":
            self._matrix = torch.randn(sketch_dim, dim, generator=gen, dtype=torch.float64).float()
        elif kind == "orthogonal":
            self._matrix = _haar_rows(gen, dim, sketch_dim).float()
        else:
            self._n = next_pow2(dim)
            self._blocks = -(-sketch_dim // self._n)
            self._signs = random_signs(gen, self._blocks, self.hadamard_rounds, self._n)
            self._matrix = None

    def __repr__(self):
        return f"QJLSketch(dim={self.dim}, sketch_dim={self.sketch_dim}, kind={self.kind!r}, seed={self.seed})"

    # -- the linear map -------------------------------------------------------------
    def project(self, x: torch.Tensor) -> torch.Tensor:
        """S x: [..., dim] float32 -> [..., sketch_dim] float32 (O(d log d) per block for hadamard)."""
        if self._matrix is not None:
            return torch.matmul(x, on_device(self._matrix, x.device).T)
        y = hadamard_rotate(x.unsqueeze(-2), on_device(self._signs, x.device))  # [..., blocks, n]
        return y.flatten(-2)[..., : self.sketch_dim] * math.sqrt(self._n)

    def project_t(self, z: torch.Tensor) -> torch.Tensor:
        """S^T z: [..., sketch_dim] float32 -> [..., dim] float32."""
        if self._matrix is not None:
            return torch.matmul(z, on_device(self._matrix, z.device))
        pad = self._blocks * self._n - self.sketch_dim
        z = torch.nn.functional.pad(z, (0, pad)) if pad else z
        parts = z.reshape(*z.shape[:-1], self._blocks, self._n)
        out = hadamard_rotate_t(parts, on_device(self._signs, z.device), self.dim)  # [..., blocks, dim]
        return out.sum(dim=-2) * math.sqrt(self._n)

    def matrix(self) -> torch.Tensor:
        """The dense S: [sketch_dim, dim] float32 (materialized on demand for "hadamard")."""
        if self._matrix is not None:
            return self._matrix.clone()
        return self.project(torch.eye(self.dim)).T.contiguous()

    # -- codec interface --------------------------------------------------------------
    def quantize(self, x: torch.Tensor) -> Codes:
        """x: [..., dim] -> Codes(signs [..., sketch_dim // 8] uint8, norm [...] norm_dtype)."""
        check_vectors("x", x, self.dim)
        xf = x.float()
        norm = torch.linalg.vector_norm(xf, dim=-1)
        check_fits("norm of x", norm, self.norm_dtype)
        signs = pack_signs(self.project(xf))
        return Codes(tuple(x.shape[:-1]), {"signs": signs, "norm": norm.to(self.norm_dtype)})

    def norm_limit(self) -> float:
        return torch.finfo(self.norm_dtype).max

    def _check_codes(self, codes: Codes, *fields, kind=None) -> None:
        super()._check_codes(codes, "signs", "norm", kind=f"QJLSketch with sketch_dim={self.sketch_dim}")
        if codes.fields["signs"].shape[-1] != self.sketch_dim // 8:
            raise ValueError(f"codes were not produced by a QJLSketch with sketch_dim={self.sketch_dim}")

    def inner_product(self, q: torch.Tensor, codes: Codes) -> torch.Tensor:
        """Eq. (4) from the packed bits. q: [..., t, dim], codes lead [..., n] -> [..., t, n] float32."""
        self._check_query(q, codes)
        self._check_codes(codes)
        sq = self.project(q.float())  # [..., t, m]
        signs, norm = codes.fields["signs"], codes.fields["norm"]
        n = signs.shape[-2] if signs.ndim >= 2 else 1
        out = []
        for start in range(0, max(n, 1), _CHUNK):
            s = unpack_signs(signs.narrow(-2, start, min(_CHUNK, n - start)))  # [..., c, m]
            nrm = norm.narrow(-1, start, min(_CHUNK, n - start)).float()
            out.append(torch.matmul(sq, s.transpose(-1, -2)) * (self.scale * nrm).unsqueeze(-2))
        return torch.cat(out, dim=-1)

    def dequantize(self, codes: Codes) -> torch.Tensor:
        """k_hat = c ||k|| S^T sign(S k): lead [...] -> [..., dim] float32, with q.k_hat = Eq. (4)."""
        self._check_codes(codes)
        signs = unpack_signs(codes.fields["signs"])
        return self.project_t(signs) * (self.scale * codes.fields["norm"].float()).unsqueeze(-1)

    # -- kernel view: sign bits as 1-bit codes of the centroids (-1, +1) -------------------------
    def score_view(self):
        """One term: ``norm * <c S q, sign>`` (Eq. 4, :meth:`inner_product`)."""
        from qjl.codecs.views import KeyTerm, PackedCodes, ScoreView

        return ScoreView((KeyTerm(PackedCodes("signs", 1, self.sketch_dim, torch.tensor([-1.0, 1.0])), "norm"),))

    def quantize_view(self):
        """Project with S, sign, pack; the norm of x."""
        from qjl.codecs.views import ProjectQuantize, QuantizeView

        return QuantizeView((ProjectQuantize(self, 1, "signs", "norm", self.norm_dtype),))

    def score_queries(self, q: torch.Tensor, shared: dict | None = None) -> list:
        """q: [..., dim] -> [c S q] ([..., sketch_dim] float32, the estimator's constant included)."""
        return [self.project(q.float()) * self.scale]

    def bit_budget(self) -> BitBudget:
        norm_bits = torch.finfo(self.norm_dtype).bits
        return BitBudget(self.dim, {"signs": self.sketch_dim, "norm": norm_bits})
