"""QJLCache inside transformers models: correctness against the full-precision cache."""

import pytest
import torch
from transformers import DynamicCache

import qjl
from qjl import CodecSpec, QJLCache, QJLConfig
from qjl.integrations.transformers.layer import QJLCacheLayer
from qjl.integrations.transformers.names import cache_kwargs
from cache_state import same, state
from tiny_models import patched_model, random_prompt, tiny_model

torch.set_grad_enabled(False)

GENEROUS = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 8}), value=CodecSpec("uniform", {"bits": 8}),
                     residual_length=8, flush_block=4)


_patched, _prompt = patched_model, random_prompt


@pytest.mark.parametrize("arch,head_dim", [("llama", 64), ("qwen2", 64), ("mistral", 64), ("gemma3", 256),
                                           ("llama", 80), ("qwen2", 96), ("llama", 100)])  # 100: not 8-aligned
def test_generous_config_generates_like_full_precision(arch, head_dim):
    model = _patched(arch, head_dim=head_dim)
    ids = _prompt()
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, **cache_kwargs(DynamicCache(config=model.config)))
    cache = QJLCache(model, GENEROUS)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, **cache_kwargs(cache))
    assert torch.equal(out, ref)
    full = [layer for layer in cache.layers if isinstance(layer, QJLCacheLayer)]
    assert full and all(layer.store.key_codes is not None for layer in full)  # compression really happened
    assert cache.get_seq_length() == out.shape[1] - 1


CODEC_SPECS = [
    CodecSpec("qjl", {"n_outliers": 4}, per_dim={"sketch_dim": 4.0, "outlier_sketch_dim": 0.5}),
    CodecSpec("turboquant_mse", {"bits": 4}),
    CodecSpec("turboquant_prod", {"bits": 4}),
    CodecSpec("turboquant_split", {"bits": 3, "split_bits": 5}, per_dim={"n_split": 0.5}),
    CodecSpec("polarquant", {"bits_per_level": (5, 4)}),
    CodecSpec("kivi", {"bits": 4, "group_size": 4}),
    CodecSpec("uniform", {"bits": 4, "group_size": 32}),
]


@pytest.mark.parametrize("spec", CODEC_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_every_key_codec_runs_and_stays_close(spec, arch):
    model = _patched(arch)
    ids = _prompt(48)
    exact = DynamicCache(config=model.config)
    model(ids[:, :40], **cache_kwargs(exact))
    ref_next = model(ids[:, 40:], **cache_kwargs(exact)).logits
    cfg = QJLConfig(key=spec, value=CodecSpec("turboquant_mse", {"bits": 4}), residual_length=8, flush_block=4)
    cache = QJLCache(model, cfg)
    model(ids[:, :40], **cache_kwargs(cache))
    got = model(ids[:, 40:], **cache_kwargs(cache)).logits
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
        model(ids[:, :32], **cache_kwargs(cache))
        outs.append(model(ids[:, 32:], **cache_kwargs(cache)).logits)
    assert torch.allclose(outs[0], outs[1], atol=1e-4)


def test_chunked_prefill():
    model = _patched("qwen2")
    ids = _prompt(48)
    # with the whole prompt inside the exact window, chunking changes nothing
    wide = QJLConfig(residual_length=64, exact_dtype=None)
    one = model(ids, **cache_kwargs(QJLCache(model, wide))).logits
    cache = QJLCache(model, wide)
    parts = [model(ids[:, s:s + 16], **cache_kwargs(cache)).logits for s in range(0, 48, 16)]
    assert torch.allclose(torch.cat(parts, 1), one, atol=1e-5)
    # with compression, later chunks attend to the compressed history: close, and they do read the codes
    cache = QJLCache(model, GENEROUS)
    parts = [model(ids[:, s:s + 16], **cache_kwargs(cache)).logits for s in range(0, 48, 16)]
    assert torch.allclose(torch.cat(parts, 1), one, atol=2e-2)
    assert cache.layers[0].store.key_codes is not None


NEAR_LOSSLESS = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 8}), value=CodecSpec("turboquant_mse", {"bits": 8}),
                          residual_length=8, flush_block=1, sink_tokens=4)


