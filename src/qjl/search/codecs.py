r"""The codecs an index can hold, as (encode, per-query tables) pairs for the LUT scan.

Each wraps a codec of the family and says how its estimate splits into segments
(:mod:`qjl.search.scan`):

* ``tq-mse``: :class:`qjl.TurboQuantMSE` as in the paper, ``<q, x_hat> = ||x|| <Pi q, c[idx]>``.
* ``tq-mse-rn``: the same codes with the RaBitQ-style per-vector renormalisation
  (``correct_norm=True``): the stored factor is ``||x|| / <u, u_hat>`` instead of ``||x||``
  (``u = Pi x / ||x||``, ``u_hat = c[idx]``), so the estimate is ``<q, u_hat> ||x|| / <u, u_hat>``,
  RaBitQ's estimator (Gao & Long 2024, Eq. 13) with TurboQuant's codebook.  Same bits.
* ``tq-prod``: :class:`qjl.TurboQuantProd` (b-1 bit MSE + QJL of the residual, two norms).
* ``qjl``: :class:`qjl.QJLSketch` with ``bits * dim`` sign bits (rounded up to a byte).
* ``polar``: :class:`qjl.PolarQuant` with ``bits`` per angle at every level: its estimate is not a
  sum over coordinates, so it is scored by dequantization (torch only, slow).

Every stored byte counts: codes plus one float16 factor per segment (the norms).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..codecs.polarquant import PolarQuant
from ..codecs.sketch import QJLSketch
from ..codecs.turboquant import TurboQuantMSE, TurboQuantProd
from ..core.lloyd_max import sphere_codebook, sphere_pdf
from ..core.validation import check_fits
from .encode import encode_lloyd_max
from .scan import Layout, Segment

__all__ = ["SearchCodec", "make_search_codec", "CODEC_NAMES", "FAST_CODECS", "ROTATION_CODECS", "check_rotation",
           "default_rotation", "scan_centroids"]

CODEC_NAMES = ("tq-mse", "tq-mse-rn", "tq-prod", "qjl", "polar")
# the rotation each codec may use: "haar" (dense, dim x dim), "hadamard" (random signs and Hadamard transforms,
# zero-padded to the next power of two: more coordinates, so more bits per vector, as faiss's "HR," prefix) or
# "hadamard-kron" (a Hadamard transform of order dim itself, dim = m 2^k with m in 1, 12, 20: 384 stays 384, and
# about 9x fewer multiply-adds than the dense rotation per round)
ROTATION_CODECS = {"haar": ("tq-mse", "tq-mse-rn", "tq-prod", "qjl", "polar"),
                   "hadamard": ("tq-mse", "tq-mse-rn", "tq-prod"), "hadamard-kron": ("tq-mse", "tq-mse-rn", "tq-prod")}
FAST_CODECS = ("tq-mse", "tq-mse-rn", "qjl")  # one factor per vector, a sum over coordinates: fast-scannable
ENCODE_ROWS = 1024  # rows shifted, rotated and encoded together: their rotated copy stays in cache


def default_rotation(codec: str, dim: int) -> str:
    """The rotation ``rotation="auto"`` picks: "hadamard-kron" where ``codec`` takes it and ``dim = m 2^k`` (m in 1,
    12, 20; dim >= 32), else "haar".  On MiniLM passages (384 = 12 x 32) its recall@10 matched the dense rotation's
    within the seed spread at 1-4 bits and ``add`` ran 1.5-1.9x faster than with the dense rotation (docs/search.md,
    "An unpadded Hadamard rotation")."""
    from ..core.hadamard import kron_orders

    if codec in ROTATION_CODECS["hadamard-kron"] and dim >= 32 and kron_orders(dim) is not None:
        return "hadamard-kron"
    return "haar"


def check_rotation(codec: str, rotation: str) -> None:
    """ValueError unless ``rotation`` is one that ``codec`` can use (:data:`ROTATION_CODECS`)."""
    if rotation not in ROTATION_CODECS or codec not in ROTATION_CODECS[rotation]:
        raise ValueError(f"rotation must be one of {[r for r in ROTATION_CODECS if codec in ROTATION_CODECS[r]]} "
                         f"for codec {codec!r}, got {rotation!r}")


@functools.lru_cache(maxsize=None)
def scan_centroids(n: int, bits: int, scan_bits: int) -> tuple:
    """Centroids of the scan cells of a ``bits``-bit sphere codebook (dimension ``n``) read by its top
    ``scan_bits`` bits: cell h is the union of the cells ``h << r .. (h + 1) << r - 1`` (r = bits - scan_bits),
    and its centroid the conditional mean ``sum_v p_v c_v / sum_v p_v`` (p_v: the cells' probabilities
    under the coordinate density, c_v: their Lloyd-Max centroids, themselves conditional means)."""
    book = sphere_codebook(n, bits)
    r = bits - scan_bits
    if r == 0:
        return tuple(book.centroids)
    pdf, lo, hi = sphere_pdf(n)
    edges = [lo, *book.boundaries, hi]
    weight = np.array([np.trapezoid(pdf(x), x) for x in (np.linspace(a, b, 20_001) for a, b in zip(edges, edges[1:]))])
    c = np.asarray(book.centroids)
    return tuple(float((weight[h << r:(h + 1) << r] * c[h << r:(h + 1) << r]).sum() / weight[h << r:(h + 1) << r].sum())
                 for h in range(1 << scan_bits))


def _mse_table(codec: TurboQuantMSE, q: torch.Tensor) -> torch.Tensor:
    """q: [nq, d] -> [nq, n, 2**bits]: (Pi q)_j * c[v]."""
    cents = torch.tensor(codec.codebook.centroids, dtype=torch.float32)
    return codec.rotation.apply(q.float()).unsqueeze(-1) * cents


def _sign_table(sketch: QJLSketch, q: torch.Tensor) -> torch.Tensor:
    """q: [nq, d] -> [nq, m, 2]: (S q)_j * (-1, +1) (a set bit is a non-negative projection)."""
    return sketch.project(q.float()).unsqueeze(-1) * torch.tensor([-1.0, 1.0])


class SearchCodec:
    """One codec, seen by the index.

    ``encode(x [n, d] float32) -> (codes [n, stride] uint8, factors [nseg, n] float16)``;
    ``tables(q [nq, d]) -> list of [nq, n_coords, 2**bits]`` (None for torch-only codecs);
    ``score(q [nq, d], codes, factors) -> [nq, n]`` the reference estimate (any codec).
    """

    def __init__(self, name: str, dim: int, bits: int, seed: int = 0, rotation: str = "haar"):
        if name not in CODEC_NAMES:
            raise ValueError(f"codec must be one of {list(CODEC_NAMES)}, got {name!r}")
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 4:
            raise ValueError(f"bits must be an int in 1..4, got {bits!r}")
        check_rotation(name, rotation)
        self.name, self.dim, self.bits, self.seed, self.rotation = name, dim, bits, seed, rotation
        if name in ("tq-mse", "tq-mse-rn"):
            self.codec = TurboQuantMSE(dim, bits, rotation, seed, "fp16", correct_norm=name == "tq-mse-rn")
            # the padded Hadamard rotation as one dense [dim, n] map: one sgemm per chunk instead of 3 x log2(n)
            # small torch passes (the same rotation up to float32 rounding)
            self._dense = self.codec.rotation.matrix().T.contiguous() if rotation == "hadamard" else None
            n = self.codec.rotation.out_dim
            self.layout = Layout((Segment(0, (n * bits + 7) // 8, bits, n),), (n * bits + 7) // 8)
        elif name == "tq-prod":
            self.codec = TurboQuantProd(dim, bits, rotation=rotation, seed=seed)
            m = self.codec.qjl.sketch_dim
            segs = [Segment(0, m // 8, 1, m)]
            if self.codec.mse is not None:
                n, b = self.codec.mse.rotation.out_dim, bits - 1
                segs.insert(0, Segment(0, (n * b + 7) // 8, b, n))
                segs[1] = Segment(segs[0].nbytes, m // 8, 1, m)
            self.layout = Layout(tuple(segs), sum(s.nbytes for s in segs))
        elif name == "qjl":
            m = -(-bits * dim // 8) * 8
            self.codec = QJLSketch(dim, m, "orthogonal", seed)
            self.layout = Layout((Segment(0, m // 8, 1, m),), m // 8)
        else:
            self.codec = PolarQuant(dim, bits, "haar", seed)
            self.layout = None
            self._fields = [f"level{i}" for i in range(self.codec.levels)]
            self._sizes = [self.codec.bit_budget().per_vector[f] // 8 for f in self._fields]

    def __repr__(self):
        return f"SearchCodec({self.name!r}, dim={self.dim}, bits={self.bits}, seed={self.seed}, rotation={self.rotation!r})"

    @property
    def stride(self) -> int:
        return self.layout.stride if self.layout is not None else sum(self._sizes)

    @property
    def nseg(self) -> int:
        return len(self.layout.segments) if self.layout is not None else 1

    @property
    def n_coords(self) -> int:
        """Coordinates of a fast-scannable code (rotated / projected dimension)."""
        return self.layout.segments[0].n_coords

    @property
    def code_bits(self) -> int:
        """Bits per coordinate of a fast-scannable code (QJL: 1)."""
        return self.layout.segments[0].bits

    def query_coords(self, q: torch.Tensor) -> torch.Tensor:
        """q: [nq, dim] -> y [nq, n_coords]: the estimate of a vector is ``f * sum_j y_j c[idx_j]``."""
        if self.name in ("tq-mse", "tq-mse-rn"):
            return self._rotate(q.float())
        if self.name == "qjl":
            return self.codec.project(q.float())
        raise ValueError(f"codec {self.name!r} is not fast-scannable (one of {list(FAST_CODECS)})")

    def centroids(self, scan_bits: int | None = None) -> torch.Tensor:
        """[2**bits] the value of each code (QJL: -1, +1); with ``scan_bits``: the scan cells' centroids."""
        if self.name == "qjl":
            return torch.tensor([-1.0, 1.0])
        n = self.codec.rotation.out_dim
        return torch.tensor(scan_centroids(n, self.bits, scan_bits or self.bits), dtype=torch.float32)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, dim] float32 -> the TurboQuant codec's rotation of x, [n, n_coords]."""
        return self.codec.rotation.apply(x) if self._dense is None else torch.matmul(x, self._dense)

    def bytes_per_vector(self) -> int:
        """Code bytes plus the float16 factors."""
        return self.stride + 2 * self.nseg

    def _encode_mse(self, x: torch.Tensor, rbits: int = 0, shift: torch.Tensor | None = None):
        """TurboQuantMSE.quantize of ``x - shift`` with the scale + bucket + pack step in C: each chunk of
        :data:`ENCODE_ROWS` rows is shifted, rotated and encoded while it is in cache (no [n, dim] temporaries),
        and divided by its norm in the kernel (codes equal TurboQuantMSE's up to float32 rounding at cell
        edges: encode.py)."""
        codec = self.codec
        parts, norms, dots = [], [], []
        for xc in x.split(ENCODE_ROWS):
            if shift is not None:
                xc = xc - shift
            norm = torch.linalg.vector_norm(xc, dim=-1)
            codes, dot = encode_lloyd_max(self._rotate(xc).contiguous(), codec.codebook, codec.bits,
                                          norm=torch.where(norm > 0, norm, torch.ones_like(norm)), rbits=rbits)
            parts.append(codes)
            norms.append(norm)
            dots.append(dot)
        codes, norm, dot = (torch.cat(t) if len(t) > 1 else t[0] for t in (parts, norms, dots))
        check_fits("norm of x", norm, torch.float16)
        if codec.correct_norm:
            norm = norm / torch.where(dot > 0, dot, torch.ones_like(dot))
            check_fits("corrected norm of x", norm, torch.float16)
        return codes, norm.half().unsqueeze(0)

    def encode(self, x: torch.Tensor, planes=None, shift: torch.Tensor | None = None):
        """x: [n, dim] float32 (finite) -> (codes [n, stride] uint8, factors [nseg, n] float16) of ``x - shift``
        (``shift``: [dim], or None).

        ``planes``: a :class:`~qjl.search.fastscan.FastLayout` -> the codes as its planes
        ``[n, planes.row_bytes]`` (``rows_to_planes(codes, planes)``; written so by the C encoder directly)."""
        if shift is not None and (not isinstance(shift, torch.Tensor) or not shift.is_floating_point()
                                  or tuple(shift.shape) != (self.dim,)):
            raise ValueError(f"shift must be a float tensor [{self.dim}] or None, got "
                             f"{getattr(shift, 'dtype', type(shift).__name__)} {tuple(getattr(shift, 'shape', ()))}")
        if self.name in ("tq-mse", "tq-mse-rn"):
            return self._encode_mse(x.float(), planes.rbits if planes is not None else 0, shift)
        codes, factors = self._encode_other(x if shift is None else x - shift)
        if planes is not None:
            from .fastscan import rows_to_planes

            codes = rows_to_planes(codes, planes)
        return codes, factors

    def _encode_other(self, x: torch.Tensor):
        c = self.codec.quantize(x.float()).fields
        if self.name == "qjl":
            return c["signs"], (c["norm"].float() * self.codec.scale).half().unsqueeze(0)
        if self.name == "tq-prod":
            res = (c["res_norm"].float() * self.codec.qjl.scale).half()
            if self.codec.mse is None:
                return c["signs"], res.unsqueeze(0)
            return torch.cat([c["codes"], c["signs"]], 1), torch.stack([c["norm"].half(), res])
        return torch.cat([c[f] for f in self._fields], 1), c["norm"].half().unsqueeze(0)

    def tables(self, q: torch.Tensor):
        if self.name in ("tq-mse", "tq-mse-rn"):
            return [_mse_table(self.codec, q)]
        if self.name == "qjl":
            return [_sign_table(self.codec, q)]
        if self.name == "tq-prod":
            signs = _sign_table(self.codec.qjl, q)
            return [signs] if self.codec.mse is None else [_mse_table(self.codec.mse, q), signs]
        return None

    def score(self, q: torch.Tensor, codes: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
        """Reference estimate through the codec itself: q [nq, d], codes [n, stride] -> [nq, n]."""
        from ..codecs.base import Codes

        lead = (codes.shape[0],)
        if self.name in ("tq-mse", "tq-mse-rn"):
            c = Codes(lead, {"codes": codes, "norm": factors[0]})
        elif self.name == "qjl":
            c = Codes(lead, {"signs": codes, "norm": (factors[0].float() / self.codec.scale)})
        elif self.name == "tq-prod":
            res = factors[-1].float() / self.codec.qjl.scale
            if self.codec.mse is None:
                c = Codes(lead, {"signs": codes, "res_norm": res})
            else:
                nb = self.layout.segments[0].nbytes
                c = Codes(lead, {"codes": codes[:, :nb], "norm": factors[0], "signs": codes[:, nb:], "res_norm": res})
        else:
            parts = torch.split(codes, self._sizes, dim=1)
            c = Codes(lead, {**dict(zip(self._fields, parts)), "norm": factors[0]})
        return self.codec.inner_product(q.float(), c)


def make_search_codec(name: str, dim: int, bits: int, seed: int = 0, rotation: str = "haar") -> SearchCodec:
    return SearchCodec(name, dim, bits, seed, rotation)
