"""Launchers of the Triton kernels (:mod:`qjl.kernels.triton.jit`): check inputs, allocate outputs, pick
the grid.  The references: ``codec.quantize`` for :func:`quantize`, and
:func:`qjl.kernels.reference.paged_decode_reference` for :func:`paged_decode` (tested through
``TRITON_INTERPRET=1`` on the CPU).  Import only where Triton is installed.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from qjl.core.devices import on_device
from qjl.kernels.triton.jit import paged_decode_kernel, quantize_kernel

__all__ = ["quantize", "paged_decode", "pack_matrix"]

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}


def _on(t: torch.Tensor, device) -> torch.Tensor:
    """A codec constant as contiguous float32 on ``device`` (copied there once: :func:`qjl.core.devices.on_device`)."""
    return on_device(t, device).float().contiguous()


def _p2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


@functools.lru_cache(maxsize=None)
def _pack_matrix_cpu(n: int, bits: int) -> torch.Tensor:
    nbytes = (n * bits + 7) // 8
    m = torch.zeros(bits, _p2(n), _p2(nbytes))
    for c in range(n):
        for r in range(bits):
            pos = c * bits + r
            m[r, c, pos // 8] = float(1 << (pos % 8))
    return m


def pack_matrix(n: int, bits: int, device) -> torch.Tensor:
    """[bits, NP, NBP] float32: ``byte_j = sum_r sum_c bit_r(idx_c) * M[r, c, j]`` (LSB-first packing)."""
    return on_device(_pack_matrix_cpu(n, bits), device)


def quantize(x: torch.Tensor, matrix: torch.Tensor, bits: int, *, sign: bool = False, boundaries=None,
             normalize: bool = False, centroids=None, correct_norm: bool = False, channel_mask=None,
             mask_mode: int = 0, block: int = 16):
    """Project, bucket and pack, one pass per block of vectors.

    x: [S, T, D] (any float dtype); matrix: [M, D] or [S, M, D] float32 (per sequence);
    sign: 1-bit codes ``y >= 0`` (QJL) instead of ``boundaries`` ([2^bits - 1] float32, bucket =
    number of boundaries below y, as ``torch.bucketize``); channel_mask: [S, D] float 0/1 with
    ``mask_mode`` 1 (keep masked channels) or 2 (keep the complement).
    Returns codes [S, T, ceil(M*bits/8)] uint8 and norms [S, T] float32.
    """
    s, t, d = x.shape
    per_seq = matrix.ndim == 3
    m = matrix.shape[-2]
    nbytes = (m * bits + 7) // 8
    codes = torch.empty(s, t, nbytes, dtype=torch.uint8, device=x.device)
    norms = torch.empty(s, t, dtype=torch.float32, device=x.device)
    dummy = torch.zeros(1, dtype=torch.float32, device=x.device)
    bnd = _on(boundaries, x.device) if boundaries is not None else dummy
    cent = _on(centroids, x.device) if centroids is not None else dummy
    mask = channel_mask.float().contiguous() if channel_mask is not None else dummy
    grid = (s, triton.cdiv(t, block))
    # output coordinates in tiles of mt (a [mt, DP] fp32 matrix tile of at most 16 KiB; mt >= 16, so a tile's
    # mt * bits codes fill whole bytes), each packed with the same [bits, mt, NBTP] matrix; one pipeline stage:
    # at 5 bits and d = 128 the default stages asked an H100 for 246 KB of shared memory (it has 227 KB)
    mt = min(_p2(m), max(16, 4096 // _p2(d)))
    nbt = mt * bits // 8
    quantize_kernel[grid](x.contiguous(), matrix.float().contiguous(), mask, bnd, cent,
                           pack_matrix(mt, bits, x.device), codes, norms, t, d, m, nbytes, triton.cdiv(m, mt),
                           DP=_p2(d), MT=mt, NBT=nbt, NBTP=_p2(nbt), BLOCK=block, MAT_PER_SEQ=per_seq,
                           MASK_MODE=mask_mode if channel_mask is not None else 0, NORMALIZE=normalize,
                           SIGN=sign, NBND=0 if sign else bnd.numel(), CORRECT=correct_norm, BITS=bits,
                           num_stages=1)
    return codes, norms



def _field(f):
    """(uint8 base tensor, stride_block, stride_head, stride_token) of a PagedField."""
    raw = f.raw_bytes()[f.offset:]
    return raw, f.stride_block, f.stride_head, f.stride_token


def paged_decode(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size, code_start, code_end,
                 *, exact=None, code_bias=None, block_n: int = 16, splits: int | None = None,
                 num_warps: int = 4, max_codes: int | None = None) -> torch.Tensor:
    """The Triton backend of :func:`qjl.kernels.paged.paged_decode` (same arguments and result): split-K
    partials of the coded tokens, merged in torch with the exact tokens' partial; then the value codec's
    ``unmix`` once per row."""
    from qjl.codecs.views import kernel_readable
    from qjl.kernels.paged import check_exact, check_paged, joined_exact, term_queries
    from qjl.kernels.reference import merge_stacked_partials, partial_softmax

    if not kernel_readable(key_codec, value_codec):
        raise ValueError(f"the Triton kernel does not read {type(key_codec).__name__} keys with "
                         f"{type(value_codec).__name__} values (see qjl.codecs.views.kernel_readable)")
    if max_codes is None:  # else the caller vouches for the arguments (qjl.kernels.paged.paged_decode)
        check_paged(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size, code_start,
                    code_end)
    exact = joined_exact(check_exact(exact, q))
    kview, vview = key_codec.score_view(), value_codec.mix_view()
    b, hkv, r, d = q.shape
    dev = q.device
    bt = block_table.to(torch.int32).contiguous()
    starts, ends = code_start.to(torch.int32).contiguous(), code_end.to(torch.int32).contiguous()
    max_len = (int((ends - starts).max()) if b else 0) if max_codes is None else int(max_codes)
    if splits is None:
        splits = max(1, min(64, max_len // 512))
    chunk = max(block_n, math.ceil(math.ceil(max(max_len, 1) / splits) / block_n) * block_n)
    splits = max(1, math.ceil(max(max_len, 1) / chunk))
    qts = [qt.float().contiguous() for qt in term_queries(q, key_codec, key_fields, bt)]
    terms = list(kview.terms)
    if len(terms) == 1:
        terms, qts = terms * 2, qts * 2
    args, consts = [], {}
    for i, (term, qt) in enumerate(zip(terms[:2], qts[:2])):
        c, n = key_fields[term.codes.field], key_fields[term.norm]
        args += [qt, *_field(c), *_field(n), _on(term.codes.centroids, dev)]
        consts[f"NDT{i + 1}"] = _DTYPES[n.dtype]
    vc, vs = value_fields[vview.codes.field], value_fields[vview.scale]
    vz = value_fields[vview.zero] if vview.zero else vs
    for f in (vs, vz, *(key_fields[t.norm] for t in kview.terms)):
        if f.dtype not in _DTYPES:
            raise ValueError(f"a norm/scale field stored as {f.dtype} is not read by the Triton kernel")
    m = torch.empty(b * hkv, splits, r, dtype=torch.float32, device=dev)
    l_ = torch.empty_like(m)
    o = torch.empty(b * hkv, splits, r, vview.codes.length, dtype=torch.float32, device=dev)
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    bias = code_bias.float().contiguous() if code_bias is not None else dummy
    paged_decode_kernel[(b * hkv, splits)](
        *args, *_field(vc), *_field(vs), *_field(vz), _on(vview.codes.centroids, dev), bt, starts, ends, bias,
        m, l_, o, hkv, r, bt.shape[1], int(block_size), chunk, splits, bias.shape[-1] if code_bias is not None else 0,
        terms[0].codes.length, terms[1].codes.length, vview.codes.length, vview.group_size, vview.groups,
        RP=_p2(r), CP1=_p2(terms[0].codes.length), CP2=_p2(terms[1].codes.length), VP=_p2(vview.codes.length),
        BITS1=terms[0].codes.bits, BITS2=terms[1].codes.bits, VBITS=vview.codes.bits, SDT=_DTYPES[vs.dtype],
        ZDT=_DTYPES[vz.dtype], SB=vs.entry_bytes // max(1, vs.shape[0] if vs.shape else 1), ZB=vz.entry_bytes // max(1, vz.shape[0] if vz.shape else 1), HAS2=len(kview.terms) == 2, HAS_ZERO=vview.zero is not None,
        HAS_BIAS=code_bias is not None, PER_BLOCK=bool(kview.shared), BLOCK_N=block_n, num_warps=num_warps, **consts)
    m_c, l_c, o_c = merge_stacked_partials(m, l_, o, dim=1) if splits > 1 else (m[:, 0], l_[:, 0], o[:, 0])
    m_c, l_c = m_c.reshape(b, hkv, r), l_c.reshape(b, hkv, r)
    o_c = o_c.reshape(b, hkv, r, -1)
    if exact is None or exact[0].shape[2] == 0:
        return value_codec.unmix(o_c) / l_c.unsqueeze(-1)
    xk, xv, xb = exact
    s = q.float() @ xk.float().transpose(-1, -2)
    if xb is not None:
        s = s + xb.float()
    m_x, l_x, o_x = partial_softmax(s, xv)
    mx = torch.maximum(m_c, m_x)
    safe = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    wc, wx = torch.exp(m_c - safe), torch.exp(m_x - safe)
    out = wc.unsqueeze(-1) * value_codec.unmix(o_c) + wx.unsqueeze(-1) * o_x
    return out / (wc * l_c + wx * l_x).unsqueeze(-1)
