"""Fast scan (4-bit groups, 8-bit tables in registers, exact re-scoring of a shortlist) and its torch reference.

For single-factor codes of 1, 2 or 4 bits per coordinate (``tq-mse``, ``tq-mse-rn``, ``qjl``) the
index stores its codes in blocks of 32 vectors, nibble-major (:func:`to_blocks`; the same bytes,
rearranged, plus padding to a multiple of 32 vectors).  A query's float tables per nibble
``lutf [G, 16]`` are quantized to ``lut8 = round((lutf - min_g) / delta)`` (one ``delta`` per
query, so every entry is within ``delta / 2`` and a sum of G entries within ``G delta / 2``); the
kernel (``fastscan.c``) ranks every vector by ``f_i (delta S_i + beta)``, keeps the ``shortlist``
best and re-scores them exactly with ``lutf``.  The result equals the float scan whenever its
top k are in the shortlist (always when ``shortlist >= n``; tested).
"""

from __future__ import annotations

import torch

from .scan import Segment, check_scan_args, extension  # noqa: F401 - check_scan_args re-exported for symmetry

__all__ = ["fastscan_ok", "to_blocks", "from_blocks", "nibble_tables", "quantize_tables", "fastscan",
           "fastscan_torch"]


def fastscan_ok(layout) -> bool:
    return layout is not None and len(layout.segments) == 1 and layout.segments[0].bits in (1, 2, 4)


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


def nibble_tables(seg: Segment, table: torch.Tensor) -> torch.Tensor:
    """table: [nq, n_coords, 2**bits] per-coordinate contributions -> [nq, G, 16] per-nibble sums."""
    nq, per = table.shape[0], 4 // seg.bits
    groups = 2 * seg.nbytes
    t = torch.nn.functional.pad(table.float(), (0, 0, 0, groups * per - seg.n_coords)).view(nq, groups, per, -1)
    out = t[:, :, per - 1, :]
    for j in reversed(range(per - 1)):
        out = (out.unsqueeze(-1) + t[:, :, j, :].unsqueeze(-2)).flatten(-2)
    return out.contiguous()


def quantize_tables(lutf: torch.Tensor):
    """lutf: [nq, G, 16] -> (lut8 [nq, G, 16] uint8, delta [nq], beta [nq]) with lutf ~ delta lut8 + min_g
    (the kernel quantizes its tables itself, with the same float32 operations)."""
    mins = lutf.amin(-1, keepdim=True)
    shifted = lutf - mins
    delta = (shifted.amax(dim=(1, 2)) / 255).clamp(min=1e-30)
    lut8 = torch.round(shifted / delta.view(-1, 1, 1)).clamp(0, 255).to(torch.uint8)
    return lut8, delta.float(), mins.sum((1, 2)).float()


def _check(blocks, n, factors, lutf, ranges, k, shortlist):
    if blocks.dtype != torch.uint8 or blocks.ndim != 3 or blocks.shape[2] != 16 or blocks.shape[0] * 32 < n:
        raise ValueError(f"blocks must be uint8 [>= {-(-n // 32)}, G, 16], got {blocks.dtype} {tuple(blocks.shape)}")
    if factors.shape != (n,):
        raise ValueError(f"factors must be [{n}], got {tuple(factors.shape)}")
    if lutf.ndim != 3 or lutf.shape[1:] != blocks.shape[1:]:
        raise ValueError(f"lutf must be [nq, {blocks.shape[1]}, 16], got {tuple(lutf.shape)}")
    if ranges.dtype != torch.int64 or ranges.ndim != 3 or ranges.shape[0] != lutf.shape[0] or ranges.shape[2] != 2:
        raise ValueError(f"ranges must be int64 [nq, nr, 2], got {ranges.dtype} {tuple(ranges.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or shortlist < k:
        raise ValueError(f"need 1 <= k <= shortlist, got k={k!r}, shortlist={shortlist!r}")


def fastscan_torch(blocks, n: int, factors, lutf, ranges, k: int, shortlist: int):
    """Reference: blocks [B, G, 16]; factors [n] float32; lutf [nq, G, 16] -> (scores, rows) [nq, k]."""
    _check(blocks, n, factors, lutf, ranges, k, shortlist)
    rows = from_blocks(blocks, n).long()
    nib = torch.stack([rows & 15, rows >> 4], dim=-1).reshape(n, -1)  # [n, G]
    base = 16 * torch.arange(nib.shape[1])
    lut8, delta, beta = quantize_tables(lutf)
    nq = lutf.shape[0]
    sums = lut8.reshape(nq, -1).long()[:, nib + base].sum(-1)  # [nq, n] exact integers
    approx = factors * (delta.unsqueeze(1) * sums.float() + beta.unsqueeze(1))
    exact = factors * lutf.reshape(nq, -1)[:, nib + base].sum(-1)
    idx = torch.arange(n)
    inside = ((idx >= ranges[..., :1]) & (idx < ranges[..., 1:])).any(1)
    approx = torch.where(inside, approx, torch.tensor(-float("inf")))
    sl = min(shortlist, n)
    short = torch.sort(-approx, dim=1, stable=True).indices[:, :sl]
    ok = torch.isfinite(approx.gather(1, short))
    cand = torch.where(ok, exact.gather(1, short), torch.tensor(-float("inf")))
    kk = min(k, sl)
    order = torch.sort(-cand, dim=1, stable=True).indices[:, :kk]
    scores, rows_out = cand.gather(1, order), short.gather(1, order)
    rows_out = torch.where(torch.isfinite(scores), rows_out, torch.full_like(rows_out, -1))
    if kk < k:
        scores = torch.nn.functional.pad(scores, (0, k - kk), value=-float("inf"))
        rows_out = torch.nn.functional.pad(rows_out, (0, k - kk), value=-1)
    return scores, rows_out


def fastscan(blocks, n: int, factors, lutf, ranges, k: int, shortlist: int, threads: int = 0):
    """The C kernel (same contract as :func:`fastscan_torch`); the reference where it is not built."""
    _check(blocks, n, factors, lutf, ranges, k, shortlist)
    mod = extension()
    if mod is None:
        return fastscan_torch(blocks, n, factors, lutf, ranges, k, shortlist)
    ffi, lib = mod.ffi, mod.lib
    nq = lutf.shape[0]
    tensors = [blocks.contiguous(), factors.float().contiguous(), lutf.float().contiguous(), ranges.contiguous()]
    scores = torch.empty(nq, k, dtype=torch.float32)
    rows = torch.empty(nq, k, dtype=torch.int64)
    p = [ffi.cast({torch.uint8: "uint8_t *", torch.float32: "float *", torch.int64: "int64_t *"}[t.dtype],
                  t.data_ptr()) for t in tensors]
    rc = lib.qjl_fastscan(p[0], n, blocks.shape[1], p[1], p[2], nq, p[3], ranges.shape[1],
                          int(shortlist), k, ffi.cast("float *", scores.data_ptr()),
                          ffi.cast("int64_t *", rows.data_ptr()), int(threads))
    if rc != 0:
        raise RuntimeError(f"qjl_fastscan failed with code {rc}")
    return scores, rows
