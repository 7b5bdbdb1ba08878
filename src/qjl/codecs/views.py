"""What a codec declares so that kernels can read its codes without knowing its class.

A decode kernel needs two things from the key codec and two from the value codec; each codec
declares them through public methods returning the dataclasses below (``None`` when the codec
cannot be read that way, e.g. PolarQuant or KIVI keys: the cache then uses the reference path):

* keys -- ``codec.score_view() -> ScoreView``: the score of a query row against stored vector
  ``t`` is a sum of terms ``norm[t] * sum_c qt[c] * centroids[code[t, c]]`` over packed b-bit
  codes, where ``qt`` is the query mapped into the term's basis by
  ``codec.score_queries(q, shared) -> [qt_0, qt_1, ...]`` (TurboQuant MSE: ``Pi q``; QJL:
  ``c S q``; QJL with outlier channels: two terms, the inlier and the outlier sketch, whose query
  maps read the per-sequence ``outlier_idx``).
* quantization -- ``codec.quantize_view() -> QuantizeView``: one or two passes of "project with a
  fixed matrix, then sign or Lloyd-Max cell, pack, and store the norm" (the Triton quantize kernel,
  TurboQuant's CPU bucketing);
* values -- ``codec.mix_view() -> MixView``: stored vector ``t`` is
  ``v[t, c] = zero[t, c // group_size] + scale[t, c // group_size] * centroids[code[t, c]]`` in
  the codec's basis; a kernel mixes ``sum_t p[t] v[t]`` there and ``codec.unmix(o)`` maps the
  mixed rows back (TurboQuant MSE: ``Pi^T o``, once per query row instead of once per token;
  token-wise: the identity).

Field names are the keys of the codec's :class:`qjl.Codes` ``fields`` (per vector) and ``shared``
(per sequence), so the same view reads contiguous ``Codes`` and paged stores alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackedCodes", "KeyTerm", "ScoreView", "MixView", "ProjectQuantize", "QuantizeView", "kernel_readable", "readable", "grouped"]


@dataclass(frozen=True)
class PackedCodes:
    """``length`` codes of ``bits`` bits per vector, packed LSB-first (:mod:`qjl.core.packing`) in the
    uint8 field ``field`` (``ceil(length * bits / 8)`` bytes per vector); code ``v`` stands for
    ``centroids[v]`` (float32 ``[2**bits]``).

    ``group`` g > 1 (a vector codebook, :class:`qjl.codecs.vq.TurboQuantVQ`): the g codes of positions
    ``[g j, g (j + 1))`` are the fields of one joint code ``e = sum_s code[g j + s] << (s bits)``, and position
    ``c`` stands for ``centroids[e g + c % g]`` (``centroids`` float32 ``[2**(g bits) g]``)."""

    field: str
    bits: int
    length: int
    centroids: torch.Tensor
    group: int = 1

    @property
    def nbytes(self) -> int:
        return (self.length * self.bits + 7) // 8

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """What unpacked codes [..., length] (integers) stand for: [..., length] float32 (the plain-torch
        reading every kernel is tested against)."""
        cent = self.centroids.to(codes.device)
        if self.group == 1:
            return cent[codes.long()]
        from qjl.core.vq_codebook import joint_codes

        g = self.group
        e = joint_codes(codes, g, self.bits).unsqueeze(-1)  # [..., length / g, 1]
        return cent[e * g + torch.arange(g, device=codes.device)].reshape(codes.shape)


@dataclass(frozen=True)
class KeyTerm:
    """One additive term of a key score: ``s[t] += norm[t] * sum_c qt[c] * centroids[code[t, c]]``.

    ``norm`` names the per-vector scalar field (any float dtype, float8 e4m3 included)."""

    codes: PackedCodes
    norm: str


@dataclass(frozen=True)
class ScoreView:
    """The terms of a key codec's score, in the order of ``codec.score_queries``; ``shared`` names the
    per-sequence fields that ``score_queries`` reads (e.g. ``("outlier_idx",)``)."""

    terms: tuple
    shared: tuple = ()


@dataclass(frozen=True)
class MixView:
    """A value codec's vectors: ``v[t, c] = zero[t, g] + scale[t, g] * centroids[code[t, c]]``,
    ``g = c // group_size``; ``scale`` / ``zero`` name per-vector fields of shape ``[groups]`` (or a
    scalar when there is one group); ``zero`` is None when there is no zero point.  ``rotated``: the
    codec's ``unmix`` is not the identity (the output must be mapped back).  ``cycles`` (K): the stored vector at
    code position t is mixed into accumulator ``t % K`` (its own basis: TurboQuant's rotations in turn), the
    mixed row is ``[K * length]`` (accumulator k in columns ``[k length, (k + 1) length)``) and ``unmix`` maps
    it back."""

    codes: PackedCodes
    group_size: int
    scale: str
    zero: str | None = None
    rotated: bool = False
    cycles: int = 1

    @property
    def mixed_length(self) -> int:
        """Columns of a mixed row: ``cycles * codes.length``."""
        return self.cycles * self.codes.length

    @property
    def groups(self) -> int:
        return -(-self.codes.length // self.group_size)


@dataclass(frozen=True)
class ProjectQuantize:
    """One quantization pass: ``y = M x'`` with ``M = matrix.matrix()`` ([m, d'] float32; a
    :class:`qjl.Rotation` also maps with ``.apply``) and ``x'`` the
    vector (``channels="all"``), the vector with its outlier channels zeroed (``"inliers"``) or its outlier
    channels alone (``"outliers"``, ``d' = n_outliers``); ``x'`` is divided by ``||x'||`` first when
    ``normalize``.  Codes: ``y >= 0`` (``boundaries`` None, 1 bit) or the number of ``boundaries`` below
    each coordinate, packed LSB-first into field ``codes``; field ``norm`` holds ``||x'||`` (divided by
    ``<y, centroids[code]>`` when ``correct_norm``) as ``norm_dtype``.

    Two extensions of TurboQuant's pass, which only the CPU encoder runs (:attr:`plain` is False; the Triton quantize
    kernel takes plain passes): ``table`` ([2^(g bits), g] float32, a vector codebook,
    :class:`qjl.codecs.vq.TurboQuantVQ`): instead of cells, each group of g consecutive coordinates gets its nearest
    codeword ``e`` (``||c||^2 - 2 <y, c>``, ties to the lowest), stored as its g b-bit fields, ``search`` its
    optional candidate grid (pairs: :func:`qjl.core.vq_codebook.search_grid`, the same indices), and the corrected
    norm divides by ``max(<y, c>, cos_floor)``; ``rotations`` (K > 1 rotations in turn, ``rotations[0]`` being
    ``matrix``): the vector at code position t is projected with ``rotations[t % K]``, so the encoder needs each
    vector's position."""

    matrix: object
    bits: int
    codes: str
    norm: str
    norm_dtype: torch.dtype
    boundaries: torch.Tensor | None = None
    centroids: torch.Tensor | None = None
    normalize: bool = False
    correct_norm: bool = False
    channels: str = "all"
    table: torch.Tensor | None = None
    search: object = None
    cos_floor: float = 0.0
    rotations: tuple = ()

    @property
    def cycles(self) -> int:
        """How many rotations are used in turn (1: ``matrix`` alone)."""
        return max(1, len(self.rotations))

    @property
    def group(self) -> int:
        """Coordinates per codeword (1: scalar cells)."""
        return 1 if self.table is None else int(self.table.shape[1])

    @property
    def plain(self) -> bool:
        """One matrix and scalar cells (or signs): what every quantize kernel runs."""
        return self.table is None and self.cycles == 1


