"""The residual stream ``QJLConfig.auto`` weighs each layer's error by (qjl.integrations.transformers.residual)."""

import pytest
import torch

import qjl
from qjl import QJLCache, QJLConfig
from qjl.integrations.transformers import residual
from qjl.integrations.transformers.names import cache_kwargs
from tiny_models import patched_model, random_prompt

torch.set_grad_enabled(False)

_patched, _prompt = patched_model, random_prompt


def test_auto_weighs_each_layer_by_the_residual_stream_it_enters(monkeypatch):
    """#14: ``QJLConfig.auto``'s proxy (AutoBits ``residual_weights``, the default) reads in each layer's attention
    call the residual stream entering that decoder layer -- ``E||h_l||^2`` over the last queries, the model's own
    hidden state l (not l + 1) -- and the output projection's gain per query head ``||W_o^(h)||_F^2 / D``; the hooks
    are installed once however often the model is patched and hold nothing after a forward."""
    from qjl.cache import allocation

    model = _patched("llama")
    qjl.patch_attention(model)  # twice: still one pair of hooks per decoder layer
    assert all(len(layer._forward_pre_hooks) == 1 and len(layer._forward_hooks) == 1 for layer in model.model.layers)
    seen = {}
    observe = allocation.Allocator.observe

    def spy(self, store, query, mask, scaling, residual=None):
        seen[store.layer_idx] = residual
        return observe(self, store, query, mask, scaling, residual)

    monkeypatch.setattr(allocation.Allocator, "observe", spy)
    ids = _prompt(200, batch=2)
    cfg = QJLConfig.auto(bits_per_value=3.0, residual_length=8, flush_block=4, boundary_layers=0)
    cache = QJLCache(model, cfg)
    hidden = model(ids, **cache_kwargs(cache), output_hidden_states=True).hidden_states
    assert not residual.holding(model)  # nothing kept after the forward
    r = cfg.allocation.queries
    d = model.config.head_dim
    for i, layer in enumerate(model.model.layers):
        gain, energy = seen[i]
        assert energy == pytest.approx(float(hidden[i][:, -r:].double().square().sum(-1).mean()), rel=1e-6)
        assert energy != pytest.approx(float(hidden[i + 1][:, -r:].double().square().sum(-1).mean()), rel=1e-3)
        w = layer.self_attn.o_proj.weight.double()
        want = torch.stack([w[:, h * d:(h + 1) * d].square().sum() / d for h in range(model.config.num_attention_heads)])
        assert torch.allclose(gain, want, rtol=1e-6)
        st = cache.layers[i].store.auto_stats
        assert st["weighed"] and st["s_k"] != pytest.approx(st["unweighed"]["s_k"])
    assert cache.memory_report()["allocation"] == "errors in the residual stream"


def test_auto_without_a_readable_residual_stream_allocates_unweighted(monkeypatch):
    """Where the output projection cannot be read (another attention layout), ``auto`` chooses exactly what
    ``residual_weights=False`` chooses and says so in ``memory_report()``; a fixed preset reports no allocation."""
    model = _patched("llama")
    ids = _prompt(300)
    kw = dict(bits_per_value=3.0, residual_length=8, flush_block=4, boundary_layers=0)
    reports = {}
    for name, weights in (("on", True), ("off", False)):
        cache = QJLCache(model, QJLConfig.auto(**kw, residual_weights=weights))
        model(ids, **cache_kwargs(cache))
        model(_prompt(1), **cache_kwargs(cache))
        reports[name] = cache.memory_report()
    assert reports["on"]["allocation"] == "errors in the residual stream"
    assert reports["off"]["allocation"] == "errors at the attention output"
    assert reports["on"]["widths"] != reports["off"]["widths"]  # (the weights matter on this model)
    real = residual.output_gain
    for blind_layers in ({0, 1, 2}, {1}):  # every layer, or one layer without weights: none weighed
        monkeypatch.setattr(residual, "output_gain",
                            lambda m, *a, b=blind_layers: None if m.layer_idx in b else real(m, *a))
        cache = QJLCache(model, QJLConfig.auto(**kw))
        model(ids, **cache_kwargs(cache))
        model(_prompt(1), **cache_kwargs(cache))
        blind = cache.memory_report()
        assert blind["allocation"] == "errors at the attention output" and blind["widths"] == reports["off"]["widths"]
        assert "errors at the attention output" in str(blind)
    fixed = QJLCache(model, QJLConfig(residual_length=8, flush_block=4))
    model(ids, **cache_kwargs(fixed))
    assert fixed.memory_report()["allocation"] is None



def test_residual_terms_only_for_the_layer_now_running():
    """Outside a forward, or with another layer's input held, or without hooks, there is nothing to read (None), and
    a model without decoder layers of the usual layout is not hooked."""
    model = _patched("llama")
    attn = [layer.self_attn for layer in model.model.layers]
    q = torch.zeros(1, model.config.num_attention_heads, 4, model.config.head_dim)
    assert residual.residual_terms(attn[0], q, 4) is None  # no forward running
    got = {}

    def peek(module, args, kwargs):
        got["other"] = residual.residual_terms(attn[1], q, 4)  # layer 0's input is held, not layer 1's
        got["own"] = residual.residual_terms(attn[0], q, 4)
        got["holding"] = residual.holding(model)

    handle = attn[0].register_forward_pre_hook(peek, with_kwargs=True)
    model(_prompt(12))
    handle.remove()
    assert got["other"] is None and got["own"] is not None and got["own"][1] > 0 and got["holding"]
    assert not residual.holding(model)
    assert residual.residual_terms(torch.nn.Linear(2, 2), q, 4) is None  # not hooked
    assert residual.install(torch.nn.Sequential(torch.nn.Linear(2, 2))) is False
    assert residual.output_gain(torch.nn.Module(), 2, 4) is None


def test_a_layer_that_raises_leaves_nothing_held():
    """A decoder layer raising mid-forward (here its attention) still drops the input its hook held."""
    model = _patched("llama")
    attn = model.model.layers[1].self_attn

    def fail(module, args, kwargs):
        raise RuntimeError("boom")

    handle = attn.register_forward_pre_hook(fail, with_kwargs=True)
    with pytest.raises(RuntimeError, match="boom"):
        model(_prompt(12))
    handle.remove()
    assert not residual.holding(model)
    model(_prompt(12))  # and the model runs again
    assert not residual.holding(model)


def test_residual_functions_name_bad_input():
    model = _patched("llama")
    attn = model.model.layers[0].self_attn
    q = torch.zeros(1, model.config.num_attention_heads, 4, model.config.head_dim)
    with pytest.raises(TypeError, match="model"):
        residual.install("not a model")
    for bad in (torch.zeros(2, 4), "q"):
        with pytest.raises(ValueError, match="query"):
            residual.residual_terms(attn, bad, 4)
    for rows in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="rows"):
            residual.residual_terms(attn, q, rows)
    with pytest.raises(ValueError, match="heads"):
        residual.output_gain(attn, 0, 64)
    with pytest.raises(ValueError, match="head_dim"):
        residual.output_gain(attn, 2, 1.5)
