"""Cache configuration: which codec for keys and values, per layer, and the exact window.

``QJLConfig`` is frozen, hashable and validated on construction, structurally and cheaply: codec names,
parameter names, types and ranges (each codec declares its parameters, :mod:`qjl.codecs.params`), the
window and flush sizes.  Nothing is built at construction -- no rotation, sketch or codebook -- so the
presets cost nothing to import.  What needs the model (the head dimension, the number of layers) is
checked by :meth:`QJLConfig.check_model`, which :class:`qjl.QJLCache` calls before the model runs.

``QJLConfig()`` is the default preset (``DEFAULT_PRESET`` in :mod:`qjl.cache.presets`, "tq-k45v3"):
the same configuration ``QJLCache(model)`` uses.  Named presets: ``QJLConfig.preset(name)``; widths
chosen per layer and KV head from the prompt itself: ``QJLConfig.auto(bits_per_value=...)``
(:mod:`qjl.cache.allocation`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from qjl.codecs.params import FrozenDict

__all__ = ["CodecSpec", "QJLConfig"]

_MAX_CONFIG_SEED = 2 ** 62  # layer seeds are seed + 1000 * layer (+ 1 for values): they stay below 2**63


def _codec_class(name):
    from qjl.codecs.registry import CODECS  # the codec classes only: building one is what is avoided here

    if not isinstance(name, str) or name not in CODECS:
        raise ValueError(f"codec must be one of {sorted(CODECS)}, got {name!r}")
    return CODECS[name]


@dataclass(frozen=True)
class CodecSpec:
    """A codec by registry name, with fixed parameters and sizes proportional to head_dim.

    ``CodecSpec("qjl", {"n_outliers": 8}, per_dim={"sketch_dim": 2.0})`` gives a QJL sketch of
    ``2 * head_dim`` bits (rounded to a multiple of 8).  Only sizes a codec declares as scaling with
    the head dimension (QJL's sketch sizes) may be given in ``per_dim``.  ``params`` and ``per_dim``
    are stored as read-only mappings: a spec cannot change after it was validated.
    """

    name: str
    params: Mapping = field(default_factory=FrozenDict)
    per_dim: Mapping = field(default_factory=FrozenDict)

    def __post_init__(self):
        cls = _codec_class(self.name)
        normalized = cls.check_params(self.params, self.per_dim)  # TypeError/ValueError naming the parameter
        object.__setattr__(self, "params", FrozenDict(normalized))
        object.__setattr__(self, "per_dim", FrozenDict(self.per_dim))

    def resolve(self, head_dim: int) -> dict:
        """The codec's keyword parameters at this head dimension."""
        out = dict(self.params)
        for k, ratio in self.per_dim.items():
            out[k] = max(8, int(round(ratio * head_dim / 8)) * 8)
        return out

    def build(self, head_dim: int, seed: int = 0):
        """The codec for vectors of ``head_dim`` (``seed`` unless the spec fixes one)."""
        from qjl.codecs.registry import codec_parameters, make_codec

        params = self.resolve(head_dim)
        if "seed" in codec_parameters(self.name) and "seed" not in params:
            params["seed"] = seed
        return make_codec(self.name, head_dim, **params)

    def describe(self, head_dim: int) -> str:
        p = self.resolve(head_dim)
        return self.name + ("(" + ", ".join(f"{k}={v}" for k, v in sorted(p.items())) + ")" if p else "")

    def param(self, name: str):
        """A parameter's value as the codec will see it (given, or the codec's default)."""
        import inspect

        if name in self.params:
            return self.params[name]
        return inspect.signature(_codec_class(self.name)).parameters[name].default


def _tq(bits: int, **extra) -> CodecSpec:
    return CodecSpec("turboquant_mse", {"bits": bits, "correct_norm": True, **extra})


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_spec(name, spec, allow_none=False):
    if spec is None and allow_none:
        return
    if not isinstance(spec, CodecSpec):
        raise TypeError(f"{name} must be a qjl.CodecSpec, got {type(spec).__name__} {spec!r}")


@dataclass(frozen=True)
class QJLConfig:
    """How a :class:`qjl.QJLCache` compresses keys and values.

    ``QJLConfig()`` is the default preset "tq-k45v3" (``DEFAULT_PRESET``): TurboQuant MSE keys with the
    norm correction at 4 bits (5 bits in the deeper half of the layers), 3-bit values, key and value smoothing, 4
    exact sink tokens, the 16 prompt tokens the prompt attends to most and the 128 most recent tokens exact.  ``QJLConfig(residual_length=64)`` is that preset with
    a shorter window.

    Args:
        key, value: codecs for keys and values (any registry codec).
        residual_length: the most recent tokens kept in full precision (>= 0).
        flush_block: tokens leave the residual window in blocks of this size (a multiple of the key
            codec's ``tokens_per_code``, e.g. KIVI's group_size).
        sink_tokens: the first tokens of each sequence kept exact (attention sinks); in a left-padded
            batch, each row's own first real tokens.
        layer_overrides: {layer_idx: {"key": CodecSpec, "value": CodecSpec}} per-layer codecs; indices must
            exist in the model (checked by :class:`qjl.QJLCache`).
        late_key: a key codec for the last ``late_fraction`` of the layers (deeper layers are more
            sensitive on the embedded model); explicit ``layer_overrides`` take precedence.  None: ``key``
            everywhere.  "default": 5-bit TurboQuant when ``key`` is the default 4-bit one (the default
            preset), else None -- so ``QJLConfig(key=...)`` uses that key codec in every layer.
        late_fraction: fraction of the layers, counted from the last, that use ``late_key``.
        score_path: "inner_product" (the codec's estimator, e.g. QJL's Eq. 4) or "dequantize"
            (reconstructed keys, then a matmul).  Both give the same scores up to float error.
        compress_sliding: also compress sliding-window layers (default: keep them exact).
        exact_dtype: storage of the exact window and sinks: "half" (default: the model's dtype if it is 16-bit,
            else fp16 -- measured as good as fp32 on the embedded model, half the bytes; docs/cache.md), None
            (the model's dtype), "fp16", "bf16" or "fp32".  A value beyond the chosen dtype's range is refused
            by the update that brings it.
        smooth_keys: subtract from every stored key the channel mean of its layer's and KV head's first
            keys (each sequence's prompt; :mod:`qjl.cache.smoothing`).  Softmax is unchanged (each query's
            scores shift by the same ``q . mu``), the codecs see keys without their shared offset.  On by
            default (measured better, docs/cache.md); not exact with attention logit softcapping:
            :class:`qjl.QJLCache` turns it off there, with a warning.
        smooth_values: subtract from every stored value the channel mean ``mu_v`` of its layer's and KV head's
            first values (each sequence's prompt) and add ``mu_v`` back to the attention output.  Exact for any
            softmax (the weights of a query sum to 1, so ``sum_t p_t (v_t - mu_v) + mu_v = sum_t p_t v_t``),
            also with softcapping; the value codecs see values without their shared offset.  The mean is weighted
            by the attention of the prompt's last queries (:mod:`qjl.cache.smoothing`: the plain mean measured
            worse).  On by default (measured better on every text for the default, docs/cache.md); a cache with
            it prefills with the model (it reads the prompt's queries).
        heavy_tokens: per sequence and layer, keep exact (with the sinks) this many more prompt tokens: those the
            prompt's last queries attend to most (averaged over the layer's KV heads), among the tokens that would be
            coded.  Attention sinks are not only the first tokens (KVSink, arXiv:2508.04257); an error in a token
            that takes much of the attention moves the output most.  Counted with the exact tokens; 16 by default
            (measured better on every text, docs/cache.md).
        fit_key_scale: per sequence, layer and KV head, scale the coded keys' scores by a factor fitted from the
            prompt's last queries at the first flush (:mod:`qjl.cache.key_scale`: quantization noise sharpens the
            softmax over the codes; the factor, in [0.8, 1], is folded into the stored key norms, so every attention
            path reads it; the exact tokens keep their exact scores).  Key codecs ``turboquant_mse`` and
            ``turboquant_vq`` only.  Off by default; on in :meth:`auto` (measured better, docs/cache.md).  Not served
            by the vLLM backend yet (refused there).
        allocation: None, or widths chosen per layer and KV head from the prompt
            (:class:`qjl.cache.allocation.AutoBits`; made by :meth:`QJLConfig.auto`); then
            ``key``/``value``/``late_key``/``layer_overrides`` are unused.
        seed: base seed; layer l uses seed + 1000 * l for its sketches and rotations.
        kernel: attention/quantization kernels (:mod:`qjl.kernels`): "auto" (default: Triton on
            CUDA, the C kernel on CPU, for the codecs they cover), "cpu", "triton" or "torch"
            (the reference path).  Every kernel computes the same attention up to float error, except the
            C kernel's integer path (the default on CPUs with AVX-512 VBMI + VNNI; ``QJL_CPU_IMPL=c`` for fp32
            sums), which rounds queries and centroids to int8 and weights to int16 at a stated bound
            (``kernels/cpu/decode_vnni.c``; the embedded model's KL and perplexity do not move).
    """

    key: CodecSpec = field(default_factory=lambda: _tq(4))
    value: CodecSpec = field(default_factory=lambda: _tq(3))
    residual_length: int = 128
    flush_block: int = 32
    sink_tokens: int = 4
    layer_overrides: Mapping = field(default_factory=FrozenDict)
    late_key: CodecSpec | None | str = "default"
    late_fraction: float = 0.5
    score_path: str = "inner_product"
    compress_sliding: bool = False
    exact_dtype: str | None = "half"
    smooth_keys: bool = True
    smooth_values: bool = True
    heavy_tokens: int = 16
    fit_key_scale: bool = False
    allocation: object = None
    seed: int = 0
    kernel: str = "auto"

    def __post_init__(self):
        _check_int("residual_length", self.residual_length, 0)
        _check_int("sink_tokens", self.sink_tokens, 0)
        _check_int("heavy_tokens", self.heavy_tokens, 0)
        _check_int("flush_block", self.flush_block, 1)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < _MAX_CONFIG_SEED:
            raise ValueError(f"seed must be an int in [0, 2**62), got {self.seed!r}")
        for name in ("compress_sliding", "smooth_keys", "smooth_values", "fit_key_scale"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__} "
                                f"{getattr(self, name)!r}")
        if self.exact_dtype not in (None, "half", "fp16", "bf16", "fp32"):
            raise ValueError(f"exact_dtype must be 'half', None, 'fp16', 'bf16' or 'fp32', got {self.exact_dtype!r}")
        if self.kernel not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(f"kernel must be 'auto', 'torch', 'cpu' or 'triton', got {self.kernel!r}")
        if self.score_path not in ("inner_product", "dequantize"):
            raise ValueError(f"score_path must be 'inner_product' or 'dequantize', got {self.score_path!r}")
        lf = self.late_fraction
        if isinstance(lf, bool) or not isinstance(lf, (int, float)) or not 0 < lf <= 1:
            raise ValueError(f"late_fraction must be a number in (0, 1], got {lf!r}")
        _check_spec("key", self.key)
        _check_spec("value", self.value)
        if isinstance(self.late_key, str) and self.late_key == "default":
            object.__setattr__(self, "late_key", _tq(5) if self.key == _tq(4) else None)
        _check_spec("late_key", self.late_key, allow_none=True)
        object.__setattr__(self, "layer_overrides", self._checked_overrides(self.layer_overrides))
        if self.allocation is not None:
            from qjl.cache.allocation import AutoBits

            if not isinstance(self.allocation, AutoBits):
                raise TypeError(f"allocation must be None or a qjl.cache.allocation.AutoBits (see QJLConfig.auto), "
                                f"got {type(self.allocation).__name__}")
        for role, spec in self._all_specs():
            self._check_role(role, spec)
        if self.fit_key_scale:
            from qjl.cache.key_scale import SCALED_CODECS

            keys = ([s for r, s in self._all_specs() if r == "key"] if self.allocation is None
                    else list(self.allocation.key_candidates))
            bad = sorted({s.name for s in keys if s.name not in SCALED_CODECS})
            if bad:
                raise ValueError(f"fit_key_scale needs key codecs whose scores are linear in a stored norm "
                                 f"({', '.join(SCALED_CODECS)}); got {', '.join(bad)}")

    @staticmethod
    def _checked_overrides(overrides) -> FrozenDict:
        if not isinstance(overrides, Mapping):
            raise TypeError(f"layer_overrides must be a dict {{layer_idx: {{'key': CodecSpec, 'value': CodecSpec}}}}, "
                            f"got {type(overrides).__name__} {overrides!r}")
        out = {}
        for layer, spec in overrides.items():
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ValueError(f"layer_overrides keys must be layer indices >= 0, got {layer!r}")
            if not isinstance(spec, Mapping) or not spec or set(spec) - {"key", "value"}:
                raise ValueError(f"layer_overrides[{layer}] must be a dict with 'key' and/or 'value', got {spec!r}")
            for role, s in spec.items():
                _check_spec(f"layer_overrides[{layer}][{role!r}]", s)
            out[layer] = FrozenDict(spec)
        return FrozenDict(out)

    def _all_specs(self):
        yield "key", self.key
        yield "value", self.value
        if self.late_key is not None:
            yield "key", self.late_key
        for over in self.layer_overrides.values():
            yield from over.items()

    def _check_role(self, role: str, spec: CodecSpec) -> None:
        if role == "value" and spec.name == "kivi":
            raise ValueError("value codec 'kivi' quantizes per channel over tokens; KIVI's values are per token: "
                             "use 'uniform'")
        if role == "key" and spec.name == "kivi" and self.flush_block % spec.param("group_size"):
            raise ValueError(f"flush_block={self.flush_block} must be a multiple of kivi's group_size "
                             f"{spec.param('group_size')} (one code holds a whole group of tokens)")

    # -- per layer -----------------------------------------------------------------------------
    def is_late(self, layer_idx: int, num_layers: int) -> bool:
        return self.late_key is not None and layer_idx >= num_layers - round(self.late_fraction * num_layers)

    def specs(self, layer_idx: int | None, num_layers: int | None = None) -> tuple:
        """(key spec, value spec) for a layer of a model with ``num_layers`` layers."""
        key = self.key
        if layer_idx is not None and num_layers is not None and self.is_late(layer_idx, num_layers):
            key = self.late_key
        over = self.layer_overrides.get(layer_idx, {}) if layer_idx is not None else {}
        return over.get("key", key), over.get("value", self.value)

    def check_model(self, head_dim: int, num_layers: int) -> None:
        """Build every distinct codec at this head dimension and check the layer indices: what cannot
        serve this model fails here, before any token is stored (``ValueError``)."""
        beyond = sorted(i for i in self.layer_overrides if i >= num_layers)
        if beyond:
            raise ValueError(f"layer_overrides name layer(s) {beyond}, but the model has {num_layers} layers "
                             f"(0..{num_layers - 1})")
        specs = {s for _, s in self._all_specs()}
        if self.allocation is not None:
            specs |= set(self.allocation.key_candidates) | set(self.allocation.value_candidates)
        for spec in sorted(specs, key=repr):
            try:
                spec.build(head_dim, self.seed)
            except (TypeError, ValueError) as e:
                raise ValueError(f"codec {spec!r} cannot serve head_dim={head_dim}: {e}") from None

    def bits_per_value(self, head_dim: int, num_layers: int | None = None, tokens: int = 4096) -> dict:
        """Bits per stored coordinate of the compressed part (residual window excluded), averaged over
        the layers when ``num_layers`` is given (per-layer codecs included), else for a default layer.
        With ``allocation``: the budget the allocation keeps to."""
        if self.allocation is not None:
            b = self.allocation.bits_per_value
            return {"key": b, "value": b, "kv": b}
        layers = [None] if num_layers is None else list(range(num_layers))
        kb = vb = 0.0
        for layer in layers:
            k, v = self.specs(layer, num_layers)
            kb += k.build(head_dim, self.seed).bit_budget().amortized(tokens) / len(layers)
            vb += v.build(head_dim, self.seed).bit_budget().amortized(tokens) / len(layers)
        return {"key": kb, "value": vb, "kv": (kb + vb) / 2}

    def describe(self, head_dim: int, num_layers: int | None = None) -> str:
        smooth = "".join(f", {name}" for on, name in ((self.smooth_keys, "key smoothing"),
                                                       (self.smooth_values, "value smoothing"),
                                                       (self.fit_key_scale, "key scale fitted")) if on)
        if self.allocation is not None:
            return (f"{self.allocation.describe()}, residual {self.residual_length}, sinks {self.sink_tokens}{smooth}")
        b = self.bits_per_value(head_dim, num_layers)
        late = (f" (last {self.late_fraction:g} of layers: {self.late_key.describe(head_dim)})"
                if self.late_key is not None else "")
        return (f"keys {self.key.describe(head_dim)}{late}, values {self.value.describe(head_dim)}, "
                f"residual {self.residual_length}, sinks {self.sink_tokens}{smooth}: {b['kv']:.2f} bits/value "
                f"(keys {b['key']:.2f}, values {b['value']:.2f}) at head_dim={head_dim}")

    # -- constructors ------------------------------------------------------------------------------
    @staticmethod
    def preset(name: str, **overrides) -> "QJLConfig":
        """A named preset (see ``PRESETS``), optionally with fields replaced."""
        from qjl.cache.presets import PRESETS

        if name not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
        return replace(PRESETS[name], **overrides)

    @staticmethod
    def named(name: str, **overrides) -> "QJLConfig":
        """A preset by name (:meth:`preset`) or ``"auto-<bits>"`` (e.g. ``"auto-3.0"``: :meth:`auto` with that
        budget, bits in [1, 16]; ``"auto-3.0c1"``: values over one rotation instead of AutoBits' default 8 rotations in
        turn, ``value_cycles``; a final ``s``: scalar codebooks for keys and values (the default before vector
        codebooks, e.g. ``"auto-3.0c8s"``), ``v``: vector codebooks for both (AutoBits ``vector_keys`` /
        ``vector_values``; the default: vector keys, scalar values); a last ``l``: widths per layer instead of per
        KV head (AutoBits ``per_head=False``, e.g. ``"auto-3.0l"``); a last ``u``: each layer's error taken at its
        attention output, unweighted (AutoBits ``residual_weights=False``, the default before 2026-11-29, e.g.
        ``"auto-3.0u"``)), with fields replaced; the names ``qjl eval --methods`` and lm-eval's model take."""
        if isinstance(name, str) and name.startswith("auto-"):
            import re

            m = re.fullmatch(r"auto-([0-9]*\.?[0-9]+)(?:c([0-9]+))?([sv])?(l)?(u)?", name)
            if m is None:
                raise ValueError(f"{name!r}: write auto-<bits per value>[c<rotations>][s|v][l][u], e.g. auto-3.0, "
                                 "auto-3.0c8, auto-3.0c8s, auto-3.0l or auto-3.0u")
            bits = float(m[1])
            if not 1.0 <= bits <= 16.0:
                raise ValueError(f"{name!r}: bits per value must be in [1, 16]")
            if m[2] is not None:
                overrides = {"value_cycles": int(m[2]), **overrides}
            if m[3] is not None:
                overrides = {"vector_keys": m[3] == "v", "vector_values": m[3] == "v", **overrides}
            if m[4] is not None:
                overrides = {"per_head": False, **overrides}
            if m[5] is not None:
                overrides = {"residual_weights": False, **overrides}
            return QJLConfig.auto(bits_per_value=bits, **overrides)
        return QJLConfig.preset(name, **overrides)

    @staticmethod
    def auto(bits_per_value: float, **fields) -> "QJLConfig":
        """Widths chosen per layer and KV head at the end of prefill from the prompt's own keys, values and queries,
        within ``bits_per_value`` (compressed part, keys and values averaged); see
        :class:`qjl.cache.allocation.AutoBits` for the error proxy and the candidates.

        ``fields`` are other :class:`QJLConfig` fields (e.g. ``residual_length``; ``fit_key_scale`` is True unless
        given) or AutoBits fields (``key_candidates``, ``value_candidates``, ``queries``).
        """
        from dataclasses import fields as dc_fields

        from qjl.cache.allocation import AutoBits

        auto_names = {f.name for f in dc_fields(AutoBits)}
        auto_kw = {k: fields.pop(k) for k in list(fields) if k in auto_names}
        fields.setdefault("fit_key_scale", True)  # (measured better for the 5x point and 3 bits: docs/cache.md)
        return QJLConfig(allocation=AutoBits(bits_per_value=bits_per_value, **auto_kw), late_key=None, **fields)
