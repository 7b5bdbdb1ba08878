"""What the CPU kernels' launchers share (:mod:`qjl.kernels.cpu.launch`, :mod:`qjl.kernels.cpu.store`,
:mod:`qjl.kernels.cpu.rows`): the loaded C module, the argument struct that keeps every tensor whose address it
holds alive, the value view's fields, and the dtype codes and conversions the C side reads."""

from __future__ import annotations

import torch

__all__ = ["module", "require", "Args", "fill_view", "check_groups", "f32", "i64", "i32", "DTYPES", "X_DTYPES"]

DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}  # scalar fields
X_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # rows (exact tokens, inputs, outputs)


def module():
    """The C module (:mod:`qjl.kernels.cpu.build`, compiled once per machine), or None where it cannot be built."""
    from qjl.kernels.cpu import build

    return build.load()


def require():
    """The loaded C module, or RuntimeError saying why there is none."""
    mod = module()
    if mod is None:
        raise RuntimeError("the C CPU kernels could not be built (cffi and a C compiler with OpenMP are needed)")
    return mod


class Args:
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
            if f.dtype not in DTYPES:
                raise ValueError(f"a norm/scale field stored as {f.dtype} is not read by the CPU kernel")
            dst.dtype = DTYPES[f.dtype]


def fill_view(a: Args, vv, vview, fields: dict) -> None:
    """A ``qjl_value_view`` struct's fields, bits, groups, centroids, cycles (K accumulators) and code group (g fields
    per joint code, :attr:`qjl.codecs.views.PackedCodes.group`) from a codec's :class:`qjl.codecs.views.MixView` and
    its stored fields (``unmix``, [K n, out_dim], left to the caller)."""
    a.field(vv.codes, fields[vview.codes.field], False)
    a.field(vv.scale, fields[vview.scale], True)
    if vview.zero:
        a.field(vv.zero, fields[vview.zero], True)
    vv.bits, vv.n, vv.group_size, vv.groups = vview.codes.bits, vview.codes.length, vview.group_size, vview.groups
    vv.has_zero, vv.cent = int(vview.zero is not None), a.ptr(vview.codes.centroids)
    vv.cycles, vv.group = vview.cycles, vview.codes.group


def check_groups(what: str, codes) -> None:
    """ValueError naming ``what`` unless the C kernels read these :class:`qjl.codecs.views.PackedCodes` (an iterable
    of them): scalar codes (``group`` 1), or a vector codebook's read g at a time with g 2, 4 or 8 fields of ``bits``
    bits making a joint code of at most 8 bits and centroids [2^(g bits) g] (``decode.h``'s group_ok)."""
    for p in codes:
        g = p.group
        if g == 1:
            continue
        if g not in (2, 4, 8) or g * p.bits > 8 or p.length % g or p.centroids.numel() != g << (g * p.bits):
            raise ValueError(f"{what}: the C kernels read codes g at a time with g 2, 4 or 8, joint codes of at most 8 "
                             f"bits and [2^(g bits) g] centroids; got g {g} x {p.bits} bits, {p.length} codes, "
                             f"{p.centroids.numel()} centroids")


def f32(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous float32 tensor the C side may read (itself where it is one)."""
    if t.dtype == torch.float32 and t.is_contiguous():
        return t.detach()
    return t.detach().to(torch.float32).contiguous()


def i64(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous int64 tensor (itself where it is one)."""
    if t.dtype == torch.int64 and t.is_contiguous():
        return t
    return t.to(torch.int64).contiguous()


def i32(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous int32 tensor (itself where it is one)."""
    if t.dtype == torch.int32 and t.is_contiguous():
        return t
    return t.to(torch.int32).contiguous()
