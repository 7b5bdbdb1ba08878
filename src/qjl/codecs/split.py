r"""TurboQuant keys with their channels split by importance: more bits where the scores need them.

Seed 003 leaves open whether "non-uniform allocation (more bits for high-variance coordinates)" closes
part of TurboQuant's gap, and TurboQuant's own 2.5- and 3.5-bit settings code a set of outlier channels
with more bits than the rest (two independent instances, each with its own rotation).  This codec does
that per sequence (a layer's KV head in a cache):

* ``fit(x, queries)`` chooses the ``n_split`` channels of largest importance ``E[x_i^2] E[q_i^2]`` (the
  expected share of channel ``i`` in a score's squared error before any rotation, ``E[(q_i e_i)^2]`` with
  ``e_i`` proportional to ``x_i``), from the sequence's first vectors and, where the cache has them, the
  prompt's last queries; without queries, ``E[x_i^2]`` alone;
* the chosen channels ``x[idx]`` go through a ``split_bits``-bit :class:`TurboQuantMSE` of dimension
  ``n_split`` (its own rotation and norm), the others ``x[rest]`` through a ``bits``-bit one of dimension
  ``dim - n_split``; ``x_hat`` puts both reconstructions back in their channels.

The score is ``<q[idx], x_hat[idx]> + <q[rest], x_hat[rest]>``: two key terms of the kernel views (each
``norm * <Pi q_part, c[code]>``), whose query maps read the per-sequence ``split_idx``.  The error is not
spread evenly over the ``dim`` coordinates as a single rotation's is: the relative error of each part is
its own codec's (``D_mse(split_bits)`` on the chosen channels' energy, ``D_mse(bits)`` on the rest), so
what it saves depends on the queries' channels; ``qjl.cache.allocation`` measures it in the queries'
metric.  Measured on the embedded model: ``docs/cache.md`` ("Keys split by channel importance").
"""

from __future__ import annotations

import torch

from qjl.codecs.base import BitBudget, Codec, Codes
from qjl.codecs.outliers import derive_seed
from qjl.codecs.params import Param, boolean, choice, integer, multiple_of_8, seed as seed_param
from qjl.codecs.turboquant import TurboQuantMSE
from qjl.core.rotation import ROTATIONS
from qjl.core.validation import NORM_DTYPES, check_channels, check_positive_int, check_vectors

__all__ = ["SplitTurboQuant"]


