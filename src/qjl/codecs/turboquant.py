r"""TurboQuant (arXiv:2504.19874; seed 003): rotation + Lloyd-Max, and its unbiased variant.

``TurboQuantMSE``: store ``||x||`` and, for the rotated unit vector
``y = Pi x / ||x||`` (a uniform point of S^{n-1}), the index of the nearest
centroid of the Lloyd-Max codebook of one sphere coordinate (:mod:`qjl.core.lloyd_max`)
for each of its n coordinates.  ``x_hat = ||x|| Pi^T c[idx]``.  For a unit vector
the expected distortion is ``D_mse = n * C(f, b)``: 0.3609, 0.1160, 0.0340, 0.00931
at n = 128 and b = 1..4.  Seed 003's table prints 0.030 at b = 3; the Lloyd-Max
optimum of this density is 0.034 (0.0345 in the Gaussian limit), so we reproduce
the optimum, not the printed value.  Upper bound: ``sqrt(3) pi / 2 * 4^-b``.

``TurboQuantMSE(cycles=K)``: the same code over K rotations used in turn, token at code position t by rotation
``t mod K`` (same bits; ``cycles=1`` is the paper's codec).  With one rotation, near-identical vectors (a
repeated identifier's values) get identical quantization errors, which add up coherently in an attention
output ``sum_t p_t v_t``; rotations in turn decorrelate them (docs/cache.md, "Value codes over rotations in
turn").  Kernels mix token t's weighted row into accumulator ``t mod K`` and unmix with the K inverse
rotations (:meth:`TurboQuantMSE.unmix` on rows of ``K n``).

``TurboQuantProd``: a (b-1)-bit MSE stage, then a QJL sketch (any family, with its
exact constant) of the residual ``r = x - x_hat_mse`` and ``||r||``.  The score
``<q, x_hat_mse> + Prod_QJL(q, r)`` is unbiased for ``<q, x>`` because the QJL part
is unbiased for ``<q, r>`` given the first stage.  With a Gaussian sketch of k = d
rows, ``D_prod = E|<q,x> - est|^2 ~ (pi/2 - 1/d) D_mse(b-1) / d`` for a unit query.
"""

from __future__ import annotations

import torch

from qjl.codecs.base import BitBudget, Codec, Codes
from qjl.codecs.outliers import derive_seed
from qjl.codecs.params import Param, boolean, choice, integer, multiple_of_8, optional, seed as seed_param
from qjl.codecs.sketch import KINDS, QJLSketch
from qjl.core.lloyd_max import bucket, sphere_codebook
from qjl.core.devices import on_device
from qjl.core.packing import pack_bits, packed_size, unpack_bits
from qjl.core.rotation import ROTATIONS, Rotation
from qjl.core.validation import NORM_DTYPES, check_fits, check_positive_int, check_vectors, storage_dtype

__all__ = ["TurboQuantMSE", "TurboQuantProd"]


