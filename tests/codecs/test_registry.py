import pytest
import torch

import qjl
from qjl import CODECS, codec_parameters, make_codec

PARAMS = {
    "qjl": {"sketch_dim": 128, "n_outliers": 4, "outlier_sketch_dim": 32},
    "turboquant_mse": {"bits": 3},
    "turboquant_prod": {"bits": 3},
    "polarquant": {"bits_per_level": (4, 2)},
    "kivi": {"bits": 2, "group_size": 8},
    "uniform": {"bits": 2, "group_size": 32},
}


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("d", [64, 96])
def test_every_codec_implements_the_interface(name, d):
    codec = make_codec(name, d, **PARAMS[name])
    assert isinstance(codec, qjl.Codec) and codec.name == name
    k = torch.randn(2, 3, 16, d, dtype=torch.bfloat16)
    q = torch.randn(2, 3, 4, d)
    codes = codec.quantize(k)
    k_hat = codec.dequantize(codes)
    assert k_hat.shape == k.shape and k_hat.dtype == torch.float32
    scores = codec.inner_product(q, codes)
    assert scores.shape == (2, 3, 4, 16)
    assert torch.allclose(scores, q @ k_hat.transpose(-1, -2), rtol=1e-3, atol=1e-3)
    # the reconstruction is informative: correlated with the input
    cos = torch.nn.functional.cosine_similarity(k_hat.flatten(), k.float().flatten(), dim=0)
    assert cos > 0.6
    b = codec.bit_budget()
    assert 0 < b.bits_per_coordinate < 16
    n_vec, n_seq = 2 * 3 * 16, 2 * 3
    assert codes.nbytes() * 8 == pytest.approx(n_vec * b.bits_per_vector + n_seq * b.shared_bits)


def test_unknown_name_and_parameters():
    with pytest.raises(ValueError, match="codec must be one of"):
        make_codec("int4", 64)
    with pytest.raises(TypeError, match="unknown parameter"):
        make_codec("turboquant_mse", 64, bitz=3)
    with pytest.raises(TypeError, match="sketch_dim"):
        make_codec("qjl", 64)
    with pytest.raises(ValueError, match="bits"):
        make_codec("uniform", 64, bits=0)
    assert "bits_per_level" in codec_parameters("polarquant")
