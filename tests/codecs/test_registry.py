import pytest
import torch

import qjl
from qjl import CODECS, codec_parameters, make_codec

PARAMS = {
    "qjl": {"sketch_dim": 128, "n_outliers": 4, "outlier_sketch_dim": 32},
    "turboquant_mse": {"bits": 3},
    "turboquant_prod": {"bits": 3},
    "turboquant_split": {"bits": 2, "split_bits": 4, "n_split": 16},
    "turboquant_vq": {"bits": 2, "correct_norm": True},
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


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("shape", [(0, 64), (2, 3, 0, 64), (0, 3, 8, 64)])
def test_empty_input_gives_empty_codes(name, shape):
    """0 vectors: empty codes, an empty reconstruction and empty scores (issue #11.4)."""
    codec = make_codec(name, 64, **PARAMS[name])
    if name == "kivi" and shape[-2] % 8:
        pytest.skip("kivi codes whole groups of tokens")
    codes = codec.quantize(torch.randn(*shape))
    lead = shape[:-1] if name != "kivi" else (*shape[:-2], shape[-2] // 8)
    per_sequence = sum(t.numel() * t.element_size() for t in codes.shared.values())  # e.g. outlier channels
    assert codes.lead == lead and codes.nbytes() == per_sequence
    assert codec.dequantize(codes).shape == shape
    if len(shape) > 2:
        q = torch.randn(*shape[:-2], 5, 64)
        assert codec.inner_product(q, codes).shape == (*shape[:-2], 5, shape[-2])


@pytest.mark.parametrize("name", sorted(CODECS))
def test_foreign_or_missing_codes_are_named(name):
    """dequantize(None) and codes of another codec raise TypeError/ValueError naming the codec (#11.6)."""
    codec = make_codec(name, 64, **PARAMS[name])
    with pytest.raises(TypeError, match="codes must be a qjl.Codes"):
        codec.dequantize(None)
    other = "uniform" if name != "uniform" else "turboquant_mse"
    foreign = make_codec(other, 64, **PARAMS[other]).quantize(torch.randn(2, 32, 64))
    with pytest.raises(ValueError, match="codes were not produced by"):
        codec.dequantize(foreign)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_declared_parameters_match_the_signature(name):
    """Every keyword parameter is declared (checked without building) and nothing else."""
    assert sorted(CODECS[name].params) == sorted(codec_parameters(name))


@pytest.mark.parametrize("name,params,match", [
    ("turboquant_mse", {"bits": 0}, "bits must be in 1..8"),
    ("turboquant_mse", {"bits": 3.0}, "bits must be an int"),
    ("turboquant_mse", {"correct_norm": "yes"}, "correct_norm must be a bool"),
    ("turboquant_mse", {"norm_dtype": "fp4"}, "norm_dtype must be one of"),
    ("turboquant_mse", {"seed": 2 ** 70}, "seed must be an int in"),
    ("qjl", {"sketch_dim": 100}, "multiple of 8"),
    ("qjl", {"sketch_dim": 64, "n_outliers": 4}, "needs outlier_sketch_dim"),
    ("polarquant", {"bits_per_level": ()}, "bits_per_level"),
    ("uniform", {"group_size": 0}, "group_size must be >= 1"),
])
def test_structural_checks_name_the_parameter(name, params, match):
    with pytest.raises((TypeError, ValueError), match=match):
        CODECS[name].check_params(params)
    with pytest.raises((TypeError, ValueError), match=match):
        make_codec(name, 64, **{"sketch_dim": 64, **params} if name == "qjl" else params)
