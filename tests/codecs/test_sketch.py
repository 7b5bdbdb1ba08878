import math
import subprocess
import sys

import pytest
import torch

from qjl import QJLSketch, scale_constant, sphere_abs_moment
from qjl.core.hadamard import fwht, next_pow2

DIMS = [64, 80, 96, 128, 256]
KINDS = ["gaussian", "orthogonal", "hadamard"]


@pytest.mark.parametrize("d", [2, 3, 8, 64, 80, 128, 256])
def test_sphere_moment_against_numerical_integration(d):
    """E|u_1| from the density of one coordinate of a uniform point on S^{d-1}."""
    t = torch.linspace(-1, 1, 2_000_001, dtype=torch.float64)
    log_c = math.lgamma(d / 2) - math.lgamma((d - 1) / 2) - 0.5 * math.log(math.pi)
    dens = torch.exp(log_c + (d - 3) / 2 * torch.log1p(-t * t)) if d > 3 else math.exp(log_c)
    if d == 2:  # integrable singularity at +-1: integrate in the angle instead
        theta = torch.linspace(0, math.pi, 2_000_001, dtype=torch.float64)
        numeric = torch.trapezoid(theta.cos().abs(), theta).item() / math.pi
    else:
        numeric = torch.trapezoid(t.abs() * dens, t).item()
    assert abs(numeric - sphere_abs_moment(d)) < 1e-6


def test_scale_constants():
    g = scale_constant("gaussian", 128, 256)
    assert g == math.sqrt(math.pi / 2) / 256
    # orthogonal rows of norm sqrt(d) need a smaller constant: 0.39% at d=64, 0.20% at d=128
    assert 1 - scale_constant("orthogonal", 64, 64) / scale_constant("gaussian", 64, 64) == pytest.approx(0.0039, abs=2e-4)
    assert 1 - scale_constant("orthogonal", 128, 256) / g == pytest.approx(0.0020, abs=1e-4)
    assert scale_constant("hadamard", 80, 64) == scale_constant("orthogonal", 128, 64)


@pytest.mark.parametrize("d,m", [(64, 128), (80, 136), (96, 200)])
def test_orthogonal_blocks(d, m):
    S = QJLSketch(d, m, kind="orthogonal", seed=3).matrix().double()
    assert S.shape == (m, d)
    assert torch.allclose(S.norm(dim=1), torch.full((m,), math.sqrt(d), dtype=torch.float64), atol=1e-4)
    block = S[:d]
    assert torch.allclose(block @ block.T, d * torch.eye(d, dtype=torch.float64), atol=1e-3)
    # the next block is independent, not a copy
    assert (S[d:2 * d] @ block.T).abs().max() > 1.0


def test_fwht_is_orthonormal_involution():
    x = torch.randn(5, 64, dtype=torch.float64)
    assert torch.allclose(fwht(fwht(x)), x, atol=1e-12)
    assert torch.allclose(fwht(x).norm(dim=-1), x.norm(dim=-1), atol=1e-12)


