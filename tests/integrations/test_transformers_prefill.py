"""One prefill for several caches: every cache of a group ends bit for bit as its own prefill leaves it."""

import pytest
import torch

import qjl
from cache_state import same, state
from qjl.integrations.transformers.layer import QJLCacheLayer
from qjl.integrations.transformers.prefill import prefill_key, record_updates, replay_prefill, shared_prefill
from qjl.tools.methods import has_quanto, make_cache, make_method, prefill_groups
from qjl.integrations.transformers.names import cache_kwargs
from tiny_models import tiny_model

torch.set_grad_enabled(False)

# the quick set's prefill groups (exact storage dtype x key / value smoothing) and a few more presets
NAMES = ["full precision", "tq-k45v3", "tq-k3v2", "qjl-paper", "kivi-k2v2", "tq-k4v3", "tq-k3v3"]
PROMPT = 720  # > residual 128 + block 32 + EAGER_FLUSH 512: the prefill compresses the prompt right away


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama")
    qjl.patch_attention(m)
    return m


def _ids(n, seed=0):
    return torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def _names():
    return NAMES + (["hf-quanto-k4v4"] if has_quanto() else [])


def _forward(model, ids):
    return lambda cache: model(ids, **cache_kwargs(cache), use_cache=True)


def _held(cache) -> list:
    """What a cache holds, layer by layer, as plain tensors (compressed stores, or a layer's tensors)."""
    out = []
    for layer in cache.layers:
        if isinstance(layer, QJLCacheLayer):
            out.append(state(layer.store))
        else:
            out.append({n: t.clone() for n, t in vars(layer).items() if isinstance(t, torch.Tensor)})
    return out


def calls_of(model, ids) -> list:
    """The update calls (with their attention) of a prefill through a DynamicCache."""
    dyn = make_cache(model, None)
    with record_updates(dyn) as calls:
        model(ids, **cache_kwargs(dyn))
    return calls


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def test_groups_follow_exact_dtype_and_smoothing(model):
    caches = {n: make_cache(model, make_method(n)) for n in _names()}
    groups = prefill_groups(model, caches)
    assert ["tq-k45v3", "tq-k3v3"] in groups  # fp16 window, smoothed keys and values over 4 sinks + 128 window
    assert ["tq-k3v2"] in groups  # a window of 120: another value mean
    assert ["qjl-paper", "kivi-k2v2", "tq-k4v3"] in groups  # fp16 window, keys as they are
    # transformers' QuantizedCache attends over the prompt as given, as DynamicCache does
    assert (["full precision", "hf-quanto-k4v4"] if has_quanto() else ["full precision"]) in groups
    assert prefill_key(model, make_cache(model, qjl.QJLConfig.auto(bits_per_value=3.0))) is None
    # value smoothing changes the prefill's rounding (values stored minus their mean): its own group
    plain = make_cache(model, qjl.QJLConfig.preset("tq-k3v2", smooth_values=False))
    assert prefill_key(model, plain) != prefill_key(model, caches["tq-k3v2"])
    fp32 = make_cache(model, qjl.QJLConfig.preset("tq-k4v3", exact_dtype="fp32"))
    assert prefill_key(model, fp32) != prefill_key(model, caches["tq-k4v3"])


def test_a_shared_prefill_leaves_every_cache_as_its_own(model):
    """Logits, what each cache holds, and the next chunk's logits: all bit for bit equal to a prefill of
    each cache through the model."""
    ids, nxt = _ids(PROMPT), _ids(40, seed=1)
    caches = {n: make_cache(model, make_method(n)) for n in _names()}
    for names in prefill_groups(model, caches):
        group = [caches[n] for n in names]
        out = shared_prefill(model, group, _forward(model, ids))
        for name, cache in zip(names, group):
            own = make_cache(model, make_method(name))
            own_out = model(ids, **cache_kwargs(own), use_cache=True)
            assert torch.equal(out.logits, own_out.logits), name
            assert cache.get_seq_length() == own.get_seq_length() == PROMPT
            assert _same(_held(cache), _held(own)), name
            a = model(nxt, **cache_kwargs(cache), use_cache=True).logits
            b = model(nxt, **cache_kwargs(own), use_cache=True).logits
            assert torch.equal(a, b), name
            if isinstance(cache, qjl.QJLCache):
                assert cache.memory_report()["key_code_bytes"] > 0  # the prompt was compressed


def test_a_replayed_prefill_picks_the_same_heavy_tokens(model):
    """Heavy tokens are chosen from the prompt's last queries, recorded with the updates: a replayed cache holds
    the same exact tokens (and everything else) as its own prefill."""
    ids = _ids(PROMPT)
    a, b = (make_cache(model, qjl.QJLConfig.preset("tq-k45v3", heavy_tokens=h)) for h in (0, 8))
    assert prefill_key(model, a) == prefill_key(model, b)  # the prefill's logits do not depend on them
    shared_prefill(model, [a, b], _forward(model, ids))
    own = make_cache(model, qjl.QJLConfig.preset("tq-k45v3", heavy_tokens=8))
    model(ids, **cache_kwargs(own), use_cache=True)
    assert own.layers[0].store.n_sink == 4 + 8
    assert _same(_held(b), _held(own))


