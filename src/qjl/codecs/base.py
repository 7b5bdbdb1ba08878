"""The codec interface every quantizer in the package implements.

A codec maps vectors ``x: [..., dim]`` to :class:`Codes` and back:

* ``quantize(x) -> Codes`` (leading shape ``[...]`` kept, one code per vector);
* ``dequantize(codes) -> [..., dim]`` (float32);
* ``inner_product(q, codes)``: ``q: [..., t, dim]`` against the ``n`` vectors of
  ``codes`` (leading shape ``[..., n]``) -> ``[..., t, n]`` float32.  The default
  is ``q @ dequantize(codes)^T``; codecs with a better estimator override it;
* ``bit_budget() -> BitBudget``: every stored bit, per vector and per sequence.

:class:`Codes` holds *per-vector* tensors (shape ``lead + tail``, one entry per
quantized vector) and *shared* tensors (shape ``lead[:-1] + tail``, one entry per
sequence of vectors, e.g. a head's outlier channel indices).  The last leading
axis is the vector (token) axis: ``cat``/``narrow`` along it touch only the
per-vector tensors; selections along earlier axes apply to both.
"""

from __future__ import annotations

import abc
import functools
import inspect
from dataclasses import dataclass, field

import torch

__all__ = ["BitBudget", "Codes", "Codec"]


@dataclass(frozen=True)
class BitBudget:
    """Exact storage cost of a codec, in bits.

    ``per_vector`` maps each stored per-vector component (codes, norms, scales,
    zero points, ...) to the bits one vector takes, byte padding included.
    ``shared`` maps per-sequence components (e.g. outlier indices) to the bits one
    sequence of vectors takes, whatever its length.
    """

    dim: int
    per_vector: dict = field(default_factory=dict)
    shared: dict = field(default_factory=dict)

    @property
    def bits_per_vector(self) -> int:
        return sum(self.per_vector.values())

    @property
    def bits_per_coordinate(self) -> float:
        """Per-vector bits / dim (shared components excluded: see :meth:`amortized`)."""
        return self.bits_per_vector / self.dim

    @property
    def shared_bits(self) -> int:
        return sum(self.shared.values())

    def amortized(self, n_vectors: int) -> float:
        """Bits per coordinate for a sequence of ``n_vectors`` vectors, shared parts included."""
        if n_vectors < 1:
            raise ValueError(f"n_vectors must be >= 1, got {n_vectors}")
        return (self.bits_per_vector + self.shared_bits / n_vectors) / self.dim

    def __add__(self, other: "BitBudget") -> "BitBudget":
        if self.dim != other.dim:
            raise ValueError(f"cannot add budgets of dim {self.dim} and {other.dim}")
        per_vector = dict(self.per_vector)
        for k, v in other.per_vector.items():
            per_vector[k] = per_vector.get(k, 0) + v
        shared = dict(self.shared)
        for k, v in other.shared.items():
            shared[k] = shared.get(k, 0) + v
        return BitBudget(self.dim, per_vector, shared)


