"""The numba CPU decode kernel and the kernel plumbing against the PyTorch reference."""

import pytest
import torch

from qjl import kernels
from qjl.kernels import plan
from kernel_cases import PAIRS, case, normalized, reference

cpu = pytest.importorskip("qjl.kernels.cpu")
if not cpu.available():  # pragma: no cover
    pytest.skip("numba is not installed", allow_module_level=True)

TOL = 2e-5  # float32 sums in another order, relative to the output scale

from qjl.kernels import cpu_build  # noqa: E402

IMPLS = ["numba"] + (["c"] if cpu_build.load() is not None else [])


def _close(got, want, vp):
    a, b = normalized(got, vp), normalized(want, vp)
    assert torch.allclose(a, b, atol=TOL * b.abs().max().item(), rtol=0), (a - b).abs().max()
    # the raw partials agree too (m exactly up to rounding, l relative)
    assert torch.allclose(got[0], want[0], atol=1e-4, rtol=1e-5)
    assert torch.allclose(got[1], want[1], rtol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", PAIRS)
def test_cpu_kernel_matches_reference_every_codec(name, impl):
    parts, vp, bias = case(name, b=2, h=2, rows=3, d=64, n=301)
    _close(cpu.decode_partial(parts, vp, bias, block=128, impl=impl), reference(parts, vp, bias), vp)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 9])
def test_cpu_kernel_head_dims_and_gqa_groups(d, rows, impl):
    parts, vp, bias = case("tq3-tq2", b=2, h=1, rows=rows, d=d, n=133, seed=d + rows)
    _close(cpu.decode_partial(parts, vp, bias, block=64, impl=impl), reference(parts, vp, bias), vp)


@pytest.mark.parametrize("impl", IMPLS)
def test_cpu_kernel_long_blocks_rescale_online(impl):
    """Blocks longer than the C kernel's 1024-token pass, with the largest logits late (online rescaling)."""
    parts, vp, bias = case("tq4-uni3", b=1, h=2, rows=4, d=64, n=3000, masked=False)
    parts[0].norm[:, 2500:] *= 3  # later tokens score higher
    _close(cpu.decode_partial(parts, vp, None, block=3000, impl=impl), reference(parts, vp, None), vp)


@pytest.mark.parametrize("impl", IMPLS)
def test_cpu_kernel_split_that_is_fully_masked(impl):
    parts, vp, _ = case("qjl-outliers-uni2", b=2, h=3, rows=4, d=64, n=200, masked=False)
    bias = torch.zeros(2, 200)
    bias[1, :150] = float("-inf")  # whole blocks of 64 masked in row 1
    got = cpu.decode_partial(parts, vp, bias, block=64, impl=impl)
    _close(got, reference(parts, vp, bias), vp)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cpu_kernel_reads_norms_and_scales_in_their_dtype(impl, dtype):
    from qjl.turboquant import TurboQuantMSE
    from qjl.values import TokenwiseQuantizer

    g = torch.Generator().manual_seed(3)
    k, v, q = (torch.randn(1, 2, n, 64, generator=g) for n in (90, 90, 3))
    for kc, vc in ((TurboQuantMSE(64, 3, norm_dtype=dtype), TokenwiseQuantizer(64, 2, scale_dtype=dtype)),
                   (TurboQuantMSE(64, 4), TurboQuantMSE(64, 2, norm_dtype=dtype))):
        parts, vp = kernels.key_parts(kc, kc.quantize(k), q), kernels.value_part(vc, vc.quantize(v))
        _close(cpu.decode_partial(parts, vp, None, impl=impl), reference(parts, vp, None), vp)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_c_kernel_reads_every_half_precision_norm_exactly(dtype):
    """The C kernel converts fp16/bf16 norms itself: every finite bit pattern (normal, subnormal, zero,
    negative) must read as torch reads it.  One sequence per pattern, one token each, score = norm."""
    if "c" not in IMPLS:
        pytest.skip("the C kernel is not built here")
    pattern = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    norms = pattern[torch.isfinite(pattern.float())].reshape(-1, 1)  # [BH, 1]
    bh = norms.shape[0]
    q = torch.zeros(bh, 1, 8)
    q[:, 0, 0] = 1.0
    part = plan.KeyPart(torch.zeros(bh, 1, 1, dtype=torch.uint8), 1, 8, torch.ones(2), norms, q)
    vp = plan.ValuePart(torch.zeros(bh, 1, 1, dtype=torch.uint8), 1, 8, torch.ones(2), 8,
                        torch.ones(bh, 1, 1), None, None)
    m, l_, o = cpu.decode_partial([part], vp, None, impl="c")
    assert torch.equal(m[:, 0], norms[:, 0].float())