def test_a_short_prompt_waits_for_the_next_append(model):
    """Below the eager flush the window keeps the prompt until the next forward: the same after a replay."""
    cfg = qjl.QJLConfig.preset("tq-k3v3")
    ids, nxt = _ids(300), _ids(8, seed=2)
    a, b = make_cache(model, cfg), make_cache(model, qjl.QJLConfig.preset("tq-k45v3"))
    shared_prefill(model, [b, a], _forward(model, ids))
    own = make_cache(model, cfg)
    model(ids, **cache_kwargs(own), use_cache=True)
    assert _same(_held(a), _held(own))
    assert torch.equal(model(nxt, **cache_kwargs(a)).logits, model(nxt, **cache_kwargs(own)).logits)


def test_padding_rows_start_where_the_mask_says(model):
    cfg = qjl.QJLConfig.preset("tq-k45v3", residual_length=16, flush_block=16)
    ids = _ids(2 * 64).reshape(2, 64)
    mask = torch.ones(2, 64, dtype=torch.long)
    mask[1, :5] = 0
    a, b = make_cache(model, cfg), make_cache(model, cfg)
    shared_prefill(model, [a, b], lambda c: model(ids, attention_mask=mask, **cache_kwargs(c)), attention_mask=mask)
    own = make_cache(model, cfg)
    model(ids, attention_mask=mask, **cache_kwargs(own))
    assert _same(_held(b), _held(own))
    assert own.layers[0].store.row_start.tolist() == [0, 5]


def test_bad_input_is_refused_and_leaves_the_caches_empty(model):
    ids = _ids(40)
    full, tq, paper = (make_cache(model, make_method(n)) for n in ("full precision", "tq-k45v3", "qjl-paper"))
    with pytest.raises(ValueError, match="share one prefill"):
        shared_prefill(model, [tq, paper], _forward(model, ids))
    with pytest.raises(ValueError, match="must not be empty"):
        shared_prefill(model, [], _forward(model, ids))
    model(ids, **cache_kwargs(full))
    with pytest.raises(ValueError, match=r"caches\[0\] must be empty"):
        shared_prefill(model, [full], _forward(model, ids))
    with pytest.raises(ValueError, match="attention_mask"):
        shared_prefill(model, [tq, make_cache(model, make_method("tq-k3v3"))], _forward(model, ids),
                       attention_mask=torch.ones(40))
    assert tq.get_seq_length() == 0
    with pytest.raises(ValueError, match="one forward"):
        with record_updates(full) as calls:
            model(ids, **cache_kwargs(full))
            model(ids[:, :3], **cache_kwargs(full))
        replay_prefill(tq, calls)
    assert tq.get_seq_length() == 0 and "update" not in vars(full)
    auto = make_cache(model, qjl.QJLConfig.auto(bits_per_value=3.0))
    with record_updates(make_cache(model, None)) as calls:
        pass
    with pytest.raises(ValueError, match="each of"):
        replay_prefill(auto, calls)
    dyn = make_cache(model, None)
    with record_updates(dyn) as calls:
        model(ids, **cache_kwargs(dyn))
    with pytest.raises(ValueError, match="QJLConfig.auto"):
        replay_prefill(auto, calls)
    assert auto.get_seq_length() == 0
    # value smoothing fits its mean to the prompt's last queries: updates recorded without attention cannot fill it
    smoothed = make_cache(model, qjl.QJLConfig.preset("tq-k3v2"))
    bare = make_cache(model, None)
    with record_updates(bare) as calls:
        for i, _k, _v, _ in calls_of(model, ids):
            bare.update(_k, _v, i)
    with pytest.raises(ValueError, match="smooth_values"):
        replay_prefill(smoothed, calls)
    assert smoothed.get_seq_length() == 0
    scaled = make_cache(model, qjl.QJLConfig.preset("tq-k3v2", smooth_values=False, heavy_tokens=0, fit_key_scale=True))
    with pytest.raises(ValueError, match="fit_key_scale"):  # (the coded keys' scale fits to them too)
        replay_prefill(scaled, calls)

    # a single cache without a key prefills on its own
    out = shared_prefill(model, [auto], _forward(model, ids))
    assert auto.get_seq_length() == 40 and out.logits.shape[1] == 40


def test_a_replayed_prefill_fits_the_same_key_scale(model):
    """The coded keys' scale is fitted from the prompt's last queries, recorded with the updates: a replayed cache holds
    the same gamma and key norms as its own prefill, and they differ from the cache without the fit."""
    ids = _ids(PROMPT)
    a, b = (make_cache(model, qjl.QJLConfig.preset("tq-k3v2", fit_key_scale=f)) for f in (False, True))
    assert prefill_key(model, a) == prefill_key(model, b)  # the prefill's logits do not depend on it
    shared_prefill(model, [a, b], _forward(model, ids))
    own = make_cache(model, qjl.QJLConfig.preset("tq-k3v2", fit_key_scale=True))
    model(ids, **cache_kwargs(own), use_cache=True)
    assert _same(_held(b), _held(own)) and not _same(_held(a), _held(b))
    assert torch.equal(b.layers[0].store.key_scale, own.layers[0].store.key_scale)
