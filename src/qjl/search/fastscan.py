r"""Fast scan over 4-bit groups with 8-bit tables, several queries per pass, and its torch reference.

For codecs whose estimate is ``f_i * sum_j y_j c[idx_ij]`` (one factor per vector: ``tq-mse``,
``tq-mse-rn``, ``qjl``), the index stores each coordinate's ``bits``-bit code ``idx`` as two
*planes*: the top ``scan_bits`` bits ``h = idx >> r`` and the remaining ``r = bits - scan_bits``
bits ``l``, each packed LSB first and cut into nibbles, vectors in blocks of 32 (:func:`to_blocks`).
The same bits as the packed codes, rearranged (plus padding to 32 vectors, counted).

A query becomes float tables ``lutf [Gs, 16]`` over the scan plane's nibbles, built with the scan
cells' centroids ``cs[h]`` (the conditional means of the union of the cells sharing ``h``; ``c``
itself when ``r = 0``), then 8-bit tables ``lut8 = round((lutf - min_g) / delta)`` (one ``delta``
per query: each entry within ``delta / 2``).  The kernel (``fastscan.c``) ranks every vector by
``approx_i = f_i (delta S_i + beta) + add_i + bias``, keeps the ``shortlist`` best and re-scores them
exactly, ``f_i sum_j y_j c[idx_ij] + add_i + bias``.  The result equals the exact scan whenever the
exact top k are in the shortlist.  Scanning a 2-bit plane of 3- or 4-bit codes halves the work;
on 24,576 real embeddings its top 10 had recall 0.9999 (3 bits) / 0.9994 (4 bits) against the full-code
scan (``benchmarks/search_scan_planes.py``).

:func:`fastscan_torch` is the reference of the same signature: the approximate scores, hence the
shortlist, are bit-exact with the kernel's; the exact scores agree to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.packing import pack_bits, unpack_bits
from .scan import extension, range_terms

__all__ = ["FastLayout", "fast_layout", "to_blocks", "from_blocks", "rows_to_planes", "planes_to_rows",
           "nibble_tables", "quantize_tables", "fastscan", "fastscan_torch", "default_shortlist"]


@dataclass(frozen=True)
class FastLayout:
    """``n_coords`` codes of ``bits`` bits, scanned by their top ``scan_bits`` bits."""

    n_coords: int
    bits: int
    scan_bits: int

    def __post_init__(self):
        if isinstance(self.n_coords, bool) or not isinstance(self.n_coords, int) or self.n_coords < 1:
            raise ValueError(f"n_coords must be a positive int, got {self.n_coords!r}")
        if self.bits not in (1, 2, 3, 4):
            raise ValueError(f"bits must be 1, 2, 3 or 4 for the fast scan, got {self.bits!r}")
        ok = (1, 2, 4) if self.bits == 4 else (1, 2)
        if self.scan_bits not in ok or self.scan_bits > self.bits or self.bits - self.scan_bits > 2:
            raise ValueError(f"scan_bits must be one of {[s for s in ok if s <= self.bits and self.bits - s <= 2]} "
                             f"for {self.bits}-bit codes, got {self.scan_bits!r}")

    @property
    def rbits(self) -> int:
        return self.bits - self.scan_bits

    @property
    def n_scan(self) -> int:
        """Gs: nibbles of the scan plane (even)."""
        return 2 * (-(-self.n_coords * self.scan_bits // 8))

    @property
    def n_nibbles(self) -> int:
        """G: all nibbles of a vector (scan plane, then refine plane)."""
        return self.n_scan + (2 * (-(-self.n_coords * self.rbits // 8)) if self.rbits else 0)

    @property
    def row_bytes(self) -> int:
        return self.n_nibbles // 2


def fast_layout(n_coords: int, bits: int, scan_bits: int = 0) -> FastLayout:
    """The layout of ``bits``-bit codes; ``scan_bits`` 0 picks ``min(bits, 2)``."""
    return FastLayout(n_coords, bits, scan_bits or min(bits, 2))


def default_shortlist(k: int, full_code: bool = False) -> int:
    """Approximate candidates re-scored exactly for a top ``k``.  ``full_code``: the scan plane is the whole
    code (1- and 2-bit codes), so the approximate score differs from the exact one only by the 8-bit
    rounding of the tables: ``max(2k, 16)``.  Otherwise (a 2-bit plane of 3- or 4-bit codes) ``max(4k, 64)``.
    ``python benchmarks/search_scan_planes.py --bits 1 2 3 4`` measures both against the full-code scan."""
    return max(2 * k, 16) if full_code else max(4 * k, 64)


def to_blocks(codes: torch.Tensor) -> torch.Tensor:
    """codes: [n, nbytes] uint8 -> blocks [ceil(n / 32), 2 nbytes, 16] uint8 (see fastscan.c)."""
    n, nbytes = codes.shape
    pad = (-n) % 32
    c = torch.nn.functional.pad(codes, (0, 0, 0, pad)) if pad else codes
    nib = torch.stack([c & 15, c >> 4], dim=-1).reshape(-1, 32, 2 * nbytes)  # [B, 32, G]
    return (nib[:, :16] | (nib[:, 16:] << 4)).transpose(1, 2).contiguous()  # [B, G, 16]


def from_blocks(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`to_blocks`: -> [n, G / 2] uint8."""
    b = blocks.transpose(1, 2)  # [B, 16, G]
    nib = torch.cat([b & 15, b >> 4], dim=1).reshape(-1, blocks.shape[1])[:n]  # [n, G]
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous()


