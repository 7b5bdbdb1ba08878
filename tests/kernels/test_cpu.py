"""The numba CPU decode kernel and the kernel plumbing against the PyTorch reference."""

import pytest
import torch

from qjl import kernels
from qjl.kernels import plan
from kernel_cases import PAIRS, case, normalized, reference

cpu = pytest.importorskip("qjl.kernels.cpu.launch")
if not cpu.available():  # pragma: no cover
    pytest.skip("numba is not installed", allow_module_level=True)

TOL = 1e-4  # float32 sums over hundreds of tokens in another order (fastmath), relative to the output scale

from qjl.kernels.cpu import build as cpu_build  # noqa: E402

IMPLS = ["numba"] + (["c", "c-portable"] if cpu_build.load() is not None else [])


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
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])  # 16, 32: code rows under 8 bytes, read exactly
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
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_cpu_kernel_reads_norms_and_scales_in_their_dtype(impl, dtype):
    from qjl.codecs.turboquant import TurboQuantMSE
    from qjl.codecs.tokenwise import TokenwiseQuantizer

    g = torch.Generator().manual_seed(3)
    k, v, q = (torch.randn(1, 2, n, 64, generator=g) for n in (90, 90, 3))
    sdtype = "fp32" if dtype == "fp8" else dtype  # fp8 is for norms only
    for kc, vc in ((TurboQuantMSE(64, 3, norm_dtype=dtype), TokenwiseQuantizer(64, 2, scale_dtype=sdtype)),
                   (TurboQuantMSE(64, 4), TurboQuantMSE(64, 2, norm_dtype=dtype))):
        parts, vp = kernels.key_parts(kc, kc.quantize(k), q), kernels.value_part(vc, vc.quantize(v))
        _close(cpu.decode_partial(parts, vp, None, impl=impl), reference(parts, vp, None), vp)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_c_kernel_reads_every_half_precision_norm_exactly(dtype):
    """The C kernel converts fp16/bf16/fp8 norms itself: every finite bit pattern (normal, subnormal, zero,
    negative) must read as torch reads it.  One sequence per pattern, one token each, score = norm."""
    if "c" not in IMPLS:
        pytest.skip("the C kernel is not built here")
    if dtype == torch.float8_e4m3fn:
        pattern = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    else:
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


def test_auto_backend_needs_one_cpu_build(monkeypatch):
    from qjl.kernels.cpu import build as cpu_build

    monkeypatch.setattr(kernels, "_has", lambda name: False)  # no numba, no triton
    assert kernels.pick_backend("cpu") == ("cpu" if cpu_build.load() is not None else "torch")
    monkeypatch.setattr(cpu_build, "load", lambda: None)  # and no C compiler either
    assert kernels.pick_backend("cpu") == "torch"
    with pytest.raises(ValueError, match="C compiler"):
        kernels.pick_backend("cpu", "cpu")


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
    """Decode steps through the CPU kernel equal the reference path from the same cache state (a copy of
    the prefilled cache switched to kernel "torch"; prefilling each separately would differ by float
    error in the prefill's attention, which can flip a QJL sign bit of a later layer's key)."""
    import copy

    import qjl
    from qjl import CodecSpec, QJLCache, QJLConfig
    from qjl.integrations.transformers.layer import QJLCacheLayer
    from tiny_models import tiny_model

    torch.set_grad_enabled(False)
    model = tiny_model("qwen2")
    qjl.patch_attention(model)
    calls = []
    real = kernels.decode_partial
    monkeypatch.setattr(kernels, "decode_partial", lambda backend, *a, **k: calls.append(backend) or real(backend, *a, **k))
    a, b = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(4))
    batch = torch.stack([a, torch.cat([torch.zeros(9, dtype=torch.long), b[9:]])])
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :9] = 0
    cfg = QJLConfig(key=CodecSpec("qjl", {"n_outliers": 4}, per_dim={"sketch_dim": 2.0, "outlier_sketch_dim": 0.5}),
                    value=CodecSpec("uniform", {"bits": 4}), residual_length=8, flush_block=4)
    cache = QJLCache(model, cfg)
    tok = model(batch, attention_mask=mask, past_key_values=cache).logits[:, -1:].argmax(-1)
    ref = copy.deepcopy(cache)
    for layer in ref.layers:
        if isinstance(layer, QJLCacheLayer):
            layer.store.backend, layer.store.kernel_ok = "torch", False
    assert cache.layers[0].store.backend == "cpu" and cache.layers[0].store.kernel_ok
    for _ in range(8):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        got = model(tok, attention_mask=mask, past_key_values=cache).logits
        want = model(tok, attention_mask=mask, past_key_values=ref).logits
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        tok = want[:, -1:].argmax(-1)
    assert calls and set(calls) == {"cpu"}  # the kernel served the decode steps; the copy used the reference


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("correct", [False, True])
def test_cpu_quantize_equals_reference(bits, correct):
    from qjl.codecs.turboquant import TurboQuantMSE

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
    from qjl.codecs.turboquant import TurboQuantMSE

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
    from qjl.codecs.turboquant import TurboQuantMSE
    from qjl.codecs.tokenwise import TokenwiseQuantizer

    assert kernels.supports(TurboQuantMSE(64, 3), TokenwiseQuantizer(64, 2))
    assert not kernels.supports(TurboQuantMSE(100, 3), TurboQuantMSE(100, 2))  # 100 % 8 != 0: reference path
    assert not kernels.supports(TurboQuantMSE(64, 3), TokenwiseQuantizer(64, 2, group_size=12))


