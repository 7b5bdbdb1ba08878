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
from qjl.kernels.triton.jit import combine_kernel, paged_decode_kernel, quantize_kernel

__all__ = ["quantize", "paged_decode", "pack_matrix", "product_form"]

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
                 num_warps: int = 4, max_codes: int | None = None, precision: str = "auto") -> torch.Tensor:
    """The Triton backend of :func:`qjl.kernels.paged.paged_decode` (same arguments and result): split-K
    partials of the coded tokens (``paged_decode_kernel``), then one ``combine_kernel`` that merges them, applies
    the value codec's ``unmix`` and folds in the exact tokens: two launches per layer and step.  ``splits``:
    token splits per (sequence, KV head); None picks enough programs to fill the GPU (:func:`_splits`).
    ``precision``: the decode kernel's products.  ``"fma"``: fp32 products of broadcast tiles summed with ``tl.sum``
    (no ``tl.dot`` operand layouts, query rows padded to a power of two from 2 instead of 16), up to 8 query rows
    (more go through ``"ieee"``: with 16 padded rows Triton's compiler turned those sums into a TF32 ``tl.dot`` on an
    H100, 2e-3 off); ``"ieee"``: ``tl.dot`` in fp32; ``"tf32"``: ``tl.dot`` on TF32-rounded inputs (about 2e-3 of the
    output's scale); ``"auto"`` (the default): ``"fma"`` for tiles up to the measured size (:func:`product_form`),
    which on an H100 took a Llama-3-8B layer's decode from 3.86 to 2.31 ms at 128k tokens and from 14.0 to 7.5 ms
    for 8 sequences of 64k, at fp32 accuracy (``benchmarks/gpu_kernels.py --parts sweep``), else ``"ieee"``.
    ``block_n``, ``num_warps``: tuning knobs for the same sweep.  Values over K rotations in turn
    (``MixView.cycles``): K programs per split, one per accumulator, each reading every K-th code position (the
    token at position t mixed into accumulator ``t % K``), and the combine maps accumulator k back by rows
    ``[k n, (k + 1) n)`` of :func:`qjl.kernels.paged.unmix_matrix`.  Codes of a vector codebook (key terms' or
    values' ``PackedCodes.group`` g > 1, :class:`qjl.codecs.vq.TurboQuantVQ`): passed to the kernel as constexprs
    (``GRP1``, ``GRP2``, ``VGRP``), which read each group's g fields as one joint code e and coordinate c as
    ``centroids[e g + c % g]`` (g = 1: the scalar reading, compiled as before)."""
    from qjl.codecs.views import kernel_readable
    from qjl.kernels.paged import check_exact, check_paged, term_queries, views

    if not kernel_readable(key_codec, value_codec):
        raise ValueError(f"the Triton kernel does not read {type(key_codec).__name__} keys with "
                         f"{type(value_codec).__name__} values (see qjl.codecs.views.kernel_readable)")
    if max_codes is None:  # else the caller vouches for the arguments (qjl.kernels.paged.paged_decode)
        check_paged(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size, code_start,
                    code_end)
    precision = product_form(precision, q.shape[2], key_codec, value_codec)
    segments = check_exact(exact, q)
    kview, vview = views(key_codec, value_codec)
    for packed in (*(t.codes for t in kview.terms), vview.codes):
        g = packed.group
        if g > 1 and (g * packed.bits > 8 or packed.length % g or packed.centroids.numel() != (g << (g * packed.bits))):
            raise ValueError(f"the Triton kernel reads codes {g} at a time only as joint codes of at most 8 bits over "
                             f"whole groups with [2^(g bits) g] centroids: {packed.bits} bits x {g}, {packed.length} "
                             f"codes, {packed.centroids.numel()} centroids")
    b, hkv, r, d = q.shape
    dev = q.device
    bt = block_table.to(torch.int32).contiguous()
    starts, ends = code_start.to(torch.int32).contiguous(), code_end.to(torch.int32).contiguous()
    max_len = (int((ends - starts).max()) if b else 0) if max_codes is None else int(max_codes)
    cyc = vview.cycles
    if splits is None:
        splits = _splits(dev, b * hkv, max_len, block_n, cyc)
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
    # partial j: split j // cyc, accumulator j % cyc (values over cyc rotations in turn: cyc programs per split)
    m = torch.empty(b * hkv, splits * cyc, r, dtype=torch.float32, device=dev)
    l_ = torch.empty_like(m)
    o = torch.empty(b * hkv, splits * cyc, r, vview.codes.length, dtype=torch.float32, device=dev)
    bias = code_bias.float().contiguous() if code_bias is not None else m  # m: a placeholder pointer, never read
    paged_decode_kernel[(b * hkv, splits * cyc)](
        *args, *_field(vc), *_field(vs), *_field(vz), _on(vview.codes.centroids, dev), bt, starts, ends, bias,
        m, l_, o, hkv, r, bt.shape[1], int(block_size), chunk, splits, bias.shape[-1] if code_bias is not None else 0,
        terms[0].codes.length, terms[1].codes.length, vview.codes.length, vview.group_size, vview.groups,
        RP=_p2(r, 2 if precision == "fma" else 16), CP1=_p2(terms[0].codes.length),
        CP2=_p2(terms[1].codes.length), VP=_p2(vview.codes.length),
        BITS1=terms[0].codes.bits, BITS2=terms[1].codes.bits, VBITS=vview.codes.bits,
        GRP1=terms[0].codes.group, GRP2=terms[1].codes.group, VGRP=vview.codes.group, SDT=_DTYPES[vs.dtype],
        ZDT=_DTYPES[vz.dtype], SB=vs.entry_bytes // max(1, vs.shape[0] if vs.shape else 1),
        ZB=vz.entry_bytes // max(1, vz.shape[0] if vz.shape else 1), HAS2=len(kview.terms) == 2,
        HAS_ZERO=vview.zero is not None, HAS_BIAS=code_bias is not None, PER_BLOCK=bool(kview.shared),
        BLOCK_N=block_n, PREC=precision, CYC=cyc, num_warps=num_warps, **consts)
    return _combine(q, m, l_, o, value_codec, segments)


