"""One prefill for several caches: fill empty caches whose prefill computes the same thing with one forward.

A prompt's forward attends exactly for every cache this package knows: the compressed layers of a
:class:`qjl.QJLCache` attend over the prompt they just received (at their exact storage dtype, key
smoothing applied) and compress it afterwards; transformers' ``DynamicCache`` and ``QuantizedCache``
attend over the keys and values they are given.  Two empty caches whose layers would see the same
keys and values at the prefill (:func:`prefill_key`) therefore yield the same logits and receive the same
``update`` calls, layer by layer.  :func:`shared_prefill` runs the model once with the first cache, records
those calls and feeds them to the others (:func:`replay_prefill`): each ends in the state its own prefill
would have left, bit for bit, at the cost of one forward.

    caches = [qjl.QJLCache(model, qjl.QJLConfig.preset(n)) for n in ("tq-k45v3", "tq-k3v3")]
    out = shared_prefill(model, caches, lambda c: model(input_ids, **cache_kwargs(c), use_cache=True))

What makes two prefills the same (:func:`prefill_key`), per layer: a compressed layer's exact storage dtype,
key smoothing, value smoothing with its sink and window sizes (its mean covers the tokens to be coded, weighted
by the prompt's last queries, which are recorded with the updates) and kernel setting (codecs, and without value
smoothing the window and sink sizes, only act after the attention); transformers' ``DynamicLayer``,
``DynamicSlidingWindowLayer`` and ``QuantizedLayer`` attend over the keys and values they were given at the
prefill (a ``QuantizedLayer`` quantizes them for later), so they share one by their sliding window.
Configurations that choose anything from the prompt's queries (``QJLConfig.auto``) and cache classes not listed
have no key: they prefill on their own.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from qjl.cache.smoothing import VALUE_MEAN_ROWS
from qjl.cache.storage import exact_storage
from qjl.integrations.transformers.attention import recording_queries
from qjl.integrations.transformers.layer import QJLCacheLayer

__all__ = ["prefill_key", "record_updates", "replay_prefill", "shared_prefill"]

_EXACT_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")


def prefill_key(model, cache):
    """What the prefill of an empty ``cache`` on ``model`` depends on besides the prompt, as a hashable
    tuple (one entry per layer); equal keys mean equal prefills.  None: the cache cannot share a prefill."""
    from transformers import cache_utils as cu

    # transformers' layers whose first update returns the keys and values it was given (or an equal copy)
    exact = tuple(c for c in (getattr(cu, n, None) for n in _EXACT_LAYERS) if c is not None)
    if not hasattr(cache, "layers"):
        raise TypeError(f"cache must be a transformers Cache, got {type(cache).__name__}")
    parts = []
    for layer in cache.layers:
        if isinstance(layer, QJLCacheLayer):
            cfg = layer.store.config
            if cfg.allocation is not None:  # widths chosen from the prompt's queries
                return None
            # value smoothing's mean covers the tokens to be coded: it depends on the sinks and the window
            values = (cfg.sink_tokens, cfg.residual_length) if cfg.smooth_values else None
            parts.append(("qjl", layer.is_sliding, exact_storage(cfg.exact_dtype, model.dtype), cfg.smooth_keys,
                          values, cfg.kernel))
        elif type(layer) in exact or isinstance(layer, getattr(cu, "QuantizedLayer", ())):
            parts.append(("exact", layer.is_sliding, getattr(layer, "sliding_window", None)))
        else:
            return None
    return tuple(parts)


@contextmanager
def record_updates(cache):
    """Within the block, every ``cache.update(keys, values, layer_idx)`` is also appended to the yielded list
    as ``[layer_idx, keys, values, attention]`` (keys/values ``[B, H_kv, t, D]``, the tensors the model passed);
    ``attention`` is what the layer's next attention call received -- ``(query, mask, scaling, softcap)`` with the
    last :data:`~qjl.cache.smoothing.VALUE_MEAN_ROWS` rows of the query [B, H_q, r, D] and of the mask
    [B, 1|H, r, L] (what value smoothing fits to) -- or None (no attention through a patched model)."""
    calls = []
    update = cache.update

    def recording(key_states, value_states, layer_idx, *args, **kwargs):
        calls.append([layer_idx, key_states, value_states, None])
        return update(key_states, value_states, layer_idx, *args, **kwargs)

    def attention(layer_idx, query, mask, scaling, softcap):
        for call in reversed(calls):
            if call[0] == layer_idx:
                if call[3] is None:
                    rows = query.shape[2] - min(VALUE_MEAN_ROWS, query.shape[2])
                    call[3] = (query[:, :, rows:].clone(), None if mask is None else mask[:, :, rows:].clone(),
                               scaling, softcap)
                break

    cache.update = recording  # this instance only, for this block
    try:
        with recording_queries(attention):
            yield calls
    finally:
        del cache.update


def _layer_mask(attention_mask, batch: int):
    """A 2D padding mask [B, L] (1 = token) as the [B, 1, 1, L] bool mask a compressed layer reads its
    rows' first tokens from (None: no padding)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch:
        raise ValueError(f"attention_mask must be a [batch, length] padding mask with batch {batch}, "
                         f"got shape {tuple(attention_mask.shape)}")
    return attention_mask[:, None, None, :].bool()


