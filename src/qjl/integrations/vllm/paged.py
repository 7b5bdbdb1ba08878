"""Paged compressed KV: the fields in vLLM's pages and the plain-torch attention over them (writes: :mod:`.writes`;
a step's orchestration: :mod:`.step`; the kernel path: :mod:`.decode`).

PAGED CONTRACT (shared with the paged kernels of issue #13)::

    paged_decode_reference(q, key_fields, value_fields, block_table, seq_lens, block_size, *,
                           key_codec, value_codec, scale, num_kv_heads, exact=None, sinks=0,
                           window=0, current=None, rows=None, sliding_window=None) -> out [B, H_q, D] float32

* ``q``: [B, H_q, D], one query row per sequence (a decode step); query head ``i`` reads KV
  head ``i // (H_q / H_kv)`` (GQA).
* ``key_fields`` / ``value_fields``: {codec field name: :class:`PagedField`}, the fields of the
  codec's :class:`qjl.Codes` (TurboQuant MSE: ``codes`` uint8 [nbytes], ``norm`` fp16/bf16/fp8;
  QJL: ``signs`` uint8 [m/8], ``norm``, with outliers also ``outlier_signs``, ``outlier_norm``
  and the per-block shared ``outlier_idx`` uint8 [n_outliers]; token-wise values: ``codes``
  uint8, ``scale`` and ``zero`` [groups] fp16).  Field ``f`` of token ``t`` of sequence ``b``,
  KV head ``h``, is the ``f.dtype`` array of shape ``f.shape`` at byte address
  ``f.offset + block_table[b, t // block_size] * f.stride_block + h * f.stride_head
  + (t % block_size) * f.stride_token`` of ``f.buffer`` (``stride_token = 0``: one entry per
  block and head).  vLLM's pages (:mod:`.layout`) and transformers' contiguous cache (one
  block per sequence, ``block_table = arange(B)[:, None]``) are both this addressing.
* ``block_table``: [B, max_blocks] int; ``seq_lens``: [B] tokens of history in the cache
  (the current token excluded when it is passed in ``current``).
* Tokens ``[sinks, w0)`` of a sequence of ``n`` are scored from codes; the first ``sinks`` and the exact window
  ``[w0, n)`` (:func:`.layout.window_start`: the last ``sinks + window`` past block 0, whose later blocks ring over
  the sink slots too) come exactly from ``exact = (key PagedField, value PagedField)`` at slot
  :func:`.layout.exact_slot` instead of ``t % block_size``.
* ``current``: None or (k, v) [B, H_kv, D], the current token's exact key and value.
* ``sliding_window``: None, or W for a sliding-window layer: the current token sees the W - 1 tokens before it
  (codes from position ``n + 1 - W``; such a layer keeps no sinks and ``window < W``).
* Softmax in float32 over all of them; ``scale`` multiplies the logits.

Keys are scored with the codec's own estimator (``inner_product``), values mixed from
``dequantize``; a fast kernel must match this within float error.
"""

from __future__ import annotations

import torch

from ...cache.attention import masked_sdpa
from ...codecs.base import Codes
from ...kernels.paged import FieldMap, extent_bytes, mix_view, role_fields
from ...kernels.paged import PagedField as KernelPagedField
from .layout import PageLayout, check_sliding_window, exact_slot, window_start

__all__ = ["PagedField", "page_fields", "paged_decode_reference", "check_output", "paged_attention_reference",
           "chunk_sequences", "sequence_kv", "gather_history", "history_codes", "rotated_basis"]


