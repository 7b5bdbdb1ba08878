"""Attention over a LayerStore: the kernel path (the paged core with one block per sequence) against the
reference path, from the same store."""

import copy

import pytest
import torch

from qjl import kernels
from qjl.cache.attention import attend
from qjl.cache.config import QJLConfig
from qjl.cache.storage import LayerStore
from qjl.integrations.transformers.names import cache_kwargs

pytestmark = pytest.mark.skipif(not kernels.cpu_available(), reason="the C kernels do not build here")


def _config(preset: str, **fields) -> QJLConfig:
    """A preset by name; ``<preset>c8``: its values over 8 rotations in turn (TurboQuantMSE ``cycles``);
    ``<preset>c8vq``: and every codec of the layer with a vector codebook (``turboquant_vq``, the same parameters)."""
    from dataclasses import replace

    from qjl.cache.config import CodecSpec

    if preset.endswith("vq"):
        cfg = _config(preset[:-2], **fields)
        vq = lambda s: None if s is None else CodecSpec("turboquant_vq", dict(s.params))  # noqa: E731
        return replace(cfg, key=vq(cfg.key), late_key=vq(cfg.late_key), value=vq(cfg.value))
    if preset.endswith("c8"):
        cfg = QJLConfig.preset(preset[:-2], **fields)
        return replace(cfg, value=CodecSpec(cfg.value.name, {**cfg.value.params, "cycles": 8}))
    return QJLConfig.preset(preset, **fields)


def _int_path():
    from qjl.kernels.cpu import launch

    return launch.has_int_path()


@pytest.mark.parametrize("impl,tol", [("c", 1e-4), pytest.param("c-int", 2e-3, marks=pytest.mark.skipif(
    not _int_path(), reason="no AVX-512 VBMI / VNNI here"))])
@pytest.mark.parametrize("preset", ["tq-k3v2", "tq-k45v3", "qjl-paper", "tq-k3v2c8", "tq-k3v2c8vq"])
def test_kernel_path_equals_reference_path(preset, impl, tol, monkeypatch):
    """A decode step (GQA rows, padding mask over codes and exact tokens) through the kernel and through the
    codecs' estimators, from one store: the fp32 path within 1e-4 of the output's scale, the integer path ("c-int",
    the default where the CPU has it) within 2e-3 of the values' (its int8 / int16 rounding, decode_vnni.c)."""
    monkeypatch.setenv("QJL_CPU_IMPL", impl)
    g = torch.Generator().manual_seed(1)
    b, hkv, hq, d, n = 2, 2, 6, 64, 300
    store = LayerStore(0, _config(preset, kernel="cpu"), num_layers=30)
    v = torch.randn(b, hkv, n, d, generator=g)
    store.append(torch.randn(b, hkv, n, d, generator=g), v)
    store.flush()
    assert store.kernel_ok and store.n_codes > 0
    q = torch.randn(b, hq, 1, d, generator=g)
    mask = torch.zeros(b, 1, 1, store.seq_length())
    mask[1, ..., :40] = float("-inf")  # left padding: sinks and first codes of sequence 1
    ref = copy.copy(store)
    ref.backend, ref.kernel_ok = "torch", False
    want = attend(ref, q, mask, d ** -0.5)
    calls = []
    real = kernels.paged_decode

    def spy(*a, **k):
        calls.append(k["backend"])
        return real(*a, **k)

    kernels.paged_decode = spy
    try:
        got = attend(store, q, mask, d ** -0.5)
    finally:
        kernels.paged_decode = real
    assert calls == ["cpu"]
    scale = (want if impl == "c" else v).abs().max().item()
    assert torch.allclose(got, want, atol=tol * scale), (got - want).abs().max()


