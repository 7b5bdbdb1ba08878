"""What one compressed layer holds: exact sinks, codes, and an exact recent window.

Tokens of one layer, in slot order: ``sink_tokens`` exact sinks (each row's own first real tokens,
:mod:`qjl.cache.padding`), then codes (keys and values through their codecs), then the
``residual_length`` (+ < ``flush_block``) most recent tokens in full precision.  :meth:`LayerStore.append`
adds new tokens to the window; :meth:`LayerStore.flush` (at the next append, or right after the attention
of a forward that brought a long prompt) moves the window's overflow into sinks and, in whole blocks, into
codes.  So a forward
attends to compressed history + exact recent tokens + itself, and the prompt is attended exactly during
prefill.  Codes are only ever appended (from the original keys), never re-quantized.

Guarantees (issue #11):

* every tensor is the store's own (copied in, never a view of a caller's tensor); :meth:`nbytes` counts
  the storage held, capacity included (:mod:`qjl.cache.buffers`);
* :meth:`append` validates everything it receives first -- shapes, matching key/value token counts,
  floating dtype, finite values, vectors the codecs and the exact dtype can store -- and either applies
  completely or raises leaving the store unchanged; :meth:`snapshot`/:meth:`restore` let a cache undo a
  whole forward across layers;
* :meth:`check_crop` / :meth:`check_select` validate before anything changes, so a cache can make
  ``crop`` and ``reorder`` all-or-nothing across layers.

Key and value smoothing (``config.smooth_keys`` / ``smooth_values``, :mod:`qjl.cache.smoothing`): ``mu`` /
``mu_v`` are fit once, before the first flush or at the first attention, and subtracted from every key / value
the store holds; :func:`qjl.cache.attention.attend` adds ``mu_v`` back to its output.

Widths per KV head (``QJLConfig.auto``'s default): :meth:`LayerStore.assign_heads` gives runs of adjacent KV heads
codecs of their own (a :class:`HeadGroup` each, with its own code buffers); the exact parts stay shared, and
attention reads each run through a :class:`HeadGroupView`.

This module knows nothing of any framework; attention over a store is :mod:`qjl.cache.attention`,
the transformers cache layer is :mod:`qjl.integrations.transformers.layer`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from qjl import kernels
from qjl.cache import checks, key_scale, padding
from qjl.cache.buffers import CodeBuffer, TokenBuffer, storage_bytes
from qjl.cache.key_scale import FIT_ROWS
from qjl.cache.smoothing import VALUE_MEAN_ROWS, attention_weighted_mean, attention_weights, channel_mean
from qjl.codecs.base import Codec, Codes
from qjl.core.validation import STORAGE_DTYPES

__all__ = ["LayerStore", "HeadGroup", "HeadGroupView", "EAGER_FLUSH", "exact_storage"]

# A window overflowing by more than this many tokens (a prompt, a long chunk) is flushed right after the
# attention that read it, so the prompt is not held at full precision; smaller overflows (decode steps,
# speculative candidates that may be cropped again) wait for the next append, as a crop expects.
EAGER_FLUSH = 512


class ScaleRows(NamedTuple):
    """What ``fit_key_scale`` keeps of the prompt's last queries until the first flush fits the scale."""

    rows: torch.Tensor  # [B, H_q, R, D] float32: the last FIT_ROWS query rows
    scaling: float  # their attention's scaling
    softcap: float | None  # and logit softcap
    length: int  # the tokens held when the last of them was read
    seen: torch.Tensor  # [B, 1|H_q, R, L] bool, position order: what each row attends (its mask: padding, a window)


def _causal(r: int, length: int, device) -> torch.Tensor:
    """[r, L] bool: the last ``r`` positions of ``length`` each see the positions up to their own."""
    pos = torch.arange(length, device=device)
    return pos[None, :] <= pos[length - r:, None]