def _padded_generate(model, cfg, a, b, new: int):
    """Greedy generation of ``new`` tokens for the batch of ``a`` and ``b`` (1-D ids, ``b`` the shorter, left-padded
    with zeros to ``a``'s length) through a fresh QJLCache of ``cfg`` -> (output ids, the cache)."""
    pad = a.numel() - b.numel()
    batch = torch.stack([a, torch.cat([torch.zeros(pad, dtype=torch.long), b])])
    mask = torch.stack([torch.ones(a.numel()), torch.cat([torch.zeros(pad), torch.ones(b.numel())])]).long()
    cache = QJLCache(model, cfg)
    out = model.generate(batch, attention_mask=mask, max_new_tokens=new, do_sample=False, **cache_kwargs(cache))
    return out, cache


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_padded_batch_equals_rows_alone(arch):
    """#11.7: sinks are each row's first real tokens (read from the attention mask), so a left-padded batch
    generates what each row generates alone, token for token, for 64 tokens.  flush_block=1 keeps the
    code/window split of every row where it is alone (with larger blocks the split follows the padded
    length: a tiny difference, not a different token order)."""
    model = _patched(arch)
    a, b = _prompt(40, seed=2)[0], _prompt(27, seed=3)[0]
    out, cache = _padded_generate(model, NEAR_LOSSLESS, a, b, 64)
    store = cache.layers[0].store
    assert store.slot_order is not None and store.n_codes > 0
    assert torch.equal(store.row_start.cpu(), torch.tensor([0, 13]))
    for row, ids in enumerate((a, b)):
        alone = model.generate(ids[None], max_new_tokens=64, do_sample=False,
                               **cache_kwargs(QJLCache(model, NEAR_LOSSLESS)))
        assert torch.equal(out[row, -64:], alone[0, -64:]), (row, out[row, -64:], alone[0, -64:])


def test_heavy_tokens_in_a_padded_batch_equal_rows_alone():
    """#14: heavy tokens are chosen per row from its own attention (padding masked out), so a left-padded batch
    holds and generates what each row does alone; they are exact tokens (beside sinks and window)."""
    model = _patched("llama")
    cfg = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 8}), value=CodecSpec("turboquant_mse", {"bits": 8}),
                    residual_length=8, flush_block=1, sink_tokens=2, heavy_tokens=4, exact_dtype="fp32")
    a, b = _prompt(40, seed=4)[0], _prompt(31, seed=5)[0]
    out, cache = _padded_generate(model, cfg, a, b, 16)
    store = cache.layers[0].store
    assert store.n_sink == 6 and store.slot_order is not None
    for row, ids in enumerate((a, b)):
        alone = QJLCache(model, cfg)
        got = model.generate(ids[None], max_new_tokens=16, do_sample=False, **cache_kwargs(alone))
        assert torch.equal(out[row, -16:], got[0, -16:])
        mine = alone.layers[0].store
        pad = 9 * row
        assert (store.slot_order[row, 2:6].long() - pad).tolist() == mine.slot_order[0, 2:6].long().tolist()
        assert torch.allclose(store.sink_k[row], mine.sink_k[0], atol=1e-6)


def test_crop_then_continue_equals_never_seen():
    model = _patched("llama")
    ids = _prompt(60)
    for heavy in (0, 16):
        cfg = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 3}), residual_length=8, flush_block=4,
                        heavy_tokens=heavy)
        a, b = QJLCache(model, cfg), QJLCache(model, cfg)
        model(ids[:, :40], **cache_kwargs(a))
        model(ids[:, 40:50], **cache_kwargs(a))
        a.crop(-10)
        assert a.get_seq_length() == 40
        model(ids[:, :40], **cache_kwargs(b))
        la = model(ids[:, 50:52], **cache_kwargs(a)).logits
        lb = model(ids[:, 50:52], **cache_kwargs(b)).logits
        assert torch.allclose(la, lb, atol=1e-6)
        if heavy:  # the heavy tokens' slots are reordered: a crop below them is refused, nothing changes
            with pytest.raises(ValueError, match="heavy tokens"):
                a.crop(-30)
            assert a.get_seq_length() == 42
        else:
            a.crop(-30)  # into the codes
            assert a.get_seq_length() == 12


