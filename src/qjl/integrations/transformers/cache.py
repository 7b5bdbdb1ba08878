"""``QJLCache``: a transformers ``Cache`` whose attention layers hold compressed keys and values.

    import qjl
    qjl.patch_attention(model)                     # once: switch attention to "qjl"
    cache = qjl.QJLCache(model, qjl.QJLConfig.preset("tq-k4v3"))
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=256)
    print(cache.memory_report())

Full-attention layers become :class:`qjl.integrations.transformers.layer.QJLCacheLayer`; sliding-window
layers stay transformers' exact sliding layers unless ``compress_sliding`` is set.
"""

from __future__ import annotations

from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from qjl.integrations.transformers.attention import ATTN_NAME
from qjl.integrations.transformers.layer import QJLCacheLayer
from qjl.cache.config import QJLConfig
from qjl.cache.presets import DEFAULT_PRESET

__all__ = ["QJLCache"]

_COMPRESSIBLE = {"full_attention"}
_SLIDING = {"sliding_attention", "chunked_attention"}


class QJLCache(Cache):
    """Compressed KV cache for a Hugging Face decoder model.

    Args:
        model: the transformers model this cache serves (its config decides the layer types).
        config: a :class:`qjl.QJLConfig` (default: the preset ``DEFAULT_PRESET``).
    """

    def __init__(self, model, config: QJLConfig | None = None):
        if not hasattr(model, "config") or not hasattr(model.config, "get_text_config"):
            raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
        config = QJLConfig.preset(DEFAULT_PRESET) if config is None else config
        if not isinstance(config, QJLConfig):
            raise TypeError(f"config must be a qjl.QJLConfig, got {type(config).__name__}")
        self.model_config, self.qjl_config = model.config, config
        text = model.config.get_text_config(decoder=True)
        layer_types, kwargs = get_layer_types_and_kwargs(text)
        unknown = set(layer_types) - _COMPRESSIBLE - _SLIDING - {"dummy"}
        if unknown:
            raise ValueError(f"QJLCache supports full and sliding-window attention layers; this model has {sorted(unknown)}")
        layers = []
        for i, (kind, kw) in enumerate(zip(layer_types, kwargs)):
            if kind in _COMPRESSIBLE or (kind in _SLIDING and config.compress_sliding):
                layers.append(QJLCacheLayer(i, config, owner=self, num_layers=len(layer_types)))
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw))
        super().__init__(layers=layers)

    def check_attention(self) -> None:
        """Raise unless the model attends through the "qjl" attention (see :func:`qjl.patch_attention`)."""
        impl = getattr(self.model_config, "_attn_implementation", None)
        if impl != ATTN_NAME:
            raise RuntimeError(f"the model's attention is {impl!r}, which would ignore the compressed cache; "
                               "call qjl.patch_attention(model) once before using QJLCache")

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (codes, exact window, sinks, uncompressed layers)."""
        return self.memory_report()["bytes"]

    def memory_report(self) -> dict:
        """Bytes held by part, the fp16 size of the same tokens, and bits per stored coordinate."""
        key_codes = value_codes = exact = other = 0
        compressed = exact_coords = other_coords = 0
        for layer in self.layers:
            if isinstance(layer, QJLCacheLayer):
                nb, c = layer.store.nbytes(), layer.store.counts()
                key_codes += nb["key_codes"]
                value_codes += nb["value_codes"]
                exact += nb["exact"]
                compressed += c["compressed"]
                exact_coords += c["exact"]
            elif getattr(layer, "keys", None) is not None and layer.keys.numel():
                other += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
                other_coords += layer.keys.numel()
        total = key_codes + value_codes + exact + other
        coords = compressed + exact_coords + other_coords  # per K or V
        per = lambda nbytes, n: 8 * nbytes / n if n else 0.0  # noqa: E731
        return {
            "bytes": total, "fp16_bytes": 2 * 2 * coords,
            "key_code_bytes": key_codes, "value_code_bytes": value_codes, "exact_bytes": exact,
            "uncompressed_layer_bytes": other,
            "key_bits": per(key_codes, compressed), "value_bits": per(value_codes, compressed),
            "exact_bits": per(exact, 2 * exact_coords), "bits_per_value": per(total, 2 * coords),
            "compression_vs_fp16": (2 * 2 * coords) / total if total else 0.0,
        }
