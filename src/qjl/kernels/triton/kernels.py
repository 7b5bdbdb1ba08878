"""Triton kernels: quantize keys/values into packed codes, and decode attention over them.

Both mirror the plain-PyTorch code they replace and are tested against it (on the CPU
through ``TRITON_INTERPRET=1``):

* :func:`quantize` -- one pass per vector block: (mask) -> norm -> (normalize) -> project
  with a dense matrix (the QJL sketch ``S``, or TurboQuant's rotation ``Pi``) -> sign or
  Lloyd-Max bucket -> (norm correction) -> dense LSB-first bit packing, done as one small
  exact matrix product per bit plane (``byte_j = sum_c bit_r(idx_c) 2^(c*b + r - 8j)``).
  The reference is ``QJLSketch.quantize`` / ``OutlierQJL.quantize`` / ``TurboQuantMSE.quantize``.
* :func:`decode_partial` -- split-K decode attention over the codes described in
  :mod:`qjl.kernels.plan`: each program owns one (sequence x KV head, token split); it loads
  the query rows of the whole GQA group once, then for each block of tokens unpacks the
  key codes (1 or 2 parts), scores all rows with one ``tl.dot``, keeps an online softmax,
  unpacks the value codes, scales them on the fly and accumulates ``p @ v``.  The partials
  are merged by :func:`qjl.kernels.plan.merge_partials`.  The reference is
  :func:`qjl.kernels.plan.reference_partial`.

All matrix products use ``input_precision="ieee"`` (exact fp32; the packing products
must be exact).  Import this module only where Triton is installed.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from qjl.kernels.plan import KeyPart, ValuePart, merge_partials

__all__ = ["quantize", "decode_partial", "pack_matrix"]


def _p2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


# ---------------------------------------------------------------------------------------------
# quantize
# ---------------------------------------------------------------------------------------------
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
    return _pack_matrix_cpu(n, bits).to(device)


@triton.jit
def _quantize_kernel(x_ptr, mat_ptr, mask_ptr, bnd_ptr, cent_ptr, pm_ptr, codes_ptr, norm_ptr,
                     seq_len, D, M, NBYTES,
                     DP: tl.constexpr, MP: tl.constexpr, NBP: tl.constexpr, BLOCK: tl.constexpr,
                     MAT_PER_SEQ: tl.constexpr, MASK_MODE: tl.constexpr, NORMALIZE: tl.constexpr,
                     SIGN: tl.constexpr, NBND: tl.constexpr, CORRECT: tl.constexpr, BITS: tl.constexpr):
    seq = tl.program_id(0)
    tok = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tmask = tok < seq_len
    rows = seq * seq_len + tok
    cols = tl.arange(0, DP)
    cmask = cols < D
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=tmask[:, None] & cmask[None, :], other=0.0)
    x = x.to(tl.float32)
    if MASK_MODE != 0:  # 1: keep the mask's channels (inliers), 2: keep the others (outliers)
        keep = tl.load(mask_ptr + seq * D + cols, mask=cmask, other=0.0)
        if MASK_MODE == 2:
            keep = 1.0 - keep
        x = x * keep[None, :]
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    if NORMALIZE:
        x = x / tl.where(norm > 0, norm, 1.0)[:, None]
    outs = tl.arange(0, MP)
    mat_base = mat_ptr + seq * M * D if MAT_PER_SEQ else mat_ptr
    mat = tl.load(mat_base + outs[:, None] * D + cols[None, :], mask=(outs[:, None] < M) & cmask[None, :], other=0.0)
    y = tl.dot(x, tl.trans(mat), input_precision="ieee")  # [BLOCK, MP]
    if SIGN:
        idx = (y >= 0).to(tl.int32)
    else:
        idx = tl.zeros([BLOCK, MP], dtype=tl.int32)
        for k in tl.static_range(NBND):
            idx += (y > tl.load(bnd_ptr + k)).to(tl.int32)
    if CORRECT:
        cos = tl.sum(tl.where((outs < M)[None, :], y * tl.load(cent_ptr + idx), 0.0), axis=1)
        norm = norm / tl.where(cos > 0, cos, 1.0)
    idx = tl.where((outs < M)[None, :], idx, 0)
    nb = tl.arange(0, NBP)
    packed = tl.zeros([BLOCK, NBP], dtype=tl.float32)
    for r in tl.static_range(BITS):
        plane = ((idx >> r) & 1).to(tl.float32)
        pm = tl.load(pm_ptr + r * MP * NBP + outs[:, None] * NBP + nb[None, :])
        packed += tl.dot(plane, pm, input_precision="ieee")
    tl.store(codes_ptr + rows[:, None] * NBYTES + nb[None, :], packed.to(tl.int32).to(tl.uint8),
             mask=tmask[:, None] & (nb < NBYTES)[None, :])
    tl.store(norm_ptr + rows, norm, mask=tmask)


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
    bnd = boundaries.float().contiguous() if boundaries is not None else dummy
    cent = centroids.float().contiguous() if centroids is not None else dummy
    mask = channel_mask.float().contiguous() if channel_mask is not None else dummy
    grid = (s, triton.cdiv(t, block))
    _quantize_kernel[grid](x.contiguous(), matrix.float().contiguous(), mask, bnd, cent,
                           pack_matrix(m, bits, x.device), codes, norms, t, d, m, nbytes,
                           DP=_p2(d), MP=_p2(m), NBP=_p2(nbytes), BLOCK=block, MAT_PER_SEQ=per_seq,
                           MASK_MODE=mask_mode if channel_mask is not None else 0, NORMALIZE=normalize,
                           SIGN=sign, NBND=0 if sign else bnd.numel(), CORRECT=correct_norm, BITS=bits)
    return codes, norms


# ---------------------------------------------------------------------------------------------
# decode attention
# ---------------------------------------------------------------------------------------------
@triton.jit
def _unpack(base, offs_t, offs_c, NB, NC, tmask, BITS: tl.constexpr):
    """b-bit codes [BLOCK_N, CP] (int32) of tokens ``offs_t`` from rows of NB packed bytes."""
    bitpos = offs_c * BITS
    byte = bitpos >> 3
    sh = bitpos & 7
    ok = tmask[:, None] & (offs_c < NC)[None, :]
    ptr = base + offs_t[:, None] * NB + byte[None, :]
    lo = tl.load(ptr, mask=ok, other=0).to(tl.int32)
    hi = tl.load(ptr + 1, mask=ok & ((byte + 1) < NB)[None, :], other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> sh[None, :]) & ((1 << BITS) - 1), ok


@triton.jit
def _key_scores(q_ptr, c_ptr, cent_ptr, nrm_ptr, bh, offs_t, tmask, R, N, NC, NB,
                RP: tl.constexpr, CP: tl.constexpr, BITS: tl.constexpr):
    offs_r = tl.arange(0, RP)
    offs_c = tl.arange(0, CP)
    q = tl.load(q_ptr + bh * R * NC + offs_r[:, None] * NC + offs_c[None, :],
                mask=(offs_r[:, None] < R) & (offs_c[None, :] < NC), other=0.0)
    code, ok = _unpack(c_ptr + bh * N * NB, offs_t, offs_c, NB, NC, tmask, BITS)
    k = tl.where(ok, tl.load(cent_ptr + code), 0.0)  # [BLOCK_N, CP]
    nrm = tl.load(nrm_ptr + bh * N + offs_t, mask=tmask, other=0.0)
    return tl.dot(q, tl.trans(k), input_precision="ieee") * nrm[None, :]


@triton.jit
def _decode_kernel(q1_ptr, c1_ptr, cent1_ptr, n1_ptr, q2_ptr, c2_ptr, cent2_ptr, n2_ptr,
                   vc_ptr, vcent_ptr, vs_ptr, vz_ptr, bias_ptr, m_ptr, l_ptr, o_ptr,
                   R, N, heads, chunk, NC1, NB1, NC2, NB2, NV, NBV, GS, G, SPLITS,
                   RP: tl.constexpr, CP1: tl.constexpr, CP2: tl.constexpr, VP: tl.constexpr,
                   BITS1: tl.constexpr, BITS2: tl.constexpr, VBITS: tl.constexpr, HAS2: tl.constexpr,
                   HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    offs_r = tl.arange(0, RP)
    offs_v = tl.arange(0, VP)
    m_i = tl.full([RP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([RP], dtype=tl.float32)
    acc = tl.zeros([RP, VP], dtype=tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, N)
    for start in range(lo, hi, BLOCK_N):
        offs_t = start + tl.arange(0, BLOCK_N)
        tmask = offs_t < hi
        s = _key_scores(q1_ptr, c1_ptr, cent1_ptr, n1_ptr, bh, offs_t, tmask, R, N, NC1, NB1, RP, CP1, BITS1)
        if HAS2:
            s += _key_scores(q2_ptr, c2_ptr, cent2_ptr, n2_ptr, bh, offs_t, tmask, R, N, NC2, NB2, RP, CP2, BITS2)
        if HAS_BIAS:
            s += tl.load(bias_ptr + (bh // heads) * N + offs_t, mask=tmask, other=0.0)[None, :]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        code, ok = _unpack(vc_ptr + bh * N * NBV, offs_t, offs_v, NBV, NV, tmask, VBITS)
        grp = offs_v // GS
        scale = tl.load(vs_ptr + bh * N * G + offs_t[:, None] * G + grp[None, :], mask=ok, other=0.0)
        v = tl.where(ok, tl.load(vcent_ptr + code), 0.0) * scale
        if HAS_ZERO:
            v += tl.load(vz_ptr + bh * N * G + offs_t[:, None] * G + grp[None, :], mask=ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = (bh * SPLITS + split) * R + offs_r
    rmask = offs_r < R
    tl.store(m_ptr + out, m_i, mask=rmask)
    tl.store(l_ptr + out, l_i, mask=rmask)
    tl.store(o_ptr + out[:, None] * NV + offs_v[None, :], acc, mask=rmask[:, None] & (offs_v < NV)[None, :])


def decode_partial(parts: list[KeyPart], vp: ValuePart, bias: torch.Tensor | None = None, block_n: int = 16,
                   splits: int | None = None):
    """Partial softmax of the code part, split-K (see :mod:`qjl.kernels.plan`).

    bias: [B, N] additive or None.  Returns m, l: [BH, R]; o: [BH, R, n_v] float32.
    """
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"the Triton kernel takes 1 or 2 key parts, got {len(parts)}")
    p1 = parts[0]
    p2 = parts[1] if len(parts) == 2 else parts[0]
    bh, n_tok = p1.norm.shape
    r = p1.q.shape[1]
    dev = p1.q.device
    if splits is None:
        splits = max(1, min(64, n_tok // 512))
    chunk = math.ceil(math.ceil(n_tok / splits) / block_n) * block_n
    splits = max(1, math.ceil(n_tok / chunk))
    m = torch.empty(bh, splits, r, dtype=torch.float32, device=dev)
    l_ = torch.empty_like(m)
    o = torch.empty(bh, splits, r, vp.n, dtype=torch.float32, device=dev)
    heads = bh // (bias.shape[0] if bias is not None else 1)
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    f32 = lambda t: t.float().contiguous()  # noqa: E731
    _decode_kernel[(bh, splits)](
        f32(p1.q), p1.codes.contiguous(), f32(p1.cent), f32(p1.norm),
        f32(p2.q), p2.codes.contiguous(), f32(p2.cent), f32(p2.norm),
        vp.codes.contiguous(), f32(vp.cent), f32(vp.scale), f32(vp.zero) if vp.zero is not None else dummy,
        f32(bias) if bias is not None else dummy, m, l_, o,
        r, n_tok, heads, chunk, p1.n, p1.codes.shape[-1], p2.n, p2.codes.shape[-1],
        vp.n, vp.codes.shape[-1], vp.group_size, vp.scale.shape[-1], splits,
        RP=_p2(r), CP1=_p2(p1.n), CP2=_p2(p2.n), VP=_p2(vp.n), BITS1=p1.bits, BITS2=p2.bits, VBITS=vp.bits,
        HAS2=len(parts) == 2, HAS_ZERO=vp.zero is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n)
    if splits == 1:
        return m[:, 0], l_[:, 0], o[:, 0]
    return merge_partials([(m[:, i], l_[:, i], o[:, i]) for i in range(splits)])
