"""Declared codec parameters: cheap structural checks, shared by the codecs and the cache configuration.

Every codec class lists its keyword parameters in ``params`` (name -> :class:`Param`).  A
:class:`Param` checks one value without building anything (no rotation, sketch or codebook), so a
:class:`qjl.CodecSpec` is validated when it is written and ``import qjl.cache.presets`` stays cheap;
the codec's ``__init__`` runs the same checks, so the two can never disagree.  Checks that need the
head dimension (``n_outliers < dim``, a Hadamard transform's minimum size) run when the codec is built
for a model (:class:`qjl.QJLCache` does that for every layer before the model runs).

``per_dim=True`` marks a size that may be given in proportion to the head dimension
(``CodecSpec.per_dim``); only those are resolved as ``ratio * head_dim`` rounded to a multiple of 8.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Param", "FrozenDict", "integer", "multiple_of_8", "choice", "boolean", "seed", "bits_sequence",
           "optional", "check_params", "MAX_SEED"]

MAX_SEED = 2 ** 63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed


class FrozenDict(Mapping):
    """An immutable, hashable mapping (codec parameters inside frozen, hashable configurations)."""

    __slots__ = ("_d", "_h")

    def __init__(self, *args, **kwargs):
        self._d = dict(*args, **kwargs)
        self._h = None

    def __getitem__(self, key):
        return self._d[key]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)

    def __hash__(self):
        if self._h is None:
            self._h = hash(frozenset(self._d.items()))
        return self._h

    def __repr__(self):
        return repr(self._d)

    def __reduce__(self):  # pickling and deepcopy
        return (FrozenDict, (self._d,))


@dataclass(frozen=True)
class Param:
    """One keyword parameter: ``check(name, value) -> normalized value`` (raises TypeError/ValueError)."""

    check: Callable[[str, Any], Any]
    per_dim: bool = False
    doc: str = ""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(lo: int, hi: int | None = None) -> Callable:
    def check(name, value):
        if not _is_int(value):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < lo or (hi is not None and value > hi):
            allowed = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise ValueError(f"{name} must be {allowed}, got {value}")
        return value
    return check


def multiple_of_8(lo: int = 8) -> Callable:
    base = integer(lo)

    def check(name, value):
        base(name, value)
        if value % 8:
            raise ValueError(f"{name} must be a multiple of 8 (bits are packed 8 per byte), got {value}")
        return value
    return check


def choice(*allowed) -> Callable:
    def check(name, value):
        try:
            ok = value in allowed
        except TypeError:  # an unhashable value compared with dtypes
            ok = False
        if not ok:
            shown = sorted(a for a in allowed if isinstance(a, str))
            raise ValueError(f"{name} must be one of {shown}, got {value!r}")
        return value
    return check


def boolean(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def seed(name, value):
    if not _is_int(value) or not 0 <= value <= MAX_SEED:
        raise ValueError(f"{name} must be an int in [0, 2**63 - 1], got {value!r}")
    return value


def bits_sequence(lo: int, hi: int) -> Callable:
    """An int, or a non-empty sequence of ints, each in lo..hi; normalized to a tuple."""
    def check(name, value):
        items = [value] if _is_int(value) else (list(value) if isinstance(value, Sequence)
                                                  and not isinstance(value, str) else None)
        if not items or any(not _is_int(b) or not lo <= b <= hi for b in items):
            raise ValueError(f"{name} must be an int in {lo}..{hi} or a non-empty sequence of them, got {value!r}")
        return value if _is_int(value) else tuple(items)
    return check


def optional(inner: Callable) -> Callable:
    def check(name, value):
        return None if value is None else inner(name, value)
    return check


def check_params(owner: str, declared: Mapping, params: Mapping, per_dim: Mapping = FrozenDict()) -> dict:
    """Check ``params`` (and ``per_dim`` ratios) against ``declared``; returns the normalized params.

    ``owner`` names the codec in messages.
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"params of codec {owner!r} must be a dict of parameter -> value, got "
                        f"{type(params).__name__} {params!r}")
    if not isinstance(per_dim, Mapping):
        raise TypeError(f"per_dim of codec {owner!r} must be a dict of parameter -> multiple of head_dim, got "
                        f"{type(per_dim).__name__} {per_dim!r}")
    allowed = sorted(declared)
    for source, label in ((params, "params"), (per_dim, "per_dim")):
        unknown = sorted(str(k) for k in source if k not in declared)
        if unknown:
            raise ValueError(f"codec {owner!r} has no parameter(s) {unknown} (in {label}); allowed: {allowed}")
    both = sorted(set(params) & set(per_dim))
    if both:
        raise ValueError(f"codec {owner!r}: parameter(s) {both} given both in params and per_dim")
    out = {k: declared[k].check(k, v) for k, v in params.items()}
    for k, ratio in per_dim.items():
        if not declared[k].per_dim:
            sizes = sorted(n for n, p in declared.items() if p.per_dim)
            raise ValueError(f"codec {owner!r}: per_dim[{k!r}] is not allowed ({k} does not scale with the head "
                             f"dimension); per_dim takes {sizes or 'no parameter of this codec'}")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio <= 0:
            raise ValueError(f"codec {owner!r}: per_dim[{k!r}] must be a finite positive multiple of head_dim, "
                             f"got {ratio!r}")
    return out