def _exact_args(segments, q: torch.Tensor) -> tuple:
    """The combine kernel's exact-token arguments: (2 x (k, 3 strides, v, 3 strides, n), bias + 4 strides,
    number of segments).  Empty segments dropped; more than two joined into one (:func:`joined_exact`); rows in
    pages gathered; a segment's last axis made contiguous."""
    from qjl.kernels.paged import PagedRows, joined_exact

    ks, vs, xb = ((), (), None) if segments is None else segments
    keep = [i for i, k in enumerate(ks) if k.shape[2] > 0]  # an empty segment holds no bias column either
    ks, vs = [ks[i] for i in keep], [vs[i] for i in keep]
    if len(ks) > 2:
        xk, xv, _ = joined_exact((tuple(ks), tuple(vs), None))
        ks, vs = [xk], [xv]
    ks = [k.gather() if isinstance(k, PagedRows) else k for k in ks]
    vs = [v.gather() if isinstance(v, PagedRows) else v for v in vs]
    seg = []
    for k, v in zip(ks, vs):
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        seg.append((k, k.stride(0), k.stride(1), k.stride(2), v, v.stride(0), v.stride(1), v.stride(2), k.shape[2]))
    nseg = len(seg)
    while len(seg) < 2:
        seg.append((q, 0, 0, 0, q, 0, 0, 0, 0))  # placeholders, never read
    if xb is None:
        bias = (q, 0, 0, 0, 0)
    else:
        xb = xb if xb.dtype == torch.float32 else xb.float()
        st = [xb.stride(i) if xb.shape[i] > 1 else 0 for i in range(4)]
        bias = (xb, *st)
    return (*seg[0], *seg[1], *bias), nseg, xb is not None