class TurboQuantMSE(Codec):
    """Rotation + per-coordinate Lloyd-Max codebook + norm.

    Args:
        dim: vector dimension d.
        bits: bits per rotated coordinate, 1..8.
        rotation: "haar" (dense, exact), "hadamard" (O(d log d), padded to a power of two) or "hadamard-kron"
            (a Hadamard transform of order d itself, d = m 2^k with m in 1, 12, 20: :class:`qjl.Rotation`).
        seed: rotation seed.
        norm_dtype: "fp16" (default), "bf16", "fp32" or "fp8" (float8 e4m3: 8 bits, relative error <= 2^-4).
        correct_norm: store ``||x|| / <u, u_hat>`` instead of ``||x||`` (u = x/||x||, u_hat its
            codebook reconstruction), so that ``<x, x_hat> = ||x||^2`` exactly.  The paper's
            reconstruction shrinks every inner product by about ``1 - D_mse`` on average (the
            Lloyd-Max centroid condition gives ``E<u, u_hat> = E||u_hat||^2 = 1 - D_mse``), which
            flattens attention; the correction removes that systematic shrink for the same bits
            (MSE grows by ~D_mse^2).  Default False: the paper's algorithm.
        cycles: K rotations used in turn by code position (module doc): the vector at position t is coded with
            ``rotations[t % K]`` (``rotations[0]`` is ``rotation``, the others from seeds derived from ``seed``).
            Positions are those of the codes in their sequence: ``quantize(x, start=s)`` and
            ``dequantize(codes, start=s)`` give the position of ``x``'s first vector (axis -2).  Kernels mix these
            codes as values (``mix_view``); they do not score them as keys (``score_view`` is None for K > 1).
    """

    name = "turboquant_mse"
    params = {"bits": Param(integer(1, 8)), "rotation": Param(choice(*ROTATIONS)), "seed": Param(seed_param),
              "norm_dtype": Param(choice(*NORM_DTYPES, *NORM_DTYPES.values())), "correct_norm": Param(boolean),
              "cycles": Param(integer(1, 64))}

    def __init__(self, dim: int, bits: int = 3, rotation: str = "haar", seed: int = 0, norm_dtype="fp16",
                 correct_norm: bool = False, cycles: int = 1):
        self.dim = check_positive_int("dim", dim)
        self.check_params(dict(bits=bits, rotation=rotation, seed=seed, norm_dtype=norm_dtype,
                               correct_norm=correct_norm, cycles=cycles))
        self.bits = bits
        self.rotation = Rotation(dim, rotation, seed)
        self.cycles = cycles
        self.rotations = (self.rotation, *(Rotation(dim, rotation, derive_seed(seed, 1000 + k)) for k in range(1, cycles)))
        n = self.rotation.out_dim
        if n < 3:
            raise ValueError(f"dim must be >= 3 for a rotation codebook, got {dim}")
        self.codebook = sphere_codebook(n, bits)
        self._centroids, self._boundaries = self.codebook.tensors()
        self.norm_dtype = storage_dtype("norm_dtype", norm_dtype, NORM_DTYPES)
        self.correct_norm = correct_norm
        self._cos_floor = None

    def __repr__(self):
        cyc = f", cycles={self.cycles}" if self.cycles > 1 else ""
        return (f"TurboQuantMSE(dim={self.dim}, bits={self.bits}, rotation={self.rotation.kind!r}, "
                f"seed={self.rotation.seed}{cyc})")

    @property
    def positional(self) -> bool:
        """Whether codes depend on their position in the sequence (``cycles > 1``): a cache passes ``start``."""
        return self.cycles > 1

    def _in_turn(self, fn, x: torch.Tensor, start: int, width: int) -> torch.Tensor:
        """``fn(rotations[k], rows)`` on the rows of x [..., m, w] (axis -2; a 1-D x is one row) at positions
        ``start + i`` with ``(start + i) % K == k``, for each k -> [..., m, width]."""
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be a non-negative int (the code position of the first vector), got {start!r}")
        if self.cycles == 1:
            return fn(self.rotation, x)
        if x.ndim == 1:
            return fn(self.rotations[start % self.cycles], x)
        out = x.new_empty(*x.shape[:-1], width, dtype=torch.float32)
        for k, rot in enumerate(self.rotations):
            first = (k - start) % self.cycles
            if first < x.shape[-2]:
                out[..., first::self.cycles, :] = fn(rot, x[..., first::self.cycles, :])
        return out

    def quantize(self, x: torch.Tensor, start: int = 0) -> Codes:
        """x: [..., dim] -> Codes(codes [..., ceil(n*bits/8)] uint8, norm [...]); ``start``: the code position of
        x's first vector (axis -2), read only with ``cycles > 1``."""
        check_vectors("x", x, self.dim)
        xf = x.float()
        norm = torch.linalg.vector_norm(xf, dim=-1)
        check_fits("norm of x", norm, self.norm_dtype)
        unit = xf / torch.where(norm > 0, norm, torch.ones_like(norm)).unsqueeze(-1)
        y = self._in_turn(lambda rot, u: rot.apply(u), unit, start, self.rotation.out_dim)
        idx, stored = self.cells(y, norm)
        return Codes(tuple(x.shape[:-1]), {"codes": pack_bits(idx, self.bits), "norm": stored})

    def check_storable(self, x: torch.Tensor, name: str = "x", *fit) -> None:
        """As :meth:`Codec.check_storable`; with ``cycles > 1`` and ``correct_norm`` the vectors beyond
        :meth:`norm_limit` are quantized with every rotation (the corrected norm depends on it)."""
        if self.cycles == 1 or not self.correct_norm or x.numel() == 0:
            return super().check_storable(x, name, *fit)
        norms = torch.linalg.vector_norm(x.float(), dim=-1)
        over = x.reshape(-1, self.dim)[(norms > self.norm_limit()).reshape(-1)]
        try:
            for k in range(self.cycles if over.shape[0] else 0):
                self.quantize(over.unsqueeze(-2), start=k)  # each vector the first of its row: position k
        except ValueError as e:
            raise ValueError(f"{name}: a vector of norm {float(norms.max()):.4g} cannot be stored by {self!r} ({e}); "
                             "give the codec a wider norm_dtype, e.g. 'fp16' or 'fp32' instead of 'fp8'") from None

    def cells(self, y: torch.Tensor, norm: torch.Tensor) -> tuple:
        """The quantizer after the rotation: y [..., n] = Pi x / ||x||, norm [...] = ||x|| -> (idx [..., n]
        int64 Lloyd-Max cells, the stored norm [...] in ``norm_dtype``: ``||x||``, or ``||x|| / <u, u_hat>`` with
        ``correct_norm``).  Raises ValueError where the stored norm overflows its dtype."""
        idx = bucket(y, on_device(self._boundaries, y.device))
        cos = (y * on_device(self._centroids, y.device)[idx]).sum(-1) if self.correct_norm else None
        return idx, self.stored_norm(norm, cos)

    def stored_norm(self, norm: torch.Tensor, cos: torch.Tensor | None) -> torch.Tensor:
        """The norm this codec stores for vectors of norm ``norm`` [...] whose cells have ``cos`` [...] =
        ``<u, u_hat>`` (used only with ``correct_norm``): ``||x||`` or ``||x|| / <u, u_hat>`` where positive, in
        ``norm_dtype``.  Raises ValueError where it overflows that dtype."""
        if self.correct_norm:  # <u, u_hat> > 0 for any b >= 1
            norm = norm / torch.where(cos > 0, cos, torch.ones_like(cos))
        check_fits("corrected norm of x" if self.correct_norm else "norm of x", norm, self.norm_dtype)
        return norm.to(self.norm_dtype)

    def norm_limit(self) -> float:
        """Norms up to the norm dtype's max are stored; with ``correct_norm`` the stored norm is
        ``||x|| / <u, u_hat>``, and ``<u, u_hat> = sum_i u_i c(u_i) >= min_k c_k / t_k`` over the codebook's
        positive cells (upper edge t_k, the last one ending at 1): each term is ``>= u_i^2 c_k / t_k``."""
        top = torch.finfo(self.norm_dtype).max
        if not self.correct_norm:
            return top
        if self._cos_floor is None:
            c, t = self.codebook.centroids, (*self.codebook.boundaries, 1.0)
            self._cos_floor = min(ck / tk for ck, tk in zip(c, t) if ck > 0 and tk > 0)
        return top * self._cos_floor

    def rotated(self, codes: Codes) -> torch.Tensor:
        """The reconstruction in the rotated basis, ``||x|| c[idx]``: [..., n] float32."""
        self._check_codes(codes, "codes", "norm", kind="TurboQuantMSE")
        packed = codes.fields["codes"]
        n = self.rotation.out_dim
        if packed.shape[-1] != packed_size(n, self.bits):
            raise ValueError(f"codes hold {packed.shape[-1]} bytes per vector; this codec stores {packed_size(n, self.bits)}")
        idx = unpack_bits(packed, self.bits, n)
        return on_device(self._centroids, packed.device)[idx] * codes.fields["norm"].float().unsqueeze(-1)

    def dequantize(self, codes: Codes, start: int = 0) -> torch.Tensor:
        """codes (lead [..., m]) -> [..., m, dim]; ``start``: the code position of the first vector (``cycles > 1``)."""
        rotated = self.rotated(codes)
        return self._in_turn(lambda rot, y: rot.inverse(y), rotated, start, self.dim)

    def inner_product(self, q: torch.Tensor, codes: Codes, start: int = 0) -> torch.Tensor:
        """Rotate the query once, score against centroids: q: [..., t, dim] -> [..., t, n] (with ``cycles > 1``:
        against the dequantized vectors at positions from ``start``)."""
        self._check_query(q, codes)
        if self.cycles > 1:
            return torch.matmul(q.float(), self.dequantize(codes, start).transpose(-1, -2))
        return torch.matmul(self.rotation.apply(q.float()), self.rotated(codes).transpose(-1, -2))

    # -- kernel views: keys scored and values mixed in the rotated basis ------------------------
    def _packed(self):
        from qjl.codecs.views import PackedCodes

        return PackedCodes("codes", self.bits, self.rotation.out_dim, self._centroids)

    def score_view(self):
        """One term: ``norm * <Pi q, c[idx]>`` (:meth:`inner_product`); None with ``cycles > 1`` (one query map
        per rotation: kernels do not score such keys)."""
        from qjl.codecs.views import KeyTerm, ScoreView

        return ScoreView((KeyTerm(self._packed(), "norm"),)) if self.cycles == 1 else None

    def score_queries(self, q: torch.Tensor, shared: dict | None = None) -> list:
        """q: [..., dim] -> [Pi q] ([..., n] float32)."""
        if self.cycles > 1:
            raise TypeError(f"{self!r} declares no score view (cycles > 1)")
        return [self.rotation.apply(q.float())]

    def quantize_view(self):
        """Normalize, rotate, Lloyd-Max cell, pack (norm correction as configured); with ``cycles > 1`` the pass
        lists the rotations in turn (``ProjectQuantize.rotations``: only the CPU encoder, given each vector's
        position, runs it)."""
        from qjl.codecs.views import ProjectQuantize, QuantizeView

        return QuantizeView((ProjectQuantize(self.rotation, self.bits, "codes", "norm", self.norm_dtype, self._boundaries,
                                             self._centroids, normalize=True, correct_norm=self.correct_norm,
                                             rotations=self.rotations if self.cycles > 1 else ()),))

    def mix_view(self):
        """One group, scale ``norm``, no zero point; rows mixed in the rotated basis (see :meth:`unmix`), into
        ``cycles`` accumulators (token at position t into accumulator ``t % cycles``)."""
        from qjl.codecs.views import MixView

        return MixView(self._packed(), self.rotation.out_dim, "norm", None, rotated=True, cycles=self.cycles)

    def unmix(self, o: torch.Tensor) -> torch.Tensor:
        """o: [..., K n] rows mixed in the rotated bases (accumulator k in columns ``[k n, (k + 1) n)``) ->
        ``sum_k Pi_k^T o_k`` [..., dim]."""
        n = self.rotation.out_dim
        if o.shape[-1] != self.cycles * n:
            raise ValueError(f"o: mixed rows of {self.cycles} x {n} = {self.cycles * n} columns expected, got "
                             f"{o.shape[-1]}")
        o = o.float()
        out = self.rotation.inverse(o[..., :n])
        for k in range(1, self.cycles):
            out = out + self.rotations[k].inverse(o[..., k * n:(k + 1) * n])
        return out

    @property
    def centroids(self) -> torch.Tensor:
        """The Lloyd-Max codebook [2**bits] float32 (code v stands for ``centroids[v]``)."""
        return self._centroids

    @property
    def boundaries(self) -> torch.Tensor:
        """The cell boundaries [2**bits - 1] float32 (code = number of boundaries below a coordinate)."""
        return self._boundaries

    def bit_budget(self) -> BitBudget:
        return BitBudget(self.dim, {"codes": 8 * packed_size(self.rotation.out_dim, self.bits),
                                    "norm": torch.finfo(self.norm_dtype).bits})


