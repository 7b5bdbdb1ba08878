"""QJL with outlier channels split off (paper 001, Section 4.1).

A few fixed key channels carry most of the norm in deeper layers, and QJL's
error scales with ``||q|| ||k||``.  Per sequence (e.g. per layer and KV head) a
set of ``n_outliers`` channels is chosen; then, for every vector,

* the inlier part ``k_in`` (outlier channels zeroed) goes through the main
  ``dim``-dimensional sketch with ``sketch_dim`` bits;
* the outlier part ``k[idx]`` goes through an independent ``n_outliers``-
  dimensional sketch with ``outlier_sketch_dim`` bits;

and both norms are stored directly (never one derived from the other by
subtracting squares, which can turn negative in low precision).  The score is

    Prod(q_in, k_in) + Prod(q[idx], k[idx]),

a sum of two unbiased estimators of ``<q_in, k_in> + <q[idx], k[idx]> = <q, k>``.
The main sketch's constant stays exact for the zero-padded ``k_in``: for a row
``s = sqrt(d) u`` with ``u`` uniform on the sphere, ``s.k_in`` has the law of
``sqrt(d) ||k_in|| u_1`` whatever the support of ``k_in``.
"""

from __future__ import annotations

import torch

from qjl.codecs.base import BitBudget, Codec, Codes
from qjl.codecs.params import Param, choice, integer, multiple_of_8, seed as seed_param
from qjl.codecs.sketch import DEFAULT_HADAMARD_ROUNDS, KINDS, QJLSketch
from qjl.core.validation import NORM_DTYPES, check_channels, check_positive_int, check_vectors

__all__ = ["OutlierQJL", "derive_seed"]