def rows_to_planes(rows: torch.Tensor, fl: FastLayout) -> torch.Tensor:
    """rows: [n, ceil(n_coords bits / 8)] packed codes -> [n, fl.row_bytes] (scan plane, refine plane)."""
    if fl.rbits == 0:
        return rows.contiguous()
    if rows.shape[0] == 0:
        return torch.empty(0, fl.row_bytes, dtype=torch.uint8)
    idx = unpack_bits(rows, fl.bits, fl.n_coords, dtype=torch.uint8)
    return torch.cat([_pack_bytes(idx >> fl.rbits, fl.scan_bits), _pack_bytes(idx & ((1 << fl.rbits) - 1), fl.rbits)], 1)


def _pack_bytes(values: torch.Tensor, bits: int) -> torch.Tensor:
    """values: [n, L] uint8, each < 2**bits -> [n, ceil(L bits / 8)] uint8, the layout of
    :func:`~qjl.core.packing.pack_bits`, in uint8 shifts where ``bits`` divides 8 (the planes' widths 1, 2
    and 4: an order of magnitude faster than the general int64 packing on the encode path)."""
    if 8 % bits:
        return pack_bits(values, bits)
    per = 8 // bits
    v = values.to(torch.uint8)
    if v.shape[1] % per:
        v = torch.nn.functional.pad(v, (0, per - v.shape[1] % per))
    v = v.view(v.shape[0], -1, per)
    out = v[..., 0].clone()
    for m in range(1, per):
        out |= v[..., m] << (m * bits)
    return out


