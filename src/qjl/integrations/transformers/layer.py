"""The transformers cache layer of a compressed layer: HF's ``CacheLayerMixin`` protocol over a
:class:`qjl.cache.storage.LayerStore`, with attention through :func:`qjl.cache.attention.attend`.

A forward through one layer: ``update`` appends the new keys/values to the store (checked first, all or
nothing), then the "qjl" attention function calls :meth:`QJLCacheLayer.attend`, which reads padding from
the mask (first forward), fits the key mean (key smoothing), attends over sinks + codes + window, and,
after a long prompt, flushes the window's overflow into codes -- so after the forward the store holds the
compressed prompt, not the prompt at full precision.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from qjl.cache.attention import attend
from qjl.cache.storage import LayerStore

__all__ = ["QJLCacheLayer"]


class QJLCacheLayer(CacheLayerMixin):
    """One compressed attention layer of a :class:`qjl.QJLCache`; tensors are ``[B, H_kv, T, D]``.

    ``store`` holds the tokens (sinks, codes, exact window); ``keys``/``values`` are the exact window,
    which transformers reads for the batch size and device.
    """

    is_sliding = False
    is_croppable = True

    def __init__(self, layer_idx: int, config, owner=None, num_layers: int | None = None):
        super().__init__()
        self.owner = owner
        self.store = LayerStore(layer_idx, config, num_layers)

    def __repr__(self):
        return f"QJLCacheLayer({self.store!r})"

    @property
    def layer_idx(self) -> int:
        return self.store.layer_idx

    @property
    def keys(self):
        return self.store.keys

    @keys.setter
    def keys(self, value):  # CacheLayerMixin.__init__ assigns None
        if value is not None:
            raise AttributeError("QJLCacheLayer.keys is the store's exact window; update the cache instead")

    @property
    def values(self):
        return self.store.values

    @values.setter
    def values(self, value):
        if value is not None:
            raise AttributeError("QJLCacheLayer.values is the store's exact window; update the cache instead")

    @property
    def is_initialized(self) -> bool:
        return self.store.is_initialized

    @is_initialized.setter
    def is_initialized(self, value):  # CacheLayerMixin.__init__ assigns False
        pass

    @property
    def dtype(self):
        return self.store.dtype

    @property
    def device(self):
        return self.store.device

    # -- HF cache-layer protocol ----------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.store.initialize(key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new [B, H_kv, t, D] keys/values; returns them tagged for the "qjl" attention function."""
        if self.owner is not None:
            self.owner.check_attention()
        self.store.append(key_states, value_states)
        key_states._qjl_layer = self  # the attention function reads the compressed state from here
        return key_states, value_states

    def attend(self, query: torch.Tensor, attention_mask, scaling: float, softcap=None, module=None) -> torch.Tensor:
        """query: [B, H_q, t, D]; mask [B, 1|H, t, L] in position order -> [B, t, H_q, D_v].  ``module``: the
        attention module calling (read by ``QJLConfig.auto``'s measurement, :meth:`QJLCache.observe`)."""
        store = self.store
        if softcap is not None and store.config.smooth_keys:
            raise ValueError(f"key smoothing is not exact with attention logit softcapping (softcap={softcap}): "
                             "use QJLConfig(smooth_keys=False) for this model")
        b, hq, t, _ = query.shape
        if t == 0:
            return query.new_zeros(b, 0, hq, store.value_dim)
        store.before_attention(attention_mask, query, scaling, softcap)
        if store.pending and self.owner is not None:
            self.owner.observe(self, query, attention_mask, scaling, module)
        out = attend(store, query, store.slot_mask(attention_mask), scaling, softcap)
        if self.owner is not None:
            self.owner.attended(self)
        else:
            store.after_attention()
        return out

    def get_seq_length(self) -> int:
        return self.store.seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return self.store.batch_size

    def reset(self) -> None:
        self.store.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.store.select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.store.select(torch.as_tensor(indices).flatten())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store.is_initialized:
            self.store.select(torch.arange(self.store.batch_size).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``|tokens_to_remove|`` tokens (window first, then codes, then sinks)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        self.store.crop(-tokens_to_remove)
