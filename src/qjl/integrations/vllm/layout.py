"""Where one layer's compressed tokens live inside vLLM's KV-cache pages (no vLLM import).

vLLM hands an attention layer one page per block: ``[num_blocks, H_kv, block_size, C]`` bytes
(its ``LBHNC`` layout, ``C = state_content_bytes``), so each (block, KV head) owns a contiguous
*head region* of ``block_size * C`` bytes.  Inside it we store structure-of-arrays:

    head region = [ key field 0 : block_size records ] [ key field 1 ] ... [ value fields ]
                  [ exact keys : E slots ] [ exact values : E slots ]
                  [ per-block shared fields (QJL outlier channels; the key and value means) ]  [ zero padding ]

Every field ``f`` of token ``t`` of a sequence, KV head ``h``, is at the byte address

    base + block_table[b, t // block_size] * stride_block + h * stride_head
         + f.offset + (t % block_size) * f.stride_token

(``stride_token = 0`` for per-block shared fields), which is the paged contract of
:mod:`qjl.integrations.vllm.paged`; transformers' contiguous cache is the case of one block per
sequence.  Exact copies (the model's keys and values in ``exact_dtype``) sit in ``E = sinks +
window`` slots per head region.  A sequence's block 0 holds its sinks (token ``t < sinks`` at slot ``t``) and a
ring of ``window`` slots (token ``t`` at ``sinks + t % window``); every later block holds only ring slots, all
``E`` of them (token ``t`` at ``t % E``: the sink slots, which only block 0 needs, serve as ring there).  So the
exact window of a history of ``n`` tokens is its last ``sinks + window`` tokens where they lie past block 0, with
block 0's last ``window`` before them (:func:`window_start`): at no bytes, a preset with 4 sinks and no window
slots keeps the last 4 tokens exact once a sequence is past its first block.  With key smoothing, ``smooth.key`` [D] (``exact_dtype``) is a per-block
field of which each sequence uses its block 0's (:mod:`.smoothing`); value smoothing's ``smooth.value`` likewise.
``C`` is rounded up to an even number of bytes (vLLM views pages in the model dtype) and padded to the widest
layer, so every layer has one size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["FieldSpec", "PageLayout", "exact_slot", "window_start", "codec_fields", "content_bytes", "layer_layout"]

_ALIGN = 8  # every field's array starts on an 8-byte boundary
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class FieldSpec:
    """One stored field: ``shape`` per token (or per block when ``shared``), bytes at
    ``offset + slot * stride_token`` inside a head region."""

    name: str
    dtype: torch.dtype
    shape: tuple
    offset: int
    stride_token: int
    shared: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()


def codec_fields(codec, dim: int) -> tuple[dict, dict]:
    """({per-token field: (dtype, shape)}, {shared field: (dtype, shape)}) a codec stores per vector."""
    x = torch.randn(1, 2, dim, generator=torch.Generator().manual_seed(0))
    codes = codec.quantize(x)
    per = {n: (t.dtype, tuple(t.shape[2:])) for n, t in codes.fields.items()}
    shared = {n: (t.dtype, tuple(t.shape[1:])) for n, t in codes.shared.items()}
    return per, shared


def check_sliding_window(sliding_window):
    """``sliding_window`` itself if it is None or a positive int (a token sees the W - 1 before it), else
    ValueError naming it."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
    return sliding_window


def exact_slot(pos: torch.Tensor, sinks: int, window: int, *, block_size: int) -> torch.Tensor:
    """Exact-area slot of absolute token positions ``pos`` (any shape, int64) in their blocks (module docstring):
    ``t`` for a sink, ``sinks + t % window`` in block 0, ``t % (sinks + window)`` in later blocks.  Only the
    positions :func:`window_start` keeps exact (and the sinks) are stored or read."""
    first = torch.where(pos < sinks, pos, sinks + torch.remainder(pos, max(window, 1)))
    return torch.where(pos < block_size, first, torch.remainder(pos, max(sinks + window, 1)))


def window_start(n, sinks: int, window: int, *, block_size: int):
    """The first position of the exact window of a history of ``n`` tokens (int, or an int64 tensor of them): its
    last ``sinks + window`` tokens where they lie past block 0 (later blocks ring over all ``E`` slots), block 0's
    last ``window`` before them (its ring), i.e. ``max(n - sinks - window, min(n, block_size) - window)``; not
    clamped below (callers clamp to their coded range's start)."""
    if isinstance(n, torch.Tensor):
        return torch.maximum(n - sinks - window, n.clamp(max=block_size) - window)
    return max(n - sinks - window, min(n, block_size) - window)