def test_reorder_matches_reordered_inputs():
    model = _patched("mistral")
    ids = _prompt(30, batch=2)
    cfg = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 3}), residual_length=8, flush_block=4)
    c1, c2 = QJLCache(model, cfg), QJLCache(model, cfg)
    model(ids, **cache_kwargs(c1))
    c1.reorder_cache(torch.tensor([1, 0]))
    model(ids.flip(0), **cache_kwargs(c2))
    nxt = _prompt(3, batch=2, seed=9)
    assert torch.allclose(model(nxt, **cache_kwargs(c1)).logits, model(nxt, **cache_kwargs(c2)).logits, atol=1e-5)


def test_beam_search_matches_full_precision():
    model = _patched("llama")
    ids = _prompt(30)
    out = model.generate(ids, max_new_tokens=5, num_beams=3, do_sample=False,
                         **cache_kwargs(QJLCache(model, GENEROUS)))
    ref = model.generate(ids, max_new_tokens=5, num_beams=3, do_sample=False,
                         **cache_kwargs(DynamicCache(config=model.config)))
    assert torch.equal(out, ref)


def test_nbytes_by_hand():
    model = _patched("llama")  # 3 layers, 2 KV heads, head_dim 64, fp32
    cfg = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 4}), value=CodecSpec("uniform", {"bits": 2, "group_size": 32}),
                    residual_length=8, flush_block=4, sink_tokens=2, heavy_tokens=0)
    cache = QJLCache(model, cfg)
    model(_prompt(30), **cache_kwargs(cache))
    model(_prompt(1), **cache_kwargs(cache))  # flushes the prompt's overflow: 2 sinks, 20 coded, 8 + 1 exact
    layer = cache.layers[0].store
    assert layer.sink_k.shape[-2] == 2 and layer.key_codes.lead[-1] == 20 and layer.keys.shape[-2] == 9
    heads, d = 2, 64
    key_code = heads * 20 * (64 * 4 // 8 + 2)  # 4-bit indices + fp16 norm per token
    value_code = heads * 20 * (64 * 2 // 8 + 2 * 2 * 2)  # 2-bit codes + fp16 scale and zero per group of 32
    exact = 2 * heads * (2 + 9) * d * 2  # keys and values at fp16 (exact_dtype "half": fp16 for an fp32 model)
    r = cache.memory_report()
    assert r["key_code_bytes"] == 3 * key_code and r["value_code_bytes"] == 3 * value_code
    assert r["exact_bytes"] == 3 * exact and r["other_bytes"] == 3 * 8  # each row's first real position (int64)
    assert r["smoothing_bytes"] == 3 * 2 * heads * d * 4  # key and value smoothing (on by default): fp32 means
    assert cache.nbytes() == 3 * (key_code + value_code + exact + 8 + 2 * heads * d * 4)
    assert r["key_bits"] == 8 * key_code / (heads * 20 * d)


def test_short_prompt_stays_exact():
    model = _patched("llama")
    ids = _prompt(10)
    cache = QJLCache(model, QJLConfig(residual_length=64))
    out = model.generate(ids, max_new_tokens=5, do_sample=False, **cache_kwargs(cache))
    ref = model.generate(ids, max_new_tokens=5, do_sample=False, **cache_kwargs(DynamicCache(config=model.config)))
    assert torch.equal(out, ref) and cache.layers[0].store.key_codes is None


def test_sliding_layers_stay_exact():
    model = _patched("gemma3")
    cache = QJLCache(model, GENEROUS)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["DynamicSlidingWindowLayer", "QJLCacheLayer"] * 2


def test_layers_built_with_the_older_layer_kwargs_api(monkeypatch):
    """transformers before 5.19 returns one kwargs dict for all layers (5.17 on a GPU image built no layer at all)."""
    from qjl.integrations.transformers import cache as cache_mod

    real = cache_mod.get_layer_types_and_kwargs

    def old_api(config):
        types, per_layer = real(config)
        return types, dict(per_layer[0])

    model = _patched("gemma3")
    want = [type(layer).__name__ for layer in QJLCache(model, GENEROUS).layers]
    monkeypatch.setattr(cache_mod, "get_layer_types_and_kwargs", old_api)
    got = QJLCache(model, GENEROUS)
    assert [type(layer).__name__ for layer in got.layers] == want and len(want) == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models(dtype):
    model = _patched("llama", dtype=dtype)
    ids = _prompt(40)
    cache = QJLCache(model, QJLConfig(residual_length=8, flush_block=4, exact_dtype="fp16"))
    out = model(ids, **cache_kwargs(cache)).logits
    out = model(_prompt(2), **cache_kwargs(cache)).logits
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert cache.layers[0].keys.dtype == torch.float16


def test_unpatched_model_is_refused():
    model = tiny_model("llama")
    cache = QJLCache(model, GENEROUS)
    with pytest.raises(RuntimeError, match="patch_attention"):
        model(_prompt(10), **cache_kwargs(cache))


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
    model(_prompt(30), **cache_kwargs(cache))
    model(_prompt(1), **cache_kwargs(cache))
    assert [layer.store.key_codec.bits for layer in cache.layers] == [4, 6, 6]


def test_long_prefill_is_scored_in_query_chunks(monkeypatch):
    """Prompts longer than QUERY_CHUNK are scored chunk by chunk (bounded memory): same logits."""
    import qjl.cache.attention as cl

    monkeypatch.setattr(cl, "QUERY_CHUNK", 16)
    model = _patched("llama")
    ids = _prompt(70)
    ref = model(ids, **cache_kwargs(DynamicCache(config=model.config))).logits
    got = model(ids, **cache_kwargs(QJLCache(model, QJLConfig(residual_length=128, exact_dtype=None)))).logits
    assert torch.allclose(got, ref, atol=1e-5)
    # and with compressed history, chunked equals unchunked
    cfgs = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 4}), residual_length=8, flush_block=4, kernel="torch")
    cache = QJLCache(model, cfgs)
    model(ids[:, :30], **cache_kwargs(cache))
    chunked = model(ids[:, 30:], **cache_kwargs(cache)).logits
    monkeypatch.setattr(cl, "QUERY_CHUNK", 4096)
    cache = QJLCache(model, cfgs)
    model(ids[:, :30], **cache_kwargs(cache))
    assert torch.allclose(model(ids[:, 30:], **cache_kwargs(cache)).logits, chunked, atol=1e-5)


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
                        kernel=kernel, exact_dtype=None)
        cache = QJLCache(model, cfg)
        first = model(batch[:, :24], attention_mask=mask[:, :24], **cache_kwargs(cache)).logits
        outs[kernel] = torch.cat([first, model(batch[:, 24:], attention_mask=mask, **cache_kwargs(cache)).logits], 1)
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
    out = model.generate(ids, max_new_tokens=4, do_sample=False, **cache_kwargs(cache))
    assert out.shape[1] == 64
    layer = cache.layers[0].store
    assert layer.value_codes.fields["norm"].dtype == torch.float8_e4m3fn
    assert layer.key_codes.fields["norm"].dtype == torch.float16
    assert cache.memory_report()["value_bits"] == pytest.approx(2 + 8 / 64)
    ref = model(ids, **cache_kwargs(DynamicCache(config=model.config))).logits[:, -1]
    got = model(ids, **cache_kwargs(QJLCache(model, cfg))).logits[:, -1]  # prefill: exact up to the fp16 window
    assert torch.allclose(got, ref, atol=5e-3)


