"""Triton kernel bodies (``@triton.jit``); their launchers, which check inputs, allocate outputs and pick
the grid, are in :mod:`qjl.kernels.triton.launch`.  Import only where Triton is installed.

* ``quantize_kernel`` -- one pass per block of vectors: (channel mask) -> norm -> (normalize) -> project
  with a dense matrix, in tiles of output coordinates -> sign or Lloyd-Max cell -> (norm correction) ->
  LSB-first packing, done as one small exact matrix product per bit plane and tile
  (``byte_j = sum_c bit_r(idx_c) 2^(c*b + r - 8j)``).
* ``paged_decode_kernel`` -- split-K decode attention over paged codes: one program per (sequence x KV
  head, token split); the query rows of the GQA group are loaded once, then per block of tokens the
  block table gives each token's page, the key codes (1 or 2 terms) are unpacked and scored against all
  rows with one product (``PREC`` below; per token when the query map differs per page), an online softmax
  is kept, and the value codes are unpacked, scaled and accumulated with ``p @ v``.  Values over K rotations in
  turn (``MixView.cycles``, constexpr ``CYC``; K = 1 compiles the plain loop): each split is K programs, program k
  walking only the positions ``t % K == k`` (tiles of tokens K apart), so one accumulator stays live and a partial
  is one rotation's accumulator; same score and value FLOPs as K = 1, K times the partials.  Codes of a vector
  codebook (``PackedCodes.group`` g > 1, constexprs ``GRP1``, ``GRP2``, ``VGRP``; g = 1 compiles the scalar
  reading): the g b-bit fields of a group are the g b contiguous bits of its joint code e, read as one field at bit
  ``(c // g) g b`` for every coordinate c of the group (one or two byte loads, as a scalar code), and c stands for
  ``centroids[e g + c % g]``.
* ``combine_kernel`` -- the rest of a decode step in one launch: one program per (sequence x KV head, tile of
  output coordinates) merges the split-K partials of ``paged_decode_kernel``, maps the merged values out of the
  value codec's mix basis (``unmix``, a matrix; with K rotations in turn one [n, DT] block of the [K n, D] matrix
  per accumulator), folds in the exact tokens (up to two segments, e.g. sinks and window, read in place in their
  dtype, with an optional additive bias) by the same online softmax, and divides.

All matrix products use ``input_precision="ieee"`` (exact fp32; the packing products must be exact), but for
``paged_decode_kernel``'s two products, whose form ``PREC`` its launcher picks: ``"fma"`` (the default up to 8
query rows: fp32 products of broadcast tiles summed with ``tl.sum`` instead of ``tl.dot``, no operand layout
conversions, the rows padded to a power of two from 2, not 16), ``"ieee"`` (``tl.dot`` in fp32; above 8 rows) or
``"tf32"`` (operands rounded to 10-bit mantissas: about 2e-3 of the output's scale; measured by
``benchmarks/gpu_kernels.py --parts sweep``, not used by the library).
"""

import triton
import triton.language as tl

__all__ = ["quantize_kernel", "paged_decode_kernel", "combine_kernel"]


