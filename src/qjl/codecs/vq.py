r"""TurboQuant with a vector codebook: the rotated unit vector's coordinates quantized g at a time.

``TurboQuantVQ(dim, bits)`` is :class:`qjl.codecs.turboquant.TurboQuantMSE` (the same rotation, rotations in turn,
norm and norm correction, the same bytes: ``ceil(n bits / 8)`` code bytes + the norm) with the per-coordinate
Lloyd-Max cell replaced by the nearest of ``2^(g bits)`` codewords for each group of g consecutive rotated
coordinates (:mod:`qjl.core.vq_codebook`: g = 4 at 2 bits, 2 at 3 and 4 bits).  Space-filling gain at the same
bits: relative distortion 0.0955 against 0.1145 at 2 bits, 0.0292 against 0.0334 at 3, 0.0079 against 0.0091 at 4
(d = 64).  The joint code of a group is stored as its g b-bit fields, so the packed layout is the scalar codec's;
only their meaning differs: coordinate ``c`` of the rotated reconstruction is
``table[e, c % g] / sqrt(n)`` with ``e = sum_s field[g (c // g) + s] << (s b)``.

Encoding is an exhaustive nearest-codeword search per group (256 codewords at most; in C on a CPU where the kernels
build, else in torch: the same indices); the decode kernels read these codes through their views' ``group``
(:class:`qjl.codecs.views.PackedCodes`).  With ``correct_norm``
the stored norm is ``||x|| / max(<u, u_hat>, 1/2)``: for a nearest-codeword code ``<u, u_hat>`` has no positive
floor the way a scalar Lloyd-Max cell has, so the division is clamped (``<u, u_hat>`` is about 0.95 at 2 bits;
no real vector comes near 1/2), which bounds the stored norm by ``2 ||x||`` (:meth:`norm_limit`).
"""

from __future__ import annotations

import math

import torch

from qjl.codecs.params import Param, integer
from qjl.codecs.turboquant import TurboQuantMSE
from qjl.core.devices import on_device
from qjl.core.packing import packed_size, unpack_bits
from qjl.core.vq_codebook import (GROUPS, codeword_norms, group_table, joint_codes, nearest_reference, search_grid,
                                  split_codes)

__all__ = ["TurboQuantVQ", "COS_FLOOR"]

COS_FLOOR = 0.5  # the norm correction divides by max(<u, u_hat>, COS_FLOOR) (module doc)


def _nearest(y: torch.Tensor, table: torch.Tensor, sq: torch.Tensor, grid=None) -> torch.Tensor:
    """Each group's nearest codeword: the C search on a CPU where it builds (a prompt's keys: ~10x faster than the
    torch reference; pairs through ``grid``, :func:`qjl.core.vq_codebook.search_grid`, 2x faster again; one token's
    groups, as a vLLM decode step writes them, 4-5x: 21 against 89 us for 96 pairs, 49 against 257 us for 48 quads,
    scratch timing, one thread), else the reference (:func:`qjl.core.vq_codebook.nearest_reference`; the same
    indices)."""
    if y.device.type == "cpu" and y.shape[0]:
        from qjl.kernels.cpu import launch

        if launch.available():
            from qjl.kernels.cpu.store import vq_nearest

            return vq_nearest(y, table, sq, grid)
    return nearest_reference(y, table, sq)


