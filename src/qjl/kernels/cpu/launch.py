"""CPU decode attention over packed codes (numba, multi-threaded, compiled once per code widths).

Reads the packed codes directly through lookup tables, never a ±1 or float key matrix:

* keys: the codes of ``g = 8 // bits`` consecutive coordinates form one index of
  ``g * bits`` bits (a byte of 8 QJL signs, four 2-bit, two 3- or 4-bit codes); per
  (sequence, KV head) a table ``T[i, v, r] = sum_j qp[r, i*g+j] * cent[code_j(v)]``
  holds every query row of the GQA group, so one read of a token's codes scores all
  of them with ``n / g`` table lookups;
* values: the softmax weights are scattered into a histogram ``H[i, v, r] += w[r] * scale``
  over the same indices, expanded once at the end (``sum_v H[i, v, r] * cent[code_j(v)]``),
  plus the zero points' sum -- again one read of the codes per token for all rows.

Work is split over (sequence x KV head, row chunk, token block) with ``numba.prange``; the
blocks' partial softmaxes are merged inside the kernel.  The kernel is compiled with the
code widths as constants on first use (a few seconds, once per process and width triple),
never inside the decode loop.  Measured speed and its limits: README ("Kernels").

:func:`bucket_pack` is the CPU half of TurboQuant quantization (cell search + packing).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from qjl.kernels.plan import KeyPart, ValuePart, check_exact, merge_apart, partial_exact

__all__ = ["available", "decode_partial", "fits", "bucket_pack", "RW"]

try:
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover - numba is a dependency; kept optional for odd platforms
    numba = None

# reassociation etc., but not "no infs/NaNs": masked logits are -inf
_FASTMATH = {"nsz", "arcp", "contract", "reassoc", "afn"}
_MIN_BLOCK = 512  # tokens per work item at least (table building amortizes over them)


def available() -> bool:
    return numba is not None


RW = 4  # query rows per table entry (one 128-bit vector of float32); more rows run in chunks of RW


def _layout(bits: int):
    """How b-bit codes are read: chunks of ``bits`` bytes = 8 codes = ``per_chunk`` fields of ``width`` bits.

    Each field indexes one table entry; it holds ``g = 8 // bits`` codes (a byte of QJL
    signs, four 2-bit, two 3- or 4-bit, or one 5- to 8-bit code).
    """
    g = 8 // bits
    return g, g * bits, 8 // g


@functools.lru_cache(maxsize=None)
def _compile(kbits1: int, kbits2: int, vbits: int):
    """The decode kernel with the code widths baked in as constants, compiled once per triple.

    LLVM's loop vectorizer turns the table lookups into slow gathers, so it is switched off while
    these functions compile (a dummy call compiles them eagerly); the per-row sums stay scalar.
    """
    saved = numba.config.LOOP_VECTORIZE
    numba.config.LOOP_VECTORIZE = False
    try:
        decode = _build(kbits1, kbits2, vbits)
        _warm_up(decode, kbits1, kbits2, vbits)
    finally:
        numba.config.LOOP_VECTORIZE = saved
    return decode


def _warm_up(decode, kbits1, kbits2, vbits):
    f32 = np.float32
    z = lambda *s: np.zeros(s, dtype=f32)  # noqa: E731
    c = lambda bits: np.zeros((1, 1, bits), dtype=np.uint8)  # noqa: E731
    decode(c(kbits1), 8, z(1 << kbits1), z(1, 1), z(1, 1, RW, 8), c(kbits2), 8, z(1 << kbits2), z(1, 1),
           z(1, 1, RW, 8), True, c(vbits), 8, z(1 << vbits), 8, z(1, 1, 1), z(1, 1, 1), True, z(1, 1), True, 1, 1,
           z(1, 1, 1, RW), z(1, 1, 1, RW), z(1, 1, 1, RW, 8))


def _build(kbits1: int, kbits2: int, vbits: int):
    g1, width1, per1 = _layout(kbits1)
    g2, width2, per2 = _layout(kbits2)
    gv, widthv, perv = _layout(vbits)
    kw = dict(cache=False, fastmath=_FASTMATH)

    def make_table(bits):
        g, width, _ = _layout(bits)
        nv, mask = 1 << width, (1 << bits) - 1

        @njit(**kw)
        def table(q, n, cent):
            """q [RW, n] -> T [n/g * 2^width * RW] float32: T[i, v, r] = sum_j q[r, i*g+j] cent[code_j(v)]."""
            out = np.zeros((n // g) * nv * RW, dtype=np.float32)
            for i in range(n // g):
                for v in range(nv):
                    base = (i * nv + v) * RW
                    for j in range(g):
                        cv = cent[(v >> (j * bits)) & mask]
                        for r in range(RW):
                            out[base + r] += q[r, i * g + j] * cv
            return out
        return table

    def make_score(bits):
        g, width, per_chunk = _layout(bits)
        nv, fmask = 1 << width, (1 << width) - 1

        @njit(**kw)
        def score(codes, flat, norm, t0, t1, out):
            """out[r, t - t0] += norm[t] * sum_i T[i, field_i(t), r]: one table lookup per field."""
            chunks = codes.shape[1] // bits
            for t in range(t0, t1):
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for ch in range(chunks):
                    w = np.uint64(0)
                    for j in range(bits):
                        w |= np.uint64(codes[t, ch * bits + j]) << np.uint64(8 * j)
                    for f in range(per_chunk):
                        v = (w >> np.uint64(f * width)) & np.uint64(fmask)
                        o = (np.uint64(ch * per_chunk + f) * np.uint64(nv) + v) * np.uint64(RW)
                        a0 += flat[o]
                        a1 += flat[o + np.uint64(1)]
                        a2 += flat[o + np.uint64(2)]
                        a3 += flat[o + np.uint64(3)]
                nt = norm[t]
                c = t - t0
                out[0, c] += a0 * nt
                out[1, c] += a1 * nt
                out[2, c] += a2 * nt
                out[3, c] += a3 * nt
        return score

    table1, score1 = make_table(kbits1), make_score(kbits1)
    table2, score2 = make_table(kbits2), make_score(kbits2)
    nvv, fmaskv, maskv = 1 << widthv, (1 << widthv) - 1, (1 << vbits) - 1

    @njit(**kw)
    def mix(codes, n, cent, gsize, scale, zero, has_zero, p, t0, t1, out):
        """out[r, c] = sum_t p[r, t-t0] (zero[t, g(c)] + scale[t, g(c)] cent[code[t, c]]) via a histogram of fields."""
        chunks = codes.shape[1] // vbits
        ngroups = scale.shape[1]
        hist = np.zeros((n // gv) * nvv * RW, dtype=np.float32)
        zsum = np.zeros((ngroups, RW), dtype=np.float32)
        for t in range(t0, t1):
            c = t - t0
            p0, p1, p2, p3 = p[0, c], p[1, c], p[2, c], p[3, c]
            if has_zero:
                for k in range(ngroups):
                    z = zero[t, k]
                    zsum[k, 0] += p0 * z
                    zsum[k, 1] += p1 * z
                    zsum[k, 2] += p2 * z
                    zsum[k, 3] += p3 * z
            k_prev = -1
            w0 = w1 = w2 = w3 = np.float32(0.0)
            for ch in range(chunks):
                k = (ch * 8) // gsize
                if k != k_prev:
                    s = scale[t, k]
                    w0, w1, w2, w3 = p0 * s, p1 * s, p2 * s, p3 * s
                    k_prev = k
                w = np.uint64(0)
                for j in range(vbits):
                    w |= np.uint64(codes[t, ch * vbits + j]) << np.uint64(8 * j)
                for f in range(perv):
                    v = (w >> np.uint64(f * widthv)) & np.uint64(fmaskv)
                    o = (np.uint64(ch * perv + f) * np.uint64(nvv) + v) * np.uint64(RW)
                    hist[o] += w0
                    hist[o + np.uint64(1)] += w1
                    hist[o + np.uint64(2)] += w2
                    hist[o + np.uint64(3)] += w3
        for i in range(n // gv):
            for v in range(nvv):
                base = (i * nvv + v) * RW
                for j in range(gv):
                    cv = cent[(v >> (j * vbits)) & maskv]
                    for r in range(RW):
                        out[r, i * gv + j] += hist[base + r] * cv
        if has_zero:
            for c in range(n):
                for r in range(RW):
                    out[r, c] += zsum[c // gsize, r]

    @njit(parallel=True, **kw)
    def decode(c1, n1, cent1, norm1, q1, c2, n2, cent2, norm2, q2, has2,
               vc, vn, vcent, vgs, vscale, vzero, has_zero, bias, has_bias, heads, block,
               out_m, out_l, out_o):
        """q1/q2: [BH, chunks, RW, n]; outputs [BH, chunks, splits, RW(, n_v)]; one item per (bh, chunk, split)."""
        bh_count, n_tok = norm1.shape
        rchunks = q1.shape[1]
        splits = out_m.shape[2]
        t1s = np.empty((bh_count * rchunks, (n1 // g1) * (1 << width1) * RW), dtype=np.float32)
        t2s = np.empty((bh_count * rchunks if has2 else 1, (n2 // g2) * (1 << width2) * RW), dtype=np.float32)
        for item in prange(bh_count * rchunks):  # tables once per (sequence x KV head, row chunk)
            t1s[item] = table1(q1[item // rchunks, item % rchunks], n1, cent1)
            if has2:
                t2s[item] = table2(q2[item // rchunks, item % rchunks], n2, cent2)
        for item in prange(bh_count * rchunks * splits):
            bh = item // (rchunks * splits)
            rc = (item // splits) % rchunks
            s = item % splits
            t0 = s * block
            t1 = min(n_tok, t0 + block)
            if t1 <= t0:
                for r in range(RW):
                    out_m[bh, rc, s, r] = -np.inf
                continue
            logits = np.zeros((RW, t1 - t0), dtype=np.float32)
            score1(c1[bh], t1s[bh * rchunks + rc], norm1[bh], t0, t1, logits)
            if has2:
                score2(c2[bh], t2s[bh * rchunks + rc], norm2[bh], t0, t1, logits)
            if has_bias:
                brow = bias[bh // heads]
                for r in range(RW):
                    for t in range(t0, t1):
                        logits[r, t - t0] += brow[t]
            for r in range(RW):
                m = -np.inf
                for t in range(t1 - t0):
                    m = max(m, logits[r, t])
                out_m[bh, rc, s, r] = m
                sm = np.float32(0.0) if m == -np.inf else np.float32(m)
                tot = np.float32(0.0)
                for t in range(t1 - t0):
                    e = np.exp(logits[r, t] - sm)
                    logits[r, t] = e
                    tot += e
                out_l[bh, rc, s, r] = tot
            mix(vc[bh], vn, vcent, vgs, vscale[bh], vzero[bh], has_zero, logits, t0, t1, out_o[bh, rc, s])
        if splits > 1:  # merge the splits' partial softmaxes into split 0
            for item in prange(bh_count * rchunks):
                bh = item // rchunks
                rc = item % rchunks
                for r in range(RW):
                    m = -np.inf
                    for s in range(splits):
                        m = max(m, out_m[bh, rc, s, r])
                    if m == -np.inf:
                        continue
                    tot = np.float32(0.0)
                    for s in range(splits):
                        w = np.exp(out_m[bh, rc, s, r] - m)
                        tot += w * out_l[bh, rc, s, r]
                        if s == 0:
                            for c in range(vn):
                                out_o[bh, rc, 0, r, c] *= w
                        else:
                            for c in range(vn):
                                out_o[bh, rc, 0, r, c] += w * out_o[bh, rc, s, r, c]
                    out_m[bh, rc, 0, r] = m
                    out_l[bh, rc, 0, r] = tot

    return decode


if numba is not None:

    @njit(cache=True, parallel=True)
    def _bucket_pack(y, bnd, cent, bits, codes, cos):
        """Lloyd-Max cell of every coordinate (number of boundaries below it, as torch.bucketize),
        packed LSB-first 8 codes per ``bits`` bytes, and cos[i] = sum_c y[i, c] * cent[idx]."""
        n_rows, n = y.shape
        nbytes = codes.shape[1]
        nb = bnd.shape[0]
        for i in prange(n_rows):
            acc = np.float32(0.0)
            for ch in range((n + 7) // 8):
                w = np.uint64(0)
                for j in range(8):
                    c = ch * 8 + j
                    if c < n:
                        v = y[i, c]
                        if nb <= 15:
                            k = 0
                            for b in range(nb):
                                k += v > bnd[b]
                        else:  # binary search: first boundary >= v
                            lo, hi = 0, nb
                            while lo < hi:
                                mid = (lo + hi) // 2
                                if bnd[mid] < v:
                                    lo = mid + 1
                                else:
                                    hi = mid
                            k = lo
                        w |= np.uint64(k) << np.uint64(bits * j)
                        acc += v * cent[k]
                for byte in range(bits):
                    pos = ch * bits + byte
                    if pos < nbytes:
                        codes[i, pos] = np.uint8((w >> np.uint64(8 * byte)) & np.uint64(255))
            cos[i] = acc


def bucket_pack(y: torch.Tensor, boundaries: torch.Tensor, centroids: torch.Tensor, bits: int):
    """y: [..., n] float32 -> (packed codes [..., ceil(n*bits/8)] uint8, cos [...] float32); see :func:`_bucket_pack`."""
    if numba is None:
        raise RuntimeError("the CPU kernel needs numba (pip install numba)")
    lead, n = y.shape[:-1], y.shape[-1]
    y2 = _np(y.reshape(-1, n).float())
    codes = np.empty((y2.shape[0], (n * bits + 7) // 8), dtype=np.uint8)
    cos = np.empty(y2.shape[0], dtype=np.float32)
    _bucket_pack(y2, _np(boundaries.float()), _np(centroids.float()), bits, codes, cos)
    return torch.from_numpy(codes).reshape(*lead, -1), torch.from_numpy(cos).reshape(lead)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def _rows(q: torch.Tensor) -> torch.Tensor:
    """[BH, R, n] -> [BH, ceil(R / RW), RW, n] float32, rows zero-padded."""
    bh, r, n = q.shape
    chunks = -(-r // RW)
    out = torch.zeros(bh, chunks * RW, n, dtype=torch.float32)
    out[:, :r] = q
    return out.reshape(bh, chunks, RW, n)


def fits(parts: list[KeyPart], vp: ValuePart) -> bool:
    """Layouts this kernel reads: 1-2 key parts; code lengths and value groups in whole bytes of 8 codes."""
    ok = 1 <= len(parts) <= 2 and all(p.n % 8 == 0 and p.bits <= 8 for p in parts)
    return ok and vp.n % 8 == 0 and vp.group_size % 8 == 0


def implementation() -> str:
    """"c" (the compiled C twin, ``cpu_kernel.c``, faster) where it builds, else "numba"."""
    from qjl.kernels.cpu import build as cpu_build

    return "c" if cpu_build.load() is not None else "numba"


def decode_partial(parts: list[KeyPart], vp: ValuePart, bias: torch.Tensor | None = None, block: int | None = None,
                   impl: str = "auto", exact=None):
    """Partial softmax of the code part (see :mod:`qjl.kernels.plan`); CPU tensors only.

    parts: 1 or 2 key parts; bias: [B, N] additive (broadcast over heads and rows) or None;
    impl: "auto" (:func:`implementation`), "c" (with its AVX-512 paths where the CPU has them),
    "c-portable" (the C build without them) or "numba".
    exact: None or (qx [BH, R, D], xk/xv [BH, n, D], xbias [BH, R, n] or None), the exact tokens
    merged in (by the C kernel itself; after the numba kernel, in torch).
    Returns m, l: [BH, R]; o: [BH, R, n_v] float32; with ``exact`` also o_x [BH, R, D]
    (see :func:`qjl.kernels.plan.merge_apart`).
    """
    if impl == "auto":
        impl = implementation()
    if impl not in ("c", "c-portable", "numba"):
        raise ValueError(f"impl must be 'auto', 'c', 'c-portable' or 'numba', got {impl!r}")
    if impl == "numba" and numba is None:
        raise RuntimeError("the numba CPU kernel needs numba (pip install numba)")
    if not fits(parts, vp):
        raise ValueError("the CPU kernel needs 1-2 key parts, code lengths and value groups that are multiples of 8")
    p1 = parts[0]
    p2 = parts[1] if len(parts) == 2 else parts[0]
    bh, n_tok = p1.norm.shape
    r_rows = p1.q.shape[1]
    q1 = _rows(p1.q)
    q2 = _rows(p2.q) if len(parts) == 2 else q1
    rchunks = q1.shape[1]
    threads = torch.get_num_threads()
    if block is None:  # split tokens only as far as needed to give every thread ~4 items
        want = math.ceil(4 * threads / (bh * rchunks))
        block = max(_MIN_BLOCK, math.ceil(n_tok / max(want, 1)))
    splits = max(1, math.ceil(n_tok / block))
    heads = bh // (bias.shape[0] if bias is not None else 1)
    bias_f = bias.float().contiguous() if bias is not None else torch.zeros(1, 1)
    r_all = rchunks * RW  # split 0 holds the merged partial
    out_m = torch.empty(bh, rchunks, splits, RW)
    out_l = torch.zeros(bh, rchunks, splits, RW)
    out_o = torch.zeros(bh, rchunks, splits, RW, vp.n)
    x = _exact_args(exact, bh, r_rows, rchunks)  # checked for every build; only the C build reads it
    if impl == "numba":  # the numba build writes through numpy views of the same tensors
        _run_numba(p1, p2, vp, q1.numpy(), q2.numpy(), len(parts) == 2, bias_f.numpy(), bias is not None, heads,
                   block, (out_m.numpy(), out_l.numpy(), out_o.numpy()))
    else:
        _run_c(p1, p2, vp, q1, q2, len(parts) == 2, bias_f, bias is not None, heads, bh, rchunks, n_tok, block,
               splits, (out_m, out_l, out_o), x, threads, _SIMD if impl == "c" else 0)
    code = (out_m[:, :, 0].reshape(bh, r_all)[:, :r_rows], out_l[:, :, 0].reshape(bh, r_all)[:, :r_rows],
            out_o[:, :, 0].reshape(bh, r_all, vp.n)[:, :r_rows])
    if exact is None:
        return code
    if impl == "numba":  # the numba build has no exact part: merged in torch
        return merge_apart(code, partial_exact(*exact))
    return (*code, x["ox"].reshape(bh, r_all, -1)[:, :r_rows])


def _exact_args(exact, bh: int, r_rows: int, rchunks: int) -> dict:
    """The exact tokens as the C kernel reads them (rows padded to whole chunks of RW)."""
    if exact is None:
        return {"has": 0, "ne": 0, "dx": 0}
    check_exact(exact, bh, r_rows)
    qx, xk, xv, xbias = exact
    ne, dx = xk.shape[-2], xk.shape[-1]
    xb = None
    if xbias is not None:
        xb = torch.zeros(bh, rchunks * RW, ne)
        xb[:, :r_rows] = xbias
    return {"has": 1, "ne": ne, "dx": dx, "qx": _rows(qx), "xk": xk.float().contiguous(),
            "xv": xv.float().contiguous(), "xbias": xb, "ox": torch.zeros(bh, rchunks, RW, dx)}


_SIMD = 7  # the C build's AVX-512 paths: 1 values, 2 keys, 4 softmax + exact tokens (where the CPU has AVX-512 VBMI)
_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}
_VIEWS = {torch.float32: torch.float32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
          torch.float8_e4m3fn: torch.uint8}


def _raw(t: torch.Tensor):
    """(tensor viewing the bytes, dtype code) of a norm / scale tensor in its stored dtype."""
    if t.dtype not in _KINDS:
        t = t.float()
    return t.contiguous().view(_VIEWS[t.dtype]), _KINDS[t.dtype]


def _run_numba(p1, p2, vp, q1, q2, has2, bias_np, has_bias, heads, block, outs):
    f32 = lambda t: _np(t.float())  # noqa: E731  (the numba build reads float32 norms and scales)
    zero = vp.zero if vp.zero is not None else vp.scale
    kernel = _compile(p1.bits, p2.bits, vp.bits)
    kernel(_np(p1.codes), p1.n, f32(p1.cent), f32(p1.norm), q1, _np(p2.codes), p2.n, f32(p2.cent), f32(p2.norm), q2,
           has2, _np(vp.codes), vp.n, f32(vp.cent), vp.group_size, f32(vp.scale), f32(zero), vp.zero is not None,
           bias_np, has_bias, heads, block, *outs)


def _run_c(p1, p2, vp, q1, q2, has2, bias, has_bias, heads, bh, rchunks, n_tok, block, splits, outs, x, threads,
           simd):
    from qjl.kernels.cpu import build as cpu_build

    mod = cpu_build.load()
    if mod is None:
        raise RuntimeError("the C CPU kernel could not be built (cffi and a C compiler with OpenMP are needed)")
    ffi, lib = mod.ffi, mod.lib
    keep = []  # every tensor whose pointer is passed stays referenced until the call returns

    def ptr(t, kind="float *"):
        if t is None:
            return ffi.NULL
        t = t.contiguous()
        keep.append(t)
        return ffi.cast(kind, t.data_ptr())

    c1, c2, vc = p1.codes.contiguous(), p2.codes.contiguous(), vp.codes.contiguous()
    n1, k1 = _raw(p1.norm)
    n2, k2 = _raw(p2.norm)
    sc, ks = _raw(vp.scale)
    zr, kz = _raw(vp.zero if vp.zero is not None else vp.scale)
    if kz != ks:
        zr, kz = _raw(vp.zero.to(vp.scale.dtype))
    f32 = lambda t: t.float()  # noqa: E731
    u8, vd = "uint8_t *", "void *"
    rc = lib.qjl_decode(p1.bits, ptr(c1, u8), c1.shape[-1], p1.n, ptr(f32(p1.cent)), ptr(n1, vd), k1, ptr(q1),
                        int(has2), p2.bits, ptr(c2, u8), c2.shape[-1], p2.n, ptr(f32(p2.cent)), ptr(n2, vd), k2,
                        ptr(q2), vp.bits, ptr(vc, u8), vc.shape[-1], vp.n, ptr(f32(vp.cent)), vp.group_size,
                        vp.scale.shape[-1], ptr(sc, vd), ptr(zr, vd), ks, int(vp.zero is not None), ptr(bias),
                        int(has_bias), heads, bh, rchunks, n_tok, block, splits, *(ptr(o) for o in outs),
                        x["has"], x["ne"], x["dx"], ptr(x.get("qx")), ptr(x.get("xk")), ptr(x.get("xv")),
                        ptr(x.get("xbias")), int(x.get("xbias") is not None), ptr(x.get("ox")), threads, int(simd))
    if rc == -2:
        raise ValueError(f"the C kernel refused storage dtype codes {k1}/{k2}/{ks}")
    if rc != 0:
        raise ValueError(f"the C kernel refused bit widths {p1.bits}/{p2.bits}/{vp.bits}")