def _cache_state(cache):
    return [state(layer.store) for layer in cache.layers]


def test_forward_that_raises_leaves_every_layer_unchanged(monkeypatch):
    """A rejected update in layer 2 undoes layers 0 and 1 of the same forward (#11.2): the lengths agree
    and the cache equals what it was; the next forward works."""
    model = _patched("llama")
    cache = QJLCache(model, QJLConfig(residual_length=8, flush_block=4))
    ids = _prompt(30)
    model(ids, **cache_kwargs(cache))
    before = _cache_state(cache)
    store = cache.layers[2].store
    real = store.append

    def bad_append(k, v):
        return real(k, v.masked_fill(torch.ones_like(v, dtype=torch.bool), float("nan")))

    monkeypatch.setattr(store, "append", bad_append)
    with pytest.raises(ValueError, match="NaN"):
        model(_prompt(3, seed=4), **cache_kwargs(cache))
    assert [layer.get_seq_length() for layer in cache.layers] == [30, 30, 30]
    assert all(same(x, y) for x, y in zip(_cache_state(cache), before))
    monkeypatch.undo()
    model(_prompt(3, seed=4), **cache_kwargs(cache))
    assert [layer.get_seq_length() for layer in cache.layers] == [33, 33, 33]


def test_kivi_crop_is_all_or_nothing_across_layers():
    """#11.3: a crop that would cut into a KIVI group raises before any layer is cut."""
    model = _patched("llama")
    cfg = QJLConfig(key=CodecSpec("kivi", {"bits": 4, "group_size": 4}), value=CodecSpec("uniform", {"bits": 4}),
                    residual_length=8, flush_block=4, sink_tokens=0, heavy_tokens=0)
    cache = QJLCache(model, cfg)
    model(_prompt(30), **cache_kwargs(cache))
    model(_prompt(1), **cache_kwargs(cache))  # flushes the prompt: 20 tokens in codes, 11 in the window
    assert cache.layers[0].store.n_codes == 20
    with pytest.raises(ValueError, match="multiple of 4"):
        cache.crop(-13)
    assert [layer.get_seq_length() for layer in cache.layers] == [31, 31, 31]
    cache.crop(-15)
    assert [layer.get_seq_length() for layer in cache.layers] == [16, 16, 16]


