"""Launchers of the CPU kernels (:mod:`qjl.kernels.cpu.build`): the paged decode and TurboQuant bucketing.

:func:`paged_decode` fills the C struct ``qjl_decode_args`` (``decode.h``) by name from the codecs'
views and the paged fields and makes one C call for the whole layer (all sequences, KV heads and query
rows; OpenMP threads over them, libgomp's pool shared with torch), which returns the attention output:
the key terms' query maps and the value codec's ``unmix`` (TurboQuant's rotation and its inverse) are
applied inside the call as matrices built once per codec (:func:`qjl.kernels.paged.query_maps`).
``impl``: "c" (the AVX2 path where the CPU has it) or "c-portable" (the C build without it; the tests
run both).
"""

from __future__ import annotations

import torch

__all__ = ["available", "implementation", "simd_path", "paged_decode", "bucket_pack", "IMPLS"]

IMPLS = ("c", "c-portable")
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}


def _module():
    from qjl.kernels.cpu import build

    return build.load()


def available() -> bool:
    """The C build compiles and loads here (compiled once per machine)."""
    return _module() is not None


def implementation() -> str:
    """"c" where the C build loads, else "unavailable" (the cache then uses the torch reference)."""
    return "c" if _module() is not None else "unavailable"


def simd_path() -> str:
    """The path ``impl="c"`` runs on this CPU: "avx2" (AVX2 + FMA) or "portable"."""
    return "avx2" if _has_avx2() else "portable"


def _has_avx2() -> bool:
    try:
        from pathlib import Path

        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
        return " avx2" in flags and " fma" in flags
    except (OSError, StopIteration):
        return False


class _Args:
    """The struct and every tensor whose address it holds (kept alive until the call returns)."""

    def __init__(self, ffi):
        self.ffi, self.keep = ffi, []
        self.c = ffi.new("qjl_decode_args *")

    def ptr(self, t: torch.Tensor | None, kind: str = "float *"):
        if t is None:
            return self.ffi.NULL
        self.keep.append(t)
        return self.ffi.cast(kind, t.data_ptr())

    def field(self, dst, f, scalar: bool) -> None:
        dst.base = self.ffi.cast("const uint8_t *", f.buffer.data_ptr() + f.offset)
        self.keep.append(f.buffer)
        dst.stride_block, dst.stride_head, dst.stride_token = f.stride_block, f.stride_head, f.stride_token
        if scalar:
            if f.dtype not in _DTYPES:
                raise ValueError(f"a norm/scale field stored as {f.dtype} is not read by the CPU kernel")
            dst.dtype = _DTYPES[f.dtype]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).contiguous()


