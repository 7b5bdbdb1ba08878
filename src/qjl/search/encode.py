"""Fused Lloyd-Max encoding (bucket + bit packing + <u, u_hat>) in C, with its torch reference.

``encode_lloyd_max(y, codebook)`` does what :meth:`qjl.TurboQuantMSE.quantize` does after the
rotation: codes bit-exact with ``pack_bits(bucket(y, boundaries), bits)``, and ``dot`` the
per-vector ``<y, c[idx]>`` (summed in another order than torch: equal to float32 rounding).
"""

from __future__ import annotations

import torch

from ..core.lloyd_max import Codebook, bucket
from ..core.packing import pack_bits
from .scan import extension

__all__ = ["encode_lloyd_max", "encode_lloyd_max_torch"]


def _check(y, codebook):
    if not isinstance(y, torch.Tensor) or y.dtype != torch.float32 or y.ndim != 2:
        raise TypeError(f"y must be a float32 [n, dim] tensor, got {getattr(y, 'dtype', type(y).__name__)}")
    if not isinstance(codebook, Codebook):
        raise TypeError(f"codebook must be a qjl.core.lloyd_max.Codebook, got {type(codebook).__name__}")


def encode_lloyd_max_torch(y: torch.Tensor, codebook: Codebook, bits: int):
    """y: [n, dim] float32 -> (codes [n, ceil(dim * bits / 8)] uint8, dot [n] float32)."""
    _check(y, codebook)
    cents, bounds = codebook.tensors()
    idx = bucket(y, bounds)
    return pack_bits(idx, bits), (y * cents[idx]).sum(-1)


def encode_lloyd_max(y: torch.Tensor, codebook: Codebook, bits: int, threads: int = 0):
    """The C path of :func:`encode_lloyd_max_torch` (the reference where the C build is missing)."""
    _check(y, codebook)
    mod = extension()
    if mod is None:
        return encode_lloyd_max_torch(y, codebook, bits)
    y = y.contiguous()
    cents, bounds = (t.contiguous() for t in codebook.tensors())
    n, dim = y.shape
    codes = torch.empty(n, (dim * bits + 7) // 8, dtype=torch.uint8)
    dot = torch.empty(n, dtype=torch.float32)
    ffi = mod.ffi
    rc = mod.lib.qjl_encode_lm(ffi.cast("float *", y.data_ptr()), n, dim, ffi.cast("float *", bounds.data_ptr()),
                               bounds.numel(), bits, ffi.cast("float *", cents.data_ptr()),
                               ffi.cast("uint8_t *", codes.data_ptr()), ffi.cast("float *", dot.data_ptr()),
                               int(threads))
    if rc != 0:
        raise RuntimeError(f"qjl_encode_lm failed with code {rc}")
    return codes, dot