def planes_to_rows(planes: torch.Tensor, fl: FastLayout) -> torch.Tensor:
    """Inverse of :func:`rows_to_planes`."""
    if fl.rbits == 0:
        return planes.contiguous()
    if planes.shape[0] == 0:
        return torch.empty(0, -(-fl.n_coords * fl.bits // 8), dtype=torch.uint8)
    return pack_bits(_plane_codes(planes, fl), fl.bits)


def _plane_codes(planes: torch.Tensor, fl: FastLayout) -> torch.Tensor:
    """planes [n, row_bytes] -> idx [n, n_coords] int64."""
    if fl.rbits == 0:
        return unpack_bits(planes, fl.bits, fl.n_coords)
    split = fl.n_scan // 2
    hi = unpack_bits(planes[:, :split].contiguous(), fl.scan_bits, fl.n_coords)
    lo = unpack_bits(planes[:, split:].contiguous(), fl.rbits, fl.n_coords)
    return (hi << fl.rbits) | lo


def nibble_tables(y: torch.Tensor, cs: torch.Tensor, fl: FastLayout) -> torch.Tensor:
    """y: [nq, n_coords], cs: [2**scan_bits] -> lutf [nq, Gs, 16]: per nibble, the sum of its coordinates'
    y_j cs[digit_j] (highest coordinate first: the kernel's order, so the tables are bit-exact)."""
    nq, per = y.shape[0], 4 // fl.scan_bits
    table = y.float().unsqueeze(-1) * cs.float()  # [nq, nc, 2**s]
    t = torch.nn.functional.pad(table, (0, 0, 0, fl.n_scan * per - fl.n_coords)).view(nq, fl.n_scan, per, -1)
    out = t[:, :, per - 1, :]
    for j in reversed(range(per - 1)):
        out = (out.unsqueeze(-1) + t[:, :, j, :].unsqueeze(-2)).flatten(-2)
    return out.contiguous()


def quantize_tables(lutf: torch.Tensor):
    """lutf: [nq, G, 16] -> (lut8 [nq, G, 16] uint8, delta [nq], beta [nq]) with lutf ~ delta lut8 + min_g."""
    mins = lutf.amin(-1, keepdim=True)
    shifted = lutf - mins
    delta = (shifted.amax(dim=(1, 2)) / 255).clamp(min=1e-30)
    lut8 = torch.round(shifted / delta.view(-1, 1, 1)).clamp(0, 255).to(torch.uint8)
    return lut8, delta.float(), mins.squeeze(-1).double().sum(-1).float()  # beta: the kernel sums in double


def _check(blocks, n, fl, factors, add, y, cs, c, ranges, bias, k, shortlist):
    if not isinstance(fl, FastLayout):
        raise TypeError(f"fl must be a FastLayout, got {type(fl).__name__}")
    if blocks.dtype != torch.uint8 or blocks.ndim != 3 or blocks.shape[1:] != (fl.n_nibbles, 16) \
            or blocks.shape[0] * 32 < n:
        raise ValueError(f"blocks must be uint8 [>= {-(-n // 32)}, {fl.n_nibbles}, 16], got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    if factors.shape != (n,):
        raise ValueError(f"factors must be [{n}], got {tuple(factors.shape)}")
    if add is not None and add.shape != (n,):
        raise ValueError(f"add must be [{n}] or None, got {tuple(add.shape)}")
    if y.ndim != 2 or y.shape[1] != fl.n_coords:
        raise ValueError(f"y must be [nq, {fl.n_coords}], got {tuple(y.shape)}")
    if cs.shape != (1 << fl.scan_bits,) or c.shape != (1 << fl.bits,):
        raise ValueError(f"cs / c must be [{1 << fl.scan_bits}] / [{1 << fl.bits}], got {tuple(cs.shape)} / {tuple(c.shape)}")
    if ranges.dtype != torch.int64 or ranges.ndim != 3 or ranges.shape[0] != y.shape[0] or ranges.shape[2] != 2:
        raise ValueError(f"ranges must be int64 [nq, nr, 2], got {ranges.dtype} {tuple(ranges.shape)}")
    if ranges.numel() and (bool((ranges < 0).any()) or bool((ranges > n).any())):
        raise ValueError(f"ranges must lie in [0, {n}]")
    live = ranges[..., 1] > ranges[..., 0]
    lo = torch.where(live, ranges[..., 0], torch.full_like(ranges[..., 0], n + 1))
    order = lo.sort(1).indices
    lo, hi = lo.gather(1, order), torch.where(live, ranges[..., 1], 0).gather(1, order)
    if bool((lo[:, 1:] < hi[:, :-1]).any()):
        raise ValueError("ranges of one query must not overlap")
    if bias is not None and bias.shape != ranges.shape[:2]:
        raise ValueError(f"bias must be [nq, nr] = {tuple(ranges.shape[:2])} or None, got {tuple(bias.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or not isinstance(shortlist, int) or shortlist < k:
        raise ValueError(f"need 1 <= k <= shortlist, got k={k!r}, shortlist={shortlist!r}")


def fastscan_torch(blocks, n: int, fl: FastLayout, factors, add, y, cs, c, ranges, bias, k: int, shortlist: int):
    """Reference.  blocks [B, G, 16] uint8; factors [n]; add [n] or None; y [nq, n_coords]; cs [2**scan_bits];
    c [2**bits]; ranges [nq, nr, 2] int64 (half-open, disjoint per query); bias [nq, nr] or None ->
    (scores [nq, k] descending, rows [nq, k] int64; -inf / -1 past the vectors in range)."""
    _check(blocks, n, fl, factors, add, y, cs, c, ranges, bias, k, shortlist)
    nq = y.shape[0]
    planes = from_blocks(blocks, n)
    nib = torch.stack([planes & 15, planes >> 4], dim=-1).reshape(n, -1).long()[:, :fl.n_scan]  # [n, Gs]
    lutf = nibble_tables(y, cs, fl)
    lut8, delta, beta = quantize_tables(lutf)
    gather = nib + 16 * torch.arange(fl.n_scan)
    sums = lut8.reshape(nq, -1).long()[:, gather].sum(-1)  # [nq, n] exact integers
    f = factors.float()
    approx = f * (delta.unsqueeze(1) * sums.float() + beta.unsqueeze(1))
    if fl.rbits == 0:
        exact = f * lutf.reshape(nq, -1)[:, gather].sum(-1)
    else:
        exact = f * (y.float() @ c.float()[_plane_codes(planes, fl)].T)
    if add is not None:
        approx, exact = approx + add.float(), exact + add.float()
    inside, per = range_terms(ranges, bias, n)
    approx = torch.where(inside, approx + per, torch.tensor(-float("inf")))
    exact = exact + per
    sl = min(shortlist, n)
    short = torch.sort(-approx, dim=1, stable=True).indices[:, :sl]  # ties: the lower row
    short = torch.sort(short, dim=1).values  # by row, so that exact ties also go to the lower row
    ok = torch.isfinite(approx.gather(1, short))
    cand = torch.where(ok, exact.gather(1, short), torch.tensor(-float("inf")))
    kk = min(k, sl)
    order = torch.sort(-cand, dim=1, stable=True).indices[:, :kk]
    scores, rows = cand.gather(1, order), short.gather(1, order)
    rows = torch.where(torch.isfinite(scores), rows, torch.full_like(rows, -1))
    if kk < k:
        scores = torch.nn.functional.pad(scores, (0, k - kk), value=-float("inf"))
        rows = torch.nn.functional.pad(rows, (0, k - kk), value=-1)
    return scores, rows


def fastscan(blocks, n: int, fl: FastLayout, factors, add, y, cs, c, ranges, bias, k: int, shortlist: int,
             threads: int = 0, shared: bool | None = None):
    """The C kernel (same contract as :func:`fastscan_torch`); the reference where it is not built.
    ``shared``: every query has the same ranges (queries are then scanned in batches); None: find out."""
    _check(blocks, n, fl, factors, add, y, cs, c, ranges, bias, k, shortlist)
    mod = extension()
    if mod is None:
        return fastscan_torch(blocks, n, fl, factors, add, y, cs, c, ranges, bias, k, shortlist)
    nq = y.shape[0]
    if shared is None:
        shared = bool((ranges == ranges[:1]).all()) if nq else True
    t = {"blocks": blocks.contiguous(), "factors": factors.float().contiguous(), "y": y.float().contiguous(),
         "cs": cs.float().contiguous(), "c": c.float().contiguous(), "ranges": ranges.contiguous(),
         "add": None if add is None else add.float().contiguous(),
         "bias": None if bias is None else bias.float().contiguous()}
    scores = torch.empty(nq, k, dtype=torch.float32)
    rows = torch.empty(nq, k, dtype=torch.int64)
    ffi, lib = mod.ffi, mod.lib

    def p(x):
        if x is None:
            return ffi.NULL
        return ffi.cast({torch.uint8: "uint8_t *", torch.float32: "float *", torch.int64: "int64_t *"}[x.dtype],
                        x.data_ptr())

    rc = lib.qjl_fastscan(p(t["blocks"]), n, fl.n_nibbles, fl.n_scan, fl.n_coords, fl.scan_bits, fl.rbits,
                          p(t["factors"]), p(t["add"]), p(t["y"]), p(t["cs"]), p(t["c"]), nq, p(t["ranges"]),
                          ranges.shape[1], p(t["bias"]), int(shared), int(shortlist), k, p(scores), p(rows),
                          int(threads))
    if rc != 0:
        raise RuntimeError(f"qjl_fastscan failed with code {rc}")
    return scores, rows