class PageLayout:
    """The byte layout of one layer's head region (see the module docstring).

    Args:
        key_codec, value_codec: the layer's codecs (per-vector codecs; QJL may carry per-block
            outlier channels as a shared field).
        head_dim: D.
        block_size: tokens per page.
        exact_dtype: dtype of the exact copies (sinks and window).
        sinks, window: exact slots per head region: E = sinks + window (block 0: the sinks and a ring of
            ``window``; later blocks: a ring of all E, module docstring).
        content_bytes: C to use (>= what this layer needs), or None for the minimum.
        sliding_window: None, or the layer's sliding window W (a query at position p sees the keys at p - W + 1
            ... p, as vLLM and transformers define it): such a layer keeps no sinks (the model never sees a token
            that far back) and at most W - 1 exact window tokens.
        smooth_keys: keep each sequence's key mean (``smooth.key``, read from its block 0; :mod:`.smoothing`).
            Not in a sliding-window layer (vLLM frees the blocks that leave the window, block 0 among them).
        smooth_values: the same for the values' attention-weighted mean (``smooth.value``).
    """

    def __init__(self, key_codec, value_codec, head_dim: int, block_size: int, exact_dtype: torch.dtype,
                 sinks: int, window: int, content_bytes: int | None = None, sliding_window: int | None = None,
                 smooth_keys: bool = False, smooth_values: bool = False):
        if check_sliding_window(sliding_window) is not None:
            sinks, window, smooth_keys, smooth_values = 0, min(window, sliding_window - 1), False, False
        if getattr(key_codec, "positional", False):  # (values over rotations in turn are served: writes.py)
            raise ValueError(f"key codec {key_codec!r}: keys over rotations in turn (cycles > 1) have no score view; "
                             "use cycles=1")
        self.smooth_keys, self.smooth_values = bool(smooth_keys), bool(smooth_values)
        self.key_codec, self.value_codec = key_codec, value_codec
        self.head_dim, self.block_size = head_dim, block_size
        self.exact_dtype, self.sinks, self.window = exact_dtype, sinks, window
        self.sliding_window = sliding_window
        self.fields: dict[str, FieldSpec] = {}
        off = 0
        kper, kshared = codec_fields(key_codec, head_dim)
        vper, vshared = codec_fields(value_codec, head_dim)
        if vshared:
            raise ValueError(f"value codec {value_codec!r} keeps per-sequence state; it cannot be paged")
        arrays = [(f"key.{n}", dt, sh, block_size, False) for n, (dt, sh) in kper.items()]
        arrays += [(f"value.{n}", dt, sh, block_size, False) for n, (dt, sh) in vper.items()]
        n_exact = sinks + window
        if n_exact:
            arrays += [("exact.key", exact_dtype, (head_dim,), n_exact, False),
                       ("exact.value", exact_dtype, (head_dim,), n_exact, False)]
        arrays += [(f"key.{n}", dt, sh, 1, True) for n, (dt, sh) in kshared.items()]
        if self.smooth_keys:
            arrays.append(("smooth.key", exact_dtype, (head_dim,), 1, True))
        if self.smooth_values:
            arrays.append(("smooth.value", exact_dtype, (head_dim,), 1, True))
        for name, dt, shape, count, shared in arrays:
            item = math.prod(shape) * torch.empty(0, dtype=dt).element_size()
            off = -(-off // _ALIGN) * _ALIGN
            self.fields[name] = FieldSpec(name, dt, shape, off, 0 if shared else item, shared)
            off += item * count
        self.used_bytes = off  # bytes of one head region actually used
        need = -(-off // block_size)
        need += need % 2
        if content_bytes is not None and content_bytes < need:
            raise ValueError(f"content_bytes={content_bytes} is below the {need} bytes per token this layer needs")
        self.content_bytes = need if content_bytes is None else content_bytes

    @property
    def head_region_bytes(self) -> int:
        return self.block_size * self.content_bytes

    def role_fields(self, role: str) -> dict[str, FieldSpec]:
        """The fields of ``role`` ("key", "value" or "exact") by their codec name."""
        p = role + "."
        return {n[len(p):]: f for n, f in self.fields.items() if n.startswith(p)}

    def bytes_per_token(self) -> float:
        """Bytes one token and KV head costs in the pool (codes, exact area, shared fields, padding)."""
        return float(self.content_bytes)

    def describe(self) -> str:
        parts = ", ".join(f"{n} {tuple(f.shape)} {str(f.dtype).replace('torch.', '')}@{f.offset}"
                          for n, f in self.fields.items())
        return (f"{self.content_bytes} B/token/head (block {self.block_size}, used {self.used_bytes} of "
                f"{self.head_region_bytes} per head region): {parts}")


def content_bytes(settings, head_dim: int, block_size: int, model_dtype: torch.dtype) -> int:
    """Bytes per (token, KV head) of the widest layer kind (keys, late keys, overrides): every layer's
    pages get this size, so the spec does not depend on the number of layers."""
    cfg = settings.config
    exact = _DTYPES.get(cfg.exact_dtype, model_dtype)
    kinds = [(cfg.key, cfg.value)] + ([(cfg.late_key, cfg.value)] if cfg.late_key is not None else [])
    kinds += [(o.get("key", cfg.key), o.get("value", cfg.value)) for o in cfg.layer_overrides.values()]
    return max(PageLayout(k.build(head_dim, cfg.seed), v.build(head_dim, cfg.seed), head_dim, block_size, exact,
                          settings.sink_tokens, settings.window_tokens, smooth_keys=cfg.smooth_keys,
                          smooth_values=cfg.smooth_values).content_bytes
               for k, v in kinds)


def layer_layout(settings, layer: int, num_layers: int, head_dim: int, block_size: int,
                 model_dtype: torch.dtype, sliding_window: int | None = None) -> PageLayout:
    """Layer ``layer``'s codecs (seeds ``seed + 1000 layer`` and ``+ 1``, as :class:`qjl.QJLCache`) in pages
    of :func:`content_bytes`; ``sliding_window``: the layer's window, if it has one (:class:`PageLayout`)."""
    cfg = settings.config
    k, v = cfg.specs(layer, num_layers)
    seed = cfg.seed + 1000 * layer
    return PageLayout(k.build(head_dim, seed), v.build(head_dim, seed + 1), head_dim, block_size,
                      _DTYPES.get(cfg.exact_dtype, model_dtype), settings.sink_tokens, settings.window_tokens,
                      content_bytes=content_bytes(settings, head_dim, block_size, model_dtype),
                      sliding_window=sliding_window, smooth_keys=cfg.smooth_keys, smooth_values=cfg.smooth_values)
