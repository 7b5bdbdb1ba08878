"""Launchers of the CPU decode (:mod:`qjl.kernels.cpu.build`; ``decode.c``, ``step.c``).  The encode's
(:mod:`qjl.kernels.cpu.store`) and the rows' (:mod:`qjl.kernels.cpu.rows`) are named here too, as before they moved.

:func:`paged_decode` fills the C struct ``qjl_decode_args`` (``decode.h``) by name from the codecs'
views and the paged fields and makes one C call for the whole layer (all sequences, KV heads and query
rows; OpenMP threads over them, libgomp's pool shared with torch), which returns the attention output:
the key terms' query maps and the value codec's ``unmix`` (TurboQuant's rotation and its inverse) are
applied inside the call as matrices built once per codec (:func:`qjl.kernels.paged.query_maps`).  Values over K
rotations in turn (``MixView.cycles``, TurboQuant's ``cycles=K``) are mixed into K accumulators by code position
and mapped back by the [K n, D] unmix (``decode.c``'s by_residue; "c-amx" mixes them on vpdpwssd as "c-int").
Codes of a vector codebook (``PackedCodes.group`` g > 1, :class:`qjl.codecs.vq.TurboQuantVQ`; keys, values or both,
values over rotations in turn too) are read as :meth:`qjl.codecs.views.PackedCodes.values` reads them: each group's
g fields one joint code e, coordinate c ``centroids[e g + c % g]`` (g 2, 4 or 8, joint codes of at most 8 bits:
else ValueError); the portable path expands each row through that table, the AVX2 path loads each joint code's g
floats from it inside its score and mix loops.  The integer paths ("c-int", "c-amx") score keys in pairs of 3-bit
codes and in 8-bit joint codes (pairs of 4-bit codes, fours of 2-bit codes: int8 tables of their codewords'
coordinates, on vpdpbusd) and leave grouped values to those AVX2 loops (the other role's scalar codes keep the
integer products).
``impl``: "auto" (default; ``$QJL_CPU_IMPL`` when set): "c-amx" where the CPU has AMX tiles, else "c-int" where
it has AVX-512 VBMI + VNNI, else "c"; "c" (fp32 sums: the AVX2 path where the CPU has it); "c-int" (integer
products: int8 queries and centroids for keys, int16 softmax weights for values, at the error bound stated in
``decode_vnni.c``, for scalar codes of <= 5 bits and grouped keys of 6- and 8-bit joint codes; the rest as "c");
"c-amx" (the same integers summed on AMX tiles, ``decode_amx.c``: "c-int"'s outputs bit for bit; "c-int" where the
OS refuses the tiles); "c-portable" (the C build without SIMD).  The tests run every one the CPU has.
"""

from __future__ import annotations

import functools
import itertools
import os
import weakref

import torch

from .binding import X_DTYPES, Args, check_groups, fill_view, f32, i32, i64, module, require
from .rows import value_rows, value_rows_reference  # (their home: rows.py; named here as before)
from .store import EncodeStore, bucket_norms, cell_moments, check_positions, store_bounds  # (store.py)

__all__ = ["available", "implementation", "simd_path", "has_int_path", "has_amx_path", "default_impl", "paged_decode", "DecodeStep",
           "paged_decode_step", "DecodeCall", "DecodeHeads", "half_rounding", "bucket_norms", "EncodeStore", "DecodeStore",
           "cell_moments", "store_bounds", "value_rows", "value_rows_reference", "IMPLS"]

IMPLS = ("c", "c-int", "c-amx", "c-portable")
_SIMD = {"c": 1, "c-int": 2, "c-amx": 3, "c-portable": 0}


def available() -> bool:
    """The C build compiles and loads here (compiled once per machine)."""
    return module() is not None


def implementation() -> str:
    """"c" where the C build loads, else "unavailable" (the cache then uses the torch reference)."""
    return "c" if module() is not None else "unavailable"


def simd_path() -> str:
    """The path ``impl="auto"`` runs on this CPU: "amx" (the integer products on AMX tiles), "int" (AVX-512 VBMI +
    VNNI integer products), "avx2" (AVX2 + FMA) or "portable"."""
    return "amx" if has_amx_path() else "int" if has_int_path() else "avx2" if _has_avx2() else "portable"


@functools.lru_cache(maxsize=None)
def has_int_path() -> bool:
    """The CPU has what ``impl="c-int"`` needs (AVX2, FMA, AVX-512 F/BW/VL/VBMI/VNNI)."""
    return _has_avx2() and all(f in _cpu_flags() for f in ("avx512f", "avx512bw", "avx512vl", "avx512vbmi",
                                                             "avx512_vnni"))


@functools.lru_cache(maxsize=None)
def has_amx_path() -> bool:
    """The CPU has what ``impl="c-amx"`` needs: the integer path's features and AMX-TILE + AMX-INT8 (the kernel
    also asks Linux for the tiles and runs "c-int" where it refuses them)."""
    return has_int_path() and {"amx_tile", "amx_int8"} <= _cpu_flags()


def default_impl() -> str:
    """``$QJL_CPU_IMPL`` if set, else "c-amx" where the CPU has AMX tiles, "c-int" where it has AVX-512 VNNI (the
    embedded model's KL and perplexity unchanged, ~1.5x faster per token than "c": docs/kernels.md; "c-amx" the
    same outputs, faster again), else "c"."""
    env = os.environ.get("QJL_CPU_IMPL", "").strip()
    if env and env != "auto":
        if env not in IMPLS:
            raise ValueError(f"QJL_CPU_IMPL must be one of {('auto',) + IMPLS}, got {env!r}")
        return env
    return "c-amx" if has_amx_path() else "c-int" if has_int_path() else "c"


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset:
    try:
        from pathlib import Path

        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
        return frozenset(line.split(":", 1)[1].split())
    except (OSError, StopIteration, IndexError):
        return frozenset()


def _has_avx2() -> bool:
    return {"avx2", "fma"} <= _cpu_flags()


class _Template:
    """The struct's parts fixed by the codecs and the fields (bits, centroids, maps, field addresses), filled once."""

    def __init__(self, mod, key_codec, key_fields, value_codec, value_fields, d: int):
        from qjl.kernels.paged import query_maps, unmix_matrix, views

        kview, vview = views(key_codec, value_codec)
        self.value_codec = weakref.ref(value_codec)
        a = Args(mod.ffi)
        c = a.c
        c.n_terms = len(kview.terms)
        self.qmaps = query_maps(key_codec) is not None  # applied inside the C call
        for i, term in enumerate(kview.terms):
            kt = c.key[i]
            a.field(kt.codes, key_fields[term.codes.field], False)
            a.field(kt.norm, key_fields[term.norm], True)
            kt.bits, kt.n, kt.group = term.codes.bits, term.codes.length, term.codes.group
            kt.cent = a.ptr(term.codes.centroids)
            if self.qmaps:
                kt.qmap, kt.qdim = a.ptr(query_maps(key_codec)[i]), d
            else:
                kt.q_per_block = 1
        vv = c.value
        fill_view(a, vv, vview, value_fields)
        unmix = unmix_matrix(value_codec)
        if unmix is None and vview.codes.length != d:
            raise ValueError(f"value codes of length {vview.codes.length} with an identity unmix need D = {d}")
        if unmix is None and vview.cycles > 1:
            raise ValueError(f"value_codec {value_codec!r}: {vview.cycles} accumulators (MixView.cycles) need an "
                             "unmix that maps them back (MixView.rotated)")
        vv.unmix, vv.out_dim = a.ptr(unmix), d  # unmix [K n, D]: the K accumulators (vv.cycles, fill_view) mapped back
        buffers = {id(f.buffer) for f in (*key_fields.values(), *value_fields.values())}
        self.keep = [t for t in a.keep if id(t) not in buffers]  # centroids and maps; no field buffer kept alive
        self.c = c  # owns the struct's memory


_TEMPLATES = weakref.WeakKeyDictionary()  # key codec -> {(fields' signature, d, id(value codec)): _Template}


def _template(mod, key_codec, key_fields, value_codec, value_fields, d: int, sig: tuple) -> _Template:
    """The :class:`_Template` of these codecs and fields (``sig``: their
    :func:`qjl.kernels.paged.fields_signature`), built once (the vLLM backend's fields live as long as the
    engine's KV cache; the transformers cache's change as its buffers grow)."""
    key = (sig, d, id(value_codec))
    try:
        memo = _TEMPLATES.setdefault(key_codec, {})
    except TypeError:  # not weak-referenceable: no memo
        memo = {}
    t = memo.get(key)
    if t is None or t.value_codec() is not value_codec:
        if len(memo) > 256:
            memo.clear()
        t = memo[key] = _Template(mod, key_codec, key_fields, value_codec, value_fields, d)
    return t