def exact_storage(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The exact window's dtype: "half" is the model's dtype if 16-bit, else fp16; None the model's dtype."""
    if name == "half":
        return model_dtype if model_dtype.itemsize == 2 else torch.float16
    return STORAGE_DTYPES.get(name, model_dtype)


class LayerStore:
    """Compressed storage of one attention layer; tensors are ``[B, H_kv, T, D]``.

    Args:
        layer_idx: the layer's index (seeds its codecs: ``config.seed + 1000 * layer_idx``).
        config: a :class:`qjl.QJLConfig`.
        num_layers: the model's number of layers (for per-layer codec choices).
    """

    def __init__(self, layer_idx: int, config, num_layers: int | None = None):
        self.layer_idx, self.config = layer_idx, config
        self.key_spec, self.value_spec = config.specs(layer_idx, num_layers) if config.allocation is None else (None, None)
        # tensor parallelism: sums a statistic (a tensor) over the ranks that hold the layer's other KV heads, so that
        # choices made from all heads (heavy tokens, auto widths) are the same on every rank and as in one process;
        # None in one process (set by the integration)
        self.rank_sum = None
        # tensor parallelism: (this rank, number of ranks); rank r holds the layer's KV heads [r h, (r + 1) h) of
        # h = self.heads per rank (transformers' column-wise split of k_proj / v_proj); None in one process
        self.ranks = None
        self.reset()

    def reset(self) -> None:
        self.is_initialized = False
        self.key_codec = self.value_codec = None
        self.groups = None  # widths per KV head (qjl.cache.allocation): a HeadGroup per run of heads, else None
        self._views = None  # a HeadGroupView per head group
        self.exact_only = False  # a layer kept exact (an allocation choice): never flushed to codes
        self.kernel_ok = False  # the kernels read this layer's codecs
        self._wk = self._wv = None  # the exact recent window (TokenBuffer)
        self.sink_k = self.sink_v = None
        self._kc, self._vc = CodeBuffer(), CodeBuffer()
        self.key_fit = None  # the key codec's per-sequence fit (e.g. outlier channels), from the first block
        self.fit_q = None  # [B, H, 1, D] float32: the prompt's last queries' RMS per channel, for a key codec that fits
        # to them (all such a codec reads: ``Codec.fits_queries``)
        self.heavy_w = None  # heavy tokens: [B, n] the prompt's attention per position (until the sinks form)
        self.mu = None  # key smoothing: [B, H, D] float32
        self.mu_v = None  # value smoothing: [B, H, D_v] float32
        self.key_scale = None  # fit_key_scale: [B, H] float32, the coded keys' score scale (folded into their norms)
        self.scale_q = None  # fit_key_scale, until the first flush: ScaleRows (qjl.cache.key_scale)
        self.row_start = None  # [B]: first real position of each row (left padding)
        self.pads = None  # [B]: padding tokens of each row (when the first slots are reordered: slot_order)
        self.heavy_pos = None  # [B, K] int32: each row's heavy tokens' positions (ascending), or None
        self.sinks_done = False
        self.auto_stats = None  # what the width allocation measured on this layer (qjl.cache.allocation)
        self.candidates = None  # (key codecs, value codecs) the allocation chooses from

    def __repr__(self):
        k = self.key_spec.name if self.key_spec else "auto"
        v = self.value_spec.name if self.value_spec else "auto"
        return f"LayerStore({self.layer_idx}, key={k}, value={v})"

    # -- codecs --------------------------------------------------------------------------------
    def initialize(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Record the dtype, device and head sizes; build the codecs (unless widths are still to be chosen)."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch, self.heads, _, self.key_dim = key_states.shape
        self.value_dim = value_states.shape[-1]
        self.exact_dtype = exact_storage(self.config.exact_dtype, key_states.dtype)
        self._wk, self._wv = TokenBuffer(self.exact_dtype), TokenBuffer(self.exact_dtype)
        self.backend = kernels.pick_backend(key_states.device, self.config.kernel)
        if self.key_spec is not None:
            self.assign(self.key_spec, self.value_spec)
        else:  # widths chosen later (qjl.cache.allocation): every candidate must be able to hold the tokens
            from qjl.cache.allocation import candidate_codecs

            self.candidates = candidate_codecs(self.config, self.layer_idx, self.key_dim, self.value_dim)
        self.is_initialized = True

    def assign(self, key_spec, value_spec, codecs: tuple | None = None) -> None:
        """Use these codecs (None, None: keep the layer exact); before any token is flushed.  ``codecs``:
        the codecs already built from these specs with this layer's seeds (else they are built here)."""
        if self._kc.n:
            raise RuntimeError(f"layer {self.layer_idx} already holds codes: its codecs cannot change")
        self.key_spec, self.value_spec = key_spec, value_spec
        self.exact_only = key_spec is None
        self._wk.spare = self._wv.spare = self.exact_only  # a layer kept whole grows geometrically
        if key_spec is None:
            self.key_codec = self.value_codec = None
            self.kernel_ok = False
            return
        seed = self.config.seed + 1000 * self.layer_idx
        self.key_codec, self.value_codec = codecs or (key_spec.build(self.key_dim, seed),
                                                       value_spec.build(self.value_dim, seed + 1))
        self.kernel_ok = self._kernel_ok(self.key_codec, self.value_codec)

    def _kernel_ok(self, key_codec, value_codec) -> bool:
        """Whether this store's kernel backend reads codes of this pair of codecs."""
        return self.backend != "torch" and kernels.supports(key_codec, value_codec, self.backend)

    def assign_heads(self, runs: list) -> None:
        """Code runs of adjacent KV heads with their own codecs (widths chosen per KV head), before any token is
        flushed.  ``runs``: ``[(heads, key_spec, value_spec, (key codec, value codec))]``, ``heads`` slices that
        cover ``0 .. H_kv`` in order, at least two; codecs of one token per code and no per-sequence fit."""
        if self._kc.n or self.groups is not None or self.key_codec is not None:
            raise RuntimeError(f"layer {self.layer_idx} already has codecs: they cannot change")
        if not isinstance(runs, (list, tuple)) or len(runs) < 2:
            raise ValueError(f"runs must list at least two head groups (one pair for every head: assign), got {runs!r}")
        at = 0
        for heads, _, _, codecs in runs:
            if not isinstance(heads, slice) or heads.start != at or heads.stop is None or heads.stop <= at:
                raise ValueError(f"runs must cover the KV heads 0..{self.heads} in order with non-empty slices, "
                                 f"got {[r[0] for r in runs]}")
            at = heads.stop
            for c in codecs:
                if c.tokens_per_code != 1 or c.fits_queries or type(c).fit is not Codec.fit:
                    raise ValueError(f"widths per KV head take codecs of one token per code without a per-sequence "
                                     f"fit, got {c!r}")
        if at != self.heads:
            raise ValueError(f"runs must cover the KV heads 0..{self.heads}, got {[r[0] for r in runs]}")
        self.key_spec = self.value_spec = None
        self.exact_only, self.kernel_ok = False, False
        self._wk.spare = self._wv.spare = False
        self.groups = tuple(HeadGroup(heads, ks, vs, kc, vc, self._kernel_ok(kc, vc))
                            for heads, ks, vs, (kc, vc) in runs)
        # (built once: a view reads everything else from the store and its group when attention asks)
        self._views = tuple(HeadGroupView(self, g) for g in self.groups)

    def head_views(self) -> tuple:
        """:class:`HeadGroupView` of each head group (``groups``), as attention reads a store."""
        return self._views

    @property
    def first_head(self) -> int:
        """The layer's index of this store's first KV head (``ranks``: rank r holds heads ``[r H, (r + 1) H)``)."""
        return 0 if self.ranks is None else self.ranks[0] * self.heads

    @property
    def layer_heads(self) -> int:
        """The layer's KV heads: this store's, times the ranks under tensor parallelism."""
        return self.heads * (1 if self.ranks is None else self.ranks[1])

    @property
    def pending(self) -> bool:
        """Widths not chosen yet (``config.allocation``): nothing can be flushed."""
        return self.is_initialized and self.key_codec is None and self.groups is None and not self.exact_only

    # -- views and lengths ------------------------------------------------------------------------
    @property
    def keys(self):
        """The exact window [B, H, n, D] (a view of the store's buffer), or None before the first token."""
        return None if self._wk is None else self._wk.view()

    @property
    def values(self):
        return None if self._wv is None else self._wv.view()

    @property
    def key_codes(self) -> Codes | None:
        self._one_pair("key_codes")
        return self._kc.view()

    @property
    def value_codes(self) -> Codes | None:
        self._one_pair("value_codes")
        return self._vc.view()

    def _one_pair(self, what: str) -> None:
        if self.groups is not None:
            raise RuntimeError(f"layer {self.layer_idx} codes its KV heads in groups of their own widths: read {what} "
                               "per group (head_views())")

    def kernel_fields(self) -> tuple:
        """(key fields, value fields, block size) of the codes for the paged kernels: one block per sequence over
        the buffers' whole capacity, the same FieldMap objects from call to call until the buffers grow (so the
        launchers keep their checks); the codes in use are tokens ``[0, n_codes)``."""
        self._one_pair("kernel_fields")
        return self._kc.paged_fields(), self._vc.paged_fields(), self._kc.capacity

    @property
    def n_sink(self) -> int:
        return 0 if self.sink_k is None else self.sink_k.shape[2]

    @property
    def n_window(self) -> int:
        return 0 if self._wk is None else self._wk.n

    @property
    def n_codes(self) -> int:
        """Tokens held as codes."""
        if self.groups is not None:
            return self.groups[0].kc.n  # (one token per code in every group)
        return self._kc.n * (self.key_codec.tokens_per_code if self.key_codec is not None else 1)

    def seq_length(self) -> int:
        return self.n_sink + self.n_codes + self.n_window if self.is_initialized else 0

    @property
    def batch_size(self) -> int:
        return self.batch

    # -- update -------------------------------------------------------------------------------
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append new keys/values ``[B, H_kv, t, D]`` to the window: all of them, or (on error) none.

        Checked first (:func:`qjl.cache.checks.check_states`): shapes, matching token counts, dtype,
        finite values, vectors the codecs and the exact dtype can store."""
        checks.check_shapes(self, key_states, value_states)
        snap = self.snapshot()
        try:
            if not self.is_initialized:
                self.initialize(key_states, value_states)
            if key_states.shape[2] == 0:
                return
            checks.check_values(self, key_states, value_states)
            self.flush()  # an overflow left by a forward without attention through this store
            k, v = self.stored_keys(key_states), self.stored_values(value_states)
            self._wk.append(k)
            self._wv.append(v)
        except BaseException:
            self.restore(snap)
            raise

    def stored_keys(self, key_states: torch.Tensor) -> torch.Tensor:
        """Keys [B, H, t, D] as the store holds them (minus the key mean, once fitted)."""
        return key_states if self.mu is None else key_states.float() - self.mu.unsqueeze(2)

    def stored_values(self, value_states: torch.Tensor) -> torch.Tensor:
        """Values [B, H, t, D_v] as the store holds them (minus the value mean, once fitted)."""
        return value_states if self.mu_v is None else value_states.float() - self.mu_v.unsqueeze(2)

    def before_attention(self, attention_mask, query=None, scaling: float = 1.0, softcap=None,
                         query_mask="same") -> None:
        """First forward: read each row's first real token from the mask, fit the key and value means.

        ``query`` [B, H_q, t, D], ``scaling``, ``softcap``: the attention's, for the value mean's weights, under
        ``query_mask`` [B, 1|H_q, t, L] (default: ``attention_mask``; a replayed prefill passes the recorded rows)."""
        if self.row_start is None:
            self.row_start = padding.row_starts(attention_mask, self.batch, self.device)
        rows_mask = attention_mask if isinstance(query_mask, str) else query_mask
        if query is not None and self.config.fit_key_scale and self.key_scale is None:
            self._keep_scale_rows(query, scaling, softcap, rows_mask)
        self.fit_means(rows_mask, query, scaling, softcap)

    def fit_means(self, attention_mask=None, query=None, scaling: float = 1.0, softcap=None) -> None:
        """Key / value smoothing (as configured, once) from the window (the prompt, in position order): the keys'
        channel mean over each row's real tokens, the values' mean weighted by the attention of the prompt's last
        queries (:func:`qjl.cache.smoothing.attention_weighted_mean`; without a query -- no attention before the
        first flush -- uniform weights over the tokens to be coded), each subtracted from everything held."""
        if self.config.smooth_keys and self.mu is None:
            w = self._wk.view()
            self.mu = channel_mean(w, self.row_start)
            self._wk.replace((w.float() - self.mu.unsqueeze(2)).to(self.exact_dtype))
        if query is not None and self.key_fit is None and self.fit_q is None and self._wants_queries():
            b, hq, t, d = query.shape
            r = min(VALUE_MEAN_ROWS, t)
            rows = query[:, :, t - r:].float().reshape(b, self.heads, hq // self.heads * r, d)  # per KV head
            self.fit_q = rows.square().mean(dim=-2, keepdim=True).sqrt()  # one row: its square is E[q_i^2]
        weights = None
        if query is not None and ((self.config.smooth_values and self.mu_v is None)
                                  or (self.config.heavy_tokens and self.heavy_w is None and not self.sinks_done)):
            weights = attention_weights(query, self._wk.view(), attention_mask, scaling, softcap)  # [B, H, n]
            if self.config.heavy_tokens and not self.sinks_done:
                w = weights.sum(1)  # summed over the KV heads (over every rank's heads: rank_sum)
                self.heavy_w = w if self.rank_sum is None else self.rank_sum(w)
        if self.config.smooth_values and self.mu_v is None:
            w = self._wv.view()
            self.mu_v = attention_weighted_mean(w, self.row_start, self.config.sink_tokens, self.config.residual_length,
                                                weights=weights)
            self._wv.replace((w.float() - self.mu_v.unsqueeze(2)).to(self.exact_dtype))

    def after_attention(self) -> None:
        """Flush now if the window overflows by more than ``EAGER_FLUSH`` tokens (else at the next append)."""
        if self.n_window > self.config.residual_length + self.config.flush_block + EAGER_FLUSH:
            self.flush()

    @property
    def slot_order(self):
        """[B, P] int64: slot -> position of the first P slots when they are reordered (left padding, heavy tokens),
        else None; rebuilt from the row starts and heavy positions at each use, not held."""
        if self.pads is None:
            return None
        return padding.sink_order(self.pads, self.config.sink_tokens, self.heavy_pos)

    def order_width(self) -> int:
        """The first slots held out of position order (sinks of padded rows, heavy tokens), 0 if none.  Read on
        every decode step (``slot_mask``): computed once per (pads, heavy_pos) pair -- the memo holds the tensors it
        was computed from and is recomputed when either is replaced (sinks formed, rows selected, reset)."""
        if self.pads is None:
            return 0
        memo = self.__dict__.get("_order_memo")
        if memo is None or memo[0] is not self.pads or memo[1] is not self.heavy_pos:
            memo = (self.pads, self.heavy_pos, padding.order_width(self.pads, self.config.sink_tokens, self.heavy_pos))
            self._order_memo = memo
        return memo[2]

    def slot_mask(self, attention_mask):
        """The mask in slot order (sinks of padded rows and heavy tokens first): [B, 1|H, t, L].  When every
        reordered column is plainly visible to every row (a decode step without padding), any order gives the same
        mask, and the order is not rebuilt."""
        if attention_mask is None or self.pads is None:
            return attention_mask
        if padding.plainly_visible(attention_mask, self.order_width()):
            return attention_mask
        return padding.remap_mask(attention_mask, self.slot_order)

    # -- compression -------------------------------------------------------------------------
    def flush(self) -> None:
        """Move the window's overflow to sinks (once), then (in whole blocks) to codes."""
        if not self.is_initialized or self.n_window <= self.config.residual_length or self.pending:
            return
        self.fit_means()
        if not self.sinks_done and not self._form_sinks():
            return
        if self.exact_only:
            return
        block = self.config.flush_block
        n = (self.n_window - self.config.residual_length) // block * block
        if n <= 0:
            return
        wk, wv = self._wk.view(), self._wv.view()
        at = self.n_codes  # the code position of the block's first token (codecs over rotations in turn read it)
        if not self._flush_stored(wk, wv, n, at):
            self._flush_quantized(wk, wv, n, at)
        self._wk.replace(wk[:, :, n:])
        self._wv.replace(wv[:, :, n:])

    def _flush_quantized(self, wk: torch.Tensor, wv: torch.Tensor, n: int, at: int) -> None:
        """The window's first ``n`` tokens (code positions ``at ..``) coded by :meth:`_quantize` and appended to the
        code buffers (the first block fits the key codec's per-sequence choice, if it has one, and with
        ``fit_key_scale`` the coded keys' score scale: :meth:`_fit_scale`)."""
        runs = ([(g.heads, g.key_codec, g.value_codec, g.kc, g.vc) for g in self.groups] if self.groups is not None
                else [(slice(0, self.heads), self.key_codec, self.value_codec, self._kc, self._vc)])
        if self.groups is None and self.key_fit is None:
            self.key_fit = self._fit_keys(self._without_padding(wk[:, :, :n]))
        fit = () if self.groups is not None else self.key_fit  # (head groups take no fitted codecs)
        coded = [(heads, self._quantize(kcodec, wk[:, heads, :n], *fit, start=at),
                  self._quantize(vcodec, wv[:, heads, :n], start=at)) for heads, kcodec, vcodec, _, _ in runs]
        if self.config.fit_key_scale:
            if self.key_scale is None:  # the first flush: one gamma per sequence and KV head, then the rows go
                parts = [(heads, kcodec, kc) for (heads, kc, _), (_, kcodec, _, _, _) in zip(coded, runs)]
                self.key_scale, self.scale_q = self._fit_scale(wk[:, :, :n], parts, n), None
            for heads, kc, _ in coded:
                self._scale_keys(heads, kc.fields["norm"])
        for (_, kc, vc), (_, _, _, kbuf, vbuf) in zip(coded, runs):
            kbuf.append(kc)
            vbuf.append(vc)

    def _flush_stored(self, wk: torch.Tensor, wv: torch.Tensor, n: int, at: int) -> bool:
        """A flush of the window's first ``n`` tokens (code positions ``at ..``) stored by the C encoder straight
        into the code buffers (:func:`qjl.kernels.encode.store_cpu`: every run of heads' key and value jobs, the
        buffers' room reserved first and the codes counted once all are stored) -> True; False where it does not
        serve (another backend, no codes held yet, a per-sequence key fit, a codec it does not store or scalar
        cells over one rotation, which :func:`qjl.kernels.encode.quantize_cpu` codes as ``codec.quantize`` does).
        Its codes are :func:`qjl.kernels.reference.encode_reference`'s bit for bit (``codec.quantize``'s but where a
        rotated coordinate lies within float32 rounding of a cell boundary)."""
        if self.backend != "cpu" or not self.n_codes or self.key_fit:
            return False
        if self.groups is not None:
            runs = [(g.heads, g.key_codec, g.value_codec, g.kc, g.vc) for g in self.groups]
        else:
            runs = [(slice(None), self.key_codec, self.value_codec, self._kc, self._vc)]
        plain = all(kernels.can_quantize_cpu(c) for r in runs for c in r[1:3])
        if plain or not all(kernels.can_store_cpu(c) for r in runs for c in r[1:3]):
            return False
        b = wk.shape[0]
        blocks = torch.arange(b).repeat_interleave(n)  # token (sequence s, i) at block s, slot at + i
        slots = (at + torch.arange(n)).repeat(b)
        from qjl.kernels.cpu.store import store_bounds

        bounds = store_bounds(blocks, slots)
        for _, _, _, kc, vc in runs:
            kc.reserve(n)
            vc.reserve(n)
        for heads, key_codec, value_codec, kc, vc in runs:
            kf, vf = kc.paged_fields(), vc.paged_fields()
            jobs = []
            for codec, x, fm in ((key_codec, wk, kf), (value_codec, wv, vf)):
                p = kernels.cpu_pass(codec)
                x = x[:, heads, :n]  # [B, h, n, D] -> tokens [B n, h, D]
                jobs.append((codec, x.transpose(1, 2).reshape(b * n, x.shape[1], x.shape[3]), fm[p.codes],
                             fm[p.norm]))
            kernels.store_cpu(jobs, blocks, slots, bounds, memo=kf.memo, positions=slots)
        for heads, _, _, kc, vc in runs:
            kc.extend(n)
            vc.extend(n)
            if self.key_scale is not None:  # (fit at the first flush, which is never a stored one)
                self._scale_keys(heads, kc.fields["norm"][:, :, kc.n - n:kc.n])
        return True

    def _keep_scale_rows(self, query: torch.Tensor, scaling: float, softcap, mask=None) -> None:
        """fit_key_scale: keep the last FIT_ROWS query rows seen (across forwards, until the first flush fits), with
        their attention's scaling and softcap, the tokens held when they were read and the positions each row saw
        (``mask`` [B, 1|H_q, t, L] in position order, or None: causal)."""
        t, length = query.shape[2], self.seq_length()
        rows = query[:, :, -FIT_ROWS:].detach().float()
        seen = _causal(rows.shape[2], length, query.device)[None, None]  # [1, 1, r, L]
        if mask is not None and tuple(mask.shape[-2:]) == (t, length):
            seen = seen & padding.visible(mask[..., t - rows.shape[2]:, :]).to(query.device)
        seen = seen.expand(query.shape[0], -1, -1, -1)
        kept = self.scale_q
        if kept is not None and kept.length + t == length:  # contiguous rows
            before = torch.nn.functional.pad(kept.seen, (0, length - kept.seen.shape[-1]))  # later tokens: unseen
            heads = max(before.shape[1], seen.shape[1])
            rows = torch.cat([kept.rows, rows], dim=2)[:, :, -FIT_ROWS:]
            seen = torch.cat([before.expand(-1, heads, -1, -1), seen.expand(-1, heads, -1, -1)], dim=2)
            seen = seen[:, :, -FIT_ROWS:]
        self.scale_q = ScaleRows(rows, float(scaling), softcap, length, seen)

    def _fit_scale(self, xk: torch.Tensor, parts: list, n: int) -> torch.Tensor:
        """The first flush with fit_key_scale: gamma [B, H] for the tokens ``xk`` [B, H, n, D] just coded (the window's
        first ``n``; ``parts``: (heads, codec, codes) of each run of heads), from the prompt's last queries over the
        sinks, these tokens and the window's rest (:mod:`qjl.cache.key_scale`); ones where no query rows match the
        tokens held (no attention through this store before its first flush)."""
        b, h = xk.shape[:2]
        rec = self.scale_q
        wk, wv = self._wk.view(), self._wv.view()
        w = wk.shape[2] - n  # the window's tokens that stay exact
        if rec is None or rec.length != self.seq_length():
            return torch.ones(b, h, device=xk.device)
        q, scaling, softcap, _, seen = rec
        r = min(q.shape[2], w + 1)  # rows that see every coded token causally: the last w + 1 positions
        g = q.shape[1] // h
        q = q[:, :, q.shape[2] - r:].reshape(b, h, g, r, q.shape[-1])
        visible = None
        if self.pads is not None and not self.n_codes:  # each row's padding slots, first in its first block
            visible = torch.arange(n, device=xk.device)[None, :] >= self.pads.to(xk.device)[:, None]
        hat = torch.empty(xk.shape, device=xk.device)
        for heads, codec, codes in parts:
            hat[:, heads] = codec.dequantize(codes)
        err = key_scale.scale_error(q, self.sink_k, self.sink_v, xk, hat, wv[:, :, :n], wk[:, :, n:], wv[:, :, n:],
                                    scaling, softcap, visible, self._seen_slots(seen[:, :, seen.shape[2] - r:], h, g))
        return key_scale.fit_key_scale(err)

    def _seen_slots(self, seen: torch.Tensor, h: int, g: int) -> torch.Tensor | None:
        """The fit's rows' masks ``seen`` [B, 1|H_q, R, L] (positions; row ``r`` at position ``L - R + r``) -> [B, 1|H,
        G R, L] in slot order (the first slots as ``slot_order`` reorders them: sinks and heavy tokens), or None where
        each row sees exactly the positions up to its own (the fit's causal window then says it all)."""
        b, _, r, length = seen.shape
        if bool((seen == _causal(r, length, seen.device)).all()):
            return None
        slots = torch.arange(length, device=seen.device).expand(b, length)
        order = self.slot_order
        if order is not None:
            slots = torch.cat([order.to(seen.device), slots[:, order.shape[1]:]], dim=1)
        got = torch.gather(seen, 3, slots[:, None, None, :].expand(b, seen.shape[1], r, length))
        if got.shape[1] == 1:
            return got.repeat(1, 1, g, 1)
        return got.reshape(b, h, g * r, length)

    def _scale_keys(self, heads: slice, norm: torch.Tensor) -> None:
        """Multiply the stored key norms ``norm`` [B, h, m] (of KV heads ``heads``) by their heads' gamma, in place."""
        gamma = self.key_scale[:, heads].to(norm.device)
        norm.copy_((norm.float() * gamma[:, :, None]).to(norm.dtype))

    def _fit_keys(self, block: torch.Tensor) -> tuple:
        """The key codec's per-sequence fit from the first flushed block [B, H, n, D] (and the prompt's last queries
        for a codec that fits to them: ``fits_queries``); the queries are dropped once used."""
        if self.key_codec.fits_queries:
            fit = self.key_codec.fit(block, queries=self.fit_q)
        else:
            fit = self.key_codec.fit(block)
        self.fit_q = None
        return fit

    def _wants_queries(self) -> bool:
        """Whether the key codec (or, before an allocation, one of its candidates) fits to the prompt's queries."""
        if self.groups is not None:
            return False  # (head groups take no fitted codecs)
        codecs = [self.key_codec] if self.key_codec is not None else list((self.candidates or ((),))[0])
        return any(c.fits_queries for c in codecs)

    def _form_sinks(self) -> bool:
        """Each row's first ``sink_tokens`` real tokens, and its ``heavy_tokens`` heaviest, become its sinks (False:
        not enough tokens yet)."""
        s, n = self.config.sink_tokens, self.n_window
        starts = self.row_start if self.row_start is not None else torch.zeros(self.batch, dtype=torch.long)
        starts = starts.to(self.device).clamp(max=max(n - s, 0))
        extra = self._heavy_positions(starts, n)
        order = padding.sink_order(starts, s, extra)
        if n < (s if order is None else order.shape[1]):
            return False
        wk, wv = padding.to_slots(self._wk.view(), order), padding.to_slots(self._wv.view(), order)
        if order is not None:  # held: the row starts and heavy positions it is rebuilt from (slot_order)
            self.pads, self.heavy_pos = starts, None if extra is None else extra.to(torch.int32)
        s += 0 if extra is None else extra.shape[1]
        if s:
            self.sink_k, self.sink_v = wk[:, :, :s].clone(), wv[:, :, :s].clone()
        self._wk.replace(wk[:, :, s:])
        self._wv.replace(wv[:, :, s:])
        self.sinks_done, self.heavy_w = True, None
        return True

    def _heavy_positions(self, starts: torch.Tensor, n: int):
        """``heavy_tokens`` positions per row [B, K] (ascending): the tokens to be coded (after the row's sinks,
        before the exact window) that the prompt's last queries attend to most, averaged over KV heads; K is the
        same for every row (at most the fewest candidates of a row).  None without weights (no attention yet)."""
        if not self.config.heavy_tokens or self.heavy_w is None:
            return None
        w = self.heavy_w[:, :n]
        end = min(w.shape[1], n - self.config.residual_length)
        first = starts.to(w.device) + self.config.sink_tokens
        k = min(self.config.heavy_tokens, max(0, end - int(first.max())))
        if k == 0:
            return None
        pos = torch.arange(w.shape[1], device=w.device)
        masked = w.masked_fill((pos[None] < first[:, None]) | (pos[None] >= end), float("-inf"))
        return masked.topk(k, dim=1).indices.sort(dim=1).values.to(starts.device)

    def _without_padding(self, block: torch.Tensor) -> torch.Tensor:
        """The first flushed block with each row's padding slots (just after its sinks) zeroed."""
        return block if self.pads is None or self.n_codes else padding.zero_padding(block, self.pads)

    def encode(self, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> tuple:
        """Codes of keys and values ``[B, H_kv, n, D]`` with this layer's codecs and kernels (not stored), their
        first token at code position ``start``."""
        self._one_pair("encode")
        fit = self.key_fit if self.key_fit is not None else self.key_codec.fit(k)
        return self._quantize(self.key_codec, k, *fit, start=start), self._quantize(self.value_codec, v, start=start)

    def _quantize(self, codec, x: torch.Tensor, *fit, start: int = 0) -> Codes:
        return kernels.quantize_with(self.backend, codec, x, *fit, start=start)

    # -- undo ----------------------------------------------------------------------------------
    def snapshot(self):
        """Everything needed to undo the next operations (buffers are only written beyond their state)."""
        bufs = {n: getattr(self, n).state() for n in ("_wk", "_wv", "_kc", "_vc") if getattr(self, n) is not None}
        for i, g in enumerate(self.groups or ()):
            bufs[(i, "kc")], bufs[(i, "vc")] = g.kc.state(), g.vc.state()
        return dict(self.__dict__), bufs

    def restore(self, snap) -> None:
        attrs, bufs = snap
        self.__dict__.clear()
        self.__dict__.update(attrs)
        for name, state in bufs.items():
            if isinstance(name, tuple):  # a head group's buffer
                getattr(self.groups[name[0]], name[1]).restore(state)
            else:
                getattr(self, name).restore(state)

    # -- crop / select ------------------------------------------------------------------------------
    def check_crop(self, n: int) -> None:
        checks.check_crop(self, n)

    def crop(self, n: int) -> None:
        """Drop the last ``n`` tokens (window first, then codes, then sinks); checked first."""
        self.check_crop(n)
        if n == 0 or not self.is_initialized:
            return
        r = min(n, self.n_window)
        self._wk.n -= r
        self._wv.n -= r
        n -= r
        c = min(n, self.n_codes)
        if c and self.groups is not None:
            for g in self.groups:
                g.kc.truncate(g.kc.n - c)
                g.vc.truncate(g.vc.n - c)
            n -= c
        elif c:
            self._kc.truncate(self._kc.n - c // (self.key_codec.tokens_per_code if self.key_codec else 1))
            self._vc.truncate(self._vc.n - c)
            n -= c
        if n:  # back into the sinks (no row is padded here): what is left of them becomes the window again
            keep_k, keep_v = self.sink_k[:, :, : self.n_sink - n], self.sink_v[:, :, : self.n_sink - n]
            self._wk.replace(keep_k)
            self._wv.replace(keep_v)
            self.sink_k = self.sink_v = None
            self.sinks_done = False

    def check_select(self, index: torch.Tensor) -> torch.Tensor:
        return checks.check_index(self, index)

    def select(self, index: torch.Tensor) -> None:
        """Reindex the batch axis of everything held (beam search, batch selection)."""
        index = self.check_select(index)
        if not self.is_initialized:
            return
        index = index.to(self.device)
        sel = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        for buf in (self._wk, self._wv):
            buf.replace(sel(buf.view()))
        self.sink_k, self.sink_v = sel(self.sink_k), sel(self.sink_v)
        for buf in (self._kc, self._vc, *(b for g in self.groups or () for b in (g.kc, g.vc))):
            buf.select(index)
        self.mu, self.mu_v = sel(self.mu), sel(self.mu_v)
        self.row_start, self.pads, self.heavy_pos = sel(self.row_start), sel(self.pads), sel(self.heavy_pos)
        self.heavy_w, self.fit_q = sel(self.heavy_w), sel(self.fit_q)
        self.key_scale = sel(self.key_scale)
        if self.scale_q is not None:
            self.scale_q = self.scale_q._replace(rows=sel(self.scale_q.rows), seen=sel(self.scale_q.seen))
        if self.key_fit is not None:
            self.key_fit = tuple(sel(t) for t in self.key_fit)
        self.batch = index.numel()

    # -- bookkeeping ------------------------------------------------------------------------------
    def parts(self) -> dict:
        """Tensors held, by part (the window and sinks are 'exact'; 'smoothing' is mu and mu_v, and each head group's
        contiguous copy of its rows of mu_v, kept for the kernels once attention has read it)."""
        groups = self.groups or ()
        return {"key_codes": self._kc.tensors() + [t for g in groups for t in g.kc.tensors()],
                "value_codes": self._vc.tensors() + [t for g in groups for t in g.vc.tensors()],
                "exact": [*(self._wk.tensors() if self._wk else []), *(self._wv.tensors() if self._wv else []),
                          self.sink_k, self.sink_v],
                "smoothing": [self.mu, self.mu_v, *(g.mean[1] for g in groups if g.mean is not None)],
                "fit": list(self.key_fit or ()) + [self.row_start, self.pads, self.heavy_pos, self.heavy_w, self.fit_q,
                                                   self.key_scale, *((self.scale_q.rows, self.scale_q.seen) if self.scale_q else ())]}

    def nbytes(self) -> dict:
        """Bytes of storage held by part (each storage counted once, capacity included)."""
        seen, out = set(), {}
        for part, tensors in self.parts().items():
            sizes = storage_bytes(tensors)
            out[part] = sum(b for ptr, b in sizes.items() if ptr not in seen)
            seen |= set(sizes)
        return out

    def counts(self) -> dict:
        """Stored coordinates by part: compressed tokens and exact (sink + window) tokens."""
        if not self.is_initialized:
            return {"compressed": 0, "exact": 0}
        per_token = self.batch * self.heads * self.key_dim
        return {"compressed": per_token * self.n_codes, "exact": per_token * (self.n_sink + self.n_window)}


class HeadGroup:
    """A run of adjacent KV heads ``heads`` (a slice) of one layer coded with its own codecs (widths chosen per KV
    head, :meth:`LayerStore.assign_heads`): the specs, the codecs, whether the kernels read them, and the code
    buffers ``kc``/``vc`` of those heads ([B, len(heads), n] codes)."""

    def __init__(self, heads: slice, key_spec, value_spec, key_codec, value_codec, kernel_ok: bool):
        self.heads, self.key_spec, self.value_spec = heads, key_spec, value_spec
        self.key_codec, self.value_codec, self.kernel_ok = key_codec, value_codec, kernel_ok
        self.kc, self.vc = CodeBuffer(), CodeBuffer()
        self.mean = None  # (the store's value mean, its rows of these heads): kept while the store's is the same

    def __repr__(self):
        return f"HeadGroup(heads {self.heads.start}-{self.heads.stop - 1}, {self.key_codec!r}, {self.value_codec!r})"


class HeadGroupView:
    """One head group of a :class:`LayerStore` read as a store of those heads alone: what
    :func:`qjl.cache.attention.attend` reads (exact sinks and window as views of the store's, the group's codes and
    codecs, the value mean's rows of those heads).  Attention of the group's query heads over it is the layer's
    attention for those heads: each query head reads only its own KV head."""

    groups = None  # (a view is read as a store with one pair of codecs)

    def __init__(self, store: LayerStore, group: HeadGroup):
        self.store, self.group, self.head_slice = store, group, group.heads
        self.layer_idx, self.config, self.backend = store.layer_idx, store.config, store.backend
        self.heads = group.heads.stop - group.heads.start
        self.value_dim = store.value_dim
        self.key_codec, self.value_codec, self.kernel_ok = group.key_codec, group.value_codec, group.kernel_ok

    def _rows(self, x):
        return None if x is None else x[:, self.head_slice]

    keys = property(lambda self: self._rows(self.store.keys))
    values = property(lambda self: self._rows(self.store.values))
    sink_k = property(lambda self: self._rows(self.store.sink_k))
    sink_v = property(lambda self: self._rows(self.store.sink_v))
    key_codes = property(lambda self: self.group.kc.view())
    value_codes = property(lambda self: self.group.vc.view())
    n_sink = property(lambda self: self.store.n_sink)
    n_codes = property(lambda self: self.store.n_codes)

    @property
    def mu_v(self):
        """The value mean's rows of these heads [B, h, D_v] (contiguous; the same tensor from call to call while the
        store's mean is)."""
        mu = self.store.mu_v
        if mu is None:
            return None
        if self.group.mean is None or self.group.mean[0] is not mu:
            self.group.mean = (mu, mu[:, self.head_slice].contiguous())
        return self.group.mean[1]

    def seq_length(self) -> int:
        return self.store.seq_length()

    def kernel_fields(self) -> tuple:
        """:meth:`LayerStore.kernel_fields` of the group's codes."""
        return self.group.kc.paged_fields(), self.group.vc.paged_fields(), self.group.kc.capacity
