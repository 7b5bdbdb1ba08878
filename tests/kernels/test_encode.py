"""CPU quantization (C bucketing) against the codecs' own quantize: codes bit-exact."""

import pytest
import torch

from qjl import kernels
from qjl.codecs.turboquant import TurboQuantMSE

pytestmark = pytest.mark.skipif(not kernels.cpu_available(), reason="the C kernels do not build here")


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("correct", [False, True])
def test_cpu_quantize_equals_reference(bits, correct):
    codec = TurboQuantMSE(64, bits, seed=bits, correct_norm=correct)
    x = torch.randn(2, 3, 50, 64, generator=torch.Generator().manual_seed(bits)) * 2
    got, want = kernels.quantize_cpu(codec, x), codec.quantize(x)
    assert torch.equal(got.fields["codes"], want.fields["codes"])
    if correct:  # the cosine is summed in another order: at most one fp16 ulp apart
        a, b = got.fields["norm"].float(), want.fields["norm"].float()
        assert ((a - b).abs() <= b.abs() * 2**-10).all()
    else:
        assert torch.equal(got.fields["norm"], want.fields["norm"])


def test_cpu_quantize_refuses_bad_input_like_the_reference():
    from qjl.codecs.polarquant import PolarQuant
    from qjl.codecs.sketch import QJLSketch

    codec = TurboQuantMSE(64, 3)
    x = torch.randn(4, 64)
    x[2, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        kernels.quantize_cpu(codec, x)
    with pytest.raises(ValueError, match="last dimension 64"):
        kernels.quantize_cpu(codec, torch.randn(4, 63))
    with pytest.raises(TypeError, match="floating"):
        kernels.quantize_cpu(codec, torch.ones(4, 64, dtype=torch.long))
    with pytest.raises(TypeError, match="codec"):
        kernels.quantize_cpu(PolarQuant(64), torch.randn(2, 64))
    assert kernels.can_quantize_cpu(codec) and not kernels.can_quantize_cpu(QJLSketch(64, 128))


def test_quantize_with_names_a_bad_backend():
    c, x = TurboQuantMSE(32, 3), torch.randn(2, 5, 32)
    ref = c.quantize(x)
    got = kernels.quantize_with("torch", c, x)
    assert all(torch.equal(got.fields[n], ref.fields[n]) for n in ref.fields)
    with pytest.raises(ValueError, match="backend"):
        kernels.quantize_with("auto", c, x)