@triton.jit
def quantize_kernel(x_ptr, mat_ptr, mask_ptr, bnd_ptr, cent_ptr, pm_ptr, codes_ptr, norm_ptr,
                     seq_len, D, M, NBYTES, NTILES,
                     DP: tl.constexpr, MT: tl.constexpr, NBT: tl.constexpr, NBTP: tl.constexpr, BLOCK: tl.constexpr,
                     MAT_PER_SEQ: tl.constexpr, MASK_MODE: tl.constexpr, NORMALIZE: tl.constexpr,
                     SIGN: tl.constexpr, NBND: tl.constexpr, CORRECT: tl.constexpr, BITS: tl.constexpr):
    """Projected coordinates in tiles of MT (MT * BITS a multiple of 8: a tile packs into NBT whole bytes,
    NBTP its power-of-two padding), so the matrix tile [MT, DP] stays small at any M and D."""
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
    mat_base = mat_ptr + seq * M * D if MAT_PER_SEQ else mat_ptr
    tile_outs = tl.arange(0, MT)
    nb = tl.arange(0, NBTP)
    cos = tl.zeros([BLOCK], dtype=tl.float32)
    for tile in range(0, NTILES):
        outs = tile * MT + tile_outs
        mat = tl.load(mat_base + outs[:, None] * D + cols[None, :], mask=(outs[:, None] < M) & cmask[None, :],
                      other=0.0)
        y = tl.dot(x, tl.trans(mat), input_precision="ieee")  # [BLOCK, MT]
        if SIGN:
            idx = (y >= 0).to(tl.int32)
        else:
            idx = tl.zeros([BLOCK, MT], dtype=tl.int32)
            for k in tl.static_range(NBND):
                idx += (y > tl.load(bnd_ptr + k)).to(tl.int32)
        if CORRECT:
            cos += tl.sum(tl.where((outs < M)[None, :], y * tl.load(cent_ptr + idx), 0.0), axis=1)
        idx = tl.where((outs < M)[None, :], idx, 0)
        packed = tl.zeros([BLOCK, NBTP], dtype=tl.float32)
        for r in tl.static_range(BITS):
            plane = ((idx >> r) & 1).to(tl.float32)
            pm = tl.load(pm_ptr + r * MT * NBTP + tile_outs[:, None] * NBTP + nb[None, :])
            packed += tl.dot(plane, pm, input_precision="ieee")
        byte = tile * NBT + nb
        tl.store(codes_ptr + rows[:, None] * NBYTES + byte[None, :], packed.to(tl.int32).to(tl.uint8),
                 mask=tmask[:, None] & ((nb < NBT) & (byte < NBYTES))[None, :])
    if CORRECT:
        norm = norm / tl.where(cos > 0, cos, 1.0)
    tl.store(norm_ptr + rows, norm, mask=tmask)


@triton.jit
def _scalar(base, off, DTYPE: tl.constexpr):
    """Entries of a scalar field at byte offsets ``off``, as float32 (DTYPE 0 fp32, 1 fp16, 2 bf16, 3 fp8 e4m3)."""
    if DTYPE == 0:
        p = (base + off).to(tl.pointer_type(tl.float32))
    elif DTYPE == 1:
        p = (base + off).to(tl.pointer_type(tl.float16))
    elif DTYPE == 2:
        p = (base + off).to(tl.pointer_type(tl.bfloat16))
    else:
        p = (base + off).to(tl.pointer_type(tl.float8e4nv))
    return tl.load(p).to(tl.float32)


