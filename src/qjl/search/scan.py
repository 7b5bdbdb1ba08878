r"""Top-k scan over packed codes with per-query lookup tables: the C kernel and its torch reference.

Every codec the index scans fast scores a vector as a sum over coordinates of a function of
one code, times a per-vector factor: ``<Pi q, c[idx]> * ||x||`` for TurboQuant MSE,
``scale ||x|| <S q, sign>`` for QJL, both for TurboQuant Prod.  A code is cut into
*segments* (one per factor), a segment into *groups* of ``gbits`` bits (a byte of 1, 2, 4
or 8-bit codes; six bits = two 3-bit codes), and for each query a table holds, for every
group and every value the group can take, the sum of its coordinates' contributions.  Then

    score[i] = sum_s factors[s, i] * sum_g luts[q, off_s + 256 g' + group_g(code_i)] + add[i] + bias[q, r]

(a segment's groups are laid out 256 entries per byte for gbits 8, per 3 bytes for gbits 6).
:func:`build_luts` makes the tables from per-coordinate tables ``[nq, n_coords, 2**bits]``;
:func:`scan` runs the C kernel (``scan.c``, OpenMP over queries) and :func:`scan_torch` is
the plain-torch reference of the same signature.  ``bias [nq, nr]`` (optional) adds a term per
query and range (an IVF index that encodes residuals adds ``<q, centroid>`` of the probed list).  The two sum in different orders, so
scores agree to float32 rounding: ``|diff| <= 1e-5 * sum_s |factor| * sum_g max|lut|``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Segment", "Layout", "build_luts", "scan", "scan_torch", "c_available", "check_scan_args", "extension",
           "top_rows", "range_terms"]

_SRC = Path(__file__).with_name("scan.c")
# one extension, one translation unit in this order: the LUT scan (heap_sift, shared), the encoder, the fast scan
_SOURCES = (_SRC, Path(__file__).with_name("encode.c"), Path(__file__).with_name("fastscan.c"))


@dataclass(frozen=True)
class Segment:
    """``nbytes`` bytes at ``offset`` of a code holding ``n_coords`` codes of ``bits`` bits."""

    offset: int
    nbytes: int
    bits: int
    n_coords: int

    def __post_init__(self):
        if self.bits not in (1, 2, 3, 4, 8):
            raise ValueError(f"bits must be 1, 2, 3, 4 or 8 for the scan, got {self.bits}")
        if self.nbytes != (self.n_coords * self.bits + 7) // 8:
            raise ValueError(f"{self.n_coords} codes of {self.bits} bits take {(self.n_coords * self.bits + 7) // 8} "
                             f"bytes, got nbytes={self.nbytes}")

    @property
    def gbits(self) -> int:
        return 6 if self.bits == 3 else 8

    @property
    def lut_size(self) -> int:
        return 256 * (self.nbytes if self.gbits == 8 else -(-self.nbytes // 3))


@dataclass(frozen=True)
class Layout:
    """The segments of one code (``stride`` bytes per vector)."""

    segments: tuple
    stride: int

    @property
    def lut_offsets(self) -> list:
        out, acc = [], 0
        for s in self.segments:
            out.append(acc)
            acc += s.lut_size
        return out

    @property
    def lut_size(self) -> int:
        return sum(s.lut_size for s in self.segments)


def _group_table(table: torch.Tensor, seg: Segment) -> torch.Tensor:
    """table: [nq, n_coords, 2**bits] -> [nq, seg.lut_size] (padding coordinates contribute 0)."""
    nq = table.shape[0]
    per = seg.gbits // seg.bits  # codes per group
    groups = seg.lut_size // (1 << seg.gbits)
    n_pad = groups * per
    t = torch.nn.functional.pad(table.float(), (0, 0, 0, n_pad - seg.n_coords)).view(nq, groups, per, -1)
    out = t[:, :, per - 1, :]  # the highest digit; each lower one multiplies the entries by 2**bits
    for j in reversed(range(per - 1)):
        out = (out.unsqueeze(-1) + t[:, :, j, :].unsqueeze(-2)).flatten(-2)
    return out.reshape(nq, -1)


def build_luts(layout: Layout, tables: list) -> torch.Tensor:
    """tables[s]: [nq, n_coords_s, 2**bits_s] per-coordinate contributions -> luts [nq, layout.lut_size] float32."""
    if len(tables) != len(layout.segments):
        raise ValueError(f"need one table per segment ({len(layout.segments)}), got {len(tables)}")
    for s, (t, seg) in enumerate(zip(tables, layout.segments)):
        if t.ndim != 3 or t.shape[1:] != (seg.n_coords, 1 << seg.bits):
            raise ValueError(f"tables[{s}] must be [nq, {seg.n_coords}, {1 << seg.bits}], got {tuple(t.shape)}")
    return torch.cat([_group_table(t, seg) for t, seg in zip(tables, layout.segments)], dim=1).contiguous()


def check_scan_args(codes, layout, factors, add, luts, ranges, k, bias=None) -> None:
    """The shared argument checks of every scan backend (names the bad argument)."""
    if codes.dtype != torch.uint8 or codes.ndim != 2 or codes.shape[1] != layout.stride:
        raise ValueError(f"codes must be uint8 [n, {layout.stride}], got {codes.dtype} {tuple(codes.shape)}")
    n = codes.shape[0]
    if factors.shape != (len(layout.segments), n):
        raise ValueError(f"factors must be [{len(layout.segments)}, {n}], got {tuple(factors.shape)}")
    if add is not None and add.shape != (n,):
        raise ValueError(f"add must be [{n}], got {tuple(add.shape)}")
    if luts.ndim != 2 or luts.shape[1] != layout.lut_size:
        raise ValueError(f"luts must be [nq, {layout.lut_size}], got {tuple(luts.shape)}")
    if ranges.dtype != torch.int64 or ranges.ndim != 3 or ranges.shape[0] != luts.shape[0] or ranges.shape[2] != 2:
        raise ValueError(f"ranges must be int64 [nq, nr, 2], got {ranges.dtype} {tuple(ranges.shape)}")
    if bias is not None and bias.shape != ranges.shape[:2]:
        raise ValueError(f"bias must be [nq, nr] = {tuple(ranges.shape[:2])} or None, got {tuple(bias.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")


def top_rows(total: torch.Tensor, k: int):
    """total [nq, n] (-inf: not a candidate) -> (scores [nq, k] descending, indices [nq, k] int64; -inf / -1 past
    the candidates), ties by the lower index (as the kernels): a stable sort on -score."""
    kk = min(k, total.shape[1])
    order = torch.sort(-total, dim=1, stable=True).indices[:, :kk]
    scores = total.gather(1, order)
    idx = torch.where(torch.isfinite(scores), order, torch.full_like(order, -1))
    if kk < k:
        scores = torch.nn.functional.pad(scores, (0, k - kk), value=-float("inf"))
        idx = torch.nn.functional.pad(idx, (0, k - kk), value=-1)
    return scores, idx


def range_terms(ranges: torch.Tensor, bias, n: int):
    """ranges [nq, nr, 2], bias [nq, nr] or None -> (inside [nq, n] bool, per-row bias [nq, n] float32)."""
    nq = ranges.shape[0]
    inside = torch.zeros(nq, n, dtype=torch.bool)
    per = torch.zeros(nq, n)
    for q in range(nq):
        for r, (lo, hi) in enumerate(ranges[q].tolist()):
            inside[q, lo:hi] = True
            if bias is not None:
                per[q, lo:hi] = bias[q, r].float()
    return inside, per


def scan_torch(codes, layout: Layout, factors, add, luts, ranges, k: int, bias=None):
    """Reference. codes: [n, stride] uint8; factors: [nseg, n] float32; add: [n] or None;
    luts: [nq, lut_size]; ranges: [nq, nr, 2] int64 (half-open row ranges, may be empty, disjoint per
    query); bias: [nq, nr] or None -> (scores [nq, k] descending, indices [nq, k] int64; -inf / -1 past
    the vectors in range)."""
    check_scan_args(codes, layout, factors, add, luts, ranges, k, bias)
    n, nq = codes.shape[0], luts.shape[0]
    total = torch.zeros(nq, n) + (add.float() if add is not None else 0)
    c = codes.long()
    for seg, off, f in zip(layout.segments, layout.lut_offsets, factors.float()):
        part = c[:, seg.offset:seg.offset + seg.nbytes]
        if seg.gbits == 8:
            idx = part + 256 * torch.arange(seg.nbytes)
        else:
            part = torch.nn.functional.pad(part, (0, (-seg.nbytes) % 3)).view(n, -1, 3)
            word = part[..., 0] | (part[..., 1] << 8) | (part[..., 2] << 16)  # [n, words]
            grp = torch.stack([(word >> (6 * g)) & 63 for g in range(4)], dim=-1)  # [n, words, 4]
            base = 256 * torch.arange(word.shape[1]).unsqueeze(-1) + 64 * torch.arange(4)
            idx = (grp + base).reshape(n, -1)
        table = luts[:, off:off + seg.lut_size].float()  # [nq, lut]
        total += table[:, idx].sum(-1) * f  # [nq, n]
    inside, per = range_terms(ranges, bias, n)
    total = torch.where(inside, total + per, torch.tensor(-float("inf")))
    return top_rows(total, k)


def _cdef() -> str:
    """The exported prototypes, read from the C sources (so the two cannot drift apart)."""
    out = []
    for path, fn in zip(_SOURCES, ("int qjl_scan(", "int qjl_encode_lm(", "int qjl_fastscan(")):
        text = path.read_text()
        start = text.index(fn)
        out.append(text[start:text.index(")", start) + 1] + ";")
    return "\n".join(out)


@functools.lru_cache(maxsize=None)
def extension():
    """The compiled scan + encoder module (``.lib``, ``.ffi``), or None where it cannot be built."""
    from ..kernels.cpu.build import load_extension

    return load_extension("_qjl_search", list(_SOURCES), _cdef())


def c_available() -> bool:
    return extension() is not None


def scan(codes, layout: Layout, factors, add, luts, ranges, k: int, threads: int = 0, bias=None):
    """The C kernel (same contract as :func:`scan_torch`); ``threads`` 0 = OpenMP's default.
    Falls back to :func:`scan_torch` where the extension cannot be built."""
    check_scan_args(codes, layout, factors, add, luts, ranges, k, bias)
    mod = extension()
    if mod is None:
        return scan_torch(codes, layout, factors, add, luts, ranges, k, bias)
    ffi, lib = mod.ffi, mod.lib
    nseg = len(layout.segments)
    codes = codes.contiguous()
    factors = factors.float().contiguous()
    add = None if add is None else add.float().contiguous()
    luts = luts.float().contiguous()
    ranges = ranges.contiguous()
    bias = None if bias is None else bias.float().contiguous()
    seg_off = torch.tensor([s.offset for s in layout.segments], dtype=torch.int32)
    seg_bytes = torch.tensor([s.nbytes for s in layout.segments], dtype=torch.int32)
    seg_gbits = torch.tensor([s.gbits for s in layout.segments], dtype=torch.int32)
    lut_off = torch.tensor(layout.lut_offsets, dtype=torch.int64)
    nq = luts.shape[0]
    scores = torch.empty(nq, k, dtype=torch.float32)
    idx = torch.empty(nq, k, dtype=torch.int64)

    def p(t, ctype):
        return ffi.NULL if t is None else ffi.cast(ctype, t.data_ptr())

    rc = lib.qjl_scan(p(codes, "uint8_t *"), codes.shape[0], layout.stride, nseg, p(seg_off, "int32_t *"),
                      p(seg_bytes, "int32_t *"), p(seg_gbits, "int32_t *"), p(lut_off, "int64_t *"),
                      p(factors, "float *"), p(add, "float *"), p(luts, "float *"), layout.lut_size, nq,
                      p(ranges, "int64_t *"), ranges.shape[1], p(bias, "float *"), k, p(scores, "float *"), p(idx, "int64_t *"),
                      int(threads))
    if rc != 0:
        raise RuntimeError(f"qjl_scan failed with code {rc}")
    return scores, idx