def derive_seed(seed: int, stream: int) -> int:
    """A seed for an independent sub-stream (e.g. the outlier sketch) of ``seed``."""
    return (seed * 0x9E3779B97F4A7C15 + stream * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


class OutlierQJL(Codec):
    """QJL keys with ``n_outliers`` channels per sequence quantized by their own sketch.

    Args:
        dim: head dimension d.
        sketch_dim: bits of the main (inlier) sketch, a multiple of 8.
        n_outliers: outlier channels per sequence, 0 <= n_outliers < dim.
        outlier_sketch_dim: bits of the outlier sketch, a multiple of 8.
        kind, seed, norm_dtype, hadamard_rounds: as for :class:`QJLSketch`; the outlier
            sketch uses an independent seed derived from ``seed`` and, for
            ``kind="hadamard"``, the "orthogonal" family (a few channels need no fast
            transform, and small Hadamard transforms are biased).
    """

    name = "qjl"
    params = {"sketch_dim": Param(multiple_of_8(), per_dim=True), "n_outliers": Param(integer(0)),
              "outlier_sketch_dim": Param(multiple_of_8(0), per_dim=True), "kind": Param(choice(*KINDS)),
              "seed": Param(seed_param), "norm_dtype": Param(choice(*NORM_DTYPES, *NORM_DTYPES.values())),
              "hadamard_rounds": Param(integer(1))}

    @classmethod
    def check_params(cls, params, per_dim=None) -> dict:
        out = super().check_params(params, per_dim)
        if out.get("n_outliers", 0) and not out.get("outlier_sketch_dim") and "outlier_sketch_dim" not in (per_dim or {}):
            raise ValueError(f"codec 'qjl' with n_outliers={out['n_outliers']} needs outlier_sketch_dim >= 8 "
                             "(a multiple of 8, in params or per_dim)")
        return out

    def __init__(self, dim: int, sketch_dim: int, n_outliers: int = 0, outlier_sketch_dim: int = 0,
                 kind: str = "orthogonal", seed: int = 0, norm_dtype="fp16",
                 hadamard_rounds: int = DEFAULT_HADAMARD_ROUNDS):
        check_positive_int("dim", dim)
        self.check_params(dict(sketch_dim=sketch_dim, n_outliers=n_outliers, outlier_sketch_dim=outlier_sketch_dim,
                               kind=kind, seed=seed, norm_dtype=norm_dtype, hadamard_rounds=hadamard_rounds))
        self.n_outliers = n_outliers
        if n_outliers >= dim:
            raise ValueError(f"n_outliers must be < dim={dim}, got {n_outliers}")
        self.inlier = QJLSketch(dim, sketch_dim, kind, seed, norm_dtype, hadamard_rounds)
        self.dim = dim
        self.outlier = None
        if n_outliers:
            # a handful of channels: a dense sketch is tiny, and Hadamard is biased at small n
            outlier_kind = "orthogonal" if kind == "hadamard" else kind
            self.outlier = QJLSketch(n_outliers, outlier_sketch_dim, outlier_kind, derive_seed(seed, 1),
                                     norm_dtype, hadamard_rounds)
        self._idx_dtype = torch.uint8 if dim <= 256 else torch.int16

    def __repr__(self):
        out = self.outlier.sketch_dim if self.outlier else 0
        return (f"OutlierQJL(dim={self.dim}, sketch_dim={self.inlier.sketch_dim}, n_outliers={self.n_outliers}, "
                f"outlier_sketch_dim={out}, kind={self.inlier.kind!r}, seed={self.inlier.seed})")

    def fit(self, x: torch.Tensor) -> tuple:
        """The outlier channels of each sequence, chosen once from its first vectors x: [..., n, dim]
        -> (outlier_idx [..., n_outliers],), or () without outliers."""
        return (self.select_outliers(x),) if self.n_outliers else ()

    def norm_limit(self) -> float:
        """Both stored norms (inlier and outlier parts) are at most ``||x||``."""
        top = self.inlier.norm_limit()
        return top if self.outlier is None else min(top, self.outlier.norm_limit())

    def select_outliers(self, x: torch.Tensor) -> torch.Tensor:
        """Channels of largest mean |x| over the vector axis. x: [..., n, dim] -> [..., n_outliers] (sorted)."""
        check_vectors("x", x, self.dim, min_ndim=2)
        score = x.float().abs().mean(dim=-2)
        return torch.topk(score, self.n_outliers, dim=-1).indices.sort(dim=-1).values

    def _check_idx(self, idx, lead_seq: tuple) -> torch.Tensor:
        return check_channels("outlier_idx", idx, self.n_outliers, "n_outliers", self.dim, lead_seq)

    @staticmethod
    def _split(x: torch.Tensor, idx: torch.Tensor):
        """x: [..., n, d], idx: [..., k] -> (x with idx channels zeroed, x[..., idx] [..., n, k])."""
        shape = torch.broadcast_shapes(tuple(x.shape[:-2]), tuple(idx.shape[:-1]))
        x = x.expand(*shape, *x.shape[-2:])
        gather_idx = idx.expand(*shape, idx.shape[-1]).unsqueeze(-2).expand(*shape, x.shape[-2], idx.shape[-1])
        mask = torch.ones(*shape, 1, x.shape[-1], dtype=x.dtype, device=x.device)
        mask = mask.scatter(-1, gather_idx[..., :1, :], 0.0)
        return x * mask, torch.gather(x, -1, gather_idx), mask

    def quantize(self, x: torch.Tensor, outlier_idx: torch.Tensor | None = None) -> Codes:
        """x: [..., n, dim] -> Codes (lead [..., n]); outlier_idx [..., n_outliers] or chosen from x."""
        check_vectors("x", x, self.dim, min_ndim=2)
        lead = tuple(x.shape[:-1])
        if self.outlier is None:
            c = self.inlier.quantize(x)
            return Codes(lead, c.fields)
        idx = self.select_outliers(x) if outlier_idx is None else outlier_idx
        idx = self._check_idx(idx.to(x.device), lead[:-1])
        x_in, x_out, _ = self._split(x.float(), idx)
        c_in, c_out = self.inlier.quantize(x_in), self.outlier.quantize(x_out)
        fields = {"signs": c_in.fields["signs"], "norm": c_in.fields["norm"],
                  "outlier_signs": c_out.fields["signs"], "outlier_norm": c_out.fields["norm"]}
        return Codes(lead, fields, {"outlier_idx": idx.to(self._idx_dtype)})

    def _parts(self, codes: Codes):
        self._check_codes(codes, "signs", "norm", *(("outlier_signs", "outlier_norm") if self.outlier else ()),
                          kind=repr(self))
        f = codes.fields
        inl = Codes(codes.lead, {"signs": f["signs"], "norm": f["norm"]})
        if self.outlier is None:
            return inl, None, None
        if "outlier_idx" not in codes.shared:
            raise ValueError("codes carry no outlier_idx: they were not produced by this OutlierQJL")
        out = Codes(codes.lead, {"signs": f["outlier_signs"], "norm": f["outlier_norm"]})
        return inl, out, codes.shared["outlier_idx"].long()

    def inner_product(self, q: torch.Tensor, codes: Codes) -> torch.Tensor:
        """q: [..., t, dim], codes lead [..., n] -> [..., t, n] float32 (sum of both estimators)."""
        self._check_query(q, codes)
        inl, out, idx = self._parts(codes)
        if out is None:
            return self.inlier.inner_product(q, inl)
        q_in, q_out, _ = self._split(q.float(), idx)
        return self.inlier.inner_product(q_in, inl) + self.outlier.inner_product(q_out, out)

    def dequantize(self, codes: Codes) -> torch.Tensor:
        """-> [..., n, dim] float32 with q . k_hat equal to :meth:`inner_product`."""
        inl, out, idx = self._parts(codes)
        k_in = self.inlier.dequantize(inl)
        if out is None:
            return k_in
        _, _, mask = self._split(k_in, idx)
        k_out = self.outlier.dequantize(out)
        shape = k_out.shape[:-1]
        return (k_in * mask).scatter(-1, idx.unsqueeze(-2).expand(*shape, self.n_outliers), k_out)

    # -- kernel view: the inlier sketch, plus the outlier sketch when there are outlier channels ----
    def score_view(self):
        """One term per sketch; the query maps read the per-sequence ``outlier_idx``."""
        from qjl.codecs.views import KeyTerm, PackedCodes, ScoreView

        inl = self.inlier.score_view()
        if self.outlier is None:
            return inl
        out = KeyTerm(PackedCodes("outlier_signs", 1, self.outlier.sketch_dim, torch.tensor([-1.0, 1.0])),
                      "outlier_norm")
        return ScoreView((inl.terms[0], out), ("outlier_idx",))

    def score_queries(self, q: torch.Tensor, shared: dict | None = None) -> list:
        """q: [..., R, dim], shared {"outlier_idx": [..., n_outliers]} -> [c S q_in, c_o S_o q[idx]]."""
        if self.outlier is None:
            return self.inlier.score_queries(q)
        if not shared or "outlier_idx" not in shared:
            raise ValueError("shared must hold the codes' outlier_idx for a codec with outlier channels")
        q_in, q_out, _ = self._split(q.float(), shared["outlier_idx"].long())
        return self.inlier.score_queries(q_in) + self.outlier.score_queries(q_out)

    def quantize_view(self):
        """The inlier sketch over x with the outlier channels zeroed, the outlier sketch over x[outlier_idx]."""
        from qjl.codecs.views import ProjectQuantize, QuantizeView

        if self.outlier is None:
            return self.inlier.quantize_view()
        inl = ProjectQuantize(self.inlier, 1, "signs", "norm", self.inlier.norm_dtype, channels="inliers")
        out = ProjectQuantize(self.outlier, 1, "outlier_signs", "outlier_norm", self.outlier.norm_dtype,
                              channels="outliers")
        return QuantizeView((inl, out), "outlier_idx")

    @property
    def idx_dtype(self) -> torch.dtype:
        """Storage dtype of ``outlier_idx``."""
        return self._idx_dtype

    def check_outlier_idx(self, idx, lead_seq: tuple) -> torch.Tensor:
        """``idx`` checked (integer, in range, no repeats) and broadcast to ``lead_seq + (n_outliers,)``."""
        return self._check_idx(idx, lead_seq)

    def bit_budget(self) -> BitBudget:
        budget = self.inlier.bit_budget()
        if self.outlier is None:
            return budget
        ob = self.outlier.bit_budget()
        per_vector = dict(budget.per_vector)
        per_vector["outlier_signs"] = ob.per_vector["signs"]
        per_vector["outlier_norm"] = ob.per_vector["norm"]
        idx_bits = self.n_outliers * torch.iinfo(self._idx_dtype).bits
        return BitBudget(self.dim, per_vector, {"outlier_idx": idx_bits})
