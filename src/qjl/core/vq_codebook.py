r"""Vector codebooks for groups of rotated coordinates (``TurboQuantVQ``, :mod:`qjl.codecs.vq`).

After a random rotation the coordinates of a unit vector in R^n are nearly independent N(0, 1/n).  A scalar
Lloyd-Max quantizer at b bits per coordinate has distortion 0.1175 (b = 2), 0.0345 (3), 0.0095 (4) per unit of
variance in the Gaussian limit; quantizing g coordinates jointly with ``2^(g b)`` codewords (the same bits)
fills space better: these k-means codebooks measure 0.0955 against 0.1145 (b = 2, g = 4: 256 codewords),
0.0291 against 0.0334 (b = 3, g = 2: 64) and 0.0079 against 0.0091 (b = 4, g = 2: 256) relative distortion at
d = 64 (``python -m qjl.core.vq_codebook``; the rate-distortion bound is ``4^-b``: 0.0625, 0.0156, 0.0039).

The tables (:mod:`qjl.core.vq_tables`) were trained once by :func:`train` (Lloyd's k-means, 50 iterations from
a fixed seed, on 400k groups of coordinates of uniform unit vectors in R^64 scaled to unit variance: d = 64 is
the embedded model's head size, and larger d approach the Gaussian limit, which differs little) and are shipped as
data, so that codes are the same on every machine; ``python -m qjl.core.vq_codebook --write`` regenerates them
(the test suite checks that they are k-means fixed points).  A codeword ``e`` of group size g is the joint code of g
consecutive coordinates: coordinate ``s`` of the group holds bits ``[s b, (s + 1) b)`` of ``e`` (packed like g
ordinary b-bit codes, LSB first, so the storage layout is that of the scalar codec).
"""

from __future__ import annotations

import base64
import functools
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["GROUPS", "group_size", "group_table", "joint_codes", "split_codes", "codeword_norms", "nearest_reference",
           "search_grid", "SearchGrid", "train"]

# bits per coordinate -> coordinates per joint code (2^(g b) codewords: 256, 64, 256)
GROUPS = {2: 4, 3: 2, 4: 2}


def group_size(bits: int) -> int:
    """Coordinates per joint code at ``bits`` per coordinate (ValueError for widths without a table)."""
    if bits not in GROUPS:
        raise ValueError(f"bits must be one of {sorted(GROUPS)} for a vector codebook, got {bits!r}")
    return GROUPS[bits]


@functools.lru_cache(maxsize=None)
def _table(bits: int) -> torch.Tensor:
    from qjl.core.vq_tables import TABLES

    g = group_size(bits)
    raw = np.frombuffer(base64.b64decode("".join(TABLES[bits])), dtype="<f4").reshape(2 ** (g * bits), g)
    return torch.from_numpy(raw.copy())


def group_table(bits: int, scale: float = 1.0) -> torch.Tensor:
    """The codebook for ``bits`` per coordinate: [2^(g bits), g] float32 codewords for unit-variance coordinates,
    times ``scale`` (``1 / sqrt(n)`` for the coordinates of a rotated unit vector in R^n).  A new tensor."""
    return (_table(bits).double() * scale).float()


