"""The codecs' kernel views describe their own estimators exactly (so kernels need nothing else)."""

import torch

from qjl.codecs import KIVIKeys, OutlierQJL, PolarQuant, QJLSketch, TokenwiseQuantizer, TurboQuantMSE
from qjl.codecs.views import kernel_readable
from qjl.core.packing import unpack_bits


def _score(codec, q, codes):
    view = codec.score_view()
    s = 0
    for term, qt in zip(view.terms, codec.score_queries(q, codes.shared)):
        c = term.codes
        k = c.centroids[unpack_bits(codes.fields[c.field], c.bits, c.length)] * codes.fields[term.norm].float().unsqueeze(-1)
        s = s + qt @ k.transpose(-1, -2)
    return s


def test_score_views_equal_inner_product():
    g = torch.Generator().manual_seed(0)
    x, q = torch.randn(2, 30, 64, generator=g), torch.randn(2, 3, 64, generator=g)
    for codec in (TurboQuantMSE(64, 3, correct_norm=True), QJLSketch(64, 128), QJLSketch(64, 128, "hadamard"),
                  OutlierQJL(64, 128, 8, 32), OutlierQJL(64, 128)):
        codes = codec.quantize(x)
        assert torch.allclose(_score(codec, q, codes), codec.inner_product(q, codes), atol=1e-5), codec


def test_mix_views_equal_dequantize():
    x = torch.randn(2, 30, 64, generator=torch.Generator().manual_seed(1))
    for codec in (TurboQuantMSE(64, 2, norm_dtype="fp8"), TokenwiseQuantizer(64, 3, group_size=16)):
        codes, view = codec.quantize(x), codec.mix_view()
        c = view.codes
        group = torch.arange(c.length) // view.group_size
        v = c.centroids[unpack_bits(codes.fields[c.field], c.bits, c.length)]
        v = v * codes.fields[view.scale].float().reshape(2, 30, -1)[..., group]
        if view.zero:
            v = v + codes.fields[view.zero].float().reshape(2, 30, -1)[..., group]
        assert torch.allclose(codec.unmix(v), codec.dequantize(codes), atol=1e-5), codec


def test_codecs_without_views_are_not_kernel_readable():
    assert KIVIKeys(64).score_view() is None and PolarQuant(64).mix_view() is None
    assert not kernel_readable(PolarQuant(64), TurboQuantMSE(64, 2))
    assert kernel_readable(TurboQuantMSE(64, 3), TokenwiseQuantizer(64, 2))
    assert TurboQuantMSE(64, 3).quantize_view().passes[0].normalize
    assert OutlierQJL(64, 128, 8, 32).quantize_view().shared == "outlier_idx"