def _exact_segments(ks: tuple, vs: tuple) -> list:
    """The exact tokens as the kernel reads them: [(xk, xv)] of at most two non-empty segments, each a tensor with
    contiguous rows of fp32/fp16/bf16 (key and value of one dtype) or a :class:`qjl.kernels.paged.PagedRows` pair,
    read in place where they are that; else the segments joined as float32 tensors."""
    from qjl.kernels.paged import PagedRows, joined_exact

    segs = [(k, v) for k, v in zip(ks, vs) if k.shape[2] > 0]
    if len(segs) <= 2 and all(k.dtype == v.dtype and k.dtype in X_DTYPES and type(k) is type(v) for k, v in segs):
        return [kv if isinstance(kv[0], PagedRows) else tuple(t if t.stride(3) == 1 else t.contiguous() for t in kv)
                for kv in segs]
    xk, xv, _ = joined_exact((tuple(k for k, _ in segs), tuple(v for _, v in segs), None))
    return [(f32(xk), f32(xv))]


class _Prepared:
    """What a decode call takes from its codecs and fields, checked and filled once: the struct's template and the
    largest block index every field's buffer holds (``room``).  Kept in the key fields'
    :attr:`qjl.kernels.paged.FieldMap.memo` (:func:`_prepared`): ``matches`` tells whether a call's value fields and
    codecs are the objects it was built for and every buffer still has the address and geometry it had (a buffer
    resized in place rebuilds it)."""

    __slots__ = ("tpl", "room", "refs", "buffers")

    def __init__(self, tpl, room, value_fields, key_codec, value_codec, buffers):
        self.tpl, self.room = tpl, room
        self.refs = tuple(weakref.ref(o) for o in (value_fields, key_codec, value_codec) if o is not None)
        self.buffers = tuple((t, t.data_ptr(), tuple(t.shape), t.stride()) for t in buffers)

    def matches(self, value_fields, key_codec, value_codec) -> bool:
        if not self.refs:  # built for one call (plain mappings): never kept
            return False
        vf, kc, vc = (r() for r in self.refs)
        return (vf is value_fields and kc is key_codec and vc is value_codec
                and all(t.data_ptr() == p and t.shape == s and t.stride() == st for t, p, s, st in self.buffers))


def _prepared(mod, q, key_codec, key_fields, value_codec, value_fields, block_table, block_size, code_start,
              code_end, checked: bool = False) -> _Prepared:
    """The call's :class:`_Prepared`: from the memo when both field maps are FieldMaps it was built for (then only
    the arguments' types and shapes are checked here), else from the full static checks
    (:func:`qjl.kernels.paged.check_static`, memoized on the fields' signature)."""
    from qjl.kernels.paged import FieldMap, check_args, check_static, kernel_readable, views

    h, d = q.shape[1], q.shape[3]
    memo = key = None
    if isinstance(key_fields, FieldMap) and isinstance(value_fields, FieldMap):
        key = ("decode", id(value_fields), id(key_codec), id(value_codec), h, d, block_size, q.device)
        memo = key_fields.memo
        p = memo.get(key)
        if p is not None and p.matches(value_fields, key_codec, value_codec):
            if not checked:  # (``checked``: the caller has checked the arguments' types and shapes)
                check_args(q, block_table, block_size, code_start, code_end)
            return p
    if not kernel_readable(key_codec, value_codec):
        raise ValueError(f"the CPU kernel does not read {type(key_codec).__name__} keys with "
                         f"{type(value_codec).__name__} values (see qjl.codecs.views.kernel_readable)")
    kview, vview = views(key_codec, value_codec)
    check_groups(f"key_codec {key_codec!r}", (t.codes for t in kview.terms))
    check_groups(f"value_codec {value_codec!r}", (vview.codes,))
    sig, room = check_static(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size, code_start,
                             code_end)
    tpl = _template(mod, key_codec, key_fields, value_codec, value_fields, d, sig)
    buffers = {id(f.buffer): f.buffer for f in (*key_fields.values(), *value_fields.values())}
    if memo is None:
        return _Prepared(tpl, room, None, None, None, ())
    try:
        p = _Prepared(tpl, room, value_fields, key_codec, value_codec, buffers.values())
    except TypeError:  # a codec that cannot be weakly referenced: checked on every call
        return _Prepared(tpl, room, None, None, None, ())
    if len(memo) > 64:  # (a FieldMap served with many codec objects)
        memo.clear()
    memo[key] = p
    return p


def _impl_code(impl) -> str:
    """``impl`` resolved ("auto": :func:`default_impl`) and checked."""
    if impl == "auto":
        impl = default_impl()
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {('auto',) + IMPLS}, got {impl!r}")
    if impl in ("c-int", "c-amx") and not has_int_path():
        raise ValueError(f"impl={impl!r} needs AVX-512 F/BW/VL/VBMI/VNNI, which this CPU lacks; use 'c' or 'auto'")
    if impl == "c-amx" and not has_amx_path():
        raise ValueError("impl='c-amx' needs AMX-TILE and AMX-INT8, which this CPU lacks; use 'c-int' or 'auto'")
    return impl


def paged_decode(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size, code_start, code_end,
                 *, exact=None, code_bias=None, impl: str = "auto", threads: int | None = None,
                 split_tokens: int = 0) -> torch.Tensor:
    """The CPU backend of :func:`qjl.kernels.paged.paged_decode` (same arguments and result).

    impl: "auto", "c", "c-int" or "c-portable" (module docstring); threads: OpenMP threads (default
    ``torch.get_num_threads()``);
    split_tokens: coded tokens per work item (0: enough items for every thread).
    Fields passed as :class:`qjl.kernels.paged.FieldMap` objects are checked and turned into C arguments once
    (the vLLM backend's); other mappings on every call.  Codes read g at a time (a vector codebook,
    ``PackedCodes.group`` g > 1, either role) are read as :meth:`qjl.codecs.views.PackedCodes.values` reads them
    (module docstring); g must be 2, 4 or 8 with joint codes of at most 8 bits and [2^(g bits) g] centroids, else
    ValueError naming the codec.
    """
    from qjl.kernels.paged import check_exact, check_paged, term_queries

    impl = _impl_code(impl)
    mod = require()
    # the ranges and the blocks are checked by the kernel itself (before it reads anything): no reads of their
    # values here (each a few torch operations per layer and step)
    prep = _prepared(mod, q, key_codec, key_fields, value_codec, value_fields, block_table, block_size, code_start,
                     code_end)
    tpl, room = prep.tpl, prep.room
    b, hkv, r, d = q.shape
    bt = i32(block_table)
    a = Args(mod.ffi)
    c = a.c
    mod.ffi.memmove(c, tpl.c, mod.ffi.sizeof("qjl_decode_args"))
    q32 = f32(q)
    if tpl.qmaps:
        for i in range(c.n_terms):
            c.key[i].q = a.ptr(q32)
    else:
        for i, qt in enumerate(term_queries(q, key_codec, key_fields, bt)):
            c.key[i].q = a.ptr(f32(qt))
    c.batch, c.heads, c.rows = b, hkv, r
    c.block_table, c.max_blocks, c.block_size = a.ptr(bt, "int32_t *"), bt.shape[1], int(block_size)
    c.max_block = min(room[0], 2**62)
    c.code_start = a.ptr(i32(code_start), "int32_t *")
    c.code_end = a.ptr(i32(code_end), "int32_t *")
    if code_bias is not None:
        cb = f32(code_bias)
        if cb.ndim != 2 or cb.shape[0] != b or (b and cb.shape[1] < int(code_end.max())):
            raise ValueError(f"code_bias must be [B={b}, >= max(code_end)], got {tuple(code_bias.shape)}")
        c.bias, c.bias_stride = a.ptr(cb), cb.shape[1]
    out = torch.empty(b, hkv, r, d)
    exact = check_exact(exact, q)
    ne = 0 if exact is None else sum(k.shape[2] for k in exact[0])
    if ne > 0:
        ks, vs, xb = exact
        c.ne, c.dx, c.qx = ne, d, a.ptr(q32)
        segs = _exact_segments(ks, vs)
        c.n_xseg = len(segs)
        for e, (k, v) in zip(c.xseg, segs):
            _segment(a, e, k, v)
        if xb is not None:  # [B|1, H|1, R|1, n_x], broadcast through zero strides
            xb = xb.float()
            if xb.ndim != 4 or xb.stride(3) != 1:
                xb = xb.contiguous()
            c.xbias = a.ptr(xb)
            c.xbias_sb, c.xbias_sh, c.xbias_sr = (xb.stride(i) if xb.shape[i] > 1 else 0 for i in range(3))
    c.out = a.ptr(out)
    a.keep.append(tpl)  # its tensors (centroids, maps) stay alive through the call
    c.split_tokens = int(split_tokens)
    c.threads = int(threads or torch.get_num_threads())
    c.simd = _SIMD[impl]
    rc = mod.lib.qjl_paged_decode(c)
    if rc < -1:  # a range or a block out of bounds (nothing was read): the full check names it
        check_paged(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size, code_start,
                    code_end)
    if rc != 0:
        raise ValueError("the C kernel refused its arguments (code widths, lengths, group sizes, ranges or blocks)")
    return out


