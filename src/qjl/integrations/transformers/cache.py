"""``QJLCache``: a transformers ``Cache`` whose attention layers hold compressed keys and values.

    import qjl
    qjl.patch_attention(model)                     # once: switch attention to "qjl"
    cache = qjl.QJLCache(model)                    # the default preset (QJLConfig())
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=256)   # transformers >= 5.24: cache=cache
    print(cache.memory_report())                   # a table; cache.memory_report()["bytes"] etc.

Full-attention layers become :class:`qjl.integrations.transformers.layer.QJLCacheLayer`; sliding-window
layers stay transformers' exact sliding layers unless ``compress_sliding`` is set.

All-or-nothing: a forward that raises (a rejected update in any layer, an attention error) leaves every
layer as it was before the forward; ``crop``, ``reorder_cache``, ``batch_select_indices``,
``batch_repeat_interleave`` and ``reset`` either apply to every layer or to none.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from qjl.cache.buffers import storage_bytes
from qjl.cache.config import QJLConfig
from qjl.cache.memory import LayerMemory, MemoryReport
from qjl.cache.smoothing import softcap_of
from qjl.integrations.transformers.attention import ATTN_NAME
from qjl.integrations.transformers.layer import QJLCacheLayer

__all__ = ["QJLCache"]

_COMPRESSIBLE = {"full_attention"}
_SLIDING = {"sliding_attention", "chunked_attention"}


def _head_dim(text) -> int:
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def _describe(store, role: str) -> str:
    """The codec of one role ("key" or "value") of a layer, or of each run of its KV heads (widths per KV head)."""
    dim = store.key_dim if role == "key" else store.value_dim
    spec = store.key_spec if role == "key" else store.value_spec
    if spec is not None:
        return spec.describe(dim)
    if store.groups is not None:  # (numbered as the layer's KV heads: under tensor parallelism, from the rank's)
        return "; ".join(f"{_heads(g.heads, store.first_head)}: "
                         f"{(g.key_spec if role == 'key' else g.value_spec).describe(dim)}"
                         for g in store.groups)
    return "pending (widths chosen after the prefill)" if store.pending else "exact"


def _heads(heads: slice, first: int = 0) -> str:
    a, b = first + heads.start, first + heads.stop - 1
    return f"KV head {a}" if a == b else f"KV heads {a}-{b}"


def _rank_sum(model):
    """Under transformers' tensor parallelism (``model.tp_size > 1``): a function summing a tensor over the ranks
    (an all-reduce over the torch.distributed world, which must then be the tensor-parallel group), so that the
    choices made from every KV head of a layer (heavy tokens, ``auto`` widths) agree between ranks and with one
    process; False when the world is larger than the tensor-parallel group; None in one process."""
    tp = getattr(model, "tp_size", None) or 1
    if tp == 1:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() == tp):
        return False

    def rank_sum(t):
        t = t.contiguous().clone()
        dist.all_reduce(t)
        return t

    return rank_sum


class QJLCache(Cache):
    """Compressed KV cache for a Hugging Face decoder model.

    Args:
        model: the transformers model this cache serves (its config decides the layer types).
        config: a :class:`qjl.QJLConfig` (default: ``QJLConfig()``, the preset ``DEFAULT_PRESET``).
    """

    def __init__(self, model, config: QJLConfig | None = None):
        if not hasattr(model, "config") or not hasattr(model.config, "get_text_config"):
            raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
        config = QJLConfig() if config is None else config
        if not isinstance(config, QJLConfig):
            raise TypeError(f"config must be a qjl.QJLConfig, got {type(config).__name__}")
        cap = softcap_of(model.config)
        if cap is not None and config.smooth_keys:
            warnings.warn(f"key smoothing turned off: it is not exact with this model's attention logit softcapping "
                          f"({cap}); pass QJLConfig(smooth_keys=False) to silence this", stacklevel=2)
            config = replace(config, smooth_keys=False)
        rank_sum = _rank_sum(model)
        if rank_sum is False and config.heavy_tokens:
            warnings.warn("heavy tokens turned off: under tensor parallelism inside a larger device mesh they would be "
                          "chosen from each rank's KV heads alone (the choice would differ between ranks and from one "
                          "process); pass QJLConfig(heavy_tokens=0) to silence this", stacklevel=2)
            config = replace(config, heavy_tokens=0)
        if rank_sum is False and config.allocation is not None:
            raise ValueError("QJLConfig.auto under tensor parallelism needs the tensor-parallel group to be the whole "
                             "torch.distributed world (each rank would choose widths from its own KV heads)")
        text = model.config.get_text_config(decoder=True)
        layer_types, kwargs = get_layer_types_and_kwargs(text)
        if isinstance(kwargs, dict):  # transformers before 5.19: one kwargs dict for every layer
            kwargs = [kwargs] * len(layer_types)
        unknown = set(layer_types) - _COMPRESSIBLE - _SLIDING - {"dummy"}
        if unknown:
            raise ValueError(f"QJLCache supports full and sliding-window attention layers; this model has {sorted(unknown)}")
        config.check_model(_head_dim(text), len(layer_types))
        self.model_config, self.qjl_config = model.config, config
        layers = []
        for i, (kind, kw) in enumerate(zip(layer_types, kwargs)):
            if kind in _COMPRESSIBLE or (kind in _SLIDING and config.compress_sliding):
                layers.append(QJLCacheLayer(i, config, owner=self, num_layers=len(layer_types)))
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw))
        super().__init__(layers=layers)
        ranks = None
        if rank_sum:  # (the tensor-parallel group is the world: checked by _rank_sum)
            import torch.distributed as dist

            ranks = (dist.get_rank(), dist.get_world_size())
        for layer in self._compressed():
            layer.store.rank_sum, layer.store.ranks = rank_sum or None, ranks
        self._step, self._last = {}, -1  # layer index -> its state before this forward; last layer updated
        self._auto = None
        if config.allocation is not None:
            from qjl.cache.allocation import Allocator

            self._auto = Allocator(config, [layer.store for layer in self._compressed()])

    def _compressed(self) -> list:
        return [layer for layer in self.layers if isinstance(layer, QJLCacheLayer)]

    def check_attention(self) -> None:
        """Raise unless the model attends through the "qjl" attention (see :func:`qjl.patch_attention`)."""
        impl = getattr(self.model_config, "_attn_implementation", None)
        if impl != ATTN_NAME:
            raise RuntimeError(f"the model's attention is {impl!r}, which would ignore the compressed cache; "
                               "call qjl.patch_attention(model) once before using QJLCache")

    # -- one forward, all or nothing --------------------------------------------------------------
    @staticmethod
    def _snapshot(layer):
        return layer.store.snapshot() if isinstance(layer, QJLCacheLayer) else dict(vars(layer))

    @staticmethod
    def _restore(layer, snap) -> None:
        if isinstance(layer, QJLCacheLayer):
            layer.store.restore(snap)
        else:
            vars(layer).clear()
            vars(layer).update(snap)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """transformers' update, undone in every layer of this forward if it raises."""
        if layer_idx <= self._last:
            self.commit()
        self._last = layer_idx
        self._step[layer_idx] = self._snapshot(self.layers[layer_idx])
        try:
            out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException:
            self.rollback()
            raise
        if layer_idx == len(self.layers) - 1 and not isinstance(self.layers[layer_idx], QJLCacheLayer):
            self.commit()
        return out

    def commit(self) -> None:
        """End of a forward: forget the states kept to undo it."""
        self._step, self._last = {}, -1

    def rollback(self) -> None:
        """Undo the current forward in every layer it reached."""
        for i, snap in self._step.items():
            self._restore(self.layers[i], snap)
        self.commit()

    def observe(self, layer: QJLCacheLayer, query, attention_mask, scaling: float, module=None) -> None:
        """Prefill of a config with ``auto`` widths: measure this layer (qjl.cache.allocation); ``module``: the
        attention module calling, whose output projection and residual stream weigh the layer's error
        (:mod:`qjl.integrations.transformers.residual`)."""
        try:
            residual = None
            if module is not None and self._auto.auto.residual_weights:
                from qjl.integrations.transformers.residual import residual_terms

                residual = residual_terms(module, query, min(self._auto.auto.queries, query.shape[2]))
            self._auto.observe(layer.store, query, attention_mask, scaling, residual)
        except BaseException:
            self.rollback()
            raise

    def attended(self, layer: QJLCacheLayer) -> None:
        """After a layer's attention: flush a long prompt (with ``auto`` widths: choose them once every layer
        was measured)."""
        try:
            if self._auto is not None and self._auto.ready():
                self._auto.allocate()
                for other in self._compressed():
                    other.store.after_attention()
            else:
                layer.store.after_attention()
        except BaseException:
            self.rollback()
            raise
        if layer.layer_idx == len(self.layers) - 1:
            self.commit()

    def _all_layers(self, op) -> None:
        """Apply ``op(layer)`` to every layer, or (if one raises) to none."""
        self.commit()
        snaps = [self._snapshot(layer) for layer in self.layers]
        try:
            for layer in self.layers:
                op(layer)
        except BaseException:
            for layer, snap in zip(self.layers, snaps):
                self._restore(layer, snap)
            raise

    def crop(self, tokens_to_remove: int) -> None:
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative int (tokens to remove), got {tokens_to_remove!r}")
        for layer in self._compressed():  # every check before any layer changes
            layer.store.check_crop(-tokens_to_remove)
        self._all_layers(lambda layer: layer.crop(tokens_to_remove))

    def reorder_cache(self, beam_idx) -> None:
        for layer in self._compressed():
            layer.store.check_select(beam_idx)
        self._all_layers(lambda layer: layer.reorder_cache(beam_idx))

    def batch_select_indices(self, indices) -> None:
        self._all_layers(lambda layer: layer.batch_select_indices(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._all_layers(lambda layer: layer.batch_repeat_interleave(repeats))

    def reset(self) -> None:
        self._all_layers(lambda layer: layer.reset())
        if self._auto is not None:
            self._auto.reset()

    # -- memory ----------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of storage the cache holds (codes, exact window, sinks, means, uncompressed layers)."""
        return self.memory_report()["bytes"]

    def memory_report(self) -> MemoryReport:
        """Bytes held by part, against the model's own cache and fp16 for the same tokens, and bits per value.

        ``str(report)`` is a table; ``report["bytes"]`` etc. as in :class:`qjl.cache.memory.MemoryReport`.
        """
        seen, layers = set(), []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, QJLCacheLayer):
                layers.append(self._layer_memory(layer.store, seen))
            elif getattr(layer, "keys", None) is not None and layer.keys.numel():
                sizes = storage_bytes([layer.keys, layer.values])
                held = sum(b for p, b in sizes.items() if p not in seen)
                seen |= set(sizes)
                coords = layer.keys.numel()
                layers.append(LayerMemory(layer=i, kind="exact", uncompressed=held, baseline=held, coords=coords,
                                          exact_coords=coords, tokens=layer.get_seq_length()))
        weighed = None if self._auto is None else self._auto.weighed
        return MemoryReport(layers, allocation=None if weighed is None else
                            "errors in the residual stream" if weighed else "errors at the attention output")

    @staticmethod
    def _layer_memory(store, seen: set) -> LayerMemory:
        out = LayerMemory(layer=store.layer_idx, kind="exact" if store.exact_only else "compressed",
                          tokens=store.seq_length())
        for part, tensors in store.parts().items():
            sizes = storage_bytes(tensors)
            out[part] = sum(b for p, b in sizes.items() if p not in seen)
            seen |= set(sizes)
        if not store.is_initialized:
            return out
        c = store.counts()
        n = store.seq_length()
        out.update(compressed_coords=c["compressed"], exact_coords=c["exact"], coords=c["compressed"] + c["exact"],
                   baseline=store.batch * store.heads * n * (store.key_dim + store.value_dim) * store.dtype.itemsize,
                   key=_describe(store, "key"), value=_describe(store, "value"))
        return out
