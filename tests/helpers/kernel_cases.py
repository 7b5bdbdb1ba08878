"""Shared cases for the kernel tests: codec pairs, random codes, and the reference partial."""

import torch

from qjl import kernels
from qjl.codecs.outliers import OutlierQJL
from qjl.codecs.sketch import QJLSketch
from qjl.codecs.turboquant import TurboQuantMSE
from qjl.codecs.tokenwise import TokenwiseQuantizer


def codec_pair(name: str, d: int):
    """(key codec, value codec) by a short name."""
    if name == "tq3-tq2":
        return TurboQuantMSE(d, 3, seed=1, correct_norm=True), TurboQuantMSE(d, 2, seed=2)
    if name == "tq4-uni3":
        return TurboQuantMSE(d, 4, seed=1), TokenwiseQuantizer(d, 3, group_size=32)
    if name == "tq5-tq3":
        return TurboQuantMSE(d, 5, seed=1), TurboQuantMSE(d, 3, seed=2)
    if name == "tq1-uni4":
        return TurboQuantMSE(d, 1, seed=1), TokenwiseQuantizer(d, 4, group_size=32)
    if name == "qjl-uni2":
        return QJLSketch(d, 2 * d, "gaussian", seed=3), TokenwiseQuantizer(d, 2, group_size=32)
    if name == "qjl-outliers-uni2":
        return OutlierQJL(d, 2 * d, n_outliers=8, outlier_sketch_dim=d // 2, seed=3), TokenwiseQuantizer(d, 2)
    if name == "qjl-hadamard-tq2":
        return QJLSketch(d, 2 * d, "hadamard", seed=3), TurboQuantMSE(d, 2, seed=2)
    raise ValueError(name)


PAIRS = ["tq3-tq2", "tq4-uni3", "tq5-tq3", "tq1-uni4", "qjl-uni2", "qjl-outliers-uni2", "qjl-hadamard-tq2"]


def case(name: str, b: int, h: int, rows: int, d: int, n: int, seed: int = 0, masked: bool = True):
    """Codes of n random tokens, query rows, a padding bias; returns (parts, value part, bias [B, N])."""
    g = torch.Generator().manual_seed(seed)
    kc, vc = codec_pair(name, d)
    k = torch.randn(b, h, n, d, generator=g) * (1 + torch.rand(d, generator=g) * 3)  # uneven channels
    v = torch.randn(b, h, n, d, generator=g)
    q = torch.randn(b, h, rows, d, generator=g) * 0.3
    parts = kernels.key_parts(kc, kc.quantize(k), q)
    vp = kernels.value_part(vc, vc.quantize(v))
    bias = None
    if masked and b > 1:
        bias = torch.zeros(b, n)
        bias[-1, : n // 3] = float("-inf")  # left padding of the last row
    return parts, vp, bias


def normalized(partial, vp):
    m, l_, o = partial
    out = o / l_.unsqueeze(-1)
    return vp.post(out) if vp.post is not None else out


def reference(parts, vp, bias):
    return kernels.decode_partial("torch", parts, vp, bias)
