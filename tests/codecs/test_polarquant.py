import math

import pytest
import torch

from qjl import PolarQuant
from qjl.codecs.polarquant import inverse_polar_transform, polar_transform


@pytest.mark.parametrize("n", [2, 4, 64, 128, 256])
def test_polar_transform_exact_round_trip(n):
    y = torch.randn(7, n, dtype=torch.float64)
    y[0] = 0.0
    r, angles = polar_transform(y)
    assert torch.allclose(r, y.norm(dim=-1))
    assert len(angles) == int(math.log2(n)) and [a.shape[-1] for a in angles] == [n >> (i + 1) for i in range(len(angles))]
    assert bool((angles[0] >= 0).all() and (angles[0] < 2 * math.pi).all())
    for a in angles[1:]:
        assert bool((a >= 0).all() and (a <= math.pi / 2).all())
    assert torch.allclose(inverse_polar_transform(r, angles), y, atol=1e-12)


def test_angle_distributions_match_lemma():
    """Gaussian input: level-1 angles uniform, level-2 angles with density sin(2 psi) (mean pi/4, var pi^2/16 - 1/2)."""
    _, angles = polar_transform(torch.randn(20000, 64, dtype=torch.float64))
    a1, a2 = angles[0].flatten(), angles[1].flatten()
    assert a1.mean().item() == pytest.approx(math.pi, abs=0.02)
    assert a1.var().item() == pytest.approx((2 * math.pi) ** 2 / 12, rel=0.02)
    assert a2.mean().item() == pytest.approx(math.pi / 4, abs=0.005)
    assert a2.var().item() == pytest.approx(math.pi ** 2 / 16 - 0.5, rel=0.02)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shapes_and_budget(d, dtype):
    pq = PolarQuant(d, (4, 2))
    x = torch.randn(2, 3, 5, d).to(dtype)
    codes = pq.quantize(x)
    assert pq.dequantize(codes).shape == x.shape
    n = pq.rotation.out_dim
    b = pq.bit_budget()
    assert b.per_vector["level0"] == 8 * ((n // 2 * 4 + 7) // 8)
    assert b.per_vector["level1"] == 8 * ((n // 4 * 2 + 7) // 8)
    assert codes.nbytes() * 8 == 30 * b.bits_per_vector


def test_mse_falls_with_bits_and_matches_level_theory():
    """With independent angles, more bits per level must lower the error; measured MSE of unit vectors."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 128, generator=g)
    x = x / x.norm(dim=-1, keepdim=True)
    errs = {}
    for spec in [(2, 1), (3, 2), (4, 2), (4, 3), (5, 4)]:
        pq = PolarQuant(128, spec, norm_dtype="fp32")
        errs[spec] = (pq.dequantize(pq.quantize(x)) - x).pow(2).sum(-1).mean().item()
    vals = list(errs.values())
    assert all(a > b for a, b in zip(vals, vals[1:])), errs
    assert errs[(4, 2)] < 0.05  # ~3.2 bits per coordinate


def test_many_bits_approach_exact():
    pq = PolarQuant(64, 8, norm_dtype="fp32")
    x = torch.randn(200, 64)
    rel = ((pq.dequantize(pq.quantize(x)) - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()
    assert rel < 1e-3


def test_bits_per_level_spec():
    assert PolarQuant(128, 3).bits == (3,) * 7
    assert PolarQuant(128, (4, 2)).bits == (4, 2, 2, 2, 2, 2, 2)
    assert PolarQuant(64, (5, 4, 3, 2, 1, 1, 1, 1)).bits == (5, 4, 3, 2, 1, 1)


def test_zero_vector_exact():
    pq = PolarQuant(64)
    assert torch.equal(pq.dequantize(pq.quantize(torch.zeros(2, 64))), torch.zeros(2, 64))


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits_per_level"):
        PolarQuant(64, 0)
    with pytest.raises(ValueError, match="bits_per_level"):
        PolarQuant(64, (4, 9))
    with pytest.raises(ValueError, match="bits_per_level"):
        PolarQuant(64, ())
    with pytest.raises(ValueError, match="dim"):
        PolarQuant(1)
    with pytest.raises(ValueError, match="power-of-two"):
        polar_transform(torch.randn(3, 6))
    with pytest.raises(ValueError, match="last dimension"):
        PolarQuant(64).quantize(torch.randn(2, 63))
