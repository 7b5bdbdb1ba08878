"""QJLCache inside transformers models: correctness against the full-precision cache."""

import pytest
import torch
from transformers import DynamicCache

import qjl
from qjl import CodecSpec, QJLCache, QJLConfig
from qjl.integrations.transformers.layer import QJLCacheLayer
from tiny_models import tiny_model

torch.set_grad_enabled(False)

GENEROUS = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 8}), value=CodecSpec("uniform", {"bits": 8}),
                     residual_length=8, flush_block=4)


def _patched(arch, **kw):
    model = tiny_model(arch, **kw)
    qjl.patch_attention(model)
    return model


def _prompt(n=40, batch=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (batch, n), generator=g)


@pytest.mark.parametrize("arch,head_dim", [("llama", 64), ("qwen2", 64), ("mistral", 64), ("gemma3", 256)])
def test_generous_config_generates_like_full_precision(arch, head_dim):
    model = _patched(arch, head_dim=head_dim)
    ids = _prompt()
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=DynamicCache(config=model.config))
    cache = QJLCache(model, GENEROUS)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=cache)
    assert torch.equal(out, ref)
    full = [layer for layer in cache.layers if isinstance(layer, QJLCacheLayer)]
    assert full and all(layer.store.key_codes is not None for layer in full)  # compression really happened
    assert cache.get_seq_length() == out.shape[1] - 1


CODEC_SPECS = [
    CodecSpec("qjl", {"n_outliers": 4}, per_dim={"sketch_dim": 4.0, "outlier_sketch_dim": 0.5}),
    CodecSpec("turboquant_mse", {"bits": 4}),
    CodecSpec("turboquant_prod", {"bits": 4}),
    CodecSpec("polarquant", {"bits_per_level": (5, 4)}),
    CodecSpec("kivi", {"bits": 4, "group_size": 4}),
    CodecSpec("uniform", {"bits": 4, "group_size": 32}),
]


@pytest.mark.parametrize("spec", CODEC_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_every_key_codec_runs_and_stays_close(spec, arch):
    model = _patched(arch)
    ids = _prompt(48)
    ref = model(ids[:, :40], past_key_values=DynamicCache(config=model.config))
    ref_next = model(ids[:, 40:], past_key_values=ref.past_key_values).logits
    cfg = QJLConfig(key=spec, value=CodecSpec("turboquant_mse", {"bits": 4}), residual_length=8, flush_block=4)
    cache = QJLCache(model, cfg)
    model(ids[:, :40], past_key_values=cache)
    got = model(ids[:, 40:], past_key_values=cache).logits
    assert got.shape == ref_next.shape and torch.isfinite(got).all()
    p, q = torch.softmax(ref_next, -1), torch.log_softmax(got, -1)
    kl = (p * (p.log() - q)).sum(-1).mean()
    assert kl < 0.15, kl  # 4-bit codecs: close to full precision, not garbage
    assert cache.memory_report()["key_code_bytes"] > 0


def test_score_paths_agree():
    model = _patched("llama")
    ids = _prompt(40)
    outs = []
    for path in ("inner_product", "dequantize"):
        cfg = QJLConfig(key=CodecSpec("qjl", {}, per_dim={"sketch_dim": 2.0}), residual_length=8, flush_block=4,
                        score_path=path, kernel="torch")
        cache = QJLCache(model, cfg)
        model(ids[:, :32], past_key_values=cache)
        outs.append(model(ids[:, 32:], past_key_values=cache).logits)
    assert torch.allclose(outs[0], outs[1], atol=1e-4)


def test_chunked_prefill():
    model = _patched("qwen2")
    ids = _prompt(48)
    # with the whole prompt inside the exact window, chunking changes nothing
    wide = QJLConfig(residual_length=64)
    one = model(ids, past_key_values=QJLCache(model, wide)).logits
    cache = QJLCache(model, wide)
    parts = [model(ids[:, s:s + 16], past_key_values=cache).logits for s in range(0, 48, 16)]
    assert torch.allclose(torch.cat(parts, 1), one, atol=1e-5)
    # with compression, later chunks attend to the compressed history: close, and they do read the codes
    cache = QJLCache(model, GENEROUS)
    parts = [model(ids[:, s:s + 16], past_key_values=cache).logits for s in range(0, 48, 16)]
    assert torch.allclose(torch.cat(parts, 1), one, atol=2e-2)
    assert cache.layers[0].store.key_codes is not None


def test_padded_batch_equals_rows_alone():
    model = _patched("llama")
    a, b = _prompt(40, seed=2)[0], _prompt(28, seed=3)[0]
    pad = torch.zeros(12, dtype=torch.long)
    batch = torch.stack([a, torch.cat([pad, b])])
    mask = torch.stack([torch.ones(40), torch.cat([torch.zeros(12), torch.ones(28)])]).long()
    cfg = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 4}), residual_length=8, flush_block=4)
    out = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         past_key_values=QJLCache(model, cfg))
    for row, ids in enumerate((a, b)):
        alone = model.generate(ids[None], max_new_tokens=6, do_sample=False, past_key_values=QJLCache(model, cfg))
        assert torch.equal(out[row, -6:], alone[0, -6:])