def _segment(a: Args, e, k, v) -> None:
    """Fill the C exact segment ``e`` from a (key, value) pair: tensors [B, H, n, D] (or [B, H, D], one token) with
    contiguous rows, or :class:`qjl.kernels.paged.PagedRows`."""
    if isinstance(k, torch.Tensor):
        a.keep += (k, v)
        _tensor_fill(a.ffi, e, k, v)
    else:  # PagedRows: the pages' bytes from each buffer's start, one offset per sequence and token (the kernel
        # checks every offset against the buffer's extent before it reads anything)
        e.n, e.dtype = k.shape[2], X_DTYPES[k.dtype]
        from qjl.kernels.paged import extent_bytes

        e.k, e.v = a.ptr(k.field.buffer, "const uint8_t *"), a.ptr(v.field.buffer, "const uint8_t *")
        e.k_sh, e.v_sh = k.field.stride_head, v.field.stride_head
        e.k_off, e.v_off = a.ptr(i64(k.offsets), "int64_t *"), a.ptr(i64(v.offsets), "int64_t *")
        e.k_room, e.v_room = extent_bytes(k.field.buffer), extent_bytes(v.field.buffer)


def _set_out(ffi, c, out: torch.Tensor) -> None:
    """Point the decode struct ``c``'s output at ``out``: float32 as ``out``, fp16 / bf16 as ``out_raw`` (the other
    pointer NULL, so a struct filled again keeps nothing of its last output)."""
    if out.dtype == torch.float32:
        c.out, c.out_raw = ffi.cast("float *", out.data_ptr()), ffi.NULL
    else:
        c.out, c.out_raw, c.out_dtype = ffi.NULL, ffi.cast("uint8_t *", out.data_ptr()), X_DTYPES[out.dtype]


def _tensor_fill(ffi, e, k: torch.Tensor, v: torch.Tensor) -> None:
    """Fill the C exact segment ``e`` from tensors k, v [B, H, n, D] (or [B, H, D], one token) of one fp32/fp16/bf16
    dtype with contiguous rows, read in place (the caller keeps them alive through the call)."""
    es = k.element_size()
    e.n, e.dtype = (k.shape[2] if k.ndim == 4 else 1), X_DTYPES[k.dtype]
    e.k, e.v = ffi.cast("const uint8_t *", k.data_ptr()), ffi.cast("const uint8_t *", v.data_ptr())
    e.k_sb, e.k_sh, e.v_sb, e.v_sh = k.stride(0) * es, k.stride(1) * es, v.stride(0) * es, v.stride(1) * es
    if k.ndim == 4:
        e.k_st, e.v_st = k.stride(2) * es, v.stride(2) * es


class _RowsBinding:
    """A (key, value) pair of exact fields as the C exact segment reads rows in place from them: each buffer's
    address, head stride and extent (the bytes the rows may reach, against which the kernel checks every offset),
    taken once; :meth:`holds` tells whether a call's fields are these objects with buffers that kept their address,
    shape and strides."""

    __slots__ = ("fields", "geometry", "snap", "k", "v", "k_sh", "v_sh", "k_room", "v_room")

    def __init__(self, ffi, fields: tuple, geometry: tuple):
        from qjl.kernels.paged import extent_bytes

        kf, vf = fields
        self.fields, self.geometry = fields, geometry
        self.snap = tuple((f.buffer.data_ptr(), tuple(f.buffer.shape), f.buffer.stride()) for f in fields)
        self.k, self.v = (ffi.cast("const uint8_t *", f.buffer.data_ptr()) for f in fields)
        self.k_sh, self.v_sh = kf.stride_head, vf.stride_head
        self.k_room, self.v_room = extent_bytes(kf.buffer), extent_bytes(vf.buffer)

    def holds(self, fields: tuple) -> bool:
        return all(f is g and g.buffer.data_ptr() == p and g.buffer.shape == sh and g.buffer.stride() == st
                   for f, g, (p, sh, st) in zip(fields, self.fields, self.snap))

    def fill(self, e, step: "DecodeStep") -> None:
        """Fill the C exact segment ``e`` with ``step``'s rows read in these fields."""
        e.n, e.dtype = step.n_rows, step.rows_dtype
        e.k, e.v, e.k_sh, e.v_sh = self.k, self.v, self.k_sh, self.v_sh
        e.k_off, e.v_off = step.c_offsets
        e.k_room, e.v_room = self.k_room, self.v_room


