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


def _close(got, want, vp):
    a, b = normalized(got, vp), normalized(want, vp)
    assert torch.allclose(a, b, atol=TOL * b.abs().max().item(), rtol=0), (a - b).abs().max()
    # the raw partials agree too (m exactly up to rounding, l relative)
    assert torch.allclose(got[0], want[0], atol=1e-4, rtol=1e-5)
    assert torch.allclose(got[1], want[1], rtol=1e-4)


@pytest.mark.parametrize("name", PAIRS)
def test_cpu_kernel_matches_reference_every_codec(name):
    parts, vp, bias = case(name, b=2, h=2, rows=3, d=64, n=301)
    _close(cpu.decode_partial(parts, vp, bias, block=128), reference(parts, vp, bias), vp)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 9])
def test_cpu_kernel_head_dims_and_gqa_groups(d, rows):
    parts, vp, bias = case("tq3-tq2", b=2, h=1, rows=rows, d=d, n=133, seed=d + rows)
    _close(cpu.decode_partial(parts, vp, bias, block=64), reference(parts, vp, bias), vp)


def test_cpu_kernel_split_that_is_fully_masked():
    parts, vp, _ = case("qjl-outliers-uni2", b=2, h=3, rows=4, d=64, n=200, masked=False)
    bias = torch.zeros(2, 200)
    bias[1, :150] = float("-inf")  # whole blocks of 64 masked in row 1
    got = cpu.decode_partial(parts, vp, bias, block=64)
    _close(got, reference(parts, vp, bias), vp)


def test_merge_partials_equals_one_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 3, 8, generator=g), torch.randn(2, 10, 8, generator=g), torch.randn(2, 10, 8, generator=g)
    whole = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
    parts = [plan.partial_exact(q, k[:, :4], v[:, :4], None), plan.partial_exact(q, k[:, 4:], v[:, 4:], None)]
    _, l_, o = plan.merge_partials(parts)
    assert torch.allclose(o / l_.unsqueeze(-1), whole, atol=1e-6)


def test_reference_partial_equals_codec_attention():
    """The kernels' reference scores with the codecs' own estimators and mixes their reconstructions."""
    from kernel_cases import codec_pair

    for name in ("tq3-tq2", "qjl-outliers-uni2"):
        kc, vc = codec_pair(name, 64)
        g = torch.Generator().manual_seed(1)
        k, v, q = (torch.randn(1, 2, n, 64, generator=g) for n in (50, 50, 3))
        kcodes, vcodes = kc.quantize(k), vc.quantize(v)
        want = torch.softmax(kc.inner_product(q, kcodes), -1) @ vc.dequantize(vcodes)
        parts, vp = kernels.key_parts(kc, kcodes, q), kernels.value_part(vc, vcodes)
        got = normalized(plan.reference_partial(parts, vp), vp)
        assert torch.allclose(got, want.reshape(2, 3, 64), atol=1e-5)


def test_pick_backend():
    assert kernels.pick_backend("cpu", "auto") == "cpu"
    assert kernels.pick_backend("cpu", "torch") == "torch"
    with pytest.raises(ValueError, match="kernel must be"):
        kernels.pick_backend("cpu", "cuda")
    with pytest.raises(ValueError, match="CPU tensors"):
        kernels.pick_backend("meta", "cpu")


def test_cpu_kernel_rejects_layouts_it_cannot_read():
    parts, vp, _ = case("tq3-tq2", b=1, h=1, rows=2, d=64, n=20)
    with pytest.raises(ValueError, match="multiples of 8"):
        cpu.decode_partial(parts * 3, vp)


def test_cache_picks_cpu_kernel_and_matches_torch_path(monkeypatch):
    import qjl
    from qjl import CodecSpec, QJLCache, QJLConfig
    from tiny_models import tiny_model

    torch.set_grad_enabled(False)
    model = tiny_model("qwen2")
    qjl.patch_attention(model)
    calls = []
    real = kernels.decode_partial
    monkeypatch.setattr(kernels, "decode_partial", lambda backend, *a: calls.append(backend) or real(backend, *a))
    a, b = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(4))
    batch = torch.stack([a, torch.cat([torch.zeros(9, dtype=torch.long), b[9:]])])
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :9] = 0
    outs = {}
    for kernel in ("auto", "torch"):
        cfg = QJLConfig(key=CodecSpec("qjl", {"n_outliers": 4}, per_dim={"sketch_dim": 2.0, "outlier_sketch_dim": 0.5}),
                        value=CodecSpec("uniform", {"bits": 4}), residual_length=8, flush_block=4, kernel=kernel)
        cache = QJLCache(model, cfg)
        outs[kernel] = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                      past_key_values=cache, output_logits=True, return_dict_in_generate=True)
        assert cache.layers[0].backend == ("cpu" if kernel == "auto" else "torch")
    assert calls and set(calls) == {"cpu"}
    assert torch.equal(outs["auto"].sequences, outs["torch"].sequences)
    for x, y in zip(outs["auto"].logits, outs["torch"].logits):
        assert torch.allclose(x, y, atol=1e-4)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("correct", [False, True])
def test_cpu_quantize_equals_reference(bits, correct):
    from qjl.turboquant import TurboQuantMSE

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
    from qjl.turboquant import TurboQuantMSE

    codec = TurboQuantMSE(64, 3)
    x = torch.randn(4, 64)
    x[2, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        kernels.quantize_cpu(codec, x)
    with pytest.raises(ValueError, match="last dimension 64"):
        kernels.quantize_cpu(codec, torch.randn(4, 63))
    with pytest.raises(TypeError, match="floating"):
        kernels.quantize_cpu(codec, torch.ones(4, 64, dtype=torch.long))


def test_supports_needs_whole_bytes_of_codes():
    from qjl.turboquant import TurboQuantMSE
    from qjl.values import TokenwiseQuantizer

    assert kernels.supports(TurboQuantMSE(64, 3), TokenwiseQuantizer(64, 2))
    assert not kernels.supports(TurboQuantMSE(100, 3), TurboQuantMSE(100, 2))  # 100 % 8 != 0: reference path
    assert not kernels.supports(TurboQuantMSE(64, 3), TokenwiseQuantizer(64, 2, group_size=12))
