"""What one compressed layer holds: exact sinks, codes, and an exact recent window.

Tokens of one layer, in order: ``sink_tokens`` exact sinks, then codes (keys and values
through their codecs), then the ``residual_length`` (+ < ``flush_block``) most recent tokens
in full precision.  :meth:`LayerStore.append` first moves the window's overflow into codes
(in blocks), then appends the new tokens to the window, so a forward pass attends to
compressed history + exact recent tokens + itself, and the prompt is attended exactly during
prefill.  Codes are only ever appended (from the original keys), never re-quantized.

This module knows nothing of any framework; attention over a store is :mod:`qjl.cache.attention`,
the transformers cache layer is :mod:`qjl.integrations.transformers.layer`.
"""

from __future__ import annotations

import torch

from qjl import kernels
from qjl.codecs.base import Codes
from qjl.codecs.kivi import KIVIKeys
from qjl.codecs.outliers import OutlierQJL

__all__ = ["LayerStore"]


def _cat(a, b, dim=-2):
    return b if a is None else torch.cat([a, b], dim=dim)


class LayerStore:
    """Compressed storage of one attention layer; tensors are ``[B, H_kv, T, D]``.

    Args:
        layer_idx: the layer's index (seeds its codecs: ``config.seed + 1000 * layer_idx``).
        config: a :class:`qjl.QJLConfig`.
        num_layers: the model's number of layers (for per-layer codec choices).
    """

    def __init__(self, layer_idx: int, config, num_layers: int | None = None):
        self.layer_idx, self.config = layer_idx, config
        self.key_spec, self.value_spec = config.specs(layer_idx, num_layers)
        self.reset()

    def reset(self) -> None:
        self.keys = self.values = None  # the exact recent window
        self.sink_k = self.sink_v = None
        self.key_codes = self.value_codes = None
        self.outlier_idx = None
        self.is_initialized = False

    def __repr__(self):
        return f"LayerStore({self.layer_idx}, key={self.key_spec.name}, value={self.value_spec.name})"

    def initialize(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Build the codecs for these head sizes and pick the kernel backend for their device."""
        self.dtype, self.device = key_states.dtype, key_states.device
        d = key_states.shape[-1]
        seed = self.config.seed + 1000 * self.layer_idx
        self.key_codec = self.key_spec.build(d, seed)
        self.value_codec = self.value_spec.build(value_states.shape[-1], seed + 1)
        names = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
        self.exact_dtype = names.get(self.config.exact_dtype, key_states.dtype)
        self.backend = kernels.pick_backend(key_states.device, self.config.kernel)
        self.kernel_ok = self.backend != "torch" and kernels.supports(self.key_codec, self.value_codec)
        self.is_initialized = True

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Flush the window's overflow into codes, then append new ``[B, H_kv, t, D]`` keys/values."""
        if not self.is_initialized:
            self.initialize(key_states, value_states)
        self.flush()
        self.keys = _cat(self.keys, key_states.to(self.exact_dtype))
        self.values = _cat(self.values, value_states.to(self.exact_dtype))

    # -- lengths ------------------------------------------------------------------------------
    @property
    def n_sink(self) -> int:
        return 0 if self.sink_k is None else self.sink_k.shape[-2]

    @property
    def n_codes(self) -> int:
        """Tokens held as codes."""
        if self.key_codes is None:
            return 0
        n = self.key_codes.lead[-1]
        return n * self.key_codec.group_size if isinstance(self.key_codec, KIVIKeys) else n

    def seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.n_sink + self.n_codes + (0 if self.keys is None else self.keys.shape[-2])

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    # -- compression -------------------------------------------------------------------------
    def flush(self) -> None:
        """Move the window's overflow to sinks, then (in whole blocks) to codes."""
        if self.keys is None:
            return
        overflow = self.keys.shape[-2] - self.config.residual_length
        if overflow <= 0:
            return
        to_sink = min(overflow, self.config.sink_tokens - self.n_sink)
        if to_sink > 0:
            self.sink_k = _cat(self.sink_k, self.keys[..., :to_sink, :])
            self.sink_v = _cat(self.sink_v, self.values[..., :to_sink, :])
            self.keys, self.values = self.keys[..., to_sink:, :], self.values[..., to_sink:, :]
            overflow -= to_sink
        n = overflow // self.config.flush_block * self.config.flush_block
        if n <= 0:
            return
        key_codes, value_codes = self.encode(self.keys[..., :n, :], self.values[..., :n, :])
        self.key_codes = self._append_codes(self.key_codes, key_codes)
        self.value_codes = self._append_codes(self.value_codes, value_codes)
        self.keys, self.values = self.keys[..., n:, :].contiguous(), self.values[..., n:, :].contiguous()

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """Codes of keys and values ``[B, H_kv, n, D]`` with this layer's codecs and kernels (not stored)."""
        return self._quantize_keys(k), self._quantize(self.value_codec, v)

    def _quantize(self, codec, x: torch.Tensor, *idx) -> Codes:
        if self.backend == "triton" and kernels.can_quantize(codec):
            return kernels.quantize(codec, x, *idx)
        if self.backend == "cpu" and kernels.can_quantize_cpu(codec):
            return kernels.quantize_cpu(codec, x)
        return codec.quantize(x, *idx)

    def _quantize_keys(self, k: torch.Tensor) -> Codes:
        if isinstance(self.key_codec, OutlierQJL) and self.key_codec.n_outliers:
            if self.outlier_idx is None:  # chosen once per layer and KV head, from the first flushed tokens
                self.outlier_idx = self.key_codec.select_outliers(k)
            return self._quantize(self.key_codec, k, self.outlier_idx)
        return self._quantize(self.key_codec, k)

    @staticmethod
    def _append_codes(codes, new: Codes) -> Codes:
        return new if codes is None else Codes.cat([codes, new], dim=-1)

    # -- bookkeeping ------------------------------------------------------------------------------
    def _tensors(self):
        return [t for t in (self.keys, self.values, self.sink_k, self.sink_v) if t is not None]

    def nbytes(self) -> dict:
        exact = sum(t.numel() * t.element_size() for t in self._tensors())
        kc = self.key_codes.nbytes() if self.key_codes is not None else 0
        vc = self.value_codes.nbytes() if self.value_codes is not None else 0
        return {"key_codes": kc, "value_codes": vc, "exact": exact}

    def counts(self) -> dict:
        """Stored coordinates by part: compressed tokens and exact (sink + window) tokens."""
        if not self.is_initialized:
            return {"compressed": 0, "exact": 0}
        b, h, _, d = self.keys.shape
        exact = sum(t.shape[-2] for t in (self.keys, self.sink_k) if t is not None)
        return {"compressed": b * h * d * self.n_codes, "exact": b * h * d * exact}

    def select(self, index: torch.Tensor) -> None:
        """Reindex the batch axis of everything held (beam search, batch selection)."""
        if not self.is_initialized:
            return
        sel = lambda t: None if t is None else t.index_select(0, index.to(t.device))  # noqa: E731
        self.keys, self.values = sel(self.keys), sel(self.values)
        self.sink_k, self.sink_v = sel(self.sink_k), sel(self.sink_v)
        self.outlier_idx = sel(self.outlier_idx)
        for name in ("key_codes", "value_codes"):
            codes = getattr(self, name)
            if codes is not None:
                setattr(self, name, codes.index_select(0, index.to(codes.fields[next(iter(codes.fields))].device)))

    def crop(self, n: int) -> None:
        """Drop the last ``n`` tokens (window first, then codes, then sinks)."""
        if n == 0 or not self.is_initialized:
            return
        if n > self.seq_length():
            raise ValueError(f"cannot crop {n} tokens from a layer holding {self.seq_length()}")
        r = min(n, self.keys.shape[-2])
        self.keys, self.values = self.keys[..., : self.keys.shape[-2] - r, :], self.values[..., : self.values.shape[-2] - r, :]
        n -= r
        c = min(n, self.n_codes)
        if c:
            unit = self.key_codec.group_size if isinstance(self.key_codec, KIVIKeys) else 1
            if c % unit:
                raise ValueError(f"cannot crop {c} tokens from KIVI codes grouped by {unit}: crop whole groups")
            keep_k = self.key_codes.lead[-1] - c // unit
            self.key_codes = self.key_codes.narrow(-1, 0, keep_k) if keep_k else None
            keep_v = self.value_codes.lead[-1] - c
            self.value_codes = self.value_codes.narrow(-1, 0, keep_v) if keep_v else None
            n -= c
        if n:
            keep = self.sink_k.shape[-2] - n
            self.sink_k, self.sink_v = self.sink_k[..., :keep, :], self.sink_v[..., :keep, :]