def test_crop_then_continue_equals_never_seen():
    model = _patched("llama")
    ids = _prompt(60)
    cfg = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 3}), residual_length=8, flush_block=4)
    a, b = QJLCache(model, cfg), QJLCache(model, cfg)
    model(ids[:, :40], past_key_values=a)
    model(ids[:, 40:50], past_key_values=a)
    a.crop(-10)
    assert a.get_seq_length() == 40
    model(ids[:, :40], past_key_values=b)
    la = model(ids[:, 50:52], past_key_values=a).logits
    lb = model(ids[:, 50:52], past_key_values=b).logits
    assert torch.allclose(la, lb, atol=1e-6)
    a.crop(-30)  # into the codes
    assert a.get_seq_length() == 12


def test_reorder_matches_reordered_inputs():
    model = _patched("mistral")
    ids = _prompt(30, batch=2)
    cfg = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 3}), residual_length=8, flush_block=4)
    c1, c2 = QJLCache(model, cfg), QJLCache(model, cfg)
    model(ids, past_key_values=c1)
    c1.reorder_cache(torch.tensor([1, 0]))
    model(ids.flip(0), past_key_values=c2)
    nxt = _prompt(3, batch=2, seed=9)
    assert torch.allclose(model(nxt, past_key_values=c1).logits, model(nxt, past_key_values=c2).logits, atol=1e-5)


def test_beam_search_matches_full_precision():
    model = _patched("llama")
    ids = _prompt(30)
    out = model.generate(ids, max_new_tokens=5, num_beams=3, do_sample=False,
                         past_key_values=QJLCache(model, GENEROUS))
    ref = model.generate(ids, max_new_tokens=5, num_beams=3, do_sample=False,
                         past_key_values=DynamicCache(config=model.config))
    assert torch.equal(out, ref)


def test_nbytes_by_hand():
    model = _patched("llama")  # 3 layers, 2 KV heads, head_dim 64, fp32
    cfg = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 4}), value=CodecSpec("uniform", {"bits": 2, "group_size": 32}),
                    residual_length=8, flush_block=4, sink_tokens=2)
    cache = QJLCache(model, cfg)
    model(_prompt(30), past_key_values=cache)
    model(_prompt(1), past_key_values=cache)  # flushes the prompt's overflow: 2 sinks, 20 coded, 8 + 1 exact
    layer = cache.layers[0].store
    assert layer.sink_k.shape[-2] == 2 and layer.key_codes.lead[-1] == 20 and layer.keys.shape[-2] == 9
    heads, d = 2, 64
    key_code = heads * 20 * (64 * 4 // 8 + 2)  # 4-bit indices + fp16 norm per token
    value_code = heads * 20 * (64 * 2 // 8 + 2 * 2 * 2)  # 2-bit codes + fp16 scale and zero per group of 32
    exact = 2 * heads * (2 + 9) * d * 4  # keys and values, fp32
    r = cache.memory_report()
    assert r["key_code_bytes"] == 3 * key_code and r["value_code_bytes"] == 3 * value_code
    assert r["exact_bytes"] == 3 * exact and cache.nbytes() == 3 * (key_code + value_code + exact)
    assert r["key_bits"] == 8 * key_code / (heads * 20 * d)


def test_short_prompt_stays_exact():
    model = _patched("llama")
    ids = _prompt(10)
    cache = QJLCache(model, QJLConfig(residual_length=64))
    out = model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=cache)
    ref = model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=DynamicCache(config=model.config))
    assert torch.equal(out, ref) and cache.layers[0].store.key_codes is None


def test_sliding_layers_stay_exact():
    model = _patched("gemma3")
    cache = QJLCache(model, GENEROUS)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["DynamicSlidingWindowLayer", "QJLCacheLayer"] * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models(dtype):
    model = _patched("llama", dtype=dtype)
    ids = _prompt(40)
    cache = QJLCache(model, QJLConfig(residual_length=8, flush_block=4, exact_dtype="fp16"))
    out = model(ids, past_key_values=cache).logits
    out = model(_prompt(2), past_key_values=cache).logits
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert cache.layers[0].keys.dtype == torch.float16


def test_unpatched_model_is_refused():
    model = tiny_model("llama")
    cache = QJLCache(model, GENEROUS)
    with pytest.raises(RuntimeError, match="patch_attention"):
        model(_prompt(10), past_key_values=cache)