KEY_SPECS_WITH_FIT = {  # key codecs whose query maps read a per-sequence fit
    "qjl-outliers": ("qjl", {"n_outliers": 4}, {"sketch_dim": 2.0, "outlier_sketch_dim": 0.5}),
    "tq-split": ("turboquant_split", {"bits": 2, "split_bits": 4, "norm_dtype": "fp8"}, {"n_split": 0.5}),
}


@pytest.mark.parametrize("key", sorted(KEY_SPECS_WITH_FIT))
def test_cache_picks_cpu_kernel_and_matches_torch_path(monkeypatch, key):
    """Decode steps of a tiny model through the CPU kernel equal the reference path from the same cache
    state (a copy of the prefilled cache switched to kernel "torch": prefilling each separately would
    differ by float error in the prefill's attention, which can flip a QJL sign bit of a later layer)."""
    import qjl
    from qjl import CodecSpec, QJLCache
    from qjl.integrations.transformers.layer import QJLCacheLayer
    from tiny_models import tiny_model

    torch.set_grad_enabled(False)
    model = tiny_model("qwen2")
    qjl.patch_attention(model)
    calls = []
    real = kernels.paged_decode
    monkeypatch.setattr(kernels, "paged_decode", lambda *a, **k: calls.append(k["backend"]) or real(*a, **k))
    a, b = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(4))
    batch = torch.stack([a, torch.cat([torch.zeros(9, dtype=torch.long), b[9:]])])
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :9] = 0
    name, params, per_dim = KEY_SPECS_WITH_FIT[key]
    cfg = QJLConfig(key=CodecSpec(name, params, per_dim=per_dim), value=CodecSpec("uniform", {"bits": 4}),
                    residual_length=8, flush_block=4)
    cache = QJLCache(model, cfg)
    tok = model(batch, attention_mask=mask, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
    ref = copy.deepcopy(cache)
    for layer in ref.layers:
        if isinstance(layer, QJLCacheLayer):
            layer.store.backend, layer.store.kernel_ok = "torch", False
    assert cache.layers[0].store.backend == "cpu" and cache.layers[0].store.kernel_ok
    for _ in range(6):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        got = model(tok, attention_mask=mask, **cache_kwargs(cache)).logits
        want = model(tok, attention_mask=mask, **cache_kwargs(ref)).logits
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        tok = want[:, -1:].argmax(-1)
    assert calls and set(calls) == {"cpu"}  # the kernel served the decode steps; the copy used the reference


def test_unavailable_kernel_is_refused_before_anything_is_stored(monkeypatch):
    """kernel='triton' on CPU tensors without the interpreter: a clear error, and the layer stays empty."""
    import qjl
    from qjl import QJLCache
    from tiny_models import tiny_model

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_model("llama")
    qjl.patch_attention(model)
    cache = QJLCache(model, QJLConfig(kernel="triton"))
    with pytest.raises(ValueError, match="kernel='triton' needs"):
        model(torch.randint(3, 96, (1, 8)), **cache_kwargs(cache))
    assert cache.get_seq_length() == 0 and not cache.layers[0].is_initialized


@pytest.mark.parametrize("preset", ["tq-k3v2", "tq-k3v2c8", "tq-k3v2c8vq"])
def test_decode_steps_across_flushes_read_every_code(monkeypatch, preset):
    """Unmasked decode steps keep the C kernel's filled arguments (:class:`DecodeCall`) between calls: steps
    that cross flushes (more codes, same buffers) must still attend to every code, as the reference does (with
    values over rotations in turn: each flushed block at its own positions)."""
    from qjl.kernels.cpu import launch

    monkeypatch.setenv("QJL_CPU_IMPL", "c")
    g = torch.Generator().manual_seed(2)
    b, hkv, hq, d = 1, 2, 4, 64
    store = LayerStore(0, _config(preset, kernel="cpu"), num_layers=30)
    store.append(torch.randn(b, hkv, 200, d, generator=g), torch.randn(b, hkv, 200, d, generator=g))
    store.flush()
    calls, real = [], launch.DecodeCall.__call__
    monkeypatch.setattr(launch.DecodeCall, "__call__", lambda *a, **k: calls.append(1) or real(*a, **k))
    seen = set()
    for _ in range(300):
        store.append(torch.randn(b, hkv, 1, d, generator=g), torch.randn(b, hkv, 1, d, generator=g))
        q = torch.randn(b, hq, 1, d, generator=g)
        ref = copy.copy(store)
        ref.backend, ref.kernel_ok = "torch", False
        want = attend(ref, q, None, d ** -0.5)
        got = attend(store, q, None, d ** -0.5)
        assert torch.allclose(got, want, atol=1e-4 * want.abs().max().item()), (store.n_codes, (got - want).abs().max())
        seen.add(store.n_codes)
    assert len(seen) >= 3 and len(calls) == 300  # flushes crossed, every step through the kept step arguments


@pytest.mark.parametrize("preset", ["tq-k3v2", "tq-k45v3", "qjl-paper", "tq-k3v2c8", "tq-k3v2c8vq"])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_decode_call_equals_the_general_kernel_path(preset, qdtype, monkeypatch):
    """A decode step through the layer's kept DecodeCall (value mean added and the output rounded in the C call)
    equals, bit for bit, the step through paged_decode_step + the mean added in torch (the path it replaces), with
    value smoothing on and off (``qjl-paper``'s per-block query maps are not served by it: the general path, the
    same answers); a mask every row sees in full (a decode step's zeros, or all True) gives the same
    output without the mask, through the kept call; a mask hiding a column keeps the masked path and the reference's
    answer."""
    from qjl.cache import attention
    from qjl.kernels.cpu import launch

    calls, real = [], launch.DecodeCall.__call__
    monkeypatch.setattr(launch.DecodeCall, "__call__", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(3)
    b, hkv, hq, d, n = 2, 2, 6, 64, 300
    for smooth in (True, False):
        store = LayerStore(0, _config(preset, kernel="cpu", smooth_values=smooth), num_layers=30)
        store.append(torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g) + 2)
        q = torch.randn(b, hq, 1, d, generator=g).to(qdtype)
        store.before_attention(None, q, d ** -0.5, None)  # (fits the means, as a model's first forward does)
        store.flush()
        assert store.n_codes and (store.mu_v is not None) == smooth
        for step in range(3):
            store.append(torch.randn(b, hkv, 1, d, generator=g), torch.randn(b, hkv, 1, d, generator=g))
            q = torch.randn(b, hq, 1, d, generator=g).to(qdtype)
            calls.clear()
            got = attend(store, q, None, d ** -0.5)
            kept = preset != "qjl-paper"  # (its outlier channels: per-block query maps, the general launcher)
            assert len(calls) == kept and got.dtype == qdtype and got.shape == (b, 1, hq, d)
            with monkeypatch.context() as m:
                m.setattr(attention, "_attend_cpu_call", lambda *a: None)
                want = attend(store, q, None, d ** -0.5)
            assert torch.equal(got, want), (preset, smooth, step)
            for full in (torch.zeros(b, 1, 1, store.seq_length()), torch.ones(b, 1, 1, store.seq_length(),
                                                                              dtype=torch.bool)):
                calls.clear()
                assert torch.equal(attend(store, q, full, d ** -0.5), got) and len(calls) == kept
        for col in (5, -1):  # a sink / code, the current token
            hidden = torch.zeros(b, 1, 1, store.seq_length())
            hidden[1, ..., col] = float("-inf")
            calls.clear()
            masked = attend(store, q, hidden, d ** -0.5)
            assert not calls and not torch.equal(masked[1], got[1])
            ref = copy.copy(store)
            ref.backend, ref.kernel_ok = "torch", False
            want = attend(ref, q, hidden, d ** -0.5).float()
            assert (masked.float() - want).abs().max() <= 3e-2 * want.abs().max()