class DecodeStep:
    """What the decode calls of one step share -- the block table, the coded ranges, the exact rows' byte offsets
    and the exact tokens' bias (every layer of a vLLM step) -- checked and turned into C arguments once, for
    :func:`paged_decode_step`.

    block_table [B, max_blocks] int, block_size, code_start / code_end [B] int: as :func:`paged_decode`'s.
    rows: None, or the exact slots as a (key, value) pair of :class:`qjl.kernels.paged.PagedRows` [B, H, E, D]:
    each call reads these offsets in its own exact fields (``exact_fields``), which must have the rows' fields'
    geometry (offset, strides, dtype, shape; the buffer may differ: another layer's pages).
    segments: how many exact segments of tensors each call passes after the rows (0-2 with the rows' one; e.g.
    vLLM's current token, or transformers' sinks and window).
    xbias: None or [B|1, H|1, R|1, n_x] float, additive over the exact tokens (n_x: E + the calls' segments'
    tokens, checked per call).
    impl: as :func:`paged_decode`'s (checked here, resolved at each call).  The step keeps its tensors alive (the C arguments point at
    them); a call checks the values of the ranges and blocks in C, as :func:`paged_decode` does."""

    def __init__(self, block_table, block_size: int, code_start, code_end, *, rows=None, segments: int = 0,
                 xbias=None, impl: str = "auto"):
        from qjl.kernels.paged import PagedRows, check_table, field_geometry

        if not isinstance(block_table, torch.Tensor):
            raise ValueError(f"block_table must be a [B, max_blocks] int tensor, got {type(block_table).__name__}")
        b = block_table.shape[0] if block_table.ndim else -1
        check_table(b, block_table, block_size, code_start, code_end)
        if block_table.dtype.is_floating_point:
            raise ValueError(f"block_table must hold ints, got {block_table.dtype}")
        if isinstance(segments, bool) or not isinstance(segments, int) or not 0 <= segments <= 2 - (rows is not None):
            raise ValueError(f"segments must be an int in [0, {2 - (rows is not None)}] (at most two exact segments "
                             f"with the rows), got {segments!r}")
        _impl_code(impl)  # checked here; resolved per call ("auto" follows $QJL_CPU_IMPL, as paged_decode does)
        self.impl, self.mod = impl, require()
        ffi = self.mod.ffi
        self.batch, self.block_size, self.segments = b, int(block_size), segments
        self.block_table, self.code_start, self.code_end = i32(block_table), i32(code_start), i32(code_end)
        self.c_table = ffi.cast("int32_t *", self.block_table.data_ptr())
        self.c_start = ffi.cast("int32_t *", self.code_start.data_ptr())
        self.c_end = ffi.cast("int32_t *", self.code_end.data_ptr())
        self.rows = rows
        self.n_rows = 0
        if rows is not None:
            if (not isinstance(rows, tuple) or len(rows) != 2 or not all(isinstance(x, PagedRows) for x in rows)):
                raise ValueError("rows must be None or a (key, value) pair of PagedRows")
            kr, vr = rows
            if kr.shape != vr.shape or kr.shape[0] != b or kr.dtype != vr.dtype or kr.dtype not in X_DTYPES:
                raise ValueError(f"rows: key and value rows must both be [B={b}, H, E, D] of one float dtype "
                                 f"(fp32, fp16, bf16), got {kr.shape} {kr.dtype} and {vr.shape} {vr.dtype}")
            self.n_rows, self.heads, self.dim = kr.shape[2], kr.shape[1], kr.shape[3]
            self.geometry = (field_geometry(kr.field), field_geometry(vr.field))
            self.offsets = (i64(kr.offsets), i64(vr.offsets))
            self.c_offsets = tuple(ffi.cast("int64_t *", t.data_ptr()) for t in self.offsets)
            self.rows_dtype = X_DTYPES[kr.dtype]
        self.xbias = None
        if xbias is not None:
            if not isinstance(xbias, torch.Tensor) or xbias.ndim != 4 or xbias.shape[0] not in (1, b):
                raise ValueError(f"xbias must be [{b}|1, H|1, R|1, n_x], got {getattr(xbias, 'shape', xbias)!r}")
            if not segments and xbias.shape[-1] != self.n_rows:
                raise ValueError(f"xbias must cover the {self.n_rows} exact rows, got {tuple(xbias.shape)}")
            xb = xbias.float()
            self.xbias = xb if xb.stride(3) == 1 else xb.contiguous()
            self.c_xbias = ffi.cast("float *", self.xbias.data_ptr())
            self.xbias_strides = tuple(self.xbias.stride(i) if self.xbias.shape[i] > 1 else 0 for i in range(3))
        self._scratch = self._shared = None

    def shared(self):
        """The step's ``qjl_step_shared`` (decode.h): its block table, ranges, bias and exact rows' offsets, with the
        threads (``torch.get_num_threads()``) and the kernel path (``impl`` resolved) of its first call, filled once
        for every layer's :class:`DecodeStore` call of the step (a vLLM step's layers follow each other at once)."""
        if self._shared is None:
            ffi = self.mod.ffi
            sh = ffi.new("qjl_step_shared *")
            sh.batch, sh.max_blocks = self.batch, self.block_table.shape[1]
            sh.block_table, sh.code_start, sh.code_end = self.c_table, self.c_start, self.c_end
            if self.xbias is not None:
                sh.xbias = self.c_xbias
                sh.xbias_sb, sh.xbias_sh, sh.xbias_sr = self.xbias_strides
            if self.rows is not None:
                sh.n_rows, sh.rows_dtype = self.n_rows, self.rows_dtype
                sh.k_off, sh.v_off = self.c_offsets
            sh.threads, sh.simd = torch.get_num_threads(), _SIMD[_impl_code(self.impl)]
            self._shared = sh
        return self._shared

    def scratch(self, *shapes) -> tuple:
        """Float32 tensors of ``shapes``, made once and handed to every call of this step that asks for the same
        shapes: the layers of one vLLM step, one after another, so a layer's call allocates nothing (a cold
        ``torch.empty`` costs tens of microseconds between two layers).  What one call leaves there is valid until the
        next call of the step."""
        hit = self._scratch
        if hit is None or hit[0] != shapes:
            hit = self._scratch = (shapes, tuple(torch.empty(s) for s in shapes))
        return hit[1]

    def rows_in(self, exact_fields) -> tuple:
        """The step's exact rows read in a layer's exact fields: (key, value) :class:`qjl.kernels.paged.PagedRows`.
        ValueError unless the fields are a CPU (key, value) pair with the geometry the rows were built for (the
        kernel checks every offset against the buffers' extent before reading)."""
        from qjl.kernels.paged import PagedRows, field_geometry

        if not isinstance(exact_fields, tuple) or len(exact_fields) != 2:
            raise ValueError("exact_fields must be a (key, value) pair of PagedFields")
        kf, vf = exact_fields
        if (field_geometry(kf), field_geometry(vf)) != self.geometry:
            raise ValueError("exact_fields: their offset, strides, dtype or shape differ from those the step's rows "
                             "were built for")
        if kf.buffer.device.type != "cpu" or vf.buffer.device.type != "cpu":
            raise ValueError("exact_fields must live in CPU memory")
        return PagedRows(kf, self.offsets[0], self.heads), PagedRows(vf, self.offsets[1], self.heads)

    def fill(self, c) -> None:
        """Write the step's block table, coded ranges and exact-token bias into the decode struct ``c``."""
        c.batch, c.block_table, c.max_blocks, c.block_size = (self.batch, self.c_table, self.block_table.shape[1],
                                                              self.block_size)
        c.code_start, c.code_end = self.c_start, self.c_end
        if self.xbias is not None:
            c.xbias = self.c_xbias
            c.xbias_sb, c.xbias_sh, c.xbias_sr = self.xbias_strides

    def bind_rows(self, exact_fields, memo: dict | None) -> "_RowsBinding":
        """The step's exact rows in a layer's exact fields as the C segment reads them (:class:`_RowsBinding`),
        checked as :meth:`rows_in` checks them; kept in ``memo`` (a dict living as long as the fields, e.g. the key
        fields' :attr:`qjl.kernels.paged.FieldMap.memo`) while the fields are the same objects with buffers of the
        same address and geometry, so a layer binds its exact fields once, not at every step."""
        if not isinstance(exact_fields, tuple) or len(exact_fields) != 2:
            raise ValueError("exact_fields must be a (key, value) pair of PagedFields")
        key = ("rows", id(exact_fields[0]), id(exact_fields[1]))
        hit = memo.get(key) if memo is not None else None
        if hit is None or not hit.holds(exact_fields) or hit.geometry != self.geometry:
            self.rows_in(exact_fields)  # the checks (geometry, device), with their messages
            hit = _RowsBinding(self.mod.ffi, exact_fields, self.geometry)
            if memo is not None:
                memo[key] = hit
        return hit

    def exact(self, exact_fields, segments) -> tuple | None:
        """The exact tokens of a call as :func:`paged_decode` takes them (``(xk, xv, xbias)``, or None)."""
        ks, vs = [], []
        if self.rows is not None:
            kr, vr = self.rows_in(exact_fields)
            ks.append(kr)
            vs.append(vr)
        ks += [k for k, _ in segments]
        vs += [v for _, v in segments]
        return (tuple(ks), tuple(vs), self.xbias) if ks else None