def replay_prefill(cache, calls: list, attention_mask=None) -> None:
    """Feed an empty ``cache`` the ``update`` calls of another cache's prefill (from :func:`record_updates`),
    as its own prefill would: compressed layers also take their prefill steps (each row's first token, key
    smoothing, compressing the prompt), without computing attention.  Each layer must appear once (one
    forward).  ``attention_mask``: the prefill's [B, L] padding mask, None without padding.  On error the
    cache is reset (empty again)."""
    if cache.get_seq_length() != 0:
        raise ValueError(f"cache must be empty, it holds {cache.get_seq_length()} tokens")
    idx = [c[0] for c in calls]
    if sorted(idx) != list(range(len(cache.layers))):
        raise ValueError(f"calls must update each of the cache's {len(cache.layers)} layers once (one forward), "
                         f"got layers {idx}")
    mask = _layer_mask(attention_mask, calls[0][1].shape[0]) if calls else None
    try:
        for i, k, v, attn in calls:
            cache.update(k.clone(), v.clone(), i)
            layer = cache.layers[i]
            if isinstance(layer, QJLCacheLayer):
                if layer.store.pending:
                    raise ValueError("replay_prefill cannot fill a cache whose widths are chosen from the prompt's "
                                     "queries (QJLConfig.auto): prefill it with the model")
                c = layer.store.config
                if attn is None and (c.smooth_values or c.heavy_tokens or c.fit_key_scale):
                    raise ValueError(f"replay_prefill: layer {i} has no recorded attention (its query), which value "
                                     "smoothing (smooth_values), heavy_tokens and fit_key_scale fit to: record the "
                                     "prefill through a patched model")
                if attn is None:
                    layer.store.before_attention(mask)
                else:  # the recorded rows: the same value mean as the cache's own prefill
                    query, rows_mask, scaling, softcap = attn
                    layer.store.before_attention(mask, query, scaling, softcap, query_mask=rows_mask)
                cache.attended(layer)
    except BaseException:
        cache.reset()
        raise


def shared_prefill(model, caches: list, run, attention_mask=None):
    """Prefill every cache of ``caches`` (empty; with more than one, of equal :func:`prefill_key`) with one forward.

    ``run(cache)`` does the prefill with one cache (e.g. ``model(ids, **cache_kwargs(cache))``, or
    ``model.generate(ids, **cache_kwargs(cache), max_new_tokens=1)``) and its result is returned: it holds for
    every cache, as their prefills compute the same.  ``attention_mask``: the prompt's [B, L] padding mask
    (None: no padding).  On error every cache is reset.
    """
    caches = list(caches)
    if not caches:
        raise ValueError("caches must not be empty")
    for n, cache in enumerate(caches):
        if cache.get_seq_length() != 0:
            raise ValueError(f"caches[{n}] must be empty, it holds {cache.get_seq_length()} tokens")
    keys = [prefill_key(model, c) for c in caches]
    if len(caches) > 1 and (keys[0] is None or any(k != keys[0] for k in keys[1:])):
        raise ValueError("caches must share one prefill (equal, non-None prefill_key); got "
                         + ", ".join(f"caches[{n}]: {'none' if k is None else 'key ' + str(sorted(set(k)))}"
                                     for n, k in enumerate(keys)))
    try:
        with record_updates(caches[0]) as calls, torch.no_grad():
            out = run(caches[0])
        for cache in caches[1:]:
            replay_prefill(cache, calls, attention_mask)
    except BaseException:
        for cache in caches:
            cache.reset()
        raise
    return out