class TurboQuantProd(Codec):
    """(bits-1)-bit TurboQuantMSE + QJL on the residual: unbiased inner products.

    Args:
        dim: vector dimension d.
        bits: total bits per coordinate budgeted as in the paper, >= 1 (the MSE stage gets bits - 1).
        sketch_dim: QJL sketch size k (default: d rounded up to a multiple of 8).
        qjl_kind: sketch family of the residual ("orthogonal" default, "gaussian" as in the paper, "hadamard").
        rotation, seed, norm_dtype: as for :class:`TurboQuantMSE`; the sketch's seed is derived from ``seed``.
    """

    name = "turboquant_prod"
    params = {"bits": Param(integer(1, 9)),  # the MSE stage takes bits - 1 <= 8
              "sketch_dim": Param(optional(multiple_of_8()), per_dim=True), "qjl_kind": Param(choice(*KINDS)),
              "rotation": Param(choice(*ROTATIONS)), "seed": Param(seed_param),
              "norm_dtype": Param(choice(*NORM_DTYPES, *NORM_DTYPES.values()))}

    def __init__(self, dim: int, bits: int = 3, sketch_dim: int | None = None, qjl_kind: str = "orthogonal",
                 rotation: str = "haar", seed: int = 0, norm_dtype="fp16"):
        self.dim = check_positive_int("dim", dim)
        self.check_params(dict(bits=bits, sketch_dim=sketch_dim, qjl_kind=qjl_kind, rotation=rotation, seed=seed,
                               norm_dtype=norm_dtype))
        self.bits = bits
        self.mse = TurboQuantMSE(dim, bits - 1, rotation, seed, norm_dtype) if bits > 1 else None
        sketch_dim = -(-dim // 8) * 8 if sketch_dim is None else sketch_dim
        self.qjl = QJLSketch(dim, sketch_dim, qjl_kind, derive_seed(seed, 2), norm_dtype)

    def __repr__(self):
        return f"TurboQuantProd(dim={self.dim}, bits={self.bits}, sketch_dim={self.qjl.sketch_dim}, qjl_kind={self.qjl.kind!r})"

    def _stage1(self, x: torch.Tensor):
        if self.mse is None:
            return {}, torch.zeros_like(x)
        c = self.mse.quantize(x)
        return c.fields, self.mse.dequantize(c)

    def quantize(self, x: torch.Tensor) -> Codes:
        """x: [..., dim] -> Codes(codes, norm (MSE stage), signs, res_norm (QJL of the residual))."""
        check_vectors("x", x, self.dim)
        fields, x_mse = self._stage1(x.float())
        res = self.qjl.quantize(x.float() - x_mse)
        fields = dict(fields, signs=res.fields["signs"], res_norm=res.fields["norm"])
        return Codes(tuple(x.shape[:-1]), fields)

    def norm_limit(self) -> float | None:
        """The MSE stage stores ``||x||``; the residual's norm is at most ``||x|| (1 + ||c[idx]||)`` with
        ``||c[idx]|| <= sqrt(n) max|c|``."""
        top = min(torch.finfo(self.qjl.norm_dtype).max, torch.finfo(self.mse.norm_dtype).max if self.mse else
                  float("inf"))
        if self.mse is None:
            return top
        c_max = max(abs(c) for c in self.mse.codebook.centroids)
        return top / (1.0 + self.mse.rotation.out_dim ** 0.5 * c_max)

    def _split(self, codes: Codes):
        self._check_codes(codes, "signs", "res_norm", kind="TurboQuantProd")
        f = codes.fields
        res = Codes(codes.lead, {"signs": f["signs"], "norm": f["res_norm"]})
        mse = Codes(codes.lead, {"codes": f["codes"], "norm": f["norm"]}) if self.mse is not None else None
        return mse, res

    def inner_product(self, q: torch.Tensor, codes: Codes) -> torch.Tensor:
        """<q, x_mse> + Prod_QJL(q, r): q [..., t, dim] -> [..., t, n], unbiased for <q, x>."""
        self._check_query(q, codes)
        mse, res = self._split(codes)
        out = self.qjl.inner_product(q, res)
        return out if mse is None else out + self.mse.inner_product(q, mse)

    def dequantize(self, codes: Codes) -> torch.Tensor:
        mse, res = self._split(codes)
        out = self.qjl.dequantize(res)
        return out if mse is None else out + self.mse.dequantize(mse)

    def bit_budget(self) -> BitBudget:
        q = self.qjl.bit_budget()
        per_vector = {"signs": q.per_vector["signs"], "res_norm": q.per_vector["norm"]}
        if self.mse is not None:
            per_vector = {**self.mse.bit_budget().per_vector, **per_vector}
        return BitBudget(self.dim, per_vector)