def test_memory_report_is_readable_and_honest():
    """#11.1/#10.10: bytes by part (storage held), the model's own cache and fp16 beside it, a table."""
    model = _patched("llama")
    cache = QJLCache(model, QJLConfig(residual_length=8, flush_block=4))
    model(_prompt(60), **cache_kwargs(cache))
    model(_prompt(1), **cache_kwargs(cache))
    r = cache.memory_report()
    assert r["key_code_bytes"] > 0
    parts = ("key_code_bytes", "value_code_bytes", "exact_bytes", "smoothing_bytes", "other_bytes",
             "uncompressed_layer_bytes")
    assert r["bytes"] == sum(r[p] for p in parts) == cache.nbytes()
    assert r["baseline_bytes"] == 3 * 2 * 2 * 61 * 64 * 4  # DynamicCache: 3 layers, K+V, 2 heads, fp32
    assert r["compression_vs_baseline"] == pytest.approx(r["baseline_bytes"] / r["bytes"])
    assert r["fp16_bytes"] == r["baseline_bytes"] // 2
    text = str(cache.memory_report())
    assert "model's own cache" in text and "key codes" in text and "layers 0:" in text
    assert dict(r)["tokens"] == 61


def test_sliding_layers_count_against_the_models_own_cache():
    """Exact sliding layers are what the model would hold anyway: the headline ratio is >= 1 here."""
    model = _patched("gemma3")
    cache = QJLCache(model, QJLConfig(residual_length=8, flush_block=4))
    model(_prompt(80), **cache_kwargs(cache))
    model(_prompt(1), **cache_kwargs(cache))
    r = cache.memory_report()
    assert r["uncompressed_layer_bytes"] > 0 and r["compression_vs_baseline"] > 1


