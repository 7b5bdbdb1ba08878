"""KIVI-style per-channel key quantization (Liu et al., arXiv:2402.02750): the non-oblivious baseline.

Keys are quantized per channel over groups of ``group_size`` consecutive tokens:
each (group, channel) stores an asymmetric min-max scale and zero point (the
same rounding rules as :mod:`qjl.values`, so ``|k - k_hat| <= scale / 2``).  Only
complete groups are quantized; KIVI keeps the incomplete tail in full precision,
which is the cache's residual window.  KIVI's values are token-wise: use
:class:`qjl.TokenwiseQuantizer` ("uniform" in the registry).

Codes have one leading entry per *token group*: ``x: [..., n, d]`` gives
``lead = [..., n / group_size]`` with ``codes [..., n/G, G, ceil(d*bits/8)]``
and ``scale``/``zero`` ``[..., n/G, d]``; ``dequantize`` returns ``[..., n, d]``.
"""

from __future__ import annotations

import torch

from qjl.codecs.base import BitBudget, Codec, Codes
from qjl.codecs.params import Param, choice, integer
from qjl.core.validation import STORAGE_DTYPES, check_positive_int, check_vectors, storage_dtype
from qjl.core.packing import pack_bits, packed_size, unpack_bits
from qjl.codecs.tokenwise import minmax_quantize

__all__ = ["KIVIKeys"]


class KIVIKeys(Codec):
    """Per-channel asymmetric quantization over groups of tokens.

    Args:
        dim: head dimension d.
        bits: bits per coordinate, 1..8 (KIVI uses 2).
        group_size: tokens per group sharing a scale and zero point per channel (KIVI: 32 or 128).
        scale_dtype: "fp16" (default), "bf16" or "fp32".
    """

    name = "kivi"
    params = {"bits": Param(integer(1, 8)), "group_size": Param(integer(1)),
              "scale_dtype": Param(choice(*STORAGE_DTYPES, *STORAGE_DTYPES.values()))}

    def __init__(self, dim: int, bits: int = 2, group_size: int = 32, scale_dtype="fp16"):
        self.dim = check_positive_int("dim", dim)
        self.check_params(dict(bits=bits, group_size=group_size, scale_dtype=scale_dtype))
        self.bits, self.group_size = bits, group_size
        self.scale_dtype = storage_dtype("scale_dtype", scale_dtype)

    @property
    def tokens_per_code(self) -> int:
        """One code holds a group of ``group_size`` tokens (per channel scales and zero points)."""
        return self.group_size

    def norm_limit(self) -> float:
        """``|x_i| <= ||x||``: with ``||x|| <= max / 2`` every zero point and every range (hence scale) of a
        group fits the scale dtype."""
        return torch.finfo(self.scale_dtype).max / 2

    def check_storable(self, x: torch.Tensor, name: str = "x", *fit) -> None:
        """Entries beyond half the scale dtype's range are refused (groups form only when flushed)."""
        if x.numel() and bool((x.float().abs() > self.norm_limit()).any()):
            raise ValueError(f"{name}: entries beyond {self.norm_limit():g} cannot be stored by {self!r} (scale "
                             f"dtype {self.scale_dtype}); use scale_dtype='fp32'")

    def __repr__(self):
        return f"KIVIKeys(dim={self.dim}, bits={self.bits}, group_size={self.group_size})"

    def quantize(self, x: torch.Tensor) -> Codes:
        """x: [..., n, dim] with n a multiple of group_size -> Codes with lead [..., n / group_size]."""
        check_vectors("x", x, self.dim, min_ndim=2)
        n, g = x.shape[-2], self.group_size
        if n % g:
            raise ValueError(f"x has {n} tokens; KIVIKeys quantizes complete groups of group_size={g} tokens "
                             "(keep the remaining tokens in full precision)")
        xg = x.float().reshape(*x.shape[:-2], n // g, g, self.dim).transpose(-1, -2)  # [..., n/G, d, G]
        codes, scale, zero = minmax_quantize(xg, self.bits, self.scale_dtype)
        packed = pack_bits(codes.transpose(-1, -2), self.bits)  # [..., n/G, G, bytes]
        return Codes(tuple(x.shape[:-2]) + (n // g,), {"codes": packed, "scale": scale, "zero": zero})

    def dequantize(self, codes: Codes) -> torch.Tensor:
        """Codes with lead [..., n/G] -> [..., n, dim] float32."""
        self._check_codes(codes, "codes", "scale", "zero", kind="KIVIKeys")
        c, sc = codes.fields["codes"], codes.fields["scale"]
        if c.ndim != sc.ndim + 1 or sc.shape[-1] != self.dim or c.shape[-1] != packed_size(self.dim, self.bits):
            raise ValueError(f"codes were not produced by {self!r} (codes {tuple(c.shape)}, scale {tuple(sc.shape)}: "
                             f"expected [..., n/G, G, {packed_size(self.dim, self.bits)}] and [..., n/G, {self.dim}])")
        q = unpack_bits(codes.fields["codes"], self.bits, self.dim, torch.uint8).float()  # [..., n/G, G, d]
        x = codes.fields["zero"].float().unsqueeze(-2) + q * codes.fields["scale"].float().unsqueeze(-2)
        return x.flatten(-3, -2)

    def bit_budget(self) -> BitBudget:
        """Per token: its codes, plus its share (1 / group_size) of the group's scales and zero points."""
        sb = torch.finfo(self.scale_dtype).bits
        per_token_meta = self.dim * sb / self.group_size
        return BitBudget(self.dim, {"codes": 8 * packed_size(self.dim, self.bits),
                                    "scale": per_token_meta, "zero": per_token_meta})
