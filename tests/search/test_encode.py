"""The fused C encoder is bit-exact with TurboQuantMSE.quantize's bucket + pack_bits."""

import pytest
import torch

from qjl.core.lloyd_max import sphere_codebook
from qjl.search.encode import encode_lloyd_max, encode_lloyd_max_torch
from qjl.search.scan import c_available
from qjl import TurboQuantMSE


@pytest.mark.skipif(not c_available(), reason="the C build is missing")
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [64, 80])
def test_c_encoder_bit_exact(bits, dim):
    book = sphere_codebook(dim, bits)
    y = torch.nn.functional.normalize(torch.randn(257, dim), dim=1)
    y[0] = 0  # an all-zero vector: every coordinate in the middle cell
    y[1, :3] = torch.tensor(book.boundaries[:3] if len(book.boundaries) >= 3 else book.boundaries * 3)  # on a boundary
    c1, d1 = encode_lloyd_max(y, book, bits)
    c2, d2 = encode_lloyd_max_torch(y, book, bits)
    assert torch.equal(c1, c2)
    assert torch.allclose(d1, d2, atol=1e-6, rtol=0)


@pytest.mark.parametrize("bits", [1, 3, 4])
def test_search_codec_matches_turboquant(bits):
    from qjl.search.codecs import SearchCodec

    sc = SearchCodec("tq-mse-rn", 64, bits)
    x = torch.randn(500, 64) * 4
    codes, factors = sc.encode(x)
    ref = TurboQuantMSE(64, bits, correct_norm=True).quantize(x)
    assert torch.equal(codes, ref.fields["codes"])
    # the correction divides by <u, u_hat>, summed in another order: at most one float16 ulp apart
    ulp = torch.finfo(torch.float16).eps * ref.fields["norm"].float().abs()
    assert ((factors[0].float() - ref.fields["norm"].float()).abs() <= ulp).all()


def test_encoder_rejects_bad_input():
    book = sphere_codebook(64, 2)
    with pytest.raises(TypeError, match="y must"):
        encode_lloyd_max(torch.zeros(3, 64, dtype=torch.float64), book, 2)