def test_key_smoothing_refused_with_softcapping():
    """#14.1: smoothing is not exact under logit softcapping: turned off with a warning for such models."""
    import transformers as tf

    cfg = tf.Gemma2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, attn_logit_softcapping=50.0)
    model = tf.Gemma2ForCausalLM(cfg).eval()
    qjl.patch_attention(model)
    with pytest.warns(UserWarning, match="softcapping"):
        cache = QJLCache(model, QJLConfig(smooth_keys=True, residual_length=8, flush_block=4))
    assert not cache.qjl_config.smooth_keys
    model(_prompt(30), **cache_kwargs(cache))
    layer = next(layer for layer in cache.layers if isinstance(layer, QJLCacheLayer))
    layer.store.config = QJLConfig(smooth_keys=True)
    with pytest.raises(ValueError, match="softcapping"):
        layer.attend(torch.randn(1, 2, 1, 32), None, 1.0, softcap=50.0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_value_smoothing_in_a_model(arch):
    """#14: value smoothing through transformers: with everything exact the logits are those without it (the mean
    added back after attention: prefill, chunks, decode, sliding and GQA layers), with 2-bit value codes they stay
    close; the means are counted."""
    model = _patched(arch)
    ids = _prompt(40)
    exact = dict(key=CodecSpec("turboquant_mse", {"bits": 8}), value=CodecSpec("turboquant_mse", {"bits": 8}),
                 residual_length=64, flush_block=4, smooth_keys=True, exact_dtype="fp32")
    outs = []
    for sv in (False, True):
        cache = QJLCache(model, QJLConfig(**exact, smooth_values=sv))
        first = model(ids[:, :32], **cache_kwargs(cache)).logits
        rest = [model(ids[:, i:i + 1], **cache_kwargs(cache)).logits for i in range(32, 40)]
        outs.append(torch.cat([first, *rest], dim=1))
        stores = [layer.store for layer in cache.layers if isinstance(layer, QJLCacheLayer)]
        assert all((s.mu_v is not None) == sv for s in stores)
    assert torch.allclose(outs[0], outs[1], atol=1e-4)
    two_bit = QJLConfig(**{**exact, "value": CodecSpec("turboquant_mse", {"bits": 2}), "residual_length": 8},
                        smooth_values=True)
    ref = model(ids, **cache_kwargs(DynamicCache(config=model.config))).logits
    cache = QJLCache(model, two_bit)
    got = model(ids[:, :32], **cache_kwargs(cache)).logits
    got = torch.cat([got] + [model(ids[:, i:i + 1], **cache_kwargs(cache)).logits for i in range(32, 40)], dim=1)
    stores = [layer.store for layer in cache.layers if isinstance(layer, QJLCacheLayer)]
    assert stores and all(s.n_codes > 0 for s in stores)
    assert (got.softmax(-1) - ref.softmax(-1)).abs().max() < 0.1
    # key and value means: fp32 [B, H_kv, D] each, per compressed layer
    assert cache.memory_report()["smoothing_bytes"] == sum(2 * s.heads * s.key_dim * 4 for s in stores)


def test_auto_widths_from_the_prompt():
    """#14.2: widths chosen at the end of prefill, within the budget, reported; generation runs."""
    model = _patched("llama")
    cfg = QJLConfig.auto(bits_per_value=3.0, residual_length=8, flush_block=4, boundary_layers=0)
    cache = QJLCache(model, cfg)
    out = model.generate(_prompt(60), max_new_tokens=5, do_sample=False, **cache_kwargs(cache))
    assert out.shape[1] == 65
    widths = cache.memory_report()["widths"]
    assert sorted(widths) == [0, 1, 2]
    assert sum(_nominal_bits(cache.layers[i].store) for i in range(3)) / 3 <= 3.0
    again = QJLCache(model, cfg)
    model.generate(_prompt(60), max_new_tokens=5, do_sample=False, **cache_kwargs(again))
    assert again.memory_report()["widths"] == widths  # deterministic


def _nominal_bits(store) -> float:
    """Bits per value of a layer's codecs (keys and values averaged; each run of KV heads weighted by its heads)."""
    amort = lambda c: c.bit_budget().amortized(4096)  # noqa: E731
    if store.groups is None:
        return (amort(store.key_codec) + amort(store.value_codec)) / 2
    return sum((g.heads.stop - g.heads.start) * (amort(g.key_codec) + amort(g.value_codec)) / 2
               for g in store.groups) / store.heads


def test_auto_widths_per_kv_head():
    """#14: widths chosen per KV head where a layer's heads differ (the default; ``per_head=False``: per layer):
    the run's heads coded by their own codecs, within the budget, reported per run; generation runs; the same
    prompt chooses the same widths; the per-layer allocation of the same prompt has one pair per layer."""
    model = _patched("llama")
    ids = _prompt(400)
    caches = {}
    for per_head in (True, False):
        cfg = QJLConfig.auto(bits_per_value=3.0, residual_length=8, flush_block=4, boundary_layers=0,
                             per_head=per_head)
        cache = caches[per_head] = QJLCache(model, cfg)
        out = model.generate(ids, max_new_tokens=5, do_sample=False, **cache_kwargs(cache))
        assert out.shape[1] == 405
        stores = [layer.store for layer in cache.layers]
        assert all(s.n_codes > 0 for s in stores)
        assert sum(_nominal_bits(s) for s in stores) / len(stores) <= 3.0
        assert cache.memory_report()["compressed_bits"] <= 3.0
    grouped = [layer.store for layer in caches[True].layers if layer.store.groups is not None]
    assert grouped and all(layer.store.groups is None for layer in caches[False].layers)
    widths = caches[True].memory_report()["widths"]
    assert any("KV head" in k + v for k, v in widths.values())
    again = QJLCache(model, caches[True].qjl_config)
    model.generate(ids, max_new_tokens=5, do_sample=False, **cache_kwargs(again))
    assert again.memory_report()["widths"] == widths  # deterministic


@pytest.mark.parametrize("prompt,new,heavy", [(220, 40, 0), (400, 90, 0), (400, 40, 16)])
def test_auto_holds_its_budget(prompt, new, heavy):
    """#14: the budget is what the cache holds -- codes with the buffers' spare capacity, key and value means, fits
    and the slot order of heavy tokens (``compressed_bits``) -- at every step of the generation, not only the
    codecs' nominal bits."""
    model = _patched("llama")
    cfg = QJLConfig.auto(bits_per_value=3.0, residual_length=8, flush_block=4, boundary_layers=0, heavy_tokens=heavy)
    cache = QJLCache(model, cfg)
    model(_prompt(prompt), **cache_kwargs(cache))
    held = [cache.memory_report()["compressed_bits"]]
    token = _prompt(1)
    for _ in range(new):
        model(token, **cache_kwargs(cache))
        held.append(cache.memory_report()["compressed_bits"])
    assert max(held) <= 3.0, max(held)
    assert max(held) > 2.7  # and it uses the budget


def test_auto_plans_room_for_the_fitted_key_scale(monkeypatch):
    """#14: with ``fit_key_scale`` the allocation's plan leaves room for the scale's float32 per sequence and KV head
    (``memory_report`` counts it under "fit"): the codes' budget is that much lower than without the fit."""
    from qjl.cache import allocation

    model = _patched("llama")
    planned, real = [], allocation.planned_budget

    def spy(*args, **kwargs):
        planned.append(real(*args, **kwargs))
        return planned[-1]

    monkeypatch.setattr(allocation, "planned_budget", spy)
    for fit in (False, True):
        cache = QJLCache(model, QJLConfig.auto(bits_per_value=3.0, residual_length=8, flush_block=4,
                                               boundary_layers=0, fit_key_scale=fit))
        model(_prompt(200), **cache_kwargs(cache))
        model(_prompt(1), **cache_kwargs(cache))
        assert cache.memory_report()["compressed_bits"] <= 3.0
    store = cache.layers[0].store
    assert len(planned) == 2
    # one float32 per row over the >= 150 compressed prompt tokens' key and value coordinates, at most
    assert 0 < planned[0] - planned[1] <= 32.0 / (150 * (store.key_dim + store.value_dim))


@pytest.mark.parametrize("heavy", [0, 16])
def test_auto_budget_stated_at_a_length(heavy):
    """#14: ``QJLConfig.auto(..., budget_tokens=N0)`` (the 5x preset's rule): a prompt of N0 tokens chooses what the
    plain budget chooses; a prompt of 2 N0 gives its codes the bits the exact tokens' smaller share frees (more than
    the plain budget), while the whole cache (codes, means, exact sinks and window) holds no more bits per value
    than the plain budget's cache holds at N0."""
    model = _patched("llama")
    kw = dict(bits_per_value=3.0, residual_length=8, flush_block=4, boundary_layers=0, sink_tokens=4, heavy_tokens=heavy)
    n0 = 200

    def report(n, **extra):
        cache = QJLCache(model, QJLConfig.auto(**kw, **extra))
        model(_prompt(n), **cache_kwargs(cache))
        model(_prompt(1), **cache_kwargs(cache))  # the first decode step flushes the prompt to codes
        return cache.memory_report()

    short, short_plain = report(n0, budget_tokens=n0), report(n0)
    assert short["widths"] == short_plain["widths"]
    held, plain = report(2 * n0, budget_tokens=n0), report(2 * n0)
    assert plain["compressed_bits"] <= 3.0 < held["compressed_bits"]
    assert held["bits_per_value"] > plain["bits_per_value"]
    # the nominal budget's whole-cache share at n0 (sinks, heavy tokens and window exact at 16 bits); held within
    # it (up to the window's pending flush) and near it (the widths are discrete)
    exact = 12 + heavy
    share = (3.0 * (n0 - exact) + 16.0 * exact) / n0
    assert share - 0.25 <= held["bits_per_value"] <= share + 16.0 * 3 / (2 * n0), (held["bits_per_value"], share)


def test_auto_warns_when_a_short_prompt_cannot_hold_the_budget():
    model = _patched("llama")
    cfg = QJLConfig.auto(bits_per_value=3.0, residual_length=8, flush_block=4, boundary_layers=0)
    with pytest.warns(UserWarning, match="holds more than the budget"):
        model(_prompt(40), **cache_kwargs(QJLCache(model, cfg)))


@pytest.mark.parametrize("version, name", [("4.57.6", "past_key_values"), ("5.0.0", "past_key_values"),
                                           ("5.23.0", "past_key_values"), ("5.24.0", "cache"),
                                           ("5.24.0.dev0", "cache"), ("5.30.1", "cache"), ("6.0.0rc1", "cache")])
def test_cache_argument_name_follows_the_transformers_version(version, name):
    from qjl.integrations.transformers import names

    assert names.arg_name(version) == name
    with pytest.raises(ValueError, match="version"):
        names.arg_name("main")


def test_cache_kwargs_reach_the_model_without_a_deprecation_warning():
    """The installed transformers takes the cache under the name ``cache_kwargs`` gives: generate fills our cache
    (a wrong name would be refused or ignored) and warns about nothing (transformers >= 5.24 warns on the old name)."""
    import logging
    import warnings

    model = _patched("llama")
    ids = _prompt(40)
    cache = QJLCache(model, QJLConfig(residual_length=8, flush_block=4))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            out = model.generate(ids, **qjl.cache_kwargs(cache), max_new_tokens=3, do_sample=False)
            model(out[:, -1:], **cache_kwargs(cache))
    finally:
        logger.removeHandler(handler)
    assert cache.get_seq_length() == ids.shape[1] + 3
    assert not [r for r in records if "past_key_values" in r.getMessage()]