def paged_decode(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size, code_start, code_end,
                 *, exact=None, code_bias=None, impl: str = "c", threads: int | None = None,
                 split_tokens: int = 0) -> torch.Tensor:
    """The CPU backend of :func:`qjl.kernels.paged.paged_decode` (same arguments and result).

    impl: "c" or "c-portable"; threads: OpenMP threads (default ``torch.get_num_threads()``);
    split_tokens: coded tokens per work item (0: enough items for every thread).
    """
    from qjl.kernels.paged import check_paged, kernel_readable, query_maps, term_queries, unmix_matrix, views

    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    mod = _module()
    if mod is None:
        raise RuntimeError("the C CPU kernels could not be built (cffi and a C compiler with OpenMP are needed)")
    if not kernel_readable(key_codec, value_codec):
        raise ValueError(f"the CPU kernel does not read {type(key_codec).__name__} keys with "
                         f"{type(value_codec).__name__} values (see qjl.codecs.views.kernel_readable)")
    check_paged(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size, code_start, code_end)
    kview, vview = views(key_codec, value_codec)
    b, hkv, r, d = q.shape
    bt = block_table.to(torch.int32).contiguous()
    a = _Args(mod.ffi)
    c = a.c
    c.n_terms = len(kview.terms)
    qmaps = query_maps(key_codec)  # applied inside the C call (no small torch matmuls per layer and step)
    qs = [None] * len(kview.terms) if qmaps is not None else term_queries(q, key_codec, key_fields, bt)
    q32 = _f32(q)
    for i, (term, qt) in enumerate(zip(kview.terms, qs)):
        kt = c.key[i]
        a.field(kt.codes, key_fields[term.codes.field], False)
        a.field(kt.norm, key_fields[term.norm], True)
        kt.bits, kt.n = term.codes.bits, term.codes.length
        kt.cent = a.ptr(term.codes.centroids)
        if qmaps is not None:
            kt.q, kt.qmap, kt.qdim = a.ptr(q32), a.ptr(qmaps[i]), d
        else:
            kt.q, kt.q_per_block = a.ptr(_f32(qt)), 1
    vv = c.value
    a.field(vv.codes, value_fields[vview.codes.field], False)
    a.field(vv.scale, value_fields[vview.scale], True)
    if vview.zero:
        a.field(vv.zero, value_fields[vview.zero], True)
    vv.bits, vv.n, vv.group_size, vv.groups = vview.codes.bits, vview.codes.length, vview.group_size, vview.groups
    vv.has_zero, vv.cent = int(vview.zero is not None), a.ptr(vview.codes.centroids)
    unmix = unmix_matrix(value_codec)
    vv.unmix, vv.out_dim = a.ptr(unmix), d
    c.batch, c.heads, c.rows = b, hkv, r
    c.block_table, c.max_blocks, c.block_size = a.ptr(bt, "int32_t *"), bt.shape[1], int(block_size)
    c.code_start = a.ptr(code_start.to(torch.int32).contiguous(), "int32_t *")
    c.code_end = a.ptr(code_end.to(torch.int32).contiguous(), "int32_t *")
    if code_bias is not None:
        cb = _f32(code_bias)
        if cb.ndim != 2 or cb.shape[0] != b or (b and cb.shape[1] < int(code_end.max())):
            raise ValueError(f"code_bias must be [B={b}, >= max(code_end)], got {tuple(code_bias.shape)}")
        c.bias, c.bias_stride = a.ptr(cb), cb.shape[1]
    if unmix is None and vview.codes.length != d:
        raise ValueError(f"value codes of length {vview.codes.length} with an identity unmix need D = {d}")
    out = torch.empty(b, hkv, r, d)
    if exact is not None and exact[0].shape[2] > 0:
        xk, xv, xb = exact
        c.ne, c.dx = xk.shape[2], d
        c.xk, c.xv, c.qx = a.ptr(_f32(xk)), a.ptr(_f32(xv)), a.ptr(q32)
        if xb is not None:  # [B|1, H|1, R|1, n_x], broadcast through zero strides
            xb = xb.float()
            if xb.ndim != 4 or xb.stride(3) != 1:
                xb = xb.contiguous()
            c.xbias = a.ptr(xb)
            c.xbias_sb, c.xbias_sh, c.xbias_sr = (xb.stride(i) if xb.shape[i] > 1 else 0 for i in range(3))
    c.out = a.ptr(out)
    c.split_tokens = int(split_tokens)
    c.threads = int(threads or torch.get_num_threads())
    c.simd = int(impl == "c")
    if mod.lib.qjl_paged_decode(c) != 0:
        raise ValueError("the C kernel refused its arguments (code widths, lengths or group sizes)")
    return out


def bucket_pack(y: torch.Tensor, boundaries: torch.Tensor, centroids: torch.Tensor, bits: int):
    """y: [..., n] float32 -> (cells packed LSB-first [..., ceil(n*bits/8)] uint8, cos [...] float32 with
    ``cos = sum_c y[c] * centroids[cell_c]``); the cells are ``torch.bucketize(y, boundaries)``."""
    mod = _module()
    if mod is None:
        raise RuntimeError("the C CPU kernels could not be built (cffi and a C compiler with OpenMP are needed)")
    lead, n = y.shape[:-1], y.shape[-1]
    y2 = _f32(y.reshape(-1, n))
    nbytes = (n * bits + 7) // 8
    codes = torch.empty(y2.shape[0], nbytes, dtype=torch.uint8)
    cos = torch.empty(y2.shape[0])
    bnd, cent = _f32(boundaries), _f32(centroids)
    ffi = mod.ffi
    rc = mod.lib.qjl_bucket_pack(ffi.cast("float *", y2.data_ptr()), y2.shape[0], n, ffi.cast("float *", bnd.data_ptr()),
                                 bnd.numel(), ffi.cast("float *", cent.data_ptr()), bits,
                                 ffi.cast("uint8_t *", codes.data_ptr()), nbytes, ffi.cast("float *", cos.data_ptr()),
                                 torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"bucket_pack: {bits}-bit codes need {2 ** bits - 1} boundaries, got {bnd.numel()}")
    return codes.reshape(*lead, nbytes), cos.reshape(lead)