class TurboQuantVQ(TurboQuantMSE):
    """Rotation + a vector codebook over groups of rotated coordinates + norm (module doc).

    Args: as :class:`TurboQuantMSE`; ``bits`` in 2, 3, 4 (the widths with a table: :data:`qjl.core.vq_codebook.GROUPS`).
    """

    name = "turboquant_vq"
    params = {**TurboQuantMSE.params, "bits": Param(integer(min(GROUPS), max(GROUPS)))}

    def __init__(self, dim: int, bits: int = 2, rotation: str = "haar", seed: int = 0, norm_dtype="fp16",
                 correct_norm: bool = False, cycles: int = 1):
        super().__init__(dim, bits, rotation, seed, norm_dtype, correct_norm, cycles)
        n = self.rotation.out_dim
        self.group = GROUPS[bits]
        if n % self.group:
            raise ValueError(f"dim: the rotated dimension {n} must be a multiple of the group size {self.group} "
                             f"at {bits} bits (TurboQuantVQ)")
        self.table = group_table(bits, 1.0 / math.sqrt(n))  # [2^(g bits), g] for coordinates of a unit vector
        self._grid = search_grid(bits, n) if self.group == 2 else None  # the C search's candidate lists (cached)
        self._flat = self.table.reshape(-1).contiguous()    # [2^(g bits) g]: the views' "centroids"
        self._sq = codeword_norms(self.table)

    def __repr__(self):
        return "TurboQuantVQ" + super().__repr__()[len("TurboQuantMSE"):]

    def cells(self, y: torch.Tensor, norm: torch.Tensor) -> tuple:
        """y [..., n] = Pi x / ||x||, norm [...] -> (idx [..., n] int64: each group's codeword as its g b-bit fields,
        the stored norm [...] in ``norm_dtype``).  Nearest codeword by ``||c||^2 - 2 <y, c>`` (ties: the lowest):
        :func:`qjl.core.vq_codebook.nearest_reference`, or its C twin on a CPU where the C kernels build (the same
        indices)."""
        g, b = self.group, self.bits
        table, sq = on_device(self.table, y.device), on_device(self._sq, y.device)
        yg = y.reshape(*y.shape[:-1], y.shape[-1] // g, g)
        code = _nearest(yg.reshape(-1, g).float(), table, sq, self._grid).reshape(yg.shape[:-1])
        idx = split_codes(code, g, b).reshape(y.shape)
        cos = (yg * table[code]).sum((-1, -2)) if self.correct_norm else None
        return idx, self.stored_norm(norm, cos)

    def cell_moments(self, y: torch.Tensor) -> tuple:
        """Rotated unit rows y [..., n] -> (cos, cc) [...] float64: ``<y, y_hat>`` and ``||y_hat||^2`` of their
        codewords (what :func:`qjl.cache.allocation.distortions` reads each candidate's error from, as
        :func:`qjl.core.lloyd_max.cell_moments` for the scalar cells)."""
        g = self.group
        n = y.shape[-1]
        if y.device.type == "cpu" and y.numel() >= 1024 * g:
            from qjl.kernels.cpu import launch

            if launch.available():  # the same codewords, the sums in C (the reference below, within float64 rounding)
                from qjl.kernels.cpu.store import vq_moments

                cos, cc = vq_moments(y.reshape(-1, n).float(), self.table, self._sq, self._grid)
                return cos.reshape(y.shape[:-1]), cc.reshape(y.shape[:-1])
        table = on_device(self.table, y.device)
        yg = y.reshape(*y.shape[:-1], n // g, g).float()
        code = _nearest(yg.reshape(-1, g), table, on_device(self._sq, y.device), self._grid).reshape(yg.shape[:-1])
        c = table[code].double()
        return (yg.double() * c).sum((-1, -2)), c.square().sum((-1, -2))

    def stored_norm(self, norm: torch.Tensor, cos: torch.Tensor | None) -> torch.Tensor:
        """``||x||``, or with ``correct_norm`` ``||x|| / max(<u, u_hat>, COS_FLOOR)``, in ``norm_dtype`` (ValueError
        where it overflows)."""
        return super().stored_norm(norm, None if cos is None else cos.clamp(min=COS_FLOOR))

    def norm_limit(self) -> float:
        """The norm dtype's max (``correct_norm``: times ``COS_FLOOR``, the clamped division's bound)."""
        top = torch.finfo(self.norm_dtype).max
        return top * COS_FLOOR if self.correct_norm else top

    def joint_codes(self, idx: torch.Tensor) -> torch.Tensor:
        """Per-coordinate fields idx [..., n] -> each group's codeword [..., n / g] int64."""
        return joint_codes(idx, self.group, self.bits)

    def stored_codewords(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed codes [..., bytes] uint8 -> each group's codeword [..., n / g] int64, read straight from the bit
        stream: a group's g fields of b bits are consecutive in it (field ``s`` at bits ``[s b, (s + 1) b)`` of the
        codeword, :func:`qjl.core.vq_codebook.joint_codes`), so its codeword is one field of g b bits -- a byte at 2
        bits (quads) and 4 bits (pairs), 6 bits at 3 (pairs).  Equal to ``joint_codes(unpack_bits(packed, b, n))``."""
        n = self.rotation.out_dim
        if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
            raise TypeError(f"packed must be a uint8 tensor, got {getattr(packed, 'dtype', type(packed))}")
        if packed.dim() < 1 or packed.shape[-1] != packed_size(n, self.bits):
            raise ValueError(f"codes hold {packed.shape[-1] if packed.dim() else 0} bytes per vector; this codec "
                             f"stores {packed_size(n, self.bits)}")
        width, m = self.group * self.bits, n // self.group
        if width == 8:
            return packed.long()
        return unpack_bits(packed, width, m)

    def rotated(self, codes) -> torch.Tensor:
        """The reconstruction in the rotated basis: [..., n] float32."""
        self._check_codes(codes, "codes", "norm", kind="TurboQuantVQ")
        packed = codes.fields["codes"]
        n = self.rotation.out_dim
        e = self.stored_codewords(packed)
        y = on_device(self.table, packed.device)[e].reshape(*packed.shape[:-1], n)
        return y * codes.fields["norm"].float().unsqueeze(-1)

    # -- kernel views: the scalar codec's, with codes read g fields at a time ------------------------
    def _packed(self):
        from qjl.codecs.views import PackedCodes

        return PackedCodes("codes", self.bits, self.rotation.out_dim, self._flat, group=self.group)

    def quantize_view(self):
        """Normalize, rotate (in turn with ``cycles > 1``), nearest codeword per group, pack, the norm corrected with
        the clamped cosine: a pass with a ``table`` (:class:`qjl.codecs.views.ProjectQuantize`), which the CPU
        encoder runs (:func:`qjl.kernels.encode.store_cpu`) and the Triton quantize kernel does not (``plain``
        False: :meth:`quantize` codes them there)."""
        from qjl.codecs.views import ProjectQuantize, QuantizeView

        return QuantizeView((ProjectQuantize(self.rotation, self.bits, "codes", "norm", self.norm_dtype,
                                             normalize=True, correct_norm=self.correct_norm, table=self.table,
                                             search=self._grid, cos_floor=COS_FLOOR,
                                             rotations=self.rotations if self.cycles > 1 else ()),))

    @property
    def centroids(self) -> torch.Tensor:
        """The codebook, flattened: [2^(g bits) g] float32 (codeword e's coordinate s at ``e g + s``)."""
        return self._flat

    @property
    def boundaries(self):
        raise AttributeError("TurboQuantVQ has no scalar cell boundaries (a vector codebook: .table)")
