"""Token-wise asymmetric min-max quantization (paper 001, Section 3.2; KIVI's value cache).

Each vector is split into groups of ``group_size`` channels (the last group may
be shorter).  Per group, with ``L = 2**bits - 1``:

    zero  = min(x_g)  rounded *down* to the scale dtype,
    scale = (max(x_g) - zero) / L  rounded *up*,
    code  = round((x - zero) / scale) in [0, L],      x_hat = zero + code * scale.

Rounding ``zero`` down and ``scale`` up keeps every value inside the stored grid,
so ``|x - x_hat| <= scale / 2`` holds with the scale actually stored.  Rows whose
groups are constant get ``scale = 0`` and are exact whenever the constant is
representable in the scale dtype (always true for zero rows and fp16 inputs).
Codes are packed densely (:mod:`qjl.packing`): ``dim * bits`` bits per vector,
plus one scale and one zero point per group.
"""

from __future__ import annotations

import torch

from qjl.codecs.base import BitBudget, Codec, Codes
from qjl.codecs.params import Param, choice, integer
from qjl.core.validation import STORAGE_DTYPES, check_fits, check_positive_int, check_vectors, storage_dtype
from qjl.core.packing import pack_bits, packed_size, unpack_bits

__all__ = ["TokenwiseQuantizer", "minmax_quantize"]


def _round_toward(target: torch.Tensor, dtype: torch.dtype, direction: float) -> torch.Tensor:
    """Round float32 ``target`` into ``dtype``, then step one ulp towards ``direction`` where it fell short."""
    y = target.to(dtype)
    short = y.float() > target if direction < 0 else y.float() < target
    step = torch.full_like(y, direction)
    return torch.where(short, torch.nextafter(y, step), y)


def minmax_quantize(xg: torch.Tensor, bits: int, scale_dtype: torch.dtype):
    """Asymmetric min-max quantization over the last axis (see the module doc).

    xg: [..., g] float32 -> (codes [..., g] uint8, scale [...], zero [...] in scale_dtype).
    """
    lo, hi = xg.amin(dim=-1), xg.amax(dim=-1)
    check_fits("x", torch.stack([lo, hi]), scale_dtype)
    levels = (1 << bits) - 1
    zero = _round_toward(lo, scale_dtype, -1.0)
    scale = _round_toward((hi - zero.float()) / levels, scale_dtype, 1.0)
    check_fits("x (range of a group)", scale.float(), scale_dtype)
    s = scale.float().unsqueeze(-1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((xg - zero.float().unsqueeze(-1)) / safe).clamp_(0, levels)
    codes = torch.where(s > 0, codes, torch.zeros_like(codes))
    return codes.to(torch.uint8), scale, zero


class TokenwiseQuantizer(Codec):
    """Asymmetric per-token, per-group uniform quantizer.

    Args:
        dim: vector dimension.
        bits: bits per coordinate, 1..8 (the paper's value cache uses 2-4).
        group_size: channels sharing one scale and zero point (default 32; ``dim`` for one group).
        scale_dtype: storage of scale and zero point: "fp16" (default), "bf16" or "fp32".
    """

    name = "uniform"
    params = {"bits": Param(integer(1, 8)), "group_size": Param(integer(1)),
              "scale_dtype": Param(choice(*STORAGE_DTYPES, *STORAGE_DTYPES.values()))}

    def __init__(self, dim: int, bits: int = 2, group_size: int = 32, scale_dtype="fp16"):
        self.dim = check_positive_int("dim", dim)
        self.check_params(dict(bits=bits, group_size=group_size, scale_dtype=scale_dtype))
        self.bits = bits
        self.group_size = min(group_size, dim)
        self.groups = -(-dim // self.group_size)
        self.scale_dtype = storage_dtype("scale_dtype", scale_dtype)

    def __repr__(self):
        return f"TokenwiseQuantizer(dim={self.dim}, bits={self.bits}, group_size={self.group_size})"

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim] -> [..., groups, group_size], the last group padded by repeating its last channel."""
        pad = self.groups * self.group_size - self.dim
        if pad:
            x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
        return x.reshape(*x.shape[:-1], self.groups, self.group_size)

    def quantize(self, x: torch.Tensor) -> Codes:
        """x: [..., dim] -> Codes(codes [..., ceil(dim*bits/8)] uint8, scale/zero [..., groups])."""
        check_vectors("x", x, self.dim)
        codes, scale, zero = minmax_quantize(self._grouped(x.float()), self.bits, self.scale_dtype)
        codes = codes.flatten(-2)[..., : self.dim]
        return Codes(tuple(x.shape[:-1]), {"codes": pack_bits(codes, self.bits), "scale": scale, "zero": zero})

    def norm_limit(self) -> float:
        """``|x_i| <= ||x||``: with ``||x|| <= max / 2`` every zero point and range (hence scale) fits."""
        return torch.finfo(self.scale_dtype).max / 2

    def dequantize(self, codes: Codes) -> torch.Tensor:
        """Codes lead [...] -> [..., dim] float32."""
        self._check_codes(codes, "codes", "scale", "zero", kind="TokenwiseQuantizer")
        c, sc = codes.fields["codes"], codes.fields["scale"]
        if c.ndim != sc.ndim or sc.shape[-1] != self.groups or c.shape[-1] != packed_size(self.dim, self.bits):
            raise ValueError(f"codes were not produced by {self!r} (codes {tuple(c.shape)}, scale {tuple(sc.shape)}: "
                             f"expected [..., {packed_size(self.dim, self.bits)}] and [..., {self.groups}])")
        q = unpack_bits(codes.fields["codes"], self.bits, self.dim, torch.uint8).float()
        qg = self._grouped(q)
        x = codes.fields["zero"].float().unsqueeze(-1) + qg * codes.fields["scale"].float().unsqueeze(-1)
        return x.flatten(-2)[..., : self.dim]

    # -- kernel view: integer codes with per-group scale and zero point ----------------------------
    def mix_view(self):
        """``v = zero[g] + scale[g] * code`` (centroids 0 .. 2**bits - 1); the identity :meth:`unmix`."""
        from qjl.codecs.views import MixView, PackedCodes

        cent = torch.arange(1 << self.bits, dtype=torch.float32)
        return MixView(PackedCodes("codes", self.bits, self.dim, cent), self.group_size, "scale", "zero")

    def unmix(self, o: torch.Tensor) -> torch.Tensor:
        return o.float()

    def bit_budget(self) -> BitBudget:
        sb = torch.finfo(self.scale_dtype).bits
        return BitBudget(self.dim, {"codes": 8 * packed_size(self.dim, self.bits),
                                    "scale": self.groups * sb, "zero": self.groups * sb})