@triton.jit
def _unpack(base, row_off, offs_c, NC, ok_t, BITS: tl.constexpr, GRP: tl.constexpr):
    """Codes [BLOCK_N, CP] (int32) of rows starting at byte offsets ``row_off`` [BLOCK_N], as centroid indices.

    GRP 1: coordinate c's BITS-bit field.  GRP g > 1 (a vector codebook): the g fields of c's group, LSB first, are
    the contiguous g * BITS bits (at most 8) at bit ``(c // g) g BITS``, so the group's joint code
    ``e = sum_s field[g (c // g) + s] << (s BITS)`` is read as one field of that width (one or two byte loads, as
    a scalar code), and c's index is ``e g + c % g`` (the centroids are [2^(g BITS) g])."""
    if GRP == 1:
        bitpos = offs_c * BITS
    else:
        bitpos = (offs_c // GRP) * (GRP * BITS)
    byte = bitpos >> 3
    sh = bitpos & 7
    ok = ok_t[:, None] & (offs_c < NC)[None, :]
    ptr = base + row_off[:, None] + byte[None, :]
    lo = tl.load(ptr, mask=ok, other=0).to(tl.int32)
    if 8 % (GRP * BITS) == 0:  # fields of 1, 2, 4, 8 bits: none straddles a byte (one load per code, not two)
        code = (lo >> sh[None, :]) & ((1 << (GRP * BITS)) - 1)
    else:
        hi = tl.load(ptr + 1, mask=ok & ((bitpos + GRP * BITS - 1) >> 3 > byte)[None, :], other=0).to(tl.int32)
        code = ((lo | (hi << 8)) >> sh[None, :]) & ((1 << (GRP * BITS)) - 1)
    if GRP > 1:
        code = code * GRP + (offs_c % GRP)[None, :]
    return code, ok


@triton.jit
def _term_scores(q_ptr, c_base, c_off, n_base, n_off, cent_ptr, q_row0, q_tok, offs_t_ok, R, NC,
                 RP: tl.constexpr, CP: tl.constexpr, BITS: tl.constexpr, GRP: tl.constexpr, NDT: tl.constexpr,
                 PER_BLOCK: tl.constexpr, PREC: tl.constexpr):
    """One key term's logits [RP, BLOCK_N]: norm[t] * sum_c q[r, c] * cent[code[t, c]] (GRP > 1: codes read GRP
    fields at a time, :func:`_unpack`)."""
    offs_r = tl.arange(0, RP)
    offs_c = tl.arange(0, CP)
    code, ok = _unpack(c_base, c_off, offs_c, NC, offs_t_ok, BITS, GRP)
    k = tl.where(ok, tl.load(cent_ptr + code), 0.0)  # [BLOCK_N, CP]
    nrm = tl.where(offs_t_ok, _scalar(n_base, tl.where(offs_t_ok, n_off, 0), NDT), 0.0)
    if PER_BLOCK:  # the query rows of each token's page, one row at a time ([BLOCK_N, CP] each)
        s = tl.zeros([RP, k.shape[0]], dtype=tl.float32)
        qm = offs_t_ok[:, None] & (offs_c[None, :] < NC)
        for r in range(0, R):
            qr = tl.load(q_ptr + q_tok[:, None] + r * NC + offs_c[None, :], mask=qm, other=0.0)
            s = tl.where(offs_r[:, None] == r, tl.sum(qr * k, axis=1)[None, :], s)
    else:
        q = tl.load(q_ptr + q_row0 + offs_r[:, None] * NC + offs_c[None, :],
                    mask=(offs_r[:, None] < R) & (offs_c[None, :] < NC), other=0.0)
        if PREC == "fma":  # plain products summed over the coordinates: no operand layouts, no padded rows
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
    return s * nrm[None, :]


@triton.jit
def _online(m_i, l_i, acc, s, v, PREC: tl.constexpr):
    """One online-softmax step: logits s [RP, n] (-inf where masked), values v [n, W] -> (m, l, acc [RP, W]);
    ``p @ v`` as ``tl.sum`` of broadcast products (PREC "fma") or ``tl.dot`` with PREC's input precision."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    if PREC == "fma":
        pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    else:
        pv = tl.dot(p, v, input_precision=PREC)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def paged_decode_kernel(q1_ptr, c1_base, c1_sb, c1_sh, c1_st, n1_base, n1_sb, n1_sh, n1_st, cent1_ptr,
                        q2_ptr, c2_base, c2_sb, c2_sh, c2_st, n2_base, n2_sb, n2_sh, n2_st, cent2_ptr,
                        vc_base, vc_sb, vc_sh, vc_st, vs_base, vs_sb, vs_sh, vs_st, vz_base, vz_sb, vz_sh, vz_st,
                        vcent_ptr, bt_ptr, start_ptr, end_ptr, bias_ptr, m_ptr, l_ptr, o_ptr,
                        H, R, MAXB, BS, CHUNK, SPLITS, BIAS_STRIDE, NC1, NC2, NV, GS, G,
                        RP: tl.constexpr, CP1: tl.constexpr, CP2: tl.constexpr, VP: tl.constexpr,
                        BITS1: tl.constexpr, BITS2: tl.constexpr, VBITS: tl.constexpr,
                        GRP1: tl.constexpr, GRP2: tl.constexpr, VGRP: tl.constexpr,
                        NDT1: tl.constexpr, NDT2: tl.constexpr, SDT: tl.constexpr, ZDT: tl.constexpr, SB: tl.constexpr, ZB: tl.constexpr,
                        HAS2: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                        PER_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, CYC: tl.constexpr):
    """Program (bh, j): the partial (m, l, acc) of split ``j // CYC``'s code positions ``[lo, hi)``; with values over
    CYC rotations in turn (CYC > 1), only its positions ``t % CYC == j % CYC`` (tiles of BLOCK_N positions CYC
    apart), so one accumulator stays live and partial j is that residue's accumulator (combine_kernel puts it in
    columns ``[(j % CYC) NV, (j % CYC + 1) NV)`` of the mixed row).  m, l [BH, SPLITS * CYC, R], o [.., R, NV]."""
    bh = tl.program_id(0)
    part = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_r = tl.arange(0, RP)
    offs_v = tl.arange(0, VP)
    m_i = tl.full([RP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([RP], dtype=tl.float32)
    acc = tl.zeros([RP, VP], dtype=tl.float32)
    s0 = tl.load(start_ptr + b)
    s1 = tl.load(end_ptr + b)
    if CYC == 1:
        lo = s0 + part * CHUNK
        hi = tl.minimum(lo + CHUNK, s1)
    else:  # from the split's first position in this residue class (base >= 0: no negative remainders)
        base = s0 + (part // CYC) * CHUNK
        hi = tl.minimum(base + CHUNK, s1)
        lo = base + (part % CYC + CYC - base % CYC) % CYC
    QB = MAXB if PER_BLOCK else 1
    for start in range(lo, hi, BLOCK_N * CYC):
        if CYC == 1:
            offs_t = start + tl.arange(0, BLOCK_N)
        else:
            offs_t = start + tl.arange(0, BLOCK_N) * CYC
        ok_t = offs_t < hi
        col = tl.where(ok_t, offs_t // BS, 0)
        blk = tl.load(bt_ptr + b * MAXB + col, mask=ok_t, other=0).to(tl.int64)
        slot = (offs_t % BS).to(tl.int64)
        q_tok = ((b * QB + col).to(tl.int64) * H + h) * R
        q_row0 = (b * H + h).to(tl.int64) * R
        s = _term_scores(q1_ptr, c1_base, blk * c1_sb + h * c1_sh + slot * c1_st, n1_base,
                         blk * n1_sb + h * n1_sh + slot * n1_st, cent1_ptr, q_row0 * NC1, q_tok * NC1, ok_t, R, NC1,
                         RP, CP1, BITS1, GRP1, NDT1, PER_BLOCK, PREC)
        if HAS2:
            s += _term_scores(q2_ptr, c2_base, blk * c2_sb + h * c2_sh + slot * c2_st, n2_base,
                              blk * n2_sb + h * n2_sh + slot * n2_st, cent2_ptr, q_row0 * NC2, q_tok * NC2, ok_t, R,
                              NC2, RP, CP2, BITS2, GRP2, NDT2, PER_BLOCK, PREC)
        if HAS_BIAS:
            s += tl.load(bias_ptr + b * BIAS_STRIDE + offs_t, mask=ok_t, other=0.0)[None, :]
        s = tl.where(ok_t[None, :], s, float("-inf"))
        code, ok = _unpack(vc_base, blk * vc_sb + h * vc_sh + slot * vc_st, offs_v, NV, ok_t, VBITS, VGRP)
        grp = offs_v // GS
        s_off = (blk * vs_sb + h * vs_sh + slot * vs_st)[:, None] + grp[None, :] * SB
        scale = tl.where(ok, _scalar(vs_base, tl.where(ok, s_off, 0), SDT), 0.0)
        v = tl.where(ok, tl.load(vcent_ptr + code), 0.0) * scale
        if HAS_ZERO:
            z_off = (blk * vz_sb + h * vz_sh + slot * vz_st)[:, None] + grp[None, :] * ZB
            v += tl.where(ok, _scalar(vz_base, tl.where(ok, z_off, 0), ZDT), 0.0)
        m_i, l_i, acc = _online(m_i, l_i, acc, s, v, PREC)
    out = (bh * SPLITS * CYC + part) * R + offs_r
    rmask = offs_r < R
    tl.store(m_ptr + out, m_i, mask=rmask)
    tl.store(l_ptr + out, l_i, mask=rmask)
    tl.store(o_ptr + out[:, None] * NV + offs_v[None, :], acc, mask=rmask[:, None] & (offs_v < NV)[None, :])




@triton.jit
def _exact_segment(m_i, l_i, acc, q, k_ptr, v_ptr, k_off, v_off, k_st, v_st, N, xb_ptr, xb_off, xb_sr, xb_sn, X0,
                   offs_r, rmask, offs_d, dmask, offs_o, omask, HAS_XB: tl.constexpr, BLOCK_X: tl.constexpr):
    """Fold one exact segment of N tokens into the running (m, l, acc): keys and values [N, D] at element offsets
    k_off / v_off with token strides k_st / v_st (the coordinate stride 1), bias columns X0 + t."""
    for t0 in range(0, N, BLOCK_X):
        offs_t = t0 + tl.arange(0, BLOCK_X)
        tm = offs_t < N
        k = tl.load(k_ptr + k_off + offs_t[:, None] * k_st + offs_d[None, :], mask=tm[:, None] & dmask[None, :],
                    other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [RP, BLOCK_X]
        if HAS_XB:
            s += tl.load(xb_ptr + xb_off + offs_r[:, None] * xb_sr + (X0 + offs_t)[None, :] * xb_sn,
                         mask=rmask[:, None] & tm[None, :], other=0.0)
        s = tl.where(tm[None, :], s, float("-inf"))
        v = tl.load(v_ptr + v_off + offs_t[:, None] * v_st + offs_o[None, :], mask=tm[:, None] & omask[None, :],
                    other=0.0).to(tl.float32)
        m_i, l_i, acc = _online(m_i, l_i, acc, s, v, "ieee")
    return m_i, l_i, acc


@triton.jit
def _merged(m_ptr, l_ptr, o_ptr, bh, k, R, NV, SPLITS, m_safe, offs_r, rmask, cols, cmask,
            RP: tl.constexpr, CW: tl.constexpr, SB: tl.constexpr, CYC: tl.constexpr):
    """Accumulator k's split-K partials (rows ``s CYC + k`` of m, l [BH, SPLITS CYC, R] and o [.., R, NV]),
    weighted by ``exp(m - m_safe)`` and summed over the splits, SB at a time (independent loads) -> (l [RP],
    o [RP, CW] at columns ``cols``)."""
    offs_s = tl.arange(0, SB)
    l_i = tl.zeros([RP], dtype=tl.float32)
    o = tl.zeros([RP, CW], dtype=tl.float32)
    for s0 in range(0, SPLITS, SB):
        sm = (s0 + offs_s) < SPLITS
        if CYC == 1:
            row = ((bh * SPLITS + s0 + offs_s) * R)[:, None] + offs_r[None, :]  # [SB, RP]
        else:
            row = (((bh * SPLITS + s0 + offs_s) * CYC + k) * R)[:, None] + offs_r[None, :]
        ok = sm[:, None] & rmask[None, :]
        w = tl.exp(tl.load(m_ptr + row, mask=ok, other=float("-inf")) - m_safe[None, :])
        l_i += tl.sum(w * tl.load(l_ptr + row, mask=ok, other=0.0), axis=0)
        o_s = tl.load(o_ptr + row[:, :, None] * NV + cols[None, None, :],
                      mask=ok[:, :, None] & cmask[None, None, :], other=0.0)  # [SB, RP, CW]
        o += tl.sum(w[:, :, None] * o_s, axis=0)
    return l_i, o


@triton.jit
def combine_kernel(q_ptr, m_ptr, l_ptr, o_ptr, u_ptr,
                   k1_ptr, k1_sb, k1_sh, k1_st, v1_ptr, v1_sb, v1_sh, v1_st, N1,
                   k2_ptr, k2_sb, k2_sh, k2_st, v2_ptr, v2_sb, v2_sh, v2_st, N2,
                   xb_ptr, xb_sb, xb_sh, xb_sr, xb_sn, out_ptr, H, R, D, NV, SPLITS,
                   RP: tl.constexpr, DP: tl.constexpr, CW: tl.constexpr, DT: tl.constexpr, NSEG: tl.constexpr,
                   HAS_U: tl.constexpr, HAS_XB: tl.constexpr, BLOCK_X: tl.constexpr, SB: tl.constexpr,
                   CYC: tl.constexpr):
    """out[bh, r, o] for the DT output coordinates of program (bh, tile): the coded partials m, l [BH, SPLITS, R]
    and o [BH, SPLITS, R, NV] merged, ``o @ U`` (U [NV, D]; without U, NV == D and o is read at the tile's
    columns: CW == DT), the exact tokens folded in, divided by the softmax sum.  q [BH, R, D] float32 (scaled).
    With values over CYC > 1 rotations in turn (U required): partials [BH, SPLITS CYC, ...], accumulator k's
    (rows ``s CYC + k``) merged and mapped back by its rows ``[k NV, (k + 1) NV)`` of U [CYC NV, D], one at a time
    (a [CW, DT] tile of U live, as for CYC = 1)."""
    bh = tl.program_id(0)
    tile = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_r = tl.arange(0, RP)
    rmask = offs_r < R
    offs_o = tile * DT + tl.arange(0, DT)
    omask = offs_o < D
    if HAS_U:
        cols = tl.arange(0, CW)
    else:
        cols = tile * DT + tl.arange(0, CW)
    cmask = cols < NV
    # the split-K partials: the maximum first, then the weighted sums (_merged)
    offs_s = tl.arange(0, SB)
    m_i = tl.full([RP], float("-inf"), dtype=tl.float32)
    for s0 in range(0, SPLITS * CYC, SB):
        sm = (s0 + offs_s) < SPLITS * CYC
        ms = tl.load(m_ptr + ((bh * SPLITS * CYC + s0 + offs_s) * R)[:, None] + offs_r[None, :],
                     mask=sm[:, None] & rmask[None, :], other=float("-inf"))
        m_i = tl.maximum(m_i, tl.max(ms, axis=0))
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    if CYC == 1:
        l_i, o = _merged(m_ptr, l_ptr, o_ptr, bh, 0, R, NV, SPLITS, m_safe, offs_r, rmask, cols, cmask, RP, CW, SB,
                         CYC)
        if HAS_U:
            u = tl.load(u_ptr + cols[:, None] * D + offs_o[None, :], mask=cmask[:, None] & omask[None, :],
                        other=0.0)
            acc = tl.dot(o, u, input_precision="ieee")  # [RP, DT]
        else:
            acc = o
    else:
        l_i = tl.zeros([RP], dtype=tl.float32)
        acc = tl.zeros([RP, DT], dtype=tl.float32)
        for k in range(0, CYC):
            l_k, o = _merged(m_ptr, l_ptr, o_ptr, bh, k, R, NV, SPLITS, m_safe, offs_r, rmask, cols, cmask, RP, CW,
                             SB, CYC)
            l_i += l_k
            u = tl.load(u_ptr + (k * NV + cols)[:, None] * D + offs_o[None, :], mask=cmask[:, None] & omask[None, :],
                        other=0.0)
            acc += tl.dot(o, u, input_precision="ieee")
    if NSEG > 0:
        offs_d = tl.arange(0, DP)
        dmask = offs_d < D
        q = tl.load(q_ptr + (bh * R + offs_r)[:, None] * D + offs_d[None, :], mask=rmask[:, None] & dmask[None, :],
                    other=0.0)
        xb_off = b * xb_sb + h * xb_sh
        m_i, l_i, acc = _exact_segment(m_i, l_i, acc, q, k1_ptr, v1_ptr, b * k1_sb + h * k1_sh,
                                       b * v1_sb + h * v1_sh, k1_st, v1_st, N1, xb_ptr, xb_off, xb_sr, xb_sn, 0,
                                       offs_r, rmask, offs_d, dmask, offs_o, omask, HAS_XB, BLOCK_X)
        if NSEG > 1:
            m_i, l_i, acc = _exact_segment(m_i, l_i, acc, q, k2_ptr, v2_ptr, b * k2_sb + h * k2_sh,
                                           b * v2_sb + h * v2_sh, k2_st, v2_st, N2, xb_ptr, xb_off, xb_sr, xb_sn,
                                           N1, offs_r, rmask, offs_d, dmask, offs_o, omask, HAS_XB, BLOCK_X)
    out = acc / tl.where(rmask, l_i, 1.0)[:, None]  # a valid row without tokens: 0 / 0 = NaN, as the reference
    tl.store(out_ptr + (bh * R + offs_r)[:, None] * D + offs_o[None, :], out, mask=rmask[:, None] & omask[None, :])