class SplitTurboQuant(Codec):
    """``n_split`` chosen channels at ``split_bits``, the other ``dim - n_split`` at ``bits`` (TurboQuant MSE each).

    Args:
        dim: vector dimension d.
        bits: bits per rotated coordinate of the other channels, 1..8.
        split_bits: bits per rotated coordinate of the chosen channels, 1..8.
        n_split: chosen channels per sequence, a multiple of 8 with ``3 <= n_split <= dim - 3`` (may be given per
            head dimension: ``CodecSpec(..., per_dim={"n_split": 0.5})``).
        rotation, seed, norm_dtype, correct_norm: as for :class:`TurboQuantMSE`, for both parts (the chosen
            channels' rotation from a seed derived from ``seed``).
    """

    name = "turboquant_split"
    params = {"bits": Param(integer(1, 8)), "split_bits": Param(integer(1, 8)),
              "n_split": Param(multiple_of_8(), per_dim=True), "rotation": Param(choice(*ROTATIONS)),
              "seed": Param(seed_param), "norm_dtype": Param(choice(*NORM_DTYPES, *NORM_DTYPES.values())),
              "correct_norm": Param(boolean)}
    fits_queries = True  # fit() reads the prompt's queries' E[q_i^2] where the cache has them

    def __init__(self, dim: int, bits: int = 2, split_bits: int = 4, n_split: int = 32, rotation: str = "haar",
                 seed: int = 0, norm_dtype="fp16", correct_norm: bool = False):
        self.dim = check_positive_int("dim", dim)
        self.check_params(dict(bits=bits, split_bits=split_bits, n_split=n_split, rotation=rotation, seed=seed,
                               norm_dtype=norm_dtype, correct_norm=correct_norm))
        if not 3 <= n_split <= dim - 3:
            raise ValueError(f"n_split must leave both parts at least 3 channels (3 <= n_split <= dim - 3 = {dim - 3}), "
                             f"got {n_split}")
        self.n_split, self.bits, self.split_bits = n_split, bits, split_bits
        self.rest = TurboQuantMSE(dim - n_split, bits, rotation, seed, norm_dtype, correct_norm)
        self.chosen = TurboQuantMSE(n_split, split_bits, rotation, derive_seed(seed, 2), norm_dtype, correct_norm)
        self.norm_dtype = self.rest.norm_dtype
        self._idx_dtype = torch.uint8 if dim <= 256 else torch.int16

    def __repr__(self):
        return (f"SplitTurboQuant(dim={self.dim}, n_split={self.n_split}, split_bits={self.split_bits}, "
                f"bits={self.bits}, rotation={self.rest.rotation.kind!r}, seed={self.rest.rotation.seed})")

    # -- the channel choice ------------------------------------------------------------------
    def importance(self, x: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
        """``E[x_i^2] E[q_i^2]`` per sequence: x [..., n, dim], queries [..., r, dim] or None -> [..., dim].

        Channels are chosen one by one.  Choosing rotary pairs whole (channel i with i + dim/2, by their summed
        energies: a later query turns within its pairs) measured worse on the embedded model (docs/cache.md)."""
        check_vectors("x", x, self.dim, min_ndim=2)
        score = x.float().square().mean(dim=-2)
        if queries is not None:
            check_vectors("queries", queries, self.dim, min_ndim=2)
            qe = queries.float().square().mean(dim=-2)
            try:
                score = score * qe
            except RuntimeError:
                raise ValueError(f"queries' leading shape {tuple(queries.shape[:-2])} does not broadcast with x's "
                                 f"{tuple(x.shape[:-2])}") from None
        return score

    def fit(self, x: torch.Tensor, queries: torch.Tensor | None = None) -> tuple:
        """The chosen channels of each sequence from its first vectors ``x`` [..., n, dim] (and the prompt's
        queries [..., r, dim] where given) -> (split_idx [..., n_split] sorted,)."""
        return (self.select(x, queries),)

    def select(self, x: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
        """The ``n_split`` channels of largest :meth:`importance` -> [..., n_split] int64, ascending (ties to the
        lower channel)."""
        score = self.importance(x, queries).nan_to_num(0.0)
        return torch.sort(score, dim=-1, descending=True, stable=True).indices[..., : self.n_split].sort(-1).values

    def check_split_idx(self, idx, lead_seq: tuple) -> torch.Tensor:
        """``idx`` checked (integer, in range, no repeats) and broadcast to ``lead_seq + (n_split,)`` (int64)."""
        return check_channels("split_idx", idx, self.n_split, "n_split", self.dim, lead_seq)

    def permutation(self, idx: torch.Tensor) -> torch.Tensor:
        """[..., n_split] chosen channels -> [..., dim] int64: the chosen channels (ascending), then the others
        (ascending)."""
        others = torch.ones(*idx.shape[:-1], self.dim, dtype=torch.bool, device=idx.device)
        others.scatter_(-1, idx.long(), False)
        return torch.sort(others.to(torch.uint8), dim=-1, stable=True).indices

    def _parts(self, x: torch.Tensor, idx: torch.Tensor) -> tuple:
        """x [..., m, dim] (m vectors per sequence), idx [..., n_split] -> (x[idx] [..., m, n_split], x[rest] [..., m,
        dim - n_split])."""
        perm = self.permutation(idx).unsqueeze(-2)
        shape = torch.broadcast_shapes(tuple(x.shape[:-1]), tuple(perm.shape[:-1]))
        xp = torch.gather(x.expand(*shape, self.dim), -1, perm.expand(*shape, self.dim))
        return xp[..., : self.n_split], xp[..., self.n_split:]

    # -- the codec --------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, split_idx: torch.Tensor | None = None) -> Codes:
        """x: [..., n, dim] -> Codes (lead [..., n]: ``codes``/``norm`` of the other channels, ``split_codes``/
        ``split_norm`` of the chosen ones; shared ``split_idx`` [..., n_split]), the channels chosen from x itself
        (:meth:`select`, keys alone) unless given."""
        check_vectors("x", x, self.dim, min_ndim=2)
        lead = tuple(x.shape[:-1])
        idx = self.select(x) if split_idx is None else split_idx
        idx = self.check_split_idx(idx.to(x.device), lead[:-1])
        hi, lo = self._parts(x.float(), idx)
        c_hi, c_lo = self.chosen.quantize(hi.contiguous()), self.rest.quantize(lo.contiguous())
        fields = {"codes": c_lo.fields["codes"], "norm": c_lo.fields["norm"],
                  "split_codes": c_hi.fields["codes"], "split_norm": c_hi.fields["norm"]}
        return Codes(lead, fields, {"split_idx": idx.to(self._idx_dtype)})

    def _codes(self, codes: Codes) -> tuple:
        self._check_codes(codes, "codes", "norm", "split_codes", "split_norm", kind=repr(self))
        if "split_idx" not in codes.shared:
            raise ValueError("codes carry no split_idx: they were not produced by this SplitTurboQuant")
        f = codes.fields
        lo = Codes(codes.lead, {"codes": f["codes"], "norm": f["norm"]})
        hi = Codes(codes.lead, {"codes": f["split_codes"], "norm": f["split_norm"]})
        return hi, lo, codes.shared["split_idx"].long()

    def dequantize(self, codes: Codes) -> torch.Tensor:
        """-> [..., n, dim] float32: each part's reconstruction in its channels."""
        hi, lo, idx = self._codes(codes)
        xp = torch.cat([self.chosen.dequantize(hi), self.rest.dequantize(lo)], dim=-1)
        perm = self.permutation(idx).unsqueeze(-2).expand(*xp.shape)
        return torch.empty_like(xp).scatter_(-1, perm, xp)

    def inner_product(self, q: torch.Tensor, codes: Codes) -> torch.Tensor:
        """q: [..., t, dim], codes lead [..., n] -> [..., t, n] float32 (the two parts' scores added)."""
        self._check_query(q, codes)
        hi, lo, idx = self._codes(codes)
        q_hi, q_lo = self._parts(q.float(), idx)
        return self.chosen.inner_product(q_hi, hi) + self.rest.inner_product(q_lo, lo)

    def norm_limit(self) -> float:
        """Each part's norm is at most ``||x||``."""
        return min(self.rest.norm_limit(), self.chosen.norm_limit())

    @property
    def idx_dtype(self) -> torch.dtype:
        """Storage dtype of ``split_idx``."""
        return self._idx_dtype

    def bit_budget(self) -> BitBudget:
        lo, hi = self.rest.bit_budget().per_vector, self.chosen.bit_budget().per_vector
        return BitBudget(self.dim, {"codes": lo["codes"], "norm": lo["norm"], "split_codes": hi["codes"],
                                    "split_norm": hi["norm"]},
                         {"split_idx": self.n_split * torch.iinfo(self._idx_dtype).bits})

    # -- kernel view: two key terms whose query maps read the per-sequence split_idx -------------
    def score_view(self):
        """Terms ``norm * <Pi_rest q[rest], c[codes]>`` and ``split_norm * <Pi_chosen q[idx], c[split_codes]>``."""
        from qjl.codecs.views import KeyTerm, PackedCodes, ScoreView

        lo = PackedCodes("codes", self.bits, self.rest.rotation.out_dim, self.rest.centroids)
        hi = PackedCodes("split_codes", self.split_bits, self.chosen.rotation.out_dim, self.chosen.centroids)
        return ScoreView((KeyTerm(lo, "norm"), KeyTerm(hi, "split_norm")), ("split_idx",))

    def score_queries(self, q: torch.Tensor, shared: dict | None = None) -> list:
        """q: [..., R, dim], shared {"split_idx": [..., n_split]} -> [Pi_rest q[rest], Pi_chosen q[idx]]."""
        if not shared or "split_idx" not in shared:
            raise ValueError("shared must hold the codes' split_idx (a SplitTurboQuant's query maps read it)")
        q_hi, q_lo = self._parts(q.float(), shared["split_idx"].long())
        return [self.rest.rotation.apply(q_lo), self.chosen.rotation.apply(q_hi)]
