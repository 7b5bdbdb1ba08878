"""Dense bit packing: sign bits and b-bit unsigned integers into ``uint8``.

Layout (shared by every codec and every kernel):

* signs: bit ``j`` of a vector lives in byte ``j // 8`` at bit position ``j % 8``
  (least significant bit first); a set bit means "non-negative".
* b-bit integers: the ``L`` values of a vector are written one after another as
  ``b``-bit little-endian fields into one bit stream, which is then packed as
  above.  ``L * b`` bits take ``ceil(L * b / 8)`` bytes; no padding between
  values, so 3-bit codes really cost 3 bits.
"""

from __future__ import annotations

import torch

from qjl.core.devices import on_device

__all__ = ["pack_signs", "unpack_signs", "pack_bits", "unpack_bits", "packed_size"]

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def packed_size(length: int, bits: int) -> int:
    """Bytes taken by ``length`` values of ``bits`` bits each."""
    return (length * bits + 7) // 8


def _pack_bool(bits: torch.Tensor) -> torch.Tensor:
    """bits: [..., L] bool -> [..., ceil(L / 8)] uint8, LSB first."""
    length = bits.shape[-1]
    pad = (-length) % 8
    if pad:
        bits = torch.nn.functional.pad(bits, (0, pad))
    grouped = bits.reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8).to(torch.uint8)
    weights = on_device(_BIT_WEIGHTS, bits.device)
    return (grouped * weights).sum(dim=-1, dtype=torch.uint8)


def _unpack_bool(packed: torch.Tensor, length: int) -> torch.Tensor:
    """packed: [..., nbytes] uint8 -> [..., length] bool."""
    weights = on_device(_BIT_WEIGHTS, packed.device)
    bits = (packed.unsqueeze(-1) & weights) != 0
    return bits.flatten(-2)[..., :length]


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack the signs of ``x`` ([..., m], m a multiple of 8) into [..., m // 8] uint8.

    Zero counts as positive, so every vector has a well-defined code.
    """
    if x.shape[-1] % 8 != 0:
        raise ValueError(f"pack_signs: last dimension must be a multiple of 8, got {x.shape[-1]}")
    return _pack_bool(x >= 0)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: [..., m // 8] uint8 -> [..., m] of +1/-1 in ``dtype``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_signs: packed must be uint8, got {packed.dtype}")
    bits = _unpack_bool(packed, packed.shape[-1] * 8)
    return bits.to(dtype) * 2 - 1


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned integers ``values`` ([..., L], each < 2**bits) densely.

    Returns [..., ceil(L * bits / 8)] uint8.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"pack_bits: bits must be in 1..8, got {bits}")
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise TypeError(f"pack_bits: values must be an integer tensor, got {values.dtype}")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= 1 << bits):
        raise ValueError(f"pack_bits: values must lie in [0, {(1 << bits) - 1}]")
    if bits == 8:
        return values.to(torch.uint8)
    return _pack_words(values, bits)


def _pack_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Eight b-bit values make one b-byte little-endian word: the stream layout above, without a bool stream."""
    length = values.shape[-1]
    pad = (-length) % 8
    v = values.to(torch.int64)
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    shifts = torch.arange(0, 8 * bits, bits, device=v.device)
    word = (v << shifts).sum(dim=-1, keepdim=True)  # [..., L/8, 1] < 2^(8 bits) <= 2^56
    out = (word >> torch.arange(0, 8 * bits, 8, device=v.device)) & 0xFF  # [..., L/8, bits]
    return out.to(torch.uint8).flatten(-2)[..., : packed_size(length, bits)]


def unpack_bits(packed: torch.Tensor, bits: int, length: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: [..., nbytes] uint8 -> [..., length] ``dtype`` (int64 for indexing;
    uint8 is faster where the codes are only converted to float)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"unpack_bits: bits must be in 1..8, got {bits}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_bits: packed must be uint8, got {packed.dtype}")
    if packed.shape[-1] != packed_size(length, bits):
        raise ValueError(
            f"unpack_bits: {length} values of {bits} bits need {packed_size(length, bits)} bytes, "
            f"got {packed.shape[-1]}"
        )
    if bits == 8:
        return packed.to(dtype)
    if 8 % bits == 0:  # whole codes per byte: shift and mask in uint8
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return codes.flatten(-2)[..., :length].to(dtype)
    nbytes = packed.shape[-1]
    pad = (-nbytes) % bits
    p = packed.to(torch.int64)
    if pad:
        p = torch.nn.functional.pad(p, (0, pad))
    p = p.reshape(*p.shape[:-1], p.shape[-1] // bits, bits)
    word = (p << torch.arange(0, 8 * bits, 8, device=p.device)).sum(dim=-1, keepdim=True)
    codes = (word >> torch.arange(0, 8 * bits, bits, device=p.device)) & ((1 << bits) - 1)
    return codes.flatten(-2)[..., :length].to(dtype)