def joint_codes(idx: torch.Tensor, g: int, bits: int) -> torch.Tensor:
    """Per-coordinate fields idx [..., n] (integers, n a multiple of g) -> each group's codeword [..., n / g] int64:
    coordinate ``s`` of a group holds bits ``[s bits, (s + 1) bits)`` of its codeword (the module doc's layout)."""
    shifts = torch.arange(g, device=idx.device) * bits
    return (idx.long().reshape(*idx.shape[:-1], idx.shape[-1] // g, g) << shifts).sum(-1)


def split_codes(code: torch.Tensor, g: int, bits: int) -> torch.Tensor:
    """Each group's codeword code [..., m] (integers) -> its per-coordinate fields [..., m g] int64 (the inverse of
    :func:`joint_codes`)."""
    shifts = torch.arange(g, device=code.device) * bits
    return ((code.long().unsqueeze(-1) >> shifts) & (2 ** bits - 1)).reshape(*code.shape[:-1], code.shape[-1] * g)


def codeword_norms(table: torch.Tensor) -> torch.Tensor:
    """``||c||^2`` of each codeword of table [k, g]: [k] float32, summed in float64 (the ``sq`` every search reads:
    :func:`nearest_reference`, the C search and the C encoder)."""
    return table.double().square().sum(-1).float()


def nearest_reference(y: torch.Tensor, table: torch.Tensor, sq: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """The nearest codeword of each group: y [groups, g] float32, table [k, g], sq [k] (``||c||^2``) -> [groups]
    int64, the index minimizing ``sq[e] - 2 <y, c_e>`` in float32 with the products summed in coordinate order
    (ties: the lowest index).  The plain-torch reference of the C search (``qjl.kernels.cpu.store.vq_nearest``),
    which repeats these operations in this order and so returns the same indices.

    ``chunk`` groups are scored at a time (the indices do not depend on it): by default 16,384 on a CPU (the
    ``[chunk, k]`` scores stay in cache) and ``2^25 / k`` elsewhere (128 MiB of scores per step: on a GPU the small
    chunks made encoding launch-bound, 543 ms for a 64k-token layer of ``tqv-k3v2`` on an H200, 2026-11-29)."""
    if chunk is None:
        chunk = 1 << 14 if y.device.type == "cpu" else max(1, (1 << 25) // table.shape[0])
    elif isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk: a positive number of groups per step, got {chunk!r}")
    out = torch.empty(y.shape[0], dtype=torch.int64, device=y.device)
    for i in range(0, y.shape[0], chunk):
        yc = y[i:i + chunk]
        s = yc[:, 0:1] * table[:, 0]
        for t in range(1, y.shape[1]):
            s = s + yc[:, t:t + 1] * table[:, t]
        out[i:i + chunk] = (sq - 2.0 * s).argmin(-1)
    return out


class SearchGrid(NamedTuple):
    """Candidate lists for pairs (``g = 2``): ``cells`` x ``cells`` squares of side ``1 / inv`` from ``lo`` on both
    axes; square ``(a, b)`` (``a`` along the first coordinate) lists ``cand[off[a cells + b]:off[a cells + b + 1]]``,
    ascending."""

    lo: float
    inv: float
    cells: int
    off: torch.Tensor   # [cells^2 + 1] int32
    cand: torch.Tensor  # [off[-1]] int32


@functools.lru_cache(maxsize=None)
def search_grid(bits: int, n: int, cells: int = 32, reach: float = 4.5) -> SearchGrid:
    """The candidate lists of the pair codebook ``group_table(bits, 1 / sqrt(n))`` (the table of a rotated unit
    vector's coordinates in R^n) over ``[-reach, reach] / sqrt(n)`` on both axes, for the C search
    (``qjl.kernels.cpu.store.vq_nearest``; pairs outside are compared with every codeword).

    A codeword is listed for a square when its distance to the square (enlarged by 1/1000 of a side on each
    side, above float32's error in placing a point) is at most the smallest farthest-corner distance of any
    codeword, plus a margin ~40x the float32 rounding of a score: every codeword the reference's float32
    scores can pick for a point of the square (its exact score within rounding of the minimum) is listed, so
    the search returns :func:`nearest_reference`'s index.  Tested against it, boundaries and ties included."""
    import math

    if group_size(bits) != 2:
        raise ValueError(f"bits: the grid serves codebooks of pairs (3 or 4 bits), got {bits!r}")
    for name, v, kind in (("n", n, int), ("cells", cells, int), ("reach", reach, (int, float))):
        if isinstance(v, bool) or not isinstance(v, kind) or not v > 0 or not math.isfinite(v):
            raise ValueError(f"{name} must be a positive {'int' if kind is int else 'number'}, got {v!r}")
    table = group_table(bits, 1.0 / math.sqrt(n)).double()  # [k, 2], the codec's table
    lo32 = torch.tensor(-reach / math.sqrt(n), dtype=torch.float32)
    inv32 = torch.tensor(cells / (2 * reach / math.sqrt(n)), dtype=torch.float32)
    lo, w = float(lo32), 1.0 / float(inv32)
    edge = lo + w * torch.arange(cells + 1, dtype=torch.float64)
    a0, a1 = edge[:-1] - 1e-3 * w, edge[1:] + 1e-3 * w  # [cells] each axis's enlarged squares
    gap = lambda c: (torch.clamp(a0[:, None] - c, min=0) + torch.clamp(c - a1[:, None], min=0)).square()  # noqa: E731
    far = lambda c: torch.maximum((c - a0[:, None]).square(), (c - a1[:, None]).square())  # noqa: E731
    near_d = gap(table[:, 0])[:, None, :] + gap(table[:, 1])[None, :, :]  # [cells, cells, k]
    far_d = far(table[:, 0])[:, None, :] + far(table[:, 1])[None, :, :]
    # a score sq - 2 <y, c> inside the grid is at most sq + 2 |y| |c|, rounded in float32 to ~4 ulps of that
    sq = table.square().sum(-1)
    bound = float(sq.max()) + 2 * math.sqrt(2) * (abs(lo) + w) * float(sq.max().sqrt())
    margin = 1e-5 * bound
    listed = near_d <= far_d.amin(-1, keepdim=True) + margin  # [cells, cells, k]
    counts = listed.reshape(cells * cells, -1).sum(-1)
    off = torch.zeros(cells * cells + 1, dtype=torch.int32)
    off[1:] = counts.cumsum(0).to(torch.int32)
    cand = listed.reshape(cells * cells, -1).nonzero()[:, 1].to(torch.int32).contiguous()  # row-major: ascending
    return SearchGrid(lo, float(inv32), cells, off, cand)


def train(bits: int, dim: int = 64, samples: int = 400_000, iters: int = 50, seed: int = 0) -> torch.Tensor:
    """Lloyd's k-means of ``2^(g bits)`` codewords on ``samples`` groups of g consecutive coordinates of uniform unit
    vectors in R^dim (float32; fixed seeds; random draws as the start), scaled to unit variance ->
    [2^(g bits), g] float32.  How the shipped tables were made, on an AVX2 CPU (float rounding elsewhere may move
    the last bits: that is why the tables are shipped rather than trained at run time)."""
    g = group_size(bits)
    k = 2 ** (g * bits)
    u = torch.randn(max(1, samples * g // dim), dim, generator=torch.Generator().manual_seed(1234))
    x = (u / u.norm(dim=1, keepdim=True)).reshape(-1, g)[:samples]
    c = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:k]].clone()
    for _ in range(iters):
        a = torch.cat([torch.cdist(x[i:i + 65536], c).argmin(1) for i in range(0, len(x), 65536)])
        s = torch.zeros_like(c).index_add_(0, a, x)
        n = torch.bincount(a, minlength=k).float()
        c = torch.where(n[:, None] > 0, s / n.clamp(min=1)[:, None], c)
    return c * dim ** 0.5


def _write() -> None:  # pragma: no cover - regeneration (a few minutes)
    import pathlib

    out = ['"""Generated by ``python -m qjl.core.vq_codebook --write`` (:func:`qjl.core.vq_codebook.train`): the vector\n'
           'codebooks of :mod:`qjl.core.vq_codebook`, float32 little-endian, [2^(g bits), g] row-major, base64."""\n',
           "TABLES = {}"]
    for bits in sorted(GROUPS):
        text = base64.b64encode(train(bits).numpy().astype("<f4").tobytes()).decode()
        chunks = [text[i:i + 100] for i in range(0, len(text), 100)]
        out.append(f"TABLES[{bits}] = (" + "\n             ".join(repr(s) for s in chunks) + ")")
    pathlib.Path(__file__).with_name("vq_tables.py").write_text("\n".join(out) + "\n")


def _check() -> None:  # pragma: no cover - a report
    from qjl.codecs.turboquant import TurboQuantMSE
    from qjl.codecs.vq import TurboQuantVQ

    x = torch.randn(20000, 64, generator=torch.Generator().manual_seed(1))
    for bits in sorted(GROUPS):
        for codec in (TurboQuantMSE(64, bits), TurboQuantVQ(64, bits)):
            err = (x - codec.dequantize(codec.quantize(x))).square().sum() / x.square().sum()
            print(f"d 64, {bits} bits: {type(codec).__name__:14s} relative distortion {float(err):.4f}")


if __name__ == "__main__":  # pragma: no cover
    import sys

    _write() if "--write" in sys.argv else _check()