@pytest.mark.parametrize("d", DIMS)
def test_hadamard_fast_path_matches_dense(d):
    sk = QJLSketch(d, 8 * (d // 4 + 3), kind="hadamard", seed=5)
    S = sk.matrix().double()
    n = next_pow2(d)
    assert bool((S.norm(dim=1) ** 2 <= n + 1e-3).all())  # rows of sqrt(n) * orthogonal, restricted to d columns
    x = torch.randn(7, d)
    assert torch.allclose(sk.project(x).double(), x.double() @ S.T, atol=1e-4)
    z = torch.randn(7, sk.sketch_dim)
    assert torch.allclose(sk.project_t(z).double(), z.double() @ S, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_seed_determinism_across_processes(kind):
    code = (
        "import torch, hashlib; from qjl import QJLSketch;"
        f"S = QJLSketch(80, 136, kind='{kind}', seed=11).matrix();"
        "print(hashlib.sha256(S.numpy().tobytes()).hexdigest())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    torch.manual_seed(123)  # the global RNG must not matter
    import hashlib
    here = hashlib.sha256(QJLSketch(80, 136, kind=kind, seed=11).matrix().numpy().tobytes()).hexdigest()
    assert here == other
    assert not torch.equal(QJLSketch(80, 136, kind=kind, seed=11).matrix(), QJLSketch(80, 136, kind=kind, seed=12).matrix())


def test_global_rng_untouched():
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    QJLSketch(64, 128, kind="orthogonal", seed=1).quantize(torch.ones(2, 64))
    assert torch.equal(before, torch.random.get_rng_state())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", DIMS)
def test_shapes_and_dequantize_consistency(kind, d):
    m = 8 * (d // 8 + 5)  # not a multiple of d
    sk = QJLSketch(d, m, kind=kind, seed=2, norm_dtype="fp32")
    k = torch.randn(2, 3, 9, d)
    q = torch.randn(2, 3, 4, d)
    codes = sk.quantize(k)
    assert codes.lead == (2, 3, 9)
    assert codes.fields["signs"].shape == (2, 3, 9, m // 8) and codes.fields["signs"].dtype == torch.uint8
    assert torch.allclose(codes.fields["norm"], k.norm(dim=-1))
    scores = sk.inner_product(q, codes)
    assert scores.shape == (2, 3, 4, 9) and scores.dtype == torch.float32
    k_hat = sk.dequantize(codes)
    assert k_hat.shape == k.shape
    assert torch.allclose(scores, q @ k_hat.transpose(-1, -2), rtol=1e-4, atol=1e-4)
    # against the paper's formula with the dense matrix and the signs recomputed
    S = sk.matrix()
    ref = sk.scale * k.norm(dim=-1).unsqueeze(-2) * ((q @ S.T) @ torch.sign(k @ S.T + 0.0).transpose(-1, -2))
    agree = torch.isclose(scores, ref, rtol=1e-3, atol=1e-3).float().mean()
    assert agree > 0.99  # a projection within float error of 0 may flip a sign


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_input_dtypes(dtype):
    sk = QJLSketch(64, 128, seed=0)
    k = torch.randn(5, 64).to(dtype)
    codes = sk.quantize(k)
    ref = sk.quantize(k.float())
    assert torch.equal(codes.fields["signs"], ref.fields["signs"])
    assert sk.inner_product(torch.randn(2, 64).to(dtype), codes).dtype == torch.float32


@pytest.mark.parametrize("norm_dtype,torch_dtype,bits", [("fp16", torch.float16, 16), ("bf16", torch.bfloat16, 16), ("fp32", torch.float32, 32),
                                                         ("fp8", torch.float8_e4m3fn, 8)])
def test_norm_dtype(norm_dtype, torch_dtype, bits):
    sk = QJLSketch(64, 64, norm_dtype=norm_dtype)
    codes = sk.quantize(torch.randn(3, 64))
    assert codes.fields["norm"].dtype == torch_dtype
    assert sk.bit_budget().per_vector == {"signs": 64, "norm": bits}


@pytest.mark.parametrize("kind", KINDS)
def test_zero_vectors_score_exactly_zero(kind):
    sk = QJLSketch(96, 104, kind=kind)
    k = torch.randn(4, 96)
    k[1] = 0.0
    codes = sk.quantize(k)
    s = sk.inner_product(torch.randn(3, 96), codes)
    assert torch.all(s[:, 1] == 0.0)
    assert torch.all(sk.dequantize(codes)[1] == 0.0)
    assert torch.all(sk.inner_product(torch.zeros(1, 96), codes) == 0.0)


def test_norm_overflow_is_refused():
    sk = QJLSketch(64, 64, norm_dtype="fp16")
    with pytest.raises(ValueError, match="overflows"):
        sk.quantize(torch.full((1, 64), 1e4))
    with pytest.raises(ValueError, match="overflows"):  # float8 e4m3 would saturate to 448 silently
        QJLSketch(64, 64, norm_dtype="fp8").quantize(torch.full((1, 64), 60.0))  # norm 480
    assert QJLSketch(64, 64, norm_dtype="fp32").quantize(torch.full((1, 64), 1e4)).fields["norm"].isfinite().all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="dim"):
        QJLSketch(0, 64)
    with pytest.raises(ValueError, match="sketch_dim"):
        QJLSketch(64, -8)
    with pytest.raises(ValueError, match="sketch_dim must be a multiple of 8"):
        QJLSketch(64, 100)
    with pytest.raises(ValueError, match="kind"):
        QJLSketch(64, 64, kind="rademacher")
    with pytest.raises(ValueError, match="norm_dtype"):
        QJLSketch(64, 64, norm_dtype="int8")
    with pytest.raises(TypeError, match="dim"):
        QJLSketch(64.0, 64)
    with pytest.raises(ValueError, match="seed"):
        QJLSketch(64, 64, seed=-1)
    sk = QJLSketch(64, 64)
    with pytest.raises(ValueError, match="x must have last dimension 64"):
        sk.quantize(torch.randn(3, 65))
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        sk.quantize(torch.tensor([[float("nan")] * 64]))
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        sk.quantize(torch.tensor([[float("inf")] * 64]))
    with pytest.raises(TypeError, match="x must be a floating tensor"):
        sk.quantize(torch.ones(2, 64, dtype=torch.int64))
    codes = sk.quantize(torch.randn(3, 64))
    with pytest.raises(ValueError, match="q must have last dimension 64"):
        sk.inner_product(torch.randn(2, 32), codes)
    with pytest.raises(ValueError, match="q contains NaN"):
        sk.inner_product(torch.full((2, 64), float("nan")), codes)
    with pytest.raises(ValueError, match="sketch_dim=128"):
        QJLSketch(64, 128).inner_product(torch.randn(2, 64), codes)


def test_small_hadamard_refused():
    with pytest.raises(ValueError, match="kind='hadamard' needs dim > 16"):
        QJLSketch(16, 64, kind="hadamard")
    QJLSketch(17, 64, kind="hadamard")  # padded to 32: fine
