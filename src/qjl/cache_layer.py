"""One layer of the compressed KV cache: exact sinks, codes, and an exact recent window.

Tokens of one layer, in order: ``sink_tokens`` exact sinks, then codes (keys and
values through their codecs), then the ``residual_length`` (+ < ``flush_block``)
most recent tokens in full precision.  ``update`` first moves the residual's
overflow into codes (in blocks), then appends the new tokens to the residual, so
a forward pass attends to compressed history + exact recent tokens + itself, and
the prompt is attended exactly during prefill.  Codes are only ever appended
(from the original keys), never re-quantized.

With a kernel backend (:mod:`qjl.kernels`: the C or numba kernel on CPU, Triton on CUDA;
``config.kernel``), decode steps (at most ``MAX_KERNEL_ROWS`` query rows per KV head, a mask
that is the same for every row over the codes, no softcap) score and mix the codes inside the
kernel, merged exactly with the sinks and the window (in the CPU kernel itself); other
forwards (prefill, long chunks, codecs the kernels do not read) run torch SDPA over sinks +
dequantized codes + window.

The reference path (``kernel="torch"``, and softcapped models) scores every part with the
codecs' own inner products, applies the mask and softmax in float32, and mixes values part
by part; the GQA group of each KV head shares one read of that head's codes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import CacheLayerMixin

from . import kernels
from .codec import Codes
from .kivi import KIVIKeys
from .outliers import OutlierQJL

__all__ = ["QJLCacheLayer", "MAX_KERNEL_ROWS"]

MAX_KERNEL_ROWS = 32  # query rows (GQA group x new tokens) per KV head up to which the kernels are used
QUERY_CHUNK = 128  # the reference path scores at most this many new tokens at a time (bounded memory)


def _additive(mask: torch.Tensor) -> torch.Tensor:
    """An attention mask as additive float32: bool (True = attend) -> 0 / -inf; float masks as they are."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.float()


def _joined(*parts) -> torch.Tensor:
    """Sinks, dequantized codes, window ([B, H, n_i, D] or None) as one float32 [B, H, n, D]."""
    return torch.cat([x.float() for x in parts if x is not None], dim=-2)


def _cat(a, b, dim=-2):
    return b if a is None else torch.cat([a, b], dim=dim)