def _combine(q: torch.Tensor, m: torch.Tensor, l_: torch.Tensor, o: torch.Tensor, value_codec,
             segments) -> torch.Tensor:
    """Split-K partials + exact tokens -> the decode output, in one launch of ``combine_kernel``.

    q: [B, H_kv, R, D] (scaled); m, l: [B * H_kv, S K, R] float32, o: [B * H_kv, S K, R, NV] float32 (S splits, K
    the value view's ``cycles``, partial ``s K + k`` accumulator k of split s; NV: the value codec's mix length);
    segments: :func:`qjl.kernels.paged.check_exact`'s result.  Returns [B, H_kv, R, D] float32, equal to
    ``merge_stacked_partials`` -> ``unmix`` -> ``partial_softmax`` of the exact tokens -> ``merge_partials`` ->
    divide (:func:`qjl.kernels.reference`) within float32 rounding."""
    from qjl.kernels.paged import mix_view, unmix_matrix

    b, hkv, r, d = q.shape
    nv = o.shape[-1]
    cyc = mix_view(value_codec).cycles
    u = unmix_matrix(value_codec)
    if u is None and (nv != d or cyc > 1):
        raise ValueError(f"a value codec without an unmix matrix must mix {d} coordinates into one accumulator, got "
                         f"{cyc} x {nv} ({value_codec!r})")
    if u is not None and tuple(u.shape) != (cyc * nv, d):
        raise ValueError(f"{value_codec!r}: an unmix matrix of {cyc} x {nv} rows and {d} columns expected, got "
                         f"{tuple(u.shape)}")
    qf = q.float().contiguous()
    args, nseg, has_xb = _exact_args(segments, qf)
    out = torch.empty(b, hkv, r, d, dtype=torch.float32, device=q.device)
    dt = min(_p2(d), 64 if _p2(nv) <= 128 else 32)
    cw = _p2(nv) if u is not None else dt
    combine_kernel[(b * hkv, triton.cdiv(d, dt))](
        qf, m, l_, o, _on(u, q.device) if u is not None else m, *args, out, hkv, r, d, nv, m.shape[1] // cyc,
        RP=_p2(r), DP=_p2(d), CW=cw, DT=dt, NSEG=nseg, HAS_U=u is not None, HAS_XB=has_xb, BLOCK_X=32, SB=4, CYC=cyc)
    return out


def product_form(precision: str, rows: int, key_codec, value_codec) -> str:
    """The decode kernel's product form for :func:`paged_decode`'s ``precision`` and ``rows`` query rows per KV
    head: ``"ieee"`` and ``"tf32"`` as given; ``"auto"`` -> ``"fma"`` where its broadcast tiles stay as small as the
    measured case (padded rows x coordinates <= 4 x 128, Llama-3-8B's group of 4 at head size 128; larger tiles,
    e.g. 8 rows at 128 or 4 at 256, were tested natively but not timed), else ``"ieee"``; ``"fma"`` -> ``"fma"`` up
    to 8 rows (16 padded rows compiled into a TF32 product on an H100), else ``"ieee"``.  ValueError for another
    precision or rows that are not a positive int."""
    from qjl.kernels.paged import views

    if precision not in ("auto", "ieee", "tf32", "fma"):
        raise ValueError(f"precision must be 'auto', 'ieee', 'tf32' or 'fma', got {precision!r}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive int, got {rows!r}")
    if precision in ("ieee", "tf32"):
        return precision
    rp = _p2(rows, 2)
    kview, vview = views(key_codec, value_codec)  # (built once per codec pair)
    width = max([_p2(t.codes.length) for t in kview.terms] + [_p2(vview.codes.length)])
    if rp > 8 or (precision == "auto" and rp * width > 4 * 128):
        return "ieee"
    return "fma"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _splits(dev, programs: int, max_len: int, block_n: int, cycles: int = 1) -> int:
    """Token splits per (sequence, KV head): on CUDA enough for about 2 programs per multiprocessor in all and at
    most 2,048 tokens per split, each at least 4 blocks of ``block_n`` tokens (on an H100: more splits than that
    did not speed the decode kernel up at batch 1 and slowed the merge; fewer, longer splits slowed batch 8 by
    half: ``benchmarks/gpu_kernels.py --parts sweep``); elsewhere (the interpreter) one split per 512 tokens, at
    most 64.  With values over ``cycles`` rotations in turn every split is ``cycles`` programs, each reading every
    ``cycles``-th token: the same bounds per program (not timed on a GPU)."""
    tiles = max(1, math.ceil(max_len / (4 * block_n * cycles)))
    if dev.type == "cuda":
        sms = _sm_count(torch.cuda.current_device() if dev.index is None else dev.index)
        return max(1, min(tiles, max(math.ceil(2 * sms / max(1, programs * cycles)),
                                     math.ceil(max_len / (2048 * cycles)))))
    return max(1, min(64, max_len // (512 * cycles)))
