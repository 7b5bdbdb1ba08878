import pytest
import torch

from qjl import TokenwiseQuantizer


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("d,group", [(64, 32), (80, 32), (96, 64), (128, 128), (256, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_error_within_half_step(bits, d, group, dtype):
    vq = TokenwiseQuantizer(d, bits=bits, group_size=group)
    x = (torch.randn(3, 7, d) * torch.rand(3, 7, 1) * 4 + torch.randn(3, 7, 1)).to(dtype)
    codes = vq.quantize(x)
    x_hat = vq.dequantize(codes)
    assert x_hat.shape == x.shape and x_hat.dtype == torch.float32
    groups = -(-d // group)
    assert codes.fields["scale"].shape == (3, 7, groups)
    step = codes.fields["scale"].float().repeat_interleave(group, dim=-1)[..., :d]
    err = (x.float() - x_hat).abs()
    assert torch.all(err <= step / 2 * (1 + 1e-5) + 1e-6)
    assert codes.fields["codes"].shape[-1] == (d * bits + 7) // 8  # densely packed


def test_step_is_not_too_coarse():
    """The stored scale is the min-max step, not something larger that would trivially pass the bound."""
    vq = TokenwiseQuantizer(64, bits=3, group_size=64)
    x = torch.randn(50, 64)
    scale = vq.quantize(x).fields["scale"].float().squeeze(-1)
    exact = (x.amax(-1) - x.amin(-1)) / 7
    assert torch.allclose(scale, exact, rtol=2e-3)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_constant_and_zero_rows_exact(bits):
    vq = TokenwiseQuantizer(80, bits=bits, group_size=32)
    x = torch.zeros(4, 80)
    x[1] = 0.375
    x[2] = -1234.0
    x[3, :32] = 2.5  # constant groups of different values in one row
    x[3, 32:] = -0.5
    assert torch.equal(vq.dequantize(vq.quantize(x)), x)
    assert torch.equal(vq.dequantize(vq.quantize(x.half())), x)


def test_budget_and_nbytes():
    vq = TokenwiseQuantizer(128, bits=2, group_size=32)
    b = vq.bit_budget()
    assert b.per_vector == {"codes": 256, "scale": 64, "zero": 64}
    assert b.bits_per_coordinate == 3.0
    codes = vq.quantize(torch.randn(5, 128))
    assert codes.nbytes() * 8 == 5 * b.bits_per_vector


def test_overflow_refused():
    vq = TokenwiseQuantizer(64, bits=2)
    with pytest.raises(ValueError, match="overflows"):
        vq.quantize(torch.full((1, 64), 1e6))
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1] = -60000.0, 60000.0  # each fits fp16, the step does not
    with pytest.raises(ValueError, match="overflows"):
        TokenwiseQuantizer(64, bits=1, group_size=64).quantize(x)
    assert TokenwiseQuantizer(64, bits=2, scale_dtype="fp32").quantize(torch.full((1, 64), 1e6)) is not None


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        TokenwiseQuantizer(64, bits=9)
    with pytest.raises(ValueError, match="bits"):
        TokenwiseQuantizer(64, bits=0)
    with pytest.raises(TypeError, match="bits"):
        TokenwiseQuantizer(64, bits=2.5)
    with pytest.raises(ValueError, match="group_size"):
        TokenwiseQuantizer(64, group_size=0)
    with pytest.raises(ValueError, match="scale_dtype"):
        TokenwiseQuantizer(64, scale_dtype="fp8")
    vq = TokenwiseQuantizer(64)
    with pytest.raises(ValueError, match="last dimension 64"):
        vq.quantize(torch.randn(2, 63))
    with pytest.raises(ValueError, match="NaN or Inf"):
        vq.quantize(torch.full((2, 64), float("inf")))
