"""Cache configuration: which codec for keys and values, per layer, and the exact window.

``QJLConfig`` is frozen and validated on construction (codec names, parameter
names, a trial build of every codec), so a bad configuration fails before any
model runs.  Codec parameters that scale with the head dimension (QJL's sketch
size) are given in ``CodecSpec.per_dim`` as multiples of ``head_dim``.

Named presets (``QJLConfig.preset(name)``) and their honest bits per value
(``config.bits_per_value(head_dim)``) are listed by :mod:`qjl.cache.presets`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from qjl.codecs.base import Codec
from qjl.codecs.registry import CODECS, codec_parameters, make_codec

__all__ = ["CodecSpec", "QJLConfig"]


@dataclass(frozen=True)
class CodecSpec:
    """A codec by registry name, with fixed parameters and parameters proportional to head_dim.

    ``CodecSpec("qjl", {"n_outliers": 8}, per_dim={"sketch_dim": 2.0})`` gives a QJL sketch of
    ``2 * head_dim`` bits (rounded to a multiple of 8).
    """

    name: str
    params: dict = field(default_factory=dict)
    per_dim: dict = field(default_factory=dict)

    def __post_init__(self):
        allowed = codec_parameters(self.name)  # raises ValueError on an unknown name
        for source in (self.params, self.per_dim):
            unknown = sorted(set(source) - set(allowed))
            if unknown:
                raise ValueError(f"codec {self.name!r} has no parameter(s) {unknown}; allowed: {allowed}")
        both = sorted(set(self.params) & set(self.per_dim))
        if both:
            raise ValueError(f"parameter(s) {both} given both in params and per_dim")
        for k, v in self.per_dim.items():
            if not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"per_dim[{k!r}] must be a positive multiple of head_dim, got {v!r}")

    def resolve(self, head_dim: int) -> dict:
        out = dict(self.params)
        for k, ratio in self.per_dim.items():
            out[k] = max(8, int(round(ratio * head_dim / 8)) * 8)
        return out

    def build(self, head_dim: int, seed: int = 0) -> Codec:
        params = self.resolve(head_dim)
        if "seed" in codec_parameters(self.name) and "seed" not in params:
            params["seed"] = seed
        return make_codec(self.name, head_dim, **params)

    def describe(self, head_dim: int) -> str:
        p = self.resolve(head_dim)
        return self.name + ("(" + ", ".join(f"{k}={v}" for k, v in sorted(p.items())) + ")" if p else "")


@dataclass(frozen=True)
class QJLConfig:
    """How a :class:`qjl.QJLCache` compresses keys and values.

    The field defaults are the preset "tq-k4v3" (the same codecs in every layer).  ``QJLCache(model)``
    without a config uses ``DEFAULT_PRESET`` ("tq-k45v3": 5-bit keys in the deeper half), the
    configuration that measured best at <= 4 bits on the embedded model (README).

    Args:
        key, value: codecs for keys and values (any registry codec).
        residual_length: the most recent tokens kept in full precision (>= 0).
        flush_block: tokens leave the residual window in blocks of this size (a multiple of
            KIVI's group_size when keys use "kivi").
        sink_tokens: the first tokens of a sequence kept exact (attention sinks).
        layer_overrides: {layer_idx: {"key": CodecSpec, "value": CodecSpec}} per-layer codecs.
        late_key: a key codec for the last ``late_fraction`` of the layers (deeper layers are more
            sensitive on the embedded model); explicit ``layer_overrides`` take precedence.
        late_fraction: fraction of the layers, counted from the last, that use ``late_key``.
        score_path: "inner_product" (the codec's estimator, e.g. QJL's Eq. 4) or "dequantize"
            (reconstructed keys, then a matmul).  Both give the same scores up to float error.
        compress_sliding: also compress sliding-window layers (default: keep them exact).
        exact_dtype: storage of the exact window and sinks: None (the model's dtype), "fp16" or "bf16".
        seed: base seed; layer l uses seed + 1000 * l for its sketches and rotations.
        kernel: attention/quantization kernels (:mod:`qjl.kernels`): "auto" (default: Triton on
            CUDA, the C kernel on CPU, for the codecs they cover), "cpu", "triton" or "torch"
            (the reference path).  Every kernel computes the same attention up to float error.
    """

    key: CodecSpec = field(default_factory=lambda: CodecSpec("turboquant_mse", {"bits": 4, "correct_norm": True}))
    value: CodecSpec = field(default_factory=lambda: CodecSpec("turboquant_mse", {"bits": 3, "correct_norm": True}))
    residual_length: int = 128
    flush_block: int = 32
    sink_tokens: int = 4
    layer_overrides: dict = field(default_factory=dict)
    late_key: CodecSpec | None = None
    late_fraction: float = 0.5
    score_path: str = "inner_product"
    compress_sliding: bool = False
    exact_dtype: str | None = None
    seed: int = 0
    kernel: str = "auto"

    def __post_init__(self):
        for name in ("residual_length", "sink_tokens", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        if isinstance(self.flush_block, bool) or not isinstance(self.flush_block, int) or self.flush_block < 1:
            raise ValueError(f"flush_block must be a positive int, got {self.flush_block!r}")
        if self.exact_dtype not in (None, "fp16", "bf16", "fp32"):
            raise ValueError(f"exact_dtype must be None, 'fp16', 'bf16' or 'fp32', got {self.exact_dtype!r}")
        if self.kernel not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(f"kernel must be 'auto', 'torch', 'cpu' or 'triton', got {self.kernel!r}")
        if self.score_path not in ("inner_product", "dequantize"):
            raise ValueError(f"score_path must be 'inner_product' or 'dequantize', got {self.score_path!r}")
        for layer, spec in self.layer_overrides.items():
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ValueError(f"layer_overrides keys must be layer indices >= 0, got {layer!r}")
            if not isinstance(spec, dict) or set(spec) - {"key", "value"}:
                raise ValueError(f"layer_overrides[{layer}] must be a dict with 'key' and/or 'value', got {spec!r}")
        if not isinstance(self.late_fraction, (int, float)) or not 0 < self.late_fraction <= 1:
            raise ValueError(f"late_fraction must be in (0, 1], got {self.late_fraction!r}")
        if self.late_key is not None and not isinstance(self.late_key, CodecSpec):
            raise TypeError(f"late_key must be a CodecSpec, got {type(self.late_key).__name__}")
        for layer in (None, *self.layer_overrides, "late"):
            k, v = self.specs(layer) if layer != "late" else (self.late_key or self.key, self.value)
            for role, s in (("key", k), ("value", v)):
                if not isinstance(s, CodecSpec):
                    raise TypeError(f"{role} codec must be a CodecSpec, got {type(s).__name__}")
                if role == "value" and s.name in ("kivi",):
                    raise ValueError("value codec 'kivi' quantizes per channel over tokens; KIVI's values are "
                                     "per token: use 'uniform'")
                if s.name == "kivi" and self.flush_block % s.params.get("group_size", 32):
                    raise ValueError(f"flush_block={self.flush_block} must be a multiple of kivi's group_size")
                s.build(64, self.seed)  # trial build: bad bits etc. fail here, not mid-generation

    def is_late(self, layer_idx: int, num_layers: int) -> bool:
        return self.late_key is not None and layer_idx >= num_layers - round(self.late_fraction * num_layers)

    def specs(self, layer_idx: int | None, num_layers: int | None = None) -> tuple:
        """(key spec, value spec) for a layer of a model with ``num_layers`` layers."""
        key = self.key
        if layer_idx is not None and num_layers is not None and self.is_late(layer_idx, num_layers):
            key = self.late_key
        over = self.layer_overrides.get(layer_idx, {}) if layer_idx is not None else {}
        return over.get("key", key), over.get("value", self.value)

    def bits_per_value(self, head_dim: int, num_layers: int | None = None, tokens: int = 4096) -> dict:
        """Bits per stored coordinate of the compressed part (residual window excluded), averaged over
        the layers when ``num_layers`` is given (per-layer codecs included), else for a default layer."""
        layers = [None] if num_layers is None else list(range(num_layers))
        kb = vb = 0.0
        for layer in layers:
            k, v = self.specs(layer, num_layers)
            kb += k.build(head_dim, self.seed).bit_budget().amortized(tokens) / len(layers)
            vb += v.build(head_dim, self.seed).bit_budget().amortized(tokens) / len(layers)
        return {"key": kb, "value": vb, "kv": (kb + vb) / 2}

    def describe(self, head_dim: int, num_layers: int | None = None) -> str:
        b = self.bits_per_value(head_dim, num_layers)
        late = (f" (last {self.late_fraction:g} of layers: {self.late_key.describe(head_dim)})"
                if self.late_key is not None else "")
        return (f"keys {self.key.describe(head_dim)}{late}, values {self.value.describe(head_dim)}, "
                f"residual {self.residual_length}, sinks {self.sink_tokens}: {b['kv']:.2f} bits/value "
                f"(keys {b['key']:.2f}, values {b['value']:.2f}) at head_dim={head_dim}")

    @staticmethod
    def preset(name: str, **overrides) -> "QJLConfig":
        """A named preset (see ``PRESETS``), optionally with fields replaced."""
        from qjl.cache.presets import PRESETS

        if name not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
        return replace(PRESETS[name], **overrides)