class PagedField(KernelPagedField):
    """:class:`qjl.kernels.PagedField` over a whole page pool (``buffer``: 1-d uint8 over the pool's storage,
    ``offset`` from its start), plus the writes and whole-block reads the backend needs; the kernels read it
    as their own (see the module docstring for the addressing)."""

    def addresses(self, blocks, heads, slots) -> torch.Tensor:
        """Byte indices [*S, entry_bytes] into ``buffer`` of the entries at broadcastable int tensors of a
        common shape S (reusable: :meth:`read` / :meth:`write` take them)."""
        dev = self.buffer.device
        blocks, heads, slots = torch.broadcast_tensors(blocks.to(dev), heads.to(dev), slots.to(dev))
        addr = self.offset + blocks.long() * self.stride_block + heads.long() * self.stride_head
        addr = addr + slots.long() * self.stride_token
        return addr.unsqueeze(-1) + torch.arange(self.entry_bytes, device=addr.device)

    def read(self, idx: torch.Tensor) -> torch.Tensor:
        """The entries [*S, *shape] at byte indices ``idx`` [*S, entry_bytes] (:meth:`addresses`)."""
        # index_select, not buffer[idx]: advanced indexing opens an OpenMP region even for a few bytes, and
        # each region waits for every thread (milliseconds per call on a loaded machine)
        raw = self.buffer.index_select(0, idx.reshape(-1))
        return raw.view(self.dtype).reshape(*idx.shape[:-1], *self.shape)

    def write(self, idx: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` [*S, *shape] at byte indices ``idx`` [*S, entry_bytes] (distinct entries)."""
        raw = values.to(self.dtype).contiguous().view(torch.uint8).reshape(-1)
        self.buffer.index_copy_(0, idx.reshape(-1), raw)  # (see read)

    def gather(self, blocks, heads, slots) -> torch.Tensor:
        """Broadcastable int tensors of a common shape S -> the entries [*S, *shape] (a copy)."""
        return self.read(self.addresses(blocks, heads, slots))

    def scatter(self, blocks, heads, slots, values: torch.Tensor) -> None:
        """Write ``values`` [*S, *shape] (S the broadcast shape of the indices)."""
        self.write(self.addresses(blocks, heads, slots), values)

    def blocks(self, blocks: torch.Tensor, num_heads: int, block_size: int) -> torch.Tensor:
        """Whole blocks at once: blocks [n] -> [n, H, block_size, *shape] (per-token fields, rows
        ``stride_token`` = the item size apart) or [n, H, *shape] (shared fields)."""
        item = self.entry_bytes
        rows = block_size if self.stride_token else 1
        if self.stride_token not in (0, item):
            return self.gather(blocks[:, None, None], torch.arange(num_heads)[None, :, None],
                               torch.arange(rows)[None, None, :])
        top = int(blocks.max()) + 1 if blocks.numel() else 1
        view = torch.as_strided(self.buffer, (top, num_heads, rows * item), (self.stride_block, self.stride_head, 1),
                                self.buffer.storage_offset() + self.offset)
        raw = view[blocks.long()].contiguous().view(self.dtype)
        return raw.reshape(len(blocks), num_heads, *((rows,) if self.stride_token else ()), *self.shape)


def page_fields(layout: PageLayout, pages: torch.Tensor) -> FieldMap:
    """The fields of ``layout`` in vLLM's page tensor ``pages`` [num_blocks, H_kv, block_size, C']
    (any element dtype; every head region must be contiguous), as a :class:`qjl.kernels.paged.FieldMap` named
    ``role.field`` (the backend builds it once per layer: the kernels then check its fields once)."""
    nb, h, bs, c = pages.shape
    es = pages.element_size()
    if bs != layout.block_size or c * es != layout.content_bytes:
        raise ValueError(f"pages of shape {tuple(pages.shape)} ({pages.dtype}) do not hold this layout "
                         f"(block {layout.block_size}, {layout.content_bytes} bytes per token)")
    if pages.stride(3) != 1 or pages.stride(2) != c:
        raise ValueError("each head region of the pages must be contiguous (vLLM's LBHNC layout)")
    storage = torch.empty(0, dtype=torch.uint8, device=pages.device).set_(pages.untyped_storage())
    base = pages.storage_offset() * es
    # the buffer is this layer's own bytes: offsets are the layout's, the same in every layer of that layout, so
    # the step's address memos (keyed by field geometry) serve all of them, and no address reaches another layer
    region = storage[base:base + extent_bytes(pages)]
    return FieldMap({n: PagedField(region, f.offset, pages.stride(0) * es, pages.stride(1) * es, f.stride_token,
                                   f.dtype, f.shape) for n, f in layout.fields.items()})


def history_codes(fields: dict, row: torch.Tensor, c0: int, c1: int, block_size: int, num_heads: int) -> Codes:
    """Codes of positions [c0, c1) of one sequence (block table row ``row``): lead [H, c1 - c0];
    per-block shared fields (QJL outlier channels) come back per token in ``shared`` ([H, n, k])."""
    b0, b1 = c0 // block_size, (c1 - 1) // block_size + 1
    blocks = row[b0:b1]
    lo, hi = c0 - b0 * block_size, c1 - b0 * block_size
    per, shared = {}, {}
    for name, f in fields.items():
        t = f.blocks(blocks, num_heads, block_size)
        if f.stride_token:
            per[name] = t.transpose(0, 1).reshape(num_heads, -1, *f.shape)[:, lo:hi]
        else:
            t = t.transpose(0, 1).unsqueeze(2).expand(num_heads, len(blocks), block_size, *f.shape)
            shared[name] = t.reshape(num_heads, -1, *f.shape)[:, lo:hi]
    return Codes((num_heads, c1 - c0), per, shared)


def _dequantize(codec, codes: Codes, start: int) -> torch.Tensor:
    """``codec.dequantize(codes)`` of the codes of positions ``start``.. of a sequence (the position passed to a codec
    over rotations in turn, ``positional``; the pages code every token by its position in its sequence)."""
    return codec.dequantize(codes, start=start) if getattr(codec, "positional", False) else codec.dequantize(codes)


def _scores(codec, q: torch.Tensor, codes: Codes) -> torch.Tensor:
    """q [..., H, R, D] against codes lead [..., H, n] -> [..., H, R, n] (the codec's estimator)."""
    if not codes.shared:
        return codec.inner_product(q, codes)
    # a per-block fit ([..., H, n, k]: one entry per token here): one codes object per token
    per = Codes((*codes.lead, 1), {n: t.unsqueeze(len(codes.lead)) for n, t in codes.fields.items()}, codes.shared)
    s = codec.inner_product(q.unsqueeze(-3), per)  # [..., H, n, R, 1]
    return s.squeeze(-1).transpose(-1, -2)


def gather_history(codecs, fields: dict, block_row: torch.Tensor, start: int, end: int, block_size: int,
                   num_heads: int, token_major: bool = False, out: tuple | None = None, unmix: bool = True):
    """Dequantized keys and values of positions [start, end) of one sequence: [H, end - start, D] float32 each, or
    [end - start, H, D] with ``token_major``.  A codec with a mix view (TurboQuant, token-wise) is read by the C
    kernel where it loads (:func:`qjl.kernels.cpu.rows.value_rows`: its formula bit for bit, mapped back to the
    model's basis row by row in the same call); others through ``codec.dequantize``.  ``out``: None, or (keys,
    values) token-major fp32 / fp16 / bf16 tensors to write into (returned; token-major then whatever
    ``token_major`` says).  ``unmix=False``: the rows in each codec's own basis (its mix view's, TurboQuant's
    rotated coordinates; codecs without a mix view are refused), not mapped back."""
    return tuple(_dequantized(codec, role_fields(fields, role), block_row, start, end, block_size, num_heads,
                              token_major, None if out is None else out[i], unmix)
                 for i, (codec, role) in enumerate(zip(codecs, ("key", "value"))))


def _dequantized(codec, fields: dict, block_row, start: int, end: int, block_size: int, num_heads: int,
                 token_major: bool, out, unmix: bool = True) -> torch.Tensor:
    """One role's vectors of :func:`gather_history` (``fields``: that role's)."""
    from ...kernels.cpu import launch, rows as cpu_rows

    view = mix_view(codec)
    if not unmix and view is None:
        raise ValueError(f"unmix=False: {type(codec).__name__} has no mix view (no basis of its own to read rows in)")
    if block_row.device.type == "cpu" and view is not None and launch.available():
        rows = cpu_rows.value_rows(codec, fields, block_row, block_size, num_heads, start, end, unmix=unmix, out=out)
    elif not unmix:
        rows = cpu_rows.value_rows_reference(codec, fields, block_row, block_size, num_heads, start, end)
        if out is not None:
            rows = out.copy_(rows)
    else:
        codes = history_codes(fields, block_row, start, end, block_size, num_heads)
        if codes.shared:  # a per-block fit (one entry per token here): dequantize token by token
            per = Codes((*codes.lead, 1), {n: t.unsqueeze(len(codes.lead)) for n, t in codes.fields.items()},
                        codes.shared)
            rows = codec.dequantize(per).squeeze(-2).transpose(0, 1)
        else:
            rows = _dequantize(codec, codes, start).transpose(0, 1)
        if out is not None:
            rows = out.copy_(rows)
    return rows if token_major or out is not None else rows.transpose(0, 1)


def _exact(exact, block_row, pos, block_size, sinks, window, heads):
    """Exact keys and values [H, n, D] float32 of positions ``pos`` [n] of one sequence."""
    blocks, slots = block_row[pos // block_size], exact_slot(pos, sinks, window, block_size=block_size)
    ek, ev = exact
    return (ek.gather(blocks, heads[:, None], slots).float(), ev.gather(blocks, heads[:, None], slots).float())


def _split(n: int, sinks: int, window: int, block_size: int, sliding_window: int | None = None):
    """(exact sink positions, code range, exact window positions) of a history of n tokens that a token at
    position n sees (with a sliding window W: from position n + 1 - W on; then no sinks, window < W); the exact
    window from :func:`.layout.window_start`."""
    s = min(sinks, n)
    c0 = s if sliding_window is None else max(s, n + 1 - sliding_window)
    w0 = max(c0, window_start(n, sinks, window, block_size=block_size))
    return torch.arange(0, s), (c0, w0), torch.arange(w0, n)


def check_output(out, b: int, hq: int, d: int):
    """``out`` checked as a decode function's destination: None, or a contiguous float tensor of B * H_q * D
    elements."""
    if out is not None and (not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point
                            or out.numel() != b * hq * d or not out.is_contiguous()):
        raise ValueError(f"out must be None or a contiguous float tensor of {b} x {hq} x {d} elements, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
    return out


def paged_decode_reference(q, key_fields, value_fields, block_table, seq_lens, block_size, *, key_codec,
                           value_codec, scale: float, num_kv_heads: int, exact=None, sinks: int = 0,
                           window: int = 0, current=None, rows=None,
                           sliding_window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The paged decode attention of the module docstring (plain torch, one sequence at a time; ``rows``, the
    step's precomputed indices that :func:`.decode.paged_decode_kernel` takes, is ignored).  ``sliding_window``:
    the layer's window W: the current token sees the W - 1 tokens before it (no sinks; ``window < W``).
    ``out``: None, or a float tensor of B * H_q * D elements the result is copied into (converted to its dtype)
    and returned as [B, H_q, D]."""
    b, hq, d = q.shape
    dst = check_output(out, b, hq, d)
    check_sliding_window(sliding_window)
    if exact is None and sinks + window:
        raise ValueError("exact must be given when sinks or window is non-zero")
    if hq % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide the {hq} query heads")
    heads = torch.arange(num_kv_heads, device=q.device)
    g = hq // num_kv_heads
    out = torch.empty(b, hq, d, dtype=torch.float32, device=q.device)
    for i in range(b):
        row = block_table[i].long()
        sink_pos, (c0, c1), win_pos = _split(int(seq_lens[i]), sinks, window, block_size, sliding_window)
        qi = q[i].float().reshape(num_kv_heads, g, d)
        logits, vs = [], []
        xpos = torch.cat([sink_pos, win_pos])
        if len(xpos):
            xk, xv = _exact(exact, row, xpos, block_size, sinks, window, heads)
            logits.append(qi @ xk.transpose(-1, -2))
            vs.append(xv)
        if c1 > c0:
            kc = history_codes(key_fields, row, c0, c1, block_size, num_kv_heads)
            logits.append(_scores(key_codec, qi, kc))
            vs.append(_dequantize(value_codec, history_codes(value_fields, row, c0, c1, block_size, num_kv_heads), c0))
        if current is not None:
            logits.append(qi @ current[0][i].float().unsqueeze(-1))
            vs.append(current[1][i].float().unsqueeze(-2))
        if not logits:
            raise ValueError(f"sequence {i} has no token to attend to (seq_lens 0 and no current token)")
        p = torch.softmax(torch.cat(logits, dim=-1) * scale, dim=-1)
        out[i] = (p @ torch.cat(vs, dim=-2)).reshape(hq, d)
    return out if dst is None else dst.view(b, hq, d).copy_(out)


def rotated_basis(key_codec, value_codec, d: int) -> tuple | None:
    """(R_k, R_v) [d, d] float32 with ``codes' basis = x @ R``: the key and value codecs'
    :func:`qjl.kernels.paged.rotation_matrix` (the inverse of an orthogonal unmix of the head dimension,
    TurboQuant's rotation), or None where either codec has none of that size.  Scores and mixes are the same in that
    basis: ``(q R)(k R)^T = q k^T`` and ``(sum p v R) R^T = sum p v``."""
    from ...kernels.paged import rotation_matrix

    rs = tuple(rotation_matrix(c) for c in (key_codec, value_codec))
    return rs if all(r is not None and tuple(r.shape) == (d, d) for r in rs) else None


def chunk_sequences(query_start_loc, seq_lens):
    """The prefill / chunk sequences of a batch -> (sequence i, first row, end row, its c new tokens, the n of its
    history) for every sequence with rows (``query_start_loc`` [B + 1], ``seq_lens`` [B]: tokens after the step)."""
    qsl = query_start_loc.tolist()
    for i in range(len(qsl) - 1):
        r0, r1 = qsl[i], qsl[i + 1]
        if r1 > r0:
            yield i, r0, r1, r1 - r0, int(seq_lens[i]) - (r1 - r0)


def _rotated(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """``x`` [..., D], or ``x @ r`` in float32 (a basis of :func:`rotated_basis`)."""
    return x if r is None else x.float() @ r


def sequence_kv(k, v, fields: dict, row, c: int, n: int, layout: PageLayout, heads,
                dtype: torch.dtype = torch.float32, basis: tuple | None = None) -> tuple:
    """What one prefill / chunk sequence attends to: its history (exact sinks, decoded codes, exact window, from the
    pages through ``row``, its block-table row) and its own ``c`` new tokens ``k``/``v`` [c, H_kv, D] after the
    ``n`` of its history -> (keys, values [L, H_kv, D] in ``dtype``, token-major: the layout vLLM's cache write
    takes; their positions [L]), in position order.  Each part is written once into the result (no joins).

    ``basis``: None (the model's basis), or (R_k, R_v) [D, D] float32, the key and value codecs' rotations as
    row maps (:func:`rotated_basis`): then every key is given as ``key @ R_k`` and every value as ``value @ R_v``
    -- the codes decoded in their codecs' own basis without the inverse rotation, the exact tokens rotated -- so
    that a query rotated by ``R_k`` scores them as the model's basis would, and an output mixed from them maps back
    by ``R_v.T`` (:class:`.prefill.VLLMPrefill`)."""
    sink_pos, (c0, c1), win_pos = _split(n, layout.sinks, layout.window, layout.block_size, layout.sliding_window)
    ns, nw = len(sink_pos), len(win_pos)
    length = ns + (c1 - c0) + nw + c
    kk = torch.empty(length, len(heads), k.shape[-1], dtype=dtype, device=k.device)
    vv = torch.empty_like(kk)
    rk, rv = (None, None) if basis is None else basis
    if ns + nw:
        ex = (fields["exact.key"], fields["exact.value"])
        xk, xv = _exact(ex, row, torch.cat([sink_pos, win_pos]), layout.block_size, layout.sinks, layout.window,
                        heads)  # [H, ns + nw, D]
        for dst, src, r in ((kk, xk, rk), (vv, xv, rv)):
            src = _rotated(src, r)
            dst[:ns].copy_(src[:, :ns].transpose(0, 1))
            dst[ns + c1 - c0:length - c].copy_(src[:, ns:].transpose(0, 1))
    if c1 > c0:  # decoded straight into the result
        gather_history((layout.key_codec, layout.value_codec), fields, row, c0, c1, layout.block_size, len(heads),
                       token_major=True, out=(kk[ns:ns + c1 - c0], vv[ns:ns + c1 - c0]), unmix=basis is None)
    kk[length - c:].copy_(_rotated(k, rk))
    vv[length - c:].copy_(_rotated(v, rv))
    pos = torch.cat([sink_pos, torch.arange(c0, c1), win_pos, torch.arange(n, n + c)]).to(k.device)
    return kk, vv, pos


def paged_attention_reference(q, k, v, fields: dict, block_table, query_start_loc, seq_lens, layout: PageLayout,
                              scale: float) -> torch.Tensor:
    """Attention of a mixed batch: q [T, H_q, D], the batch's own k/v [T, H_kv, D] (attended
    exactly, causally), history from the pages -> [T, H_q, D] float32.

    Sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]`` and has ``seq_lens[i]``
    tokens after this step; its history is the first ``seq_lens[i] - query_len`` tokens.  A layer with a sliding
    window W (``layout.sliding_window``): the token at position p sees positions p - W + 1 ... p.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    heads = torch.arange(hkv, device=q.device)
    out = torch.empty(t, hq, d, dtype=torch.float32, device=q.device)
    for i, r0, r1, c, n in chunk_sequences(query_start_loc, seq_lens):
        kk, vv, pos = sequence_kv(k[r0:r1], v[r0:r1], fields, block_table[i].long(), c, n, layout, heads)
        qpos = torch.arange(n, n + c, device=q.device)[:, None]
        mask = pos[None, :] <= qpos  # causal over [sinks, codes, window, this chunk]
        if layout.sliding_window is not None:
            mask &= pos[None, :] > qpos - layout.sliding_window
        # 4-d (3-d inputs run torch's math path on the CPU: ~2.6x slower for a 512-token chunk over 4k tokens)
        o = masked_sdpa(q[r0:r1].float().transpose(0, 1)[None], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None],
                        mask, scale)
        out[r0:r1] = o[0].transpose(0, 1)
    return out
