"""Method names for `qjl eval`, the caches they make, and the bytes those caches hold."""


import pytest
import torch

from qjl.tools import methods
from qjl.integrations.transformers.names import cache_kwargs


def test_quick_set_and_everything():
    from qjl.cache.presets import DEFAULT_PRESET, PRESETS

    quick = methods.resolve_methods()
    assert quick[0] == methods.REFERENCE and quick[1] == DEFAULT_PRESET
    assert {"tq-k3v2", "qjl-paper", "kivi-k2v2"} <= set(quick)
    full = methods.resolve_methods(everything=True)
    assert set(PRESETS) <= set(full) and full[0] == methods.REFERENCE
    assert methods.resolve_methods(["default", "tq-k3v2", "tq-k3v2"]) == [methods.REFERENCE, DEFAULT_PRESET, "tq-k3v2"]


def test_bad_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown 'tq-k9'.*tq-k3v2"):
        methods.resolve_methods(["tq-k9"])
    with pytest.raises(ValueError, match="unknown"):
        methods.make_method("nope")
    with pytest.raises(TypeError, match="cfg"):
        methods.make_cache(None, "tq-k3v2")


def _prefill(model, cache, n=300):
    torch.manual_seed(1)
    model(torch.randint(0, 96, (1, n)), **cache_kwargs(cache), use_cache=True)
    model(torch.randint(0, 96, (1, 1)), **cache_kwargs(cache), use_cache=True)
    return cache


def _storage(tensors):
    return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values())


def test_cache_memory_counts_storage_for_every_kind():
    import qjl
    from tiny_models import tiny_model

    model = tiny_model("llama")
    qjl.patch_attention(model)
    full = methods.cache_memory(_prefill(model, methods.make_cache(model, None)))
    # 3 layers x K,V x [1, 2, 301, 64] fp32
    assert full["bytes"] == 3 * 2 * 2 * 301 * 64 * 4 and full["x_vs_fp16"] == 0.5 and full["exact_bits"] == 32
    cache = _prefill(model, methods.make_cache(model, methods.make_method("tq-k45v3")))
    mem, rep = methods.cache_memory(cache), cache.memory_report()
    assert mem["bytes"] == rep["bytes"] and mem["compressed_bytes"] == rep["key_code_bytes"] + rep["value_code_bytes"]
    assert 0 < mem["compressed_bytes"] < mem["bytes"] and mem["key_bits"] > mem["value_bits"] > 0
    assert mem["bits_per_value"] == pytest.approx(16 * mem["bytes"] / mem["fp16_bytes"])


@pytest.mark.skipif(not methods.has_quanto(), reason="optimum-quanto not installed")
def test_cache_memory_of_transformers_quantized_cache():
    import qjl
    from tiny_models import tiny_model

    model = tiny_model("llama")
    qjl.patch_attention(model)
    cache = _prefill(model, methods.make_cache(model, methods.make_method("hf-quanto-k2v2")))
    mem = methods.cache_memory(cache)
    assert 0 < mem["compressed_bytes"] and mem["exact_bits"] in (0.0, 32.0)
    assert 2.0 < mem["key_bits"] < 4.0  # 2-bit codes + per-group scales and shifts


def test_seeds_are_method_names():
    """``name@seed`` is the configuration with another base seed; --seeds N adds seeds 1..N-1 to our methods only."""
    from qjl import QJLConfig

    cfg = methods.make_method("tq-k3v3@3")
    assert cfg == QJLConfig.preset("tq-k3v3", seed=3) and cfg != methods.make_method("tq-k3v3")
    assert methods.make_method("auto-3.0@2").seed == 2
    got = methods.resolve_methods(["tq-k3v3", "tq-k3v2@5"], seeds=3)
    assert got == [methods.REFERENCE, "tq-k3v3", "tq-k3v3@1", "tq-k3v3@2", "tq-k3v2@5"]
    with pytest.raises(ValueError, match="seed"):
        methods.resolve_methods(["tq-k3v3@x"])
    with pytest.raises(ValueError, match="unknown"):
        methods.resolve_methods(["tq-k9@1"])
    with pytest.raises(ValueError, match="seeds must be a positive int"):
        methods.resolve_methods(["tq-k3v3"], seeds=0)
    with pytest.raises(ValueError, match="only our cache methods"):
        methods.resolve_methods([f"{methods.REFERENCE}@1"])
