"""Triton path of the vector-search LUT scan (:mod:`qjl.search.scan`), for codes held on a GPU.

``_segment_sums_kernel`` computes, for one segment, ``part[q, i] = sum_g lut[q, off + group_g(code_i)]``
for a block of vectors per program (grid: queries x vector blocks); the launcher :func:`scan_triton`
combines the segments with their factors and ``add``, masks the rows outside each query's
ranges and takes the top k with torch, so its contract is :func:`qjl.search.scan.scan_torch`'s.
Tested on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, small shapes).
"""

from __future__ import annotations

import torch

from ...search.scan import Layout, check_scan_args, top_rows

__all__ = ["scan_triton", "triton_available"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _segment_sums_kernel(codes_ptr, lut_ptr, out_ptr, n, stride, seg_off, nbytes, lut_stride, lut_off,
                             GBITS: tl.constexpr, BLOCK: tl.constexpr):
        q = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = rows < n
        base = codes_ptr + rows.to(tl.int64) * stride + seg_off
        lut = lut_ptr + q.to(tl.int64) * lut_stride + lut_off
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        if GBITS == 8:
            for p in range(0, nbytes):
                c = tl.load(base + p, mask=live, other=0).to(tl.int32)
                acc += tl.load(lut + p * 256 + c, mask=live, other=0.0)
        else:  # two 3-bit codes per 6-bit group, four groups per 3-byte word; bytes past the end read 0
            for w in range(0, (nbytes + 2) // 3):
                b0 = tl.load(base + 3 * w, mask=live, other=0).to(tl.int32)
                pos = rows * 0 + 3 * w  # the byte position as a block vector (a scalar mask is not portable)
                b1 = tl.load(base + 3 * w + 1, mask=live & (pos + 1 < nbytes), other=0).to(tl.int32)
                b2 = tl.load(base + 3 * w + 2, mask=live & (pos + 2 < nbytes), other=0).to(tl.int32)
                v = b0 | (b1 << 8) | (b2 << 16)
                for g in range(4):
                    acc += tl.load(lut + w * 256 + g * 64 + ((v >> (6 * g)) & 63), mask=live, other=0.0)
        tl.store(out_ptr + q.to(tl.int64) * n + rows, acc, mask=live)


def scan_triton(codes, layout: Layout, factors, add, luts, ranges, k: int, block: int = 128, bias=None):
    """Same contract as :func:`qjl.search.scan.scan_torch`; every tensor on one device (a GPU, or
    the CPU under ``TRITON_INTERPRET=1``)."""
    if triton is None:
        raise RuntimeError("scan_triton needs triton (pip install triton)")
    check_scan_args(codes, layout, factors, add, luts, ranges, k, bias)
    n, nq = codes.shape[0], luts.shape[0]
    codes, luts = codes.contiguous(), luts.float().contiguous()
    total = torch.zeros(nq, n, device=codes.device) + (add.float() if add is not None else 0)
    part = torch.empty(nq, n, device=codes.device)
    for seg, off, f in zip(layout.segments, layout.lut_offsets, factors.float()):
        grid = (nq, triton.cdiv(n, block))
        _segment_sums_kernel[grid](codes, luts, part, n, layout.stride, seg.offset, seg.nbytes, luts.shape[1], off,
                                   GBITS=seg.gbits, BLOCK=block)
        total += part * f
    rows = torch.arange(n, device=codes.device)
    member = (rows >= ranges[..., :1]) & (rows < ranges[..., 1:])  # [nq, nr, n]
    if bias is not None:
        total = total + (member.float() * bias.float().unsqueeze(-1)).sum(1)  # ranges are disjoint
    total = torch.where(member.any(1), total, torch.tensor(-float("inf"), device=codes.device))
    return top_rows(total, k)