@dataclass(frozen=True)
class QuantizeView:
    """The passes of a codec's quantization; ``shared`` names the per-sequence channel choice the
    "inliers"/"outliers" passes read (chosen by ``codec.select_outliers``, stored as ``codec.idx_dtype``)."""

    passes: tuple
    shared: str | None = None

    @property
    def plain(self) -> bool:
        """Every pass plain (:attr:`ProjectQuantize.plain`): what the Triton quantize kernel runs."""
        return all(p.plain for p in self.passes)


def kernel_readable(key_codec, value_codec) -> bool:
    """Whether both codecs declare views a kernel reads: packed codes in whole bytes of 8 codes
    (``length % 8 == 0``), value groups of whole bytes, and at most two key terms."""
    return readable(getattr(key_codec, "score_view", lambda: None)(), getattr(value_codec, "mix_view", lambda: None)())


def readable(sv, mv) -> bool:
    """:func:`kernel_readable` of the views themselves (a ScoreView and a MixView, or None)."""
    if sv is None or mv is None or not 1 <= len(sv.terms) <= 2:
        return False
    codes = [t.codes for t in sv.terms] + [mv.codes]
    return all(c.length % 8 == 0 and 1 <= c.bits <= 8 for c in codes) and mv.group_size % 8 == 0


def grouped(sv, mv) -> bool:
    """Whether any codes of these views (a ScoreView and a MixView, or None) are read g at a time (``group > 1``)."""
    codes = ([t.codes for t in sv.terms] if sv is not None else []) + ([mv.codes] if mv is not None else [])
    return any(c.group > 1 for c in codes)