@dataclass
class Codes:
    """Quantized vectors: per-vector tensors ``[*lead, *tail]``, shared ``[*lead[:-1], *tail]``."""

    lead: tuple
    fields: dict
    shared: dict = field(default_factory=dict)

    def __post_init__(self):
        self.lead = tuple(self.lead)
        k = len(self.lead)
        for name, t in self.fields.items():
            assert tuple(t.shape[:k]) == self.lead, (name, t.shape, self.lead)
        for name, t in self.shared.items():
            assert tuple(t.shape[: k - 1]) == self.lead[:-1], (name, t.shape, self.lead)

    @property
    def num_vectors(self) -> int:
        return self.lead[-1] if self.lead else 1

    def nbytes(self) -> int:
        """Bytes of every tensor held (per-vector and shared)."""
        return sum(t.numel() * t.element_size() for t in (*self.fields.values(), *self.shared.values()))

    def _axis(self, dim: int) -> int:
        k = len(self.lead)
        if not -k <= dim < k:
            raise ValueError(f"dim must index one of the {k} leading axes {self.lead}, got {dim}")
        return dim % k

    def narrow(self, dim: int, start: int, length: int) -> "Codes":
        """Slice ``[start, start + length)`` along leading axis ``dim``."""
        a = self._axis(dim)
        fields = {n: t.narrow(a, start, length) for n, t in self.fields.items()}
        shared = self.shared if a == len(self.lead) - 1 else {n: t.narrow(a, start, length) for n, t in self.shared.items()}
        lead = list(self.lead)
        lead[a] = length
        return Codes(tuple(lead), fields, shared)

    def index_select(self, dim: int, index: torch.Tensor) -> "Codes":
        """Select entries along leading axis ``dim`` (e.g. beam reordering on the batch axis)."""
        a = self._axis(dim)
        fields = {n: t.index_select(a, index) for n, t in self.fields.items()}
        last = a == len(self.lead) - 1
        shared = self.shared if last else {n: t.index_select(a, index) for n, t in self.shared.items()}
        lead = list(self.lead)
        lead[a] = index.numel()
        return Codes(tuple(lead), fields, shared)

    @staticmethod
    def cat(parts: list, dim: int = -1) -> "Codes":
        """Concatenate codes from the same codec along leading axis ``dim``."""
        if not parts:
            raise ValueError("parts must hold at least one Codes")
        first = parts[0]
        a = first._axis(dim)
        last = a == len(first.lead) - 1
        for p in parts[1:]:
            if p.fields.keys() != first.fields.keys() or p.shared.keys() != first.shared.keys():
                raise ValueError("cannot concatenate codes of different codecs")
            if last and any(not torch.equal(p.shared[n], first.shared[n]) for n in first.shared):
                raise ValueError("cannot concatenate codes quantized with different shared parameters")
        fields = {n: torch.cat([p.fields[n] for p in parts], dim=a) for n in first.fields}
        shared = first.shared if last else {n: torch.cat([p.shared[n] for p in parts], dim=a) for n in first.shared}
        lead = list(first.lead)
        lead[a] = sum(p.lead[a] for p in parts)
        return Codes(tuple(lead), fields, shared)

    def to(self, device) -> "Codes":
        return Codes(
            self.lead,
            {n: t.to(device) for n, t in self.fields.items()},
            {n: t.to(device) for n, t in self.shared.items()},
        )


@functools.lru_cache(maxsize=None)
def _required(cls) -> tuple:
    """The parameters of ``cls.__init__`` without a default, besides ``self`` and ``dim`` (once per class)."""
    return tuple(n for n, p in inspect.signature(cls.__init__).parameters.items()
                 if n not in ("self", "dim") and p.default is inspect.Parameter.empty)