def test_unavailable_kernel_is_refused_before_anything_is_stored(monkeypatch):
    """kernel='triton' on CPU tensors without the interpreter: a clear error, and the layer stays empty."""
    import qjl
    from qjl import QJLCache, QJLConfig
    from tiny_models import tiny_model

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_model("llama")
    qjl.patch_attention(model)
    cache = QJLCache(model, QJLConfig(kernel="triton"))
    with pytest.raises(ValueError, match="kernel='triton' needs"):
        model(torch.randint(3, 96, (1, 8)), past_key_values=cache)
    assert cache.get_seq_length() == 0 and not cache.layers[0].is_initialized


def test_kernel_entry_points_name_bad_arguments():
    from qjl.codecs.polarquant import PolarQuant

    parts, vp, _ = case("tq3-tq2", b=1, h=1, rows=2, d=64, n=20)
    with pytest.raises(ValueError, match="backend"):
        kernels.decode_partial("gpu", parts, vp)
    with pytest.raises(ValueError, match="impl"):
        cpu.decode_partial(parts, vp, impl="fast")
    with pytest.raises(TypeError, match="codec"):
        kernels.quantize_cpu(PolarQuant(64), torch.randn(2, 64))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["tq3-tq2", "qjl-outliers-uni2", "tq4-uni3"])
def test_cpu_kernel_merges_the_exact_tokens(name, impl):
    """exact=(qx, xk, xv, xbias): the sinks + window merged in (by the C kernel itself) equal the torch
    merge of the two partials; per-row masks, a row whose exact tokens are all masked, a sequence whose
    codes are all masked, 3 rows (padded to 4), several token splits."""
    b, h, rows, d, n, ne = 2, 2, 3, 64, 150, 37
    parts, vp, _ = case(name, b=b, h=h, rows=rows, d=d, n=n, masked=False)
    g = torch.Generator().manual_seed(11)
    bias = torch.zeros(b, n)
    bias[1] = float("-inf")  # sequence 1 sees none of its codes
    qx = torch.randn(b * h, rows, d, generator=g) * 0.3
    xk, xv = torch.randn(b * h, ne, d, generator=g), torch.randn(b * h, ne, d, generator=g)
    xbias = torch.zeros(b * h, rows, ne)
    xbias[:, 1, 30:] = float("-inf")  # a causal-like per-row mask
    xbias[0, 2, :] = float("-inf")  # a row that sees no exact token (only codes)
    exact = (qx, xk, xv, xbias)
    m, l_, o, ox = cpu.decode_partial(parts, vp, bias, block=64, impl=impl, exact=exact)
    want = plan.merge_apart(reference(parts, vp, bias), plan.partial_exact(*exact))
    post = vp.post if vp.post is not None else (lambda x: x)
    got_out = (post(o) + ox) / l_.unsqueeze(-1)
    want_out = (post(want[2]) + want[3]) / want[1].unsqueeze(-1)
    assert torch.isfinite(got_out).all()
    assert torch.allclose(got_out, want_out, atol=TOL * want_out.abs().max().item(), rtol=0)
    assert torch.allclose(m, want[0], atol=1e-4, rtol=1e-5) and torch.allclose(l_, want[1], rtol=1e-4)


def test_cpu_kernel_exact_arguments_are_checked():
    parts, vp, _ = case("tq3-tq2", b=1, h=2, rows=3, d=64, n=40, masked=False)
    qx, xk = torch.zeros(2, 3, 64), torch.zeros(2, 5, 64)
    with pytest.raises(ValueError, match="exact"):
        cpu.decode_partial(parts, vp, exact=(qx, xk, torch.zeros(2, 6, 64), None), impl="c")
    with pytest.raises(ValueError, match="xbias"):
        cpu.decode_partial(parts, vp, exact=(qx, xk, xk, torch.zeros(2, 3, 4)), impl="c")


def test_exact_arguments_are_checked_for_every_backend():
    parts, vp, _ = case("tq3-tq2", b=1, h=2, rows=3, d=64, n=40, masked=False)
    qx, xk = torch.zeros(2, 3, 64), torch.zeros(2, 5, 64)
    for backend in ("torch", "cpu"):
        with pytest.raises(ValueError, match="exact"):
            kernels.decode_partial(backend, parts, vp, exact=(qx, xk, torch.zeros(2, 6, 64), None))
        with pytest.raises(ValueError, match="exact"):
            kernels.decode_partial(backend, parts, vp, exact=(qx, xk))