def paged_decode_step(q, key_codec, key_fields, value_codec, value_fields, step: DecodeStep, *, exact_fields=None,
                      segments=(), q_scale: float = 1.0, out: torch.Tensor | None = None,
                      threads: int | None = None) -> torch.Tensor:
    """:func:`paged_decode` with the step's shared arguments taken from ``step`` (a :class:`DecodeStep`): the
    same C call and result, bit for bit, with only what changes from layer to layer checked and filled here
    (the layer's query, fields, exact fields and exact tensors).

    q [B, H_kv, R, D] float, multiplied by ``q_scale`` (the softmax scale; fp32/fp16/bf16 queries are converted
    and scaled inside the call, as ``q.float() * q_scale`` rounds); exact_fields: the (key, value) PagedFields of
    the exact slots when ``step.rows`` is set; segments: ``step.segments`` pairs (k, v) of exact tokens
    [B, H_kv, n, D], or [B, H_kv, D] for one token (fp32/fp16/bf16 read in place; other floats converted), after
    the rows; out: None, or a contiguous [B, H_kv, R, D] fp32/fp16/bf16 tensor the result is written into (fp16 /
    bf16 rounded to nearest even, as ``.to()`` rounds), returned.  Key codecs whose query maps the kernel does not
    apply itself go through :func:`paged_decode` (same result)."""
    if not isinstance(step, DecodeStep):
        raise TypeError(f"step must be a DecodeStep, got {type(step).__name__}")
    if (not isinstance(q, torch.Tensor) or q.ndim != 4 or q.shape[0] != step.batch or q.device.type != "cpu"
            or not q.dtype.is_floating_point):
        raise ValueError(f"q must be a float CPU tensor [B={step.batch}, H_kv, R, D], got {getattr(q, 'shape', q)!r}")
    b, h, r, d = q.shape
    if isinstance(q_scale, bool) or not isinstance(q_scale, (int, float)) or not abs(q_scale) < float("inf"):
        raise ValueError(f"q_scale must be a finite float, got {q_scale!r}")
    if (step.rows is not None) != (exact_fields is not None):
        raise ValueError("exact_fields must be given exactly when the step has exact rows")
    if not isinstance(segments, tuple) or len(segments) != step.segments:
        raise ValueError(f"segments must be a tuple of the step's {step.segments} (k, v) pairs")
    if step.rows is not None and (h, d) != (step.heads, step.dim):
        raise ValueError(f"q: {h} KV heads of dim {d}, but the step's exact rows have {step.heads} of {step.dim}")
    if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != (b, h, r, d)
                            or out.dtype not in X_DTYPES or not out.is_contiguous() or out.device.type != "cpu"):
        raise ValueError(f"out must be a contiguous fp32/fp16/bf16 CPU tensor [{b}, {h}, {r}, {d}], got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
    segs = [_tensor_segment(i, kv, (b, h, d)) for i, kv in enumerate(segments)]
    ne = step.n_rows + sum(n for _, _, n in segs)
    xb = step.xbias
    if xb is not None and (xb.shape[1] not in (1, h) or xb.shape[2] not in (1, r) or xb.shape[3] != ne):
        raise ValueError(f"the step's xbias {tuple(xb.shape)} does not broadcast over [B, {h}, {r}, {ne}]")
    mod = step.mod
    prep = _prepared(mod, q, key_codec, key_fields, value_codec, value_fields, step.block_table, step.block_size,
                     step.code_start, step.code_end, checked=True)
    tpl = prep.tpl
    if not tpl.qmaps:  # per-block query maps (shared fields): the general launcher
        got = paged_decode(q.float() * q_scale, key_codec, key_fields, value_codec, value_fields, step.block_table,
                           step.block_size, step.code_start, step.code_end,
                           exact=step.exact(exact_fields, [(k if k.ndim == 4 else k.unsqueeze(2),
                                                           v if v.ndim == 4 else v.unsqueeze(2)) for k, v, _ in segs]),
                           impl=step.impl, threads=threads)
        return got if out is None else out.copy_(got)
    a = Args(mod.ffi)
    c = a.c
    mod.ffi.memmove(c, tpl.c, mod.ffi.sizeof("qjl_decode_args"))
    if q.dtype in X_DTYPES and q.is_contiguous():  # converted and scaled in the call
        c.q_raw, c.q_dtype, c.q_scale = a.ptr(q, "const uint8_t *"), X_DTYPES[q.dtype], float(q_scale)
        qf = mod.ffi.NULL
    else:
        qf = a.ptr(f32(q.float() * q_scale))
    for i in range(c.n_terms):
        c.key[i].q = qf
    c.heads, c.rows = h, r
    step.fill(c)
    c.max_block = min(prep.room[0], 2**62)
    a.keep.append(step)
    n_seg = 0
    if step.rows is not None:  # the layer's exact fields bound once (key fields' memo), the step's offsets
        from qjl.kernels.paged import FieldMap

        rb = step.bind_rows(exact_fields, key_fields.memo if isinstance(key_fields, FieldMap) else None)
        rb.fill(c.xseg[0], step)
        a.keep.append(rb)
        n_seg = 1
    for k, v, n in segs:
        if n:
            _segment(a, c.xseg[n_seg], k, v)
            n_seg += 1
    if ne:
        c.ne, c.dx, c.qx, c.n_xseg = ne, d, qf, n_seg
    if out is None:
        out = torch.empty(b, h, r, d)
    _set_out(mod.ffi, c, out)  # (out is returned: alive through the call)
    a.keep.append(tpl)
    c.threads = int(threads or torch.get_num_threads())
    c.simd = _SIMD[_impl_code(step.impl)]
    _decode_status(mod.lib.qjl_paged_decode(c), q, key_codec, key_fields, value_codec, value_fields, step)
    return out


def _fill_segments(ffi, xseg, segments: tuple, bhd: tuple) -> tuple:
    """Fill the C exact segments ``xseg`` from a call's (k, v) pairs (each checked by :func:`_tensor_segment`, which
    converts what the kernel does not read in place; empty ones skipped) -> (segments filled, their tokens, the
    tensors read: the caller keeps them alive through the call)."""
    n_seg = ne = 0
    segs = [_tensor_segment(i, kv, bhd) for i, kv in enumerate(segments)]
    for k, v, n in segs:
        if n:
            _tensor_fill(ffi, xseg[n_seg], k, v)
            n_seg, ne = n_seg + 1, ne + n
    return n_seg, ne, segs


def _check_call(q, q_scale, out, qshape, qdtype, whose: str) -> None:
    """A kept call's arguments: q contiguous of the build's shape and dtype, a finite ``q_scale``, out a contiguous
    fp32/fp16/bf16 CPU tensor of q's shape (ValueError naming the argument)."""
    if not isinstance(q, torch.Tensor) or q.shape != qshape or q.dtype != qdtype or not q.is_contiguous():
        raise ValueError(f"q must be a contiguous {qdtype} tensor {tuple(qshape)} ({whose}), "
                         f"got {getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    if isinstance(q_scale, bool) or not isinstance(q_scale, (int, float)) or not abs(q_scale) < float("inf"):
        raise ValueError(f"q_scale must be a finite float, got {q_scale!r}")
    if (not isinstance(out, torch.Tensor) or out.shape != qshape or out.dtype not in X_DTYPES
            or not out.is_contiguous() or out.device.type != "cpu"):
        b, h, r, d = qshape
        raise ValueError(f"out must be a contiguous fp32/fp16/bf16 CPU tensor [{b}, {h}, {r}, {d}], got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")


class DecodeCall:
    """:func:`paged_decode_step` of one layer with everything but the query, the exact segments and the output
    filled once (a transformers cache layer between two flushes: its codes, fields and ranges do not change), and
    optionally a value mean added in the same C call (``qjl_decode_mean``, step.c).  Equal bit for bit to::

        o = paged_decode_step(q, key_codec, key_fields, value_codec, value_fields, step, segments=segments,
                              q_scale=q_scale)                          # float32 [B, H_kv, R, D]
        out.copy_(o + mean[:, :, None])                                 # (without a mean: out.copy_(o))

    Built from a first query ``q`` [B, H_kv, R, D] (every call's query has its shape and dtype), the layer's codecs
    and :class:`qjl.kernels.paged.FieldMap` fields, a :class:`DecodeStep` without exact rows, and ``mean``: None or a
    contiguous float32 [B, H_kv, D] tensor (each sequence's value mean, read at every call: kept by reference).
    :attr:`served` is False where the key codec's query maps are not the kernel's own (per-block maps): there
    :func:`paged_decode_step` serves the layer.  A call refuses buffers that moved or changed shape since the build
    (build another).  One caller at a time (the struct is filled in place)."""

    __slots__ = ("mod", "objects", "prep", "step", "qshape", "qdtype", "mean", "c", "served")

    def __init__(self, q, key_codec, key_fields, value_codec, value_fields, step: DecodeStep, *, mean=None):
        from qjl.kernels.paged import FieldMap

        if not isinstance(step, DecodeStep) or step.rows is not None:
            raise ValueError("step must be a DecodeStep without exact rows")
        if not (isinstance(key_fields, FieldMap) and isinstance(value_fields, FieldMap)):
            raise TypeError("key_fields and value_fields must be FieldMaps (their checks are kept between calls)")
        if (not isinstance(q, torch.Tensor) or q.ndim != 4 or q.shape[0] != step.batch or q.device.type != "cpu"
                or q.dtype not in X_DTYPES):
            raise ValueError(f"q must be a fp32/fp16/bf16 CPU tensor [B={step.batch}, H_kv, R, D], got "
                             f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
        b, h, r, d = q.shape
        if mean is not None and (not isinstance(mean, torch.Tensor) or tuple(mean.shape) != (b, h, d)
                                 or mean.dtype != torch.float32 or not mean.is_contiguous()
                                 or mean.device.type != "cpu"):
            raise ValueError(f"mean must be None or a contiguous float32 CPU tensor [{b}, {h}, {d}], got "
                             f"{getattr(mean, 'dtype', type(mean).__name__)} {tuple(getattr(mean, 'shape', ()))}")
        self.mod = mod = step.mod
        ffi = mod.ffi
        self.prep = prep = _prepared(mod, q, key_codec, key_fields, value_codec, value_fields, step.block_table,
                                     step.block_size, step.code_start, step.code_end)
        self.objects = (key_codec, key_fields, value_codec, value_fields)
        self.served = bool(prep.tpl.qmaps)
        self.step, self.qshape, self.qdtype, self.mean = step, q.shape, q.dtype, mean
        self.c = c = ffi.new("qjl_decode_args *")
        ffi.memmove(c, prep.tpl.c, ffi.sizeof("qjl_decode_args"))
        for i in range(c.n_terms):
            c.key[i].q = ffi.NULL  # (the query is given raw: converted and scaled in the call)
        c.heads, c.rows, c.q_dtype, c.dx = h, r, X_DTYPES[q.dtype], d
        step.fill(c)
        c.max_block = min(prep.room[0], 2**62)

    def __call__(self, q, segments: tuple, *, q_scale: float, out: torch.Tensor) -> torch.Tensor:
        """q [B, H_kv, R, D] contiguous, of the build's shape and dtype, multiplied by ``q_scale`` in the call;
        segments: the step's ``segments`` (k, v) pairs of exact tokens [B, H_kv, n, D] (as
        :func:`paged_decode_step`'s); out: a contiguous fp32/fp16/bf16 [B, H_kv, R, D] tensor, written and
        returned."""
        _check_call(q, q_scale, out, self.qshape, self.qdtype, "this DecodeCall's")
        b, h, r, d = self.qshape
        step = self.step
        if not isinstance(segments, tuple) or len(segments) != step.segments:
            raise ValueError(f"segments must be a tuple of the step's {step.segments} (k, v) pairs")
        kc, kf, vc, vf = self.objects
        if not self.prep.matches(vf, kc, vc):
            raise ValueError("a buffer this DecodeCall points into moved or changed shape since it was built: build "
                             "another")
        mod, c = self.mod, self.c
        ffi = mod.ffi
        c.n_xseg, c.ne, segs = _fill_segments(ffi, c.xseg, segments, (b, h, d))  # (segs: alive through the call)
        c.q_raw, c.q_scale = ffi.cast("const uint8_t *", q.data_ptr()), float(q_scale)
        c.threads = torch.get_num_threads()
        c.simd = _SIMD[_impl_code(step.impl)]
        if self.mean is not None:  # the kernel's float32 output (scratch per call: nothing held between calls)
            tmp = torch.empty(self.qshape)
            c.out, c.out_raw = ffi.cast("float *", tmp.data_ptr()), ffi.NULL
            rc = mod.lib.qjl_decode_mean(c, ffi.cast("float *", self.mean.data_ptr()),
                                         ffi.cast("uint8_t *", out.data_ptr()), X_DTYPES[out.dtype])
        else:
            _set_out(ffi, c, out)
            rc = mod.lib.qjl_paged_decode(c)
        del segs  # (read by the call)
        _decode_status(rc, q, kc, kf, vc, vf, step)
        return out


class DecodeHeads:
    """One layer's decode step whose KV heads are coded in runs of their own codecs (widths per KV head,
    :class:`qjl.cache.storage.HeadGroupView`) in one C call (``qjl_decode_heads``): every run's items in one
    parallel region, each run's value mean added, every row written into one output.  Equal bit for bit to the runs'
    :class:`DecodeCall` calls, each over its run's heads::

        for call, heads in zip(calls, runs):                      # runs: consecutive slices tiling the KV heads
            call(q[:, heads], segments over those heads, q_scale=q_scale, out=out[:, heads])

    up to the split of each run's coded tokens into work items, which is chosen for all runs together (as one call
    over every head would: runs with one pair of codecs give that call's outputs bit for bit).

    ``calls``: a :class:`DecodeCall` per run, built without a mean (its codes, codecs, fields and ranges are read; its
    query, segments and output are this call's), in order of their heads; ``mean``: None or a contiguous float32
    [B, H_kv, D] tensor of every head (read at every call).  One caller at a time."""

    __slots__ = ("mod", "calls", "args", "head0", "heads", "qshape", "qdtype", "mean", "xseg", "failed", "segments",
                 "served")

    def __init__(self, calls, *, mean=None):
        if not isinstance(calls, (list, tuple)) or not calls or not all(isinstance(c, DecodeCall) for c in calls):
            raise TypeError("calls must be a non-empty sequence of DecodeCall")
        if any(c.mean is not None for c in calls):
            raise ValueError("calls must be built without a mean (the mean of every head is given here)")
        b, _, r, d = calls[0].qshape
        dtype, segments = calls[0].qdtype, calls[0].step.segments
        if any(c.qshape[0] != b or c.qshape[2:] != (r, d) or c.qdtype != dtype or c.step.segments != segments
               or c.mod is not calls[0].mod for c in calls):
            raise ValueError("calls: every run must have the same batch, query rows, head dim, query dtype and "
                             "segments")
        h = sum(c.qshape[1] for c in calls)
        if mean is not None and (not isinstance(mean, torch.Tensor) or tuple(mean.shape) != (b, h, d)
                                 or mean.dtype != torch.float32 or not mean.is_contiguous()
                                 or mean.device.type != "cpu"):
            raise ValueError(f"mean must be None or a contiguous float32 CPU tensor [{b}, {h}, {d}], got "
                             f"{getattr(mean, 'dtype', type(mean).__name__)} {tuple(getattr(mean, 'shape', ()))}")
        self.mod = mod = calls[0].mod
        ffi = mod.ffi
        self.calls, self.mean, self.segments = tuple(calls), mean, segments
        self.served = all(c.served for c in calls)
        self.args = ffi.new("qjl_decode_args *[]", [c.c for c in calls])
        self.head0 = ffi.new("int64_t[]", [0, *itertools.accumulate(c.qshape[1] for c in calls[:-1])])
        self.heads, self.qshape, self.qdtype = h, torch.Size((b, h, r, d)), dtype
        self.xseg = ffi.new("qjl_exact_seg[2]")
        self.failed = ffi.new("int32_t[1]")

    def __call__(self, q, segments: tuple, *, q_scale: float, out: torch.Tensor) -> torch.Tensor:
        """q [B, H_kv, R, D] contiguous of every KV head (the runs' query dtype), multiplied by ``q_scale`` in the
        call; segments: the runs' ``segments`` (k, v) pairs of exact tokens [B, H_kv, n, D] of every head; out: a
        contiguous fp32/fp16/bf16 [B, H_kv, R, D] tensor, written and returned."""
        _check_call(q, q_scale, out, self.qshape, self.qdtype, "this DecodeHeads'")
        b, h, r, d = self.qshape
        if not isinstance(segments, tuple) or len(segments) != self.segments:
            raise ValueError(f"segments must be a tuple of the runs' {self.segments} (k, v) pairs")
        for call in self.calls:
            kc, kf, vc, vf = call.objects
            if not call.prep.matches(vf, kc, vc):
                raise ValueError("a buffer a run's DecodeCall points into moved or changed shape since it was built: "
                                 "build another")
        mod = self.mod
        ffi = mod.ffi
        n_seg, ne, segs = _fill_segments(ffi, self.xseg, segments, (b, h, d))  # (segs: alive through the call)
        mean = self.mean
        rc = mod.lib.qjl_decode_heads(
            self.args, len(self.calls), self.head0, h, self.xseg, n_seg, ne,
            ffi.cast("const uint8_t *", q.data_ptr()), X_DTYPES[q.dtype], float(q_scale),
            ffi.NULL if mean is None else ffi.cast("const float *", mean.data_ptr()),
            ffi.cast("uint8_t *", out.data_ptr()), X_DTYPES[out.dtype], torch.get_num_threads(),
            _SIMD[_impl_code(self.calls[0].step.impl)], self.failed)
        del segs  # (read by the call)
        if rc:
            call = self.calls[int(self.failed[0])]
            kc, kf, vc, vf = call.objects
            _decode_status(rc, q[:, :call.qshape[1]].contiguous(), kc, kf, vc, vf, call.step)
        return out


class DecodeStore:
    """A layer's decode step in one C call (``qjl_decode_store``, step.c), with what does not change from step to
    step checked and filled once: the new keys (values) less their sequences' key (value) means, both roles
    quantized and stored, the paged decode with the new tokens as the last exact segment, the value mean added
    back.  Equal bit for bit to the calls it replaces::

        k = key.float() - mu                                   # mu: each sequence's key mean, read from mu_field
        v = value.float() - mu_v                               # (value when there is no mu_v_field)
        store((k, v), blocks, slots, bounds)                   # codes and norms into the pages
        o = paged_decode_step(q, ..., segments=((k, v),))      # the attention
        out.copy_(o + mu_v[:, :, None])                        # (with mu_v: in float32, then out's dtype)

    Built for one layer from a first :class:`DecodeStep` ``step`` (``segments=1``) and query ``q`` [B, H_kv, R, D]:
    its codecs and (key, value) fields (FieldMaps), ``store`` (the :class:`EncodeStore` of a key job then a value
    job, :func:`qjl.kernels.encode.encode_store`), ``mu_field`` (None: no smoothing; or a PagedField of [D] means,
    fp32/fp16/bf16, at each sequence's block 0, slot 0), ``mu_v_field`` (the same for value means, or None) and
    ``exact_fields`` (the (key, value) PagedFields the steps' exact rows are read in, when ``step.rows`` is set) and
    ``write_fields`` (the (key, value) PagedFields of [D] fp32/fp16/bf16 entries the calls' ``writes`` store the
    stored keys and values into, after the attention: the vLLM backend's exact copies; None: no writes).
    :meth:`holds` tells whether a call's objects are these, their buffers unmoved (a call refuses moved buffers:
    build another); the key codec's query maps must be the kernel's own (:attr:`served`; else the general launcher
    serves the layer).  Either role may be a vector codebook's and the values may be coded over rotations in turn
    (each call then gives the tokens' ``positions``).  One caller at a time."""

    def __init__(self, q, key_codec, key_fields, value_codec, value_fields, step: DecodeStep, store: "EncodeStore",
                 *, mu_field=None, mu_v_field=None, exact_fields=None, write_fields=None):
        from qjl.kernels.paged import FieldMap, extent_bytes, mix_view

        view = mix_view(value_codec)
        if not isinstance(step, DecodeStep) or step.segments != 1:
            raise ValueError("step must be a DecodeStep with one segment (the new tokens)")
        if not isinstance(store, EncodeStore) or len(store.static) != 2:
            raise TypeError(f"store must be an EncodeStore of a key and a value job, got {type(store).__name__}")
        if store.static[1][0].cycles != (view.cycles if view is not None else 1):
            raise ValueError("store: its value job's rotations in turn differ from the value codec's accumulators")
        if not (isinstance(key_fields, FieldMap) and isinstance(value_fields, FieldMap)):
            raise TypeError("key_fields and value_fields must be FieldMaps (their checks are kept between steps)")
        if not isinstance(q, torch.Tensor) or q.ndim != 4 or q.shape[0] != step.batch:
            raise ValueError(f"q must be a tensor [B={step.batch}, H_kv, R, D], got {getattr(q, 'shape', q)!r}")
        b, h, r, d = q.shape
        self.mod = mod = step.mod
        ffi = mod.ffi
        self.objects = (key_codec, key_fields, value_codec, value_fields, store, mu_field, exact_fields,
                        mu_v_field)
        self.prep = prep = _prepared(mod, q, key_codec, key_fields, value_codec, value_fields, step.block_table,
                                     step.block_size, step.code_start, step.code_end)
        self.served = bool(prep.tpl.qmaps)
        self.shape, self.block_size = (h, r, d), step.block_size
        self.geometry = step.geometry if step.rows is not None else None
        self.rows = step.bind_rows(exact_fields, key_fields.memo) if step.rows is not None else None
        a = self.args = Args(ffi)  # (its keep list holds what the template points at)
        t = self.tpl = ffi.new("qjl_step_args *")
        c = t.decode
        ffi.memmove(ffi.addressof(c), prep.tpl.c, ffi.sizeof("qjl_decode_args"))
        a.keep.append(prep.tpl)
        c.heads, c.rows, c.block_size, c.max_block = h, r, step.block_size, min(prep.room[0], 2**62)
        for i in range(c.n_terms):
            c.key[i].q = ffi.NULL  # (the query is given raw: converted and scaled in the call)
        n_seg = 0
        if self.rows is not None:
            self.rows.fill(c.xseg[0], step)
            n_seg = 1
        e = c.xseg[n_seg]  # the new tokens: k_out / v_out [B, H, D] float32, filled per call
        e.n, e.dtype, e.k_sh, e.v_sh = 1, 0, d * 4, d * 4
        e.k_sb = e.v_sb = h * d * 4
        c.n_xseg, c.dx = n_seg + 1, d
        self.jobs = ffi.new("qjl_encode_job[2]")
        self.status = ffi.new("int32_t[2]")  # (a call's stage and failed job, written by C)
        ffi.memmove(self.jobs, store.cj, 2 * ffi.sizeof("qjl_encode_job"))
        j0 = self.jobs[0]  # the keys less their means: k_out
        j0.x_dtype, j0.x_st, j0.x_sh = 0, h * d * 4, d * 4
        t.jobs, t.n_jobs, t.dim = self.jobs, 2, d
        self.store = store
        buffers = [f.buffer for f in (*key_fields.values(), *value_fields.values())]
        buffers += [x[5] for x in store.limits] + ([f.buffer for f in exact_fields] if self.rows is not None else [])
        for name, f, dst in (("mu_field", mu_field, "mu"), ("mu_v_field", mu_v_field, "mu_v")):
            if f is None:
                continue
            if f.dtype not in X_DTYPES or tuple(f.shape) != (d,) or f.buffer.device.type != "cpu" or min(
                    f.offset, f.stride_block, f.stride_head) < 0:
                raise ValueError(f"{name} must hold [{d}] fp32/fp16/bf16 means in CPU memory at non-negative "
                                 f"offsets, got {f.dtype} {tuple(f.shape)}")
            room = extent_bytes(f.buffer) - (f.offset + (h - 1) * f.stride_head + f.entry_bytes)
            if room < 0:
                raise ValueError(f"{name}: its buffer cannot hold one block's means")
            a.field(getattr(t, dst), f, True)
            setattr(t, dst + "_max_block", room // f.stride_block if f.stride_block > 0 else 2**62)
            buffers.append(f.buffer)
        self.writes = write_fields is not None
        if self.writes:
            if not isinstance(write_fields, tuple) or len(write_fields) != 2:
                raise ValueError("write_fields must be a (key, value) pair of PagedFields")
            for name, f, dst in (("key", write_fields[0], "wk"), ("value", write_fields[1], "wv")):
                if (f.dtype not in X_DTYPES or tuple(f.shape) != (d,) or f.buffer.device.type != "cpu"
                        or f.buffer.dtype != torch.uint8 or not f.buffer.is_contiguous()):
                    raise ValueError(f"write_fields ({name}) must hold [{d}] fp32/fp16/bf16 entries in a contiguous "
                                     f"uint8 CPU buffer, got {f.dtype} {tuple(f.shape)}")
                setattr(t, dst, ffi.cast("uint8_t *", f.buffer.data_ptr()))
                setattr(t, dst + "_room", f.buffer.numel())
                setattr(t, dst + "_dtype", X_DTYPES[f.dtype])
                buffers.append(f.buffer)
        if mu_v_field is not None:  # the smoothed values: stored from v_out
            j1 = self.jobs[1]
            j1.x_dtype, j1.x_st, j1.x_sh = 0, h * d * 4, d * 4
        self.smooth_values = mu_v_field is not None
        seen = {}
        for buf in buffers:  # every distinct buffer the template points at, as it is now
            seen.setdefault(id(buf), (buf, buf.data_ptr(), tuple(buf.shape), buf.stride()))
        self.buffers = tuple(seen.values())
        a.keep.extend(buf for buf, *_ in self.buffers)

    def holds(self, key_codec, key_fields, value_codec, value_fields, store, mu_field, exact_fields,
              mu_v_field=None) -> bool:
        """The call's objects are the ones this was built for, and every buffer kept its address and geometry."""
        return all(x is y for x, y in zip(self.objects, (key_codec, key_fields, value_codec, value_fields, store,
                                                          mu_field, exact_fields, mu_v_field))) and self.unmoved()

    def unmoved(self) -> bool:
        """Every buffer the C arguments point into kept its address and geometry (a caller that keeps one
        DecodeStore per set of objects checks only this)."""
        return all(t.data_ptr() == p and t.shape == sh and t.stride() == st for t, p, sh, st in self.buffers)

    def __call__(self, q, key, value, step: DecodeStep, bounds: tuple, *, q_scale: float = 1.0,
                 out: torch.Tensor | None = None, threads: int | None = None, checked: bool = False,
                 positions: torch.Tensor | None = None, writes: tuple | None = None) -> tuple:
        """One step: q [B, H_kv, R, D] float (scaled by ``q_scale`` in the call), key / value [B, H_kv, D]
        fp32/fp16/bf16 with contiguous rows (one new token per sequence), ``step`` the step's :class:`DecodeStep`
        (``segments=1``; its exact rows of the geometry this was built for), ``bounds`` :func:`store_bounds` of
        the tokens' blocks and slots (sequence b's codes at entry b), out None or a contiguous [B, H_kv, R, D]
        fp32/fp16/bf16 tensor the attention is written into; ``checked``: the caller has just found
        :meth:`unmoved` true (it is not asked again); ``positions`` [B] int: each new token's position in its
        sequence (needed where the store codes values over rotations in turn, :attr:`EncodeStore.positional`);
        ``writes`` None, or (rows [N], k_off [N, H_kv], v_off [N, H_kv]) contiguous int64 CPU tensors: after the
        attention, sequence rows[i]'s stored key and value of head h are written in the ``write_fields``' dtypes at
        byte offsets k_off[i, h], v_off[i, h] of their buffers (every write checked first; one outside its buffer:
        ValueError, nothing stored).

        Returns (status, job, out, k, v): status 0, or the store's status of its failing ``job`` (nothing stored,
        nothing attended; :func:`qjl.kernels.encode.raise_store_error` names it); k, v [B, H_kv, D] float32 the keys
        and values as stored and attended (the step's :meth:`DecodeStep.scratch`: valid until the step's next call).
        ValueError for arguments or positions that do not fit (nothing stored)."""
        h, r, d = self.shape
        if not checked and not self.unmoved():
            raise ValueError("a buffer this DecodeStore points into moved or changed shape since it was built: build "
                             "another (nothing stored)")
        if not isinstance(step, DecodeStep) or step.segments != 1 or step.block_size != self.block_size:
            raise ValueError("step must be a DecodeStep with one segment and this layer's block size")
        if (step.rows is not None) != (self.rows is not None) or (step.rows is not None
                                                                  and step.geometry != self.geometry):
            raise ValueError("step: its exact rows differ from those this DecodeStore was built for")
        b = step.batch
        if (not isinstance(q, torch.Tensor) or tuple(q.shape) != (b, h, r, d) or q.device.type != "cpu"
                or not q.dtype.is_floating_point):
            raise ValueError(f"q must be a float CPU tensor [{b}, {h}, {r}, {d}], got {getattr(q, 'shape', q)!r}")
        if q.dtype not in X_DTYPES or not q.is_contiguous():
            q = q.contiguous() if q.dtype in X_DTYPES else q.float()
        if isinstance(q_scale, bool) or not isinstance(q_scale, (int, float)) or not abs(q_scale) < float("inf"):
            raise ValueError(f"q_scale must be a finite float, got {q_scale!r}")
        for name, x in (("key", key), ("value", value)):
            if (not isinstance(x, torch.Tensor) or tuple(x.shape) != (b, h, d) or x.dtype not in X_DTYPES
                    or x.stride(2) != 1 or x.device.type != "cpu"):
                raise ValueError(f"{name} must be a CPU fp32/fp16/bf16 tensor [{b}, {h}, {d}] with contiguous rows, "
                                 f"got {getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        if out is None:
            out = torch.empty(b, h, r, d)
        elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != (b, h, r, d) or out.dtype not in X_DTYPES
              or not out.is_contiguous() or out.device.type != "cpu"):
            raise ValueError(f"out must be a contiguous fp32/fp16/bf16 CPU tensor [{b}, {h}, {r}, {d}], got "
                             f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
        blk, slt = bounds[:2]
        if blk.shape[0] != b:
            raise ValueError(f"bounds: {blk.shape[0]} positions for {b} sequences (nothing stored)")
        self.store.check_positions(bounds)
        pos = check_positions(positions, b) if self.store.positional or positions is not None else None
        xb, ne = step.xbias, step.n_rows + 1
        if xb is not None and (xb.shape[1] not in (1, h) or xb.shape[2] not in (1, r) or xb.shape[3] != ne):
            raise ValueError(f"the step's xbias {tuple(xb.shape)} does not broadcast over [B, {h}, {r}, {ne}]")
        n_w, w_ptrs = 0, (0, 0, 0)
        if writes is not None:
            if not self.writes:
                raise ValueError("writes given to a DecodeStore built without write_fields (nothing stored)")
            w_rows, wk_off, wv_off = writes
            n_w = w_rows.shape[0] if isinstance(w_rows, torch.Tensor) else -1
            for name, x, shape in (("rows", w_rows, (n_w,)), ("k_off", wk_off, (n_w, h)), ("v_off", wv_off, (n_w, h))):
                if (not isinstance(x, torch.Tensor) or x.dtype != torch.int64 or tuple(x.shape) != shape
                        or not x.is_contiguous() or x.device.type != "cpu"):
                    raise ValueError(f"writes: {name} must be a contiguous int64 CPU tensor {list(shape)}, got "
                                     f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
            w_ptrs = (w_rows.data_ptr(), wk_off.data_ptr(), wv_off.data_ptr())
        k_out, v_out, mixed = step.scratch((b, h, d), (b, h, d), (b, h, r, d) if self.smooth_values else (0,))
        ks, vs, st = key.element_size(), value.element_size(), self.status
        # one crossing: the template copied and this call's addresses filled in C (q, key, value, out, the scratch
        # and the step's tensors stay alive through the call)
        rc = self.mod.lib.qjl_decode_store_at(
            self.tpl, self.jobs, step.shared(), q.data_ptr(), X_DTYPES[q.dtype], float(q_scale), key.data_ptr(),
            key.stride(0) * ks, key.stride(1) * ks, X_DTYPES[key.dtype], value.data_ptr(), value.stride(0) * vs,
            value.stride(1) * vs, X_DTYPES[value.dtype], out.data_ptr(), X_DTYPES[out.dtype], k_out.data_ptr(),
            v_out.data_ptr(), mixed.data_ptr(), blk.data_ptr(), slt.data_ptr(), 0 if pos is None else pos.data_ptr(),
            int(threads or 0), n_w, *w_ptrs, st)
        if rc == 0 or st[0] == 1:  # (1: the store refused a job: its status, for the caller to name)
            return rc, int(st[1]), out, k_out, v_out
        if st[0] == 0:
            if rc == -7:
                raise ValueError("writes: an exact copy outside its field's buffer, or of a row not in the step "
                                 "(nothing stored)")
            raise ValueError("the C step refused its arguments (a sequence's block 0 outside the means' buffer, or "
                             "widths and dtypes it does not read): nothing stored")
        key_codec, key_fields, value_codec, value_fields = self.objects[:4]
        _decode_status(rc, q, key_codec, key_fields, value_codec, value_fields, step)


def _decode_status(rc: int, q, key_codec, key_fields, value_codec, value_fields, step: DecodeStep) -> None:
    """Raise for a C decode status (0: none)."""
    if rc < -1:  # a range or a block out of bounds (nothing was read): the full check names it
        from qjl.kernels.paged import check_paged

        check_paged(q, key_codec, key_fields, value_codec, value_fields, step.block_table, step.block_size,
                    step.code_start, step.code_end)
    if rc != 0:
        raise ValueError("the C kernel refused its arguments (code widths, lengths, group sizes, ranges, blocks or "
                         "exact rows beyond their buffers)")


def _tensor_segment(i: int, kv, bhd: tuple) -> tuple:
    """Segment ``i`` of a call, (k, v) [B, H, n, D] or [B, H, D] (one token), checked and as the kernel reads it in
    place (fp32/fp16/bf16 with contiguous rows; others converted): (k, v, n)."""
    b, h, d = bhd
    if not isinstance(kv, tuple) or len(kv) != 2:
        raise ValueError(f"segments[{i}] must be a (k, v) pair of [B, H_kv, n, D] or [B, H_kv, D] tensors")
    k, v = kv
    for name, t in (("k", k), ("v", v)):
        if (not isinstance(t, torch.Tensor) or t.ndim not in (3, 4) or t.ndim != k.ndim
                or tuple(t.shape) != (b, h) + tuple(k.shape[2:-1]) + (d,)
                or t.device.type != "cpu" or not t.dtype.is_floating_point):
            raise ValueError(f"segments[{i}] {name} must be a float CPU tensor [{b}, {h}, n, {d}] or [{b}, {h}, {d}] "
                             f"(k and v alike), got {getattr(t, 'shape', t)!r}")
    if k.dtype != v.dtype or k.dtype not in X_DTYPES:
        k, v = k.float(), v.float()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    return k, v, (k.shape[2] if k.ndim == 4 else 1)


def half_rounding(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float32, CPU) rounded to ``dtype`` (fp16 or bf16) by the C kernel's own conversion, the one it writes an
    fp16 / bf16 ``out`` of :func:`paged_decode_step` with (round to nearest even; meant to equal ``x.to(dtype)``)."""
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.device.type != "cpu":
        raise TypeError(f"x must be a float CPU tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    mod = require()
    xf = f32(x.reshape(-1))
    out = torch.empty(xf.numel(), dtype=dtype)
    rc = mod.lib.qjl_half_rounding(mod.ffi.cast("float *", xf.data_ptr()), xf.numel(), X_DTYPES[dtype],
                                   mod.ffi.cast("uint8_t *", out.data_ptr()))
    if rc:
        raise ValueError("half_rounding: refused by the C kernel")
    return out.reshape(x.shape)