def test_bad_arguments():
    model = _patched("llama")
    with pytest.raises(TypeError, match="model"):
        QJLCache("not a model", GENEROUS)
    with pytest.raises(TypeError, match="QJLConfig"):
        QJLCache(model, {"key": "qjl"})
    with pytest.raises(TypeError, match="PreTrainedModel"):
        qjl.patch_attention(object())


def test_late_layers_get_their_codec():
    model = _patched("llama")  # 3 layers: the last 2 (round(0.5 * 3)) are late
    cfg = QJLConfig(late_key=CodecSpec("turboquant_mse", {"bits": 6}), residual_length=8, flush_block=4)
    cache = QJLCache(model, cfg)
    model(_prompt(30), past_key_values=cache)
    model(_prompt(1), past_key_values=cache)
    assert [layer.store.key_codec.bits for layer in cache.layers] == [4, 6, 6]


def test_long_prefill_is_scored_in_query_chunks(monkeypatch):
    """Prompts longer than QUERY_CHUNK are scored chunk by chunk (bounded memory): same logits."""
    import qjl.cache.attention as cl

    monkeypatch.setattr(cl, "QUERY_CHUNK", 16)
    model = _patched("llama")
    ids = _prompt(70)
    ref = model(ids, past_key_values=DynamicCache(config=model.config)).logits
    got = model(ids, past_key_values=QJLCache(model, QJLConfig(residual_length=128))).logits
    assert torch.allclose(got, ref, atol=1e-5)
    # and with compressed history, chunked equals unchunked
    cfgs = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 4}), residual_length=8, flush_block=4, kernel="torch")
    cache = QJLCache(model, cfgs)
    model(ids[:, :30], past_key_values=cache)
    chunked = model(ids[:, 30:], past_key_values=cache).logits
    monkeypatch.setattr(cl, "QUERY_CHUNK", 4096)
    cache = QJLCache(model, cfgs)
    model(ids[:, :30], past_key_values=cache)
    assert torch.allclose(model(ids[:, 30:], past_key_values=cache).logits, chunked, atol=1e-5)


@pytest.mark.parametrize("spec", CODEC_SPECS, ids=lambda s: s.name)
def test_sdpa_path_for_chunks_equals_reference(spec, monkeypatch):
    """Multi-token forwards outside the decode kernels (kernel != "torch") run torch SDPA over sinks +
    dequantized codes + window: the same logits as the reference path (the codec's inner product),
    here with GQA and a left-padded batch."""
    model = _patched("llama")
    a, b = _prompt(40, seed=5)[0], _prompt(40, seed=6)[0]
    batch = torch.stack([a, torch.cat([torch.zeros(7, dtype=torch.long), b[7:]])])
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0
    calls = []
    import qjl.cache.attention as attention

    real = attention._attend_sdpa
    monkeypatch.setattr(attention, "_attend_sdpa", lambda *a: calls.append(1) or real(*a))
    outs = {}
    for kernel in ("auto", "torch"):
        cfg = QJLConfig(key=spec, value=CodecSpec("turboquant_mse", {"bits": 4}), residual_length=8, flush_block=4,
                        kernel=kernel)
        cache = QJLCache(model, cfg)
        first = model(batch[:, :24], attention_mask=mask[:, :24], past_key_values=cache).logits
        outs[kernel] = torch.cat([first, model(batch[:, 24:], attention_mask=mask, past_key_values=cache).logits], 1)
        assert cache.layers[0].store.key_codes is not None
        if kernel == "auto":
            assert calls  # the SDPA path really ran
            calls.clear()
    assert not calls  # and never for kernel="torch"
    assert torch.allclose(outs["auto"], outs["torch"], atol=1e-4), (outs["auto"] - outs["torch"]).abs().max()


def test_fp8_value_norms_are_held_and_counted_as_8_bits():
    """The 5x preset stores the values' norms as float8 e4m3: the cache holds 1-byte norms, reports
    2 + 8/64 value bits at head_dim 64, and decodes close to full precision."""
    model = _patched("llama")
    ids = _prompt(60)
    cfg = QJLConfig.preset("tq-k3v2", residual_length=8, flush_block=4)
    cache = QJLCache(model, cfg)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=cache)
    assert out.shape[1] == 64
    layer = cache.layers[0].store
    assert layer.value_codes.fields["norm"].dtype == torch.float8_e4m3fn
    assert layer.key_codes.fields["norm"].dtype == torch.float16
    assert cache.memory_report()["value_bits"] == pytest.approx(2 + 8 / 64)
    ref = model(ids, past_key_values=DynamicCache(config=model.config)).logits[:, -1]
    got = model(ids, past_key_values=QJLCache(model, cfg)).logits[:, -1]  # prefill: exact up to the fp16 window
    assert torch.allclose(got, ref, atol=5e-3)
