"""Fused Lloyd-Max encoding (scale + bucket + bit packing + <u, u_hat>) in C, with its torch reference.

``encode_lloyd_max(y, codebook, bits, norm=n)`` does what :meth:`qjl.TurboQuantMSE.quantize` does after
the rotation, on ``u = y / n[:, None]``: codes bit-exact with ``pack_bits(bucket(u, boundaries), bits)``
(the division is IEEE's, as torch's), and ``dot`` the per-vector ``<u, c[idx]>`` (summed in another order
than torch: equal to float32 rounding).  The search codecs rotate ``x`` and divide by its norm afterwards
(one pass less than normalising first); ``R(x / n)`` and ``(R x) / n`` differ by float32 rounding, so a
coordinate within rounding of a cell edge may get the neighbouring code (tested: rare, and either code is
a correct Lloyd-Max cell of the rotated unit vector to within that rounding).
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


def _check_norm(norm, n):
    if norm is None:
        return None
    if not isinstance(norm, torch.Tensor) or norm.dtype != torch.float32 or norm.shape != (n,):
        raise TypeError(f"norm must be a float32 [{n}] tensor, got {getattr(norm, 'dtype', type(norm).__name__)} "
                        f"{tuple(getattr(norm, 'shape', ()))}")
    if not bool((norm > 0).all()):
        raise ValueError("norm must be > 0 (pass 1 for a zero vector)")
    return norm.contiguous()


def _check_rbits(rbits, bits):
    if isinstance(rbits, bool) or not isinstance(rbits, int) or not 0 <= rbits < bits:
        raise ValueError(f"rbits must be an int in 0..{bits - 1} for {bits}-bit codes, got {rbits!r}")


def encode_lloyd_max_torch(y: torch.Tensor, codebook: Codebook, bits: int, norm: torch.Tensor | None = None,
                           rbits: int = 0):
    """y: [n, dim] float32, norm: [n] float32 > 0 or None -> (codes [n, ceil(dim * bits / 8)] uint8, dot [n]).

    ``rbits > 0``: the codes as the fast scan's two planes instead (``qjl.search.fastscan.rows_to_planes``):
    ``pack_bits(idx >> rbits, bits - rbits)`` then ``pack_bits(idx & (2^rbits - 1), rbits)``."""
    _check(y, codebook)
    _check_rbits(rbits, bits)
    norm = _check_norm(norm, y.shape[0])
    if norm is not None:
        y = y / norm.unsqueeze(-1)
    cents, bounds = codebook.tensors()
    idx = bucket(y, bounds)
    dot = (y * cents[idx]).sum(-1)
    if rbits:
        return torch.cat([pack_bits(idx >> rbits, bits - rbits), pack_bits(idx & ((1 << rbits) - 1), rbits)], 1), dot
    return pack_bits(idx, bits), dot


def encode_lloyd_max(y: torch.Tensor, codebook: Codebook, bits: int, threads: int = 0,
                     norm: torch.Tensor | None = None, rbits: int = 0):
    """The C path of :func:`encode_lloyd_max_torch` (the reference where the C build is missing)."""
    _check(y, codebook)
    _check_rbits(rbits, bits)
    norm = _check_norm(norm, y.shape[0])
    mod = extension()
    if mod is None:
        return encode_lloyd_max_torch(y, codebook, bits, norm, rbits)
    y = y.contiguous()
    cents, bounds = (t.contiguous() for t in codebook.tensors())
    n, dim = y.shape
    width = -(-dim * (bits - rbits) // 8) + -(-dim * rbits // 8) if rbits else -(-dim * bits // 8)
    codes = torch.empty(n, width, dtype=torch.uint8)
    dot = torch.empty(n, dtype=torch.float32)
    ffi = mod.ffi
    nptr = ffi.NULL if norm is None else ffi.cast("float *", norm.data_ptr())
    rc = mod.lib.qjl_encode_lm(ffi.cast("float *", y.data_ptr()), n, dim, nptr, ffi.cast("float *", bounds.data_ptr()),
                               bounds.numel(), bits, rbits, ffi.cast("float *", cents.data_ptr()),
                               ffi.cast("uint8_t *", codes.data_ptr()), ffi.cast("float *", dot.data_ptr()),
                               int(threads))
    if rc != 0:
        raise RuntimeError(f"qjl_encode_lm failed with code {rc}")
    return codes, dot