class Codec(abc.ABC):
    """Base class: see the module docstring for the contract.

    Besides the four operations, a codec declares what a cache needs from it:

    * ``params``: its keyword parameters (:mod:`qjl.codecs.params`), checked without building anything;
    * ``tokens_per_code``: tokens one code covers along the vector axis (KIVI's token groups; 1 otherwise);
      a cache flushes and crops in multiples of it;
    * ``fit(x)``: per-sequence parameters chosen once from the first vectors a cache stores (QJL's outlier
      channels), passed back to every later ``quantize(x, *fit)``; ``()`` when there are none.  A codec with
      ``fits_queries = True`` also takes ``fit(x, queries=q)``, ``q: [..., r, dim]`` the prompt's last queries per
      sequence, of which it reads only the per-channel second moments ``E[q_i^2]`` (a cache may pass their root
      mean square as one row);
    * ``norm_limit()`` / ``check_storable(x)``: which vectors its stored fields can represent, so a cache
      refuses a vector when it arrives rather than failing when the vector is flushed later.
    """

    name: str = "codec"
    dim: int
    params: dict = {}
    fits_queries: bool = False  # fit(x, queries=...) reads the queries' per-channel second moments

    @classmethod
    def check_params(cls, params, per_dim=None) -> dict:
        """Structural check of keyword parameters (and per-head-dim ratios), without building the codec.

        Returns the normalized parameters; raises ``ValueError``/``TypeError`` naming the parameter.
        """
        from qjl.codecs.params import FrozenDict, check_params

        out = check_params(cls.name, cls.params, params, FrozenDict() if per_dim is None else per_dim)
        given = set(out) | set(per_dim or ())
        missing = [n for n in _required(cls) if n not in given]
        if missing:
            raise ValueError(f"codec {cls.name!r} needs parameter(s) {missing} (in params, or per_dim for sizes "
                             "that scale with head_dim)")
        return out

    @property
    def tokens_per_code(self) -> int:
        """Tokens covered by one code along the vector axis (1: one code per vector)."""
        return 1

    def fit(self, x: torch.Tensor) -> tuple:
        """Per-sequence parameters from ``x: [..., n, dim]`` for ``quantize(x, *fit)`` (none by default)."""
        return ()

    @abc.abstractmethod
    def quantize(self, x: torch.Tensor) -> Codes:
        """x: [..., dim] -> Codes with lead shape [...]."""

    @abc.abstractmethod
    def dequantize(self, codes: Codes) -> torch.Tensor:
        """Codes with lead [...] -> [..., dim] float32 reconstruction."""

    @abc.abstractmethod
    def bit_budget(self) -> BitBudget:
        """Every stored bit, per vector and per sequence."""

    # -- what kernels read (qjl.codecs.views); None: no kernel reads this codec ------------------
    def score_view(self):
        """The key-score terms a kernel reads (:class:`qjl.codecs.views.ScoreView`), or None."""
        return None

    def score_queries(self, q: torch.Tensor, shared: dict | None = None) -> list:
        """q: [..., dim] float32 -> one tensor [..., length_i] per term of :meth:`score_view`."""
        raise TypeError(f"{type(self).__name__} declares no score view")

    def quantize_view(self):
        """The projection passes a quantize kernel runs (:class:`qjl.codecs.views.QuantizeView`), or None."""
        return None

    def mix_view(self):
        """The value layout a kernel mixes (:class:`qjl.codecs.views.MixView`), or None."""
        return None

    def unmix(self, o: torch.Tensor) -> torch.Tensor:
        """Rows mixed in the basis of :meth:`mix_view` [..., length] -> [..., dim] float32."""
        raise TypeError(f"{type(self).__name__} declares no mix view")

    def inner_product(self, q: torch.Tensor, codes: Codes) -> torch.Tensor:
        """q: [..., t, dim], codes lead [..., n] -> [..., t, n] float32 (via dequantize)."""
        self._check_query(q, codes)
        k_hat = self.dequantize(codes)
        return torch.matmul(q.float(), k_hat.transpose(-1, -2))

    def norm_limit(self) -> float | None:
        """The largest ``||x||`` every vector of which ``quantize`` stores without overflow, or None if
        no such guarantee is known (then :meth:`check_storable` quantizes to find out)."""
        return None

    def check_storable(self, x: torch.Tensor, name: str = "x", *fit) -> None:
        """Raise ``ValueError`` if ``quantize(x, *fit)`` would refuse a vector of ``x: [..., dim]`` (a norm,
        scale or zero point beyond its storage dtype).  Cheap when every norm is within :meth:`norm_limit`;
        otherwise the vectors beyond it are quantized (exactly what a later flush would do)."""
        if x.numel() == 0:
            return
        norms = torch.linalg.vector_norm(x.float(), dim=-1)
        limit = self.norm_limit()
        over = norms > limit if limit is not None else torch.ones_like(norms, dtype=torch.bool)
        if not bool(over.any()):
            return
        try:
            if fit or x.ndim < 2 or self.tokens_per_code > 1:
                self.quantize(x, *fit)
            else:
                self.quantize(x[over])
        except ValueError as e:
            worst = float(norms.max())
            raise ValueError(f"{name}: a vector of norm {worst:.4g} cannot be stored by {self!r} ({e}); give the "
                             f"codec a wider norm_dtype (or scale_dtype), e.g. 'fp16' or 'fp32' instead of 'fp8'") from None

    def _check_codes(self, codes, *fields: str, kind: str | None = None) -> None:
        """``codes`` must be a :class:`Codes` holding ``fields`` (else a TypeError/ValueError naming this codec)."""
        if not isinstance(codes, Codes):
            raise TypeError(f"codes must be a qjl.Codes, got {type(codes).__name__}")
        missing = [f for f in fields if f not in codes.fields]
        if missing:
            raise ValueError(f"codes were not produced by a {kind or type(self).__name__} (they hold fields "
                             f"{sorted(codes.fields)}, not {missing})")

    def _check_query(self, q: torch.Tensor, codes: Codes) -> None:
        from qjl.core.validation import check_vectors

        check_vectors("q", q, self.dim, min_ndim=2)
        if not isinstance(codes, Codes):
            raise TypeError(f"codes must be a qjl.Codes, got {type(codes).__name__}")
        if len(codes.lead) < 1:
            raise ValueError("codes must have a vector axis (quantize a [..., n, dim] tensor)")
        try:
            torch.broadcast_shapes(tuple(q.shape[:-2]), tuple(codes.lead[:-1]))
        except RuntimeError:
            raise ValueError(
                f"q leading shape {tuple(q.shape[:-2])} does not broadcast with codes leading shape "
                f"{tuple(codes.lead[:-1])}"
            ) from None