class QJLCacheLayer(CacheLayerMixin):
    """Compressed cache of one attention layer; tensors are ``[B, H_kv, T, D]``."""

    is_sliding = False
    is_croppable = True

    def __init__(self, layer_idx: int, config, owner=None, num_layers: int | None = None):
        super().__init__()
        self.layer_idx, self.config, self.owner = layer_idx, config, owner
        self.key_spec, self.value_spec = config.specs(layer_idx, num_layers)
        self._reset_state()

    def _reset_state(self):
        self.keys = self.values = None  # the exact residual window (HF reads .keys for batch size)
        self.sink_k = self.sink_v = None
        self.key_codes = self.value_codes = None
        self.outlier_idx = None
        self.is_initialized = False

    def __repr__(self):
        return f"QJLCacheLayer({self.layer_idx}, key={self.key_spec.name}, value={self.value_spec.name})"

    # -- HF cache-layer protocol ----------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
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

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new [B, H_kv, t, D] keys/values; returns them tagged for :func:`qjl.attention`."""
        if self.owner is not None:
            self.owner._check_attention()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._flush()
        self.keys = _cat(self.keys, key_states.to(self.exact_dtype))
        self.values = _cat(self.values, value_states.to(self.exact_dtype))
        key_states._qjl_layer = self  # the attention function reads the compressed state from here
        return key_states, value_states

    def _codes_len(self, codes) -> int:
        if codes is None:
            return 0
        n = codes.lead[-1]
        return n * self.key_codec.group_size if isinstance(self.key_codec, KIVIKeys) else n

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        parts = (self.sink_k, self.keys)
        return sum(p.shape[-2] for p in parts if p is not None) + self._codes_len(self.key_codes)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    # -- compression -------------------------------------------------------------------------
    def _flush(self) -> None:
        """Move the residual's overflow to sinks, then (in whole blocks) to codes."""
        if self.keys is None:
            return
        overflow = self.keys.shape[-2] - self.config.residual_length
        if overflow <= 0:
            return
        n_sink = 0 if self.sink_k is None else self.sink_k.shape[-2]
        to_sink = min(overflow, self.config.sink_tokens - n_sink)
        if to_sink > 0:
            self.sink_k = _cat(self.sink_k, self.keys[..., :to_sink, :])
            self.sink_v = _cat(self.sink_v, self.values[..., :to_sink, :])
            self.keys, self.values = self.keys[..., to_sink:, :], self.values[..., to_sink:, :]
            overflow -= to_sink
        n = overflow // self.config.flush_block * self.config.flush_block
        if n <= 0:
            return
        k, v = self.keys[..., :n, :], self.values[..., :n, :]
        self.key_codes = self._append(self.key_codes, self._quantize_keys(k))
        self.value_codes = self._append(self.value_codes, self._quantize(self.value_codec, v))
        self.keys, self.values = self.keys[..., n:, :].contiguous(), self.values[..., n:, :].contiguous()

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
    def _append(codes, new: Codes) -> Codes:
        return new if codes is None else Codes.cat([codes, new], dim=-1)

    # -- attention -----------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, attention_mask, scaling: float, softcap=None) -> torch.Tensor:
        """query: [B, H_q, t, D]; mask [B, 1|H, t, L] (additive float or bool) -> [B, t, H_q, D]."""
        b, hq, t, d = query.shape
        hkv = self.keys.shape[1]
        g = hq // hkv
        qg = query.float().reshape(b, hkv, g * t, d)  # query head h reads KV head h // g
        if (self.kernel_ok and softcap is None and self.key_codes is not None and g * t <= MAX_KERNEL_ROWS):
            out = self._attend_kernel(qg, attention_mask, scaling, hq, t)
            if out is not None:
                return out.to(query.dtype)
        total = self.get_seq_length()
        if attention_mask is not None and attention_mask.shape[-1] != total:
            raise RuntimeError(f"attention mask covers {attention_mask.shape[-1]} keys but layer {self.layer_idx} holds "
                               f"{total}; was this cache used by another model?")
        if self.backend != "torch" and softcap is None:
            return self._attend_sdpa(query, attention_mask, scaling).to(query.dtype)
        exact_k = [k.float() for k in (self.sink_k, self.keys) if k is not None]
        deq = None
        if self.key_codes is not None and self.config.score_path == "dequantize":
            deq = self.key_codec.dequantize(self.key_codes)
        values = _joined(self.sink_v, None if self.value_codes is None else self.value_codec.dequantize(self.value_codes),
                         self.values)
        outs = []
        for s0 in range(0, t, QUERY_CHUNK):  # bounded logits: [B, H_q, <= QUERY_CHUNK, L] at a time
            s1 = min(t, s0 + QUERY_CHUNK)
            qc = query[:, :, s0:s1].float().reshape(b, hkv, g * (s1 - s0), d)
            parts = [torch.matmul(qc, exact_k[0].transpose(-1, -2))] if self.sink_k is not None else []
            if self.key_codes is not None:
                parts.append(self.key_codec.inner_product(qc, self.key_codes) if deq is None
                             else torch.matmul(qc, deq.transpose(-1, -2)))
            parts.append(torch.matmul(qc, exact_k[-1].transpose(-1, -2)))
            logits = torch.cat(parts, dim=-1).reshape(b, hq, s1 - s0, -1) * scaling
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            if attention_mask is not None:
                mask = attention_mask if attention_mask.shape[2] == 1 else attention_mask[:, :, s0:s1]
                logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask.float()
            probs = torch.softmax(logits, dim=-1).reshape(b, hkv, g * (s1 - s0), -1)
            outs.append(torch.matmul(probs, values).reshape(b, hq, s1 - s0, -1))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out.transpose(1, 2).to(query.dtype)

    def _attend_sdpa(self, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
        """Prefill and chunks outside the kernels: torch SDPA over sinks + dequantized codes + window
        (the same scores as the codecs' inner products up to float error) -> [B, t, H_q, D] float32."""
        coded = self.key_codes is not None
        k = _joined(self.sink_k, self.key_codec.dequantize(self.key_codes) if coded else None, self.keys)
        v = _joined(self.sink_v, self.value_codec.dequantize(self.value_codes) if coded else None, self.values)
        mask = attention_mask
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.float()
        out = F.scaled_dot_product_attention(query.float(), k, v, attn_mask=mask, scale=scaling,
                                             enable_gqa=query.shape[1] != k.shape[1])
        return out.transpose(1, 2)

    def _code_bias(self, attention_mask, n_sink: int, n_codes: int):
        """The mask over the codes as one [B, N] additive row, None when it masks nothing, or False
        when it differs between rows or heads (then the reference path is used)."""
        if attention_mask is None:
            return None
        sl = attention_mask[..., n_sink:n_sink + n_codes]
        if sl.shape[1] != 1 or (sl.shape[2] > 1 and not bool((sl == sl[:, :, :1]).all())):
            return False
        row = _additive(sl[:, 0, 0])
        return None if not bool(row.any()) else row.contiguous()

    def _attend_kernel(self, qg: torch.Tensor, attention_mask, scaling: float, hq: int, t: int):
        """Codes through the kernel, sinks + window exactly, merged: -> [B, t, H_q, D] float32 or None."""
        b, hkv, rows, d = qg.shape
        n_sink = 0 if self.sink_k is None else self.sink_k.shape[-2]
        n_codes = self._codes_len(self.key_codes)
        total = n_sink + n_codes + self.keys.shape[-2]
        if attention_mask is not None and attention_mask.shape[-1] != total:
            raise RuntimeError(f"attention mask covers {attention_mask.shape[-1]} keys but layer {self.layer_idx} holds "
                               f"{total}; was this cache used by another model?")
        bias = self._code_bias(attention_mask, n_sink, n_codes)
        if bias is False:
            return None
        qs = qg * scaling
        parts = kernels.key_parts(self.key_codec, self.key_codes, qs)
        vp = kernels.value_part(self.value_codec, self.value_codes)
        keys, values = _joined(self.sink_k, self.keys), _joined(self.sink_v, self.values)
        ne = keys.shape[-2]
        bias_x = None
        if attention_mask is not None:
            mx = _additive(torch.cat([attention_mask[..., :n_sink], attention_mask[..., n_sink + n_codes:]], dim=-1))
            # [B, 1|H_q, t, n] -> rows of KV head groups [B * H_kv, g*t, n]
            bias_x = (mx.expand(b, hq, t, -1).reshape(b * hkv, rows, ne) if mx.shape[1] != 1
                      else mx.expand(b, 1, t, -1).repeat(1, hkv, hq // hkv, 1).reshape(b * hkv, rows, ne))
        exact = (qs.reshape(b * hkv, rows, d), keys.reshape(b * hkv, ne, d), values.reshape(b * hkv, ne, d), bias_x)
        _, l_tot, o_c, o_x = kernels.decode_partial(self.backend, parts, vp, bias, exact=exact)
        if vp.post is not None:
            o_c = vp.post(o_c)
        out = (o_c + o_x) / l_tot.unsqueeze(-1)
        return out.reshape(b, hq, t, d).transpose(1, 2)

    # -- bookkeeping ------------------------------------------------------------------------------
    def _tensors(self):
        return [t for t in (self.keys, self.values, self.sink_k, self.sink_v) if t is not None]

    def nbytes(self) -> dict:
        exact = sum(t.numel() * t.element_size() for t in self._tensors())
        kc = self.key_codes.nbytes() if self.key_codes is not None else 0
        vc = self.value_codes.nbytes() if self.value_codes is not None else 0
        return {"key_codes": kc, "value_codes": vc, "exact": exact}

    def counts(self) -> dict:
        """Stored coordinates by part: compressed tokens and exact (sink + residual) tokens."""
        if not self.is_initialized:
            return {"compressed": 0, "exact": 0}
        b, h, _, d = self.keys.shape
        exact = sum(t.shape[-2] for t in (self.keys, self.sink_k) if t is not None)
        return {"compressed": b * h * d * self._codes_len(self.key_codes), "exact": b * h * d * exact}

    def reset(self) -> None:
        self._reset_state()

    def _select(self, index: torch.Tensor) -> None:
        """Reindex the batch axis of everything held."""
        sel = lambda t: None if t is None else t.index_select(0, index.to(t.device))  # noqa: E731
        self.keys, self.values = sel(self.keys), sel(self.values)
        self.sink_k, self.sink_v = sel(self.sink_k), sel(self.sink_v)
        self.outlier_idx = sel(self.outlier_idx)
        for name in ("key_codes", "value_codes"):
            codes = getattr(self, name)
            if codes is not None:
                setattr(self, name, codes.index_select(0, index.to(codes.fields[next(iter(codes.fields))].device)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select(torch.as_tensor(indices).flatten())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select(torch.arange(self.keys.shape[0]).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``|tokens_to_remove|`` tokens (residual first, then codes, then sinks)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if n > self.get_seq_length():
            raise ValueError(f"cannot crop {n} tokens from a layer holding {self.get_seq_length()}")
        r = min(n, self.keys.shape[-2])
        self.keys, self.values = self.keys[..., : self.keys.shape[-2] - r, :], self.values[..., : self.values.shape[-2] - r, :]
        n -= r
        c = min(n, self._codes_len(self.key_codes))
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
