"""Shared cases for the kernel tests: codec pairs, codes in contiguous and paged layouts, the reference."""

import copy
import dataclasses
import os
import re

import torch

from qjl.codecs.outliers import OutlierQJL
from qjl.codecs.sketch import QJLSketch
from qjl.codecs.split import SplitTurboQuant
from qjl.codecs.tokenwise import TokenwiseQuantizer
from qjl.codecs.turboquant import TurboQuantMSE
from qjl.codecs.vq import TurboQuantVQ
from qjl.codecs.views import PackedCodes
from qjl.kernels.paged import PagedField
from qjl.kernels.reference import paged_decode_reference


# Where the Triton kernel tests run: the CPU through Triton's interpreter (conftest.py sets TRITON_INTERPRET=1
# unless it is set already), or natively on CUDA with ``TRITON_INTERPRET=0 pytest tests/kernels/test_triton*.py``
# on a machine with a GPU.  References always run on the CPU.
TRITON_DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


def _n_split(d: int) -> int:
    """A quarter of the channels split off, a multiple of 8 as SplitTurboQuant asks (at least 8: d = 24 and 80
    too, the head dims of the integer path's tests)."""
    return max(8, d // 32 * 8)


def codec_pair(name: str, d: int):
    """(key codec, value codec) by a short name."""
    if name == "tq3-tq2":
        return TurboQuantMSE(d, 3, seed=1, correct_norm=True), TurboQuantMSE(d, 2, seed=2, norm_dtype="fp8")
    if name == "tq4-uni3":
        return TurboQuantMSE(d, 4, seed=1), TokenwiseQuantizer(d, 3, group_size=32)
    if name == "tq5-tq3":
        return TurboQuantMSE(d, 5, seed=1), TurboQuantMSE(d, 3, seed=2)
    if name == "tq1-uni4":
        return TurboQuantMSE(d, 1, seed=1), TokenwiseQuantizer(d, 4, group_size=32)
    if name == "tq8-tq6":
        return TurboQuantMSE(d, 8, seed=1, norm_dtype="bf16"), TurboQuantMSE(d, 6, seed=2, norm_dtype="fp32")
    if name == "tq7-tq5":  # 7 bits: the AVX2 gather; 5 bits: the four-table unpacking (values mixed with it)
        return TurboQuantMSE(d, 7, seed=1), TurboQuantMSE(d, 5, seed=2, correct_norm=True)
    if name == "qjl-uni2":
        return QJLSketch(d, 2 * d, "gaussian", seed=3), TokenwiseQuantizer(d, 2, group_size=32)
    if name == "qjl-outliers-uni2":
        return OutlierQJL(d, 2 * d, n_outliers=8, outlier_sketch_dim=d // 2, seed=3), TokenwiseQuantizer(d, 2)
    if name == "tqsplit-tq3":  # two TurboQuant key terms whose query maps read the per-sequence split_idx
        return SplitTurboQuant(d, 2, 4, _n_split(d), seed=1, norm_dtype="fp8", correct_norm=True), TurboQuantMSE(d, 3, seed=2)
    if name == "qjl-hadamard-tq2":
        return QJLSketch(d, 2 * d, "hadamard", seed=3), TurboQuantMSE(d, 2, seed=2)
    if name == "tq3-tq2c8":  # values over 8 rotations in turn (one accumulator per rotation)
        return (TurboQuantMSE(d, 3, seed=1, correct_norm=True),
                TurboQuantMSE(d, 2, seed=2, norm_dtype="fp8", correct_norm=True, cycles=8))
    if name == "tq4-tq3c3":  # 3 rotations: cycles that do not divide a block of 16 slots
        return TurboQuantMSE(d, 4, seed=1), TurboQuantMSE(d, 3, seed=2, cycles=3)
    if name == "tqsplit-tq3c3":  # per-sequence key maps (read per page) with values over 3 rotations in turn
        return (SplitTurboQuant(d, 2, 4, _n_split(d), seed=1, norm_dtype="fp8", correct_norm=True),
                TurboQuantMSE(d, 3, seed=2, cycles=3))
    if name == "vq3-vq2c8":  # vector codebooks: keys 3 bits in pairs, values 2 bits in fours over 8 rotations
        return (TurboQuantVQ(d, 3, seed=1, correct_norm=True),
                TurboQuantVQ(d, 2, seed=2, norm_dtype="fp8", correct_norm=True, cycles=8))
    if name == "vq3-tq2":  # 3-bit pair keys (the integer path's pair table) with scalar values: all integer products
        return TurboQuantVQ(d, 3, seed=1, correct_norm=True), TurboQuantMSE(d, 2, seed=2)
    if name == "vq4-tq2":  # 4-bit pair keys (8-bit joint codes: the integer path's 512-byte tables), scalar values
        return TurboQuantVQ(d, 4, seed=1, correct_norm=True), TurboQuantMSE(d, 2, seed=2)
    if name == "vq2-tq2":  # 2-bit keys in fours (8-bit joint codes: 1 KB of tables), scalar values
        return TurboQuantVQ(d, 2, seed=1, correct_norm=True), TurboQuantMSE(d, 2, seed=2)
    if name == "vq4-vq3":  # 4-bit pairs (one byte) with 3-bit pairs (joint codes across byte boundaries)
        return TurboQuantVQ(d, 4, seed=1), TurboQuantVQ(d, 3, seed=2, correct_norm=True)
    if name == "vq2-tq3":  # 2-bit keys in fours (one byte per group) with scalar values
        return TurboQuantVQ(d, 2, seed=1, correct_norm=True), TurboQuantMSE(d, 3, seed=2)
    if name == "tq5-vq4":  # scalar keys with vector-codebook values
        return TurboQuantMSE(d, 5, seed=1), TurboQuantVQ(d, 4, seed=2, norm_dtype="fp8", correct_norm=True)
    widths = re.fullmatch(r"tq(\d)-tq(\d)", name)  # any other TurboQuant pair of widths
    if widths:
        return TurboQuantMSE(d, int(widths[1]), seed=1), TurboQuantMSE(d, int(widths[2]), seed=2)
    raise ValueError(name)


PAIRS = ["tq3-tq2", "tq4-uni3", "tq5-tq3", "tq1-uni4", "tq8-tq6", "tq7-tq5", "qjl-uni2", "qjl-outliers-uni2",
         "qjl-hadamard-tq2", "tqsplit-tq3"]
CYCLED_PAIRS = ["tq3-tq2c8", "tq4-tq3c3"]  # value codes over rotations in turn
GROUPED_PAIRS = ["vq3-vq2c8", "vq4-vq3", "vq2-tq3", "tq5-vq4"]  # vector codebooks (PackedCodes.group > 1)


class OneAccumulator:
    """A value codec over rotations in turn as a kernel that ignores ``cycles`` would mix it: every token into one
    accumulator, mapped back by the first rotation's inverse (a wrong answer the cycled tests must tell apart)."""

    def __init__(self, codec):
        self.codec = codec

    def mix_view(self):
        return dataclasses.replace(self.codec.mix_view(), cycles=1)

    def unmix(self, o):
        return self.codec.rotation.inverse(o.float())

    def __getattr__(self, name):
        return getattr(self.codec, name)


def fields_of(codes) -> dict:
    """Contiguous codes [B, H, N, ...] as paged fields (one block per sequence)."""
    out = {n: PagedField.of(t) for n, t in codes.fields.items()}
    out.update({n: PagedField.of(t, shared=True) for n, t in codes.shared.items()})
    return out


class Case:
    """Codes of n random tokens per (sequence, KV head), query rows, and the arguments of paged_decode."""

    def __init__(self, name, b=2, h=2, rows=3, d=64, n=101, seed=0, masked=True, n_exact=0, ragged=False):
        g = torch.Generator().manual_seed(seed)
        self.kc, self.vc = codec_pair(name, d)
        self.k = torch.randn(b, h, n, d, generator=g) * (1 + torch.rand(d, generator=g) * 3)  # uneven channels
        self.v = torch.randn(b, h, n, d, generator=g)
        self.q = torch.randn(b, h, rows, d, generator=g) * 0.3
        self.kcodes, self.vcodes = self.kc.quantize(self.k), self.vc.quantize(self.v)
        self.kf, self.vf = fields_of(self.kcodes), fields_of(self.vcodes)
        self.block_table = torch.arange(b, dtype=torch.int32)[:, None]
        self.block_size = n
        self.start = torch.zeros(b, dtype=torch.int32)
        self.end = torch.full((b,), n, dtype=torch.int32)
        if ragged and b > 1:
            self.start[1], self.end[1] = 3, n - n // 3
        self.bias = None
        if masked and b > 1:
            self.bias = torch.zeros(b, n)
            self.bias[-1, : n // 3] = float("-inf")  # left padding of the last sequence
        self.exact = None
        if n_exact:
            xk, xv = torch.randn(b, h, n_exact, d, generator=g), torch.randn(b, h, n_exact, d, generator=g)
            xb = torch.zeros(b, h, rows, n_exact)
            xb[..., min(rows - 1, 1), n_exact // 2:] = float("-inf")  # a causal-like per-row mask
            self.exact = (xk, xv, xb)

    def args(self):
        return (self.q, self.kc, self.kf, self.vc, self.vf, self.block_table, self.block_size, self.start, self.end)

    def reference(self):
        return paged_decode_reference(*self.args(), exact=self.exact, code_bias=self.bias)

    def on(self, device):
        """This case with every tensor on ``device`` (codecs follow their inputs); ``self`` stays as it is."""
        other = copy.copy(self)
        for name in ("k", "v", "q", "block_table", "start", "end", "bias"):
            t = getattr(self, name)
            setattr(other, name, None if t is None else t.to(device))
        other.kcodes, other.vcodes = self.kcodes.to(device), self.vcodes.to(device)
        other.kf, other.vf = fields_of(other.kcodes), fields_of(other.vcodes)
        other.exact = None if self.exact is None else tuple(t.to(device) for t in self.exact)
        return other


def close(got, want, tol):
    """Attention outputs within ``tol`` of the output scale (fp32 sums in another order)."""
    assert got.shape == want.shape
    assert torch.isfinite(got).all()
    err = (got - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), err


def segment_views(xk, xv, cuts, dtype, device="cpu"):
    """Exact tokens xk, xv [2, 2, n, 64] cut at ``cuts`` into segments (empty ones too), each a strided view of a
    larger buffer in ``dtype`` (as a sink or window buffer with spare capacity holds them) -> (keys, values)."""
    bounds = [0, *cuts, xk.shape[2]]
    ks, vs = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        bk = torch.zeros(2, 2, 8, 64, dtype=dtype, device=device)
        bv = torch.zeros(2, 2, 8, 64, dtype=dtype, device=device)
        bk[:, :, 1:1 + hi - lo], bv[:, :, 1:1 + hi - lo] = xk[:, :, lo:hi], xv[:, :, lo:hi]
        ks.append(bk[:, :, 1:1 + hi - lo])
        vs.append(bv[:, :, 1:1 + hi - lo])
    return ks, vs


# -- grouped codes (vector codebooks) read wrongly: what a kernel that misreads them computes ----------------------
@dataclasses.dataclass(frozen=True)
class ReversedFields(PackedCodes):
    """Grouped codes whose g fields are combined in reverse order: ``e = sum_s field[g j + s] << ((g - 1 - s) b)``."""

    def values(self, codes):
        g = self.group
        return super().values(codes.reshape(*codes.shape[:-1], -1, g).flip(-1).reshape(codes.shape))


class Recoded:
    """A codec whose views' grouped codes (``PackedCodes.group > 1``; every codes with ``all_codes``) are replaced by
    ``recode(packed)``: what a kernel reading them that way computes (the reference over these views)."""

    def __init__(self, codec, recode, all_codes: bool = False):
        self.codec, self.recode, self.all_codes = codec, recode, all_codes

    def _codes(self, p):
        return self.recode(p) if p.group > 1 or self.all_codes else p

    def score_view(self):
        v = self.codec.score_view()
        return dataclasses.replace(v, terms=tuple(dataclasses.replace(t, codes=self._codes(t.codes)) for t in v.terms))

    def mix_view(self):
        v = self.codec.mix_view()
        return dataclasses.replace(v, codes=self._codes(v.codes))

    def __getattr__(self, name):
        return getattr(self.codec, name)

    def __repr__(self):
        return repr(self.codec)


MISREADS = {  # grouped codes read wrongly: the group ignored (centroids[field]), or the fields combined in reverse
    "scalar": lambda p: dataclasses.replace(p, group=1),
    "reversed": lambda p: ReversedFields(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)}),
}


def misreads_are_far(c):
    """The reference of case ``c`` (grouped keys, values or both) -> want; asserts that each misreading of the grouped
    side(s) (:data:`MISREADS`) is far from it (> 5% of the output scale), so a kernel reading them so fails."""
    want = c.reference()
    sides = [side for side in ("kc", "vc") if getattr(getattr(c, side), "group", 1) > 1]
    assert sides
    for side in sides:
        for how, recode in MISREADS.items():
            wrong = copy.copy(c)
            setattr(wrong, side, Recoded(getattr(c, side), recode))
            err = (wrong.reference() - want).abs().max().item()
            assert err > 0.05 * want.abs().max().item(), (side, how, err)
    return want
