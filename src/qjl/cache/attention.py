"""Attention of new queries over one layer's store (:class:`qjl.cache.storage.LayerStore`).

Three paths, all the same attention up to float error:

* **kernel** (:func:`qjl.kernels.paged_decode`: the C kernel on CPU, Triton on CUDA;
  ``config.kernel``): decode steps (at most ``MAX_KERNEL_ROWS`` query rows per KV head, a mask that
  is the same for every row over the codes, no softcap) score and mix the codes inside the kernel --
  the same paged core vLLM calls, with one block per sequence -- merged exactly with the sinks and
  the window in the same call (a store coded in runs of KV heads: every run in that one call);
* **SDPA**: other forwards with a kernel backend (prefill, long chunks, codecs the kernels do not
  read) run torch SDPA over sinks + dequantized codes + window;
* **reference** (``kernel="torch"``, and softcapped models): every part scored with the codecs'
  own inner products, mask and softmax in float32, values mixed part by part; the GQA group of
  each KV head shares one read of that head's codes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qjl import kernels
from qjl.cache.padding import plainly_visible

__all__ = ["attend", "masked_sdpa", "MAX_KERNEL_ROWS", "QUERY_CHUNK"]

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


def _exact_parts(store) -> tuple:
    """(keys, values): the store's exact sinks and window, each a tuple of the [B, H_kv, n, D] parts it holds."""
    return (tuple(x for x in (store.sink_k, store.keys) if x is not None),
            tuple(x for x in (store.sink_v, store.values) if x is not None))


def _check_mask(store, attention_mask) -> None:
    if attention_mask is None:  # (a decode step's usual case: nothing to compare, no lengths read)
        return
    total = store.seq_length()
    if attention_mask.shape[-1] != total:
        raise RuntimeError(f"attention mask covers {attention_mask.shape[-1]} keys but layer {store.layer_idx} holds "
                           f"{total}; was this cache used by another model?")


def attend(store, query: torch.Tensor, attention_mask, scaling: float, softcap=None) -> torch.Tensor:
    """query: [B, H_q, t, D]; mask [B, 1|H, t, L] (additive float or bool) -> [B, t, H_q, D] in query's dtype.

    With value smoothing the store holds ``v - mu_v``; ``mu_v`` is added back here, after any path.  A store whose
    KV heads are coded in groups of their own widths (``store.groups``) is attended group by group, each group's
    query heads over that group's view (:class:`qjl.cache.storage.HeadGroupView`)."""
    _check_mask(store, attention_mask)
    if attention_mask is not None and attention_mask.device.type == "cpu" and plainly_visible(
            attention_mask, attention_mask.shape[-1]):
        attention_mask = None  # every row sees every key (a decode step's mask): the same attention without it
    if store.groups is not None:
        return _attend_groups(store, query, attention_mask, scaling, softcap)
    b, hq, t, d = query.shape
    hkv = store.heads
    g = hq // hkv
    if t == 1 and attention_mask is None and softcap is None and store.backend == "cpu" and store.kernel_ok:
        out = _attend_cpu_call(store, query, scaling)  # (value mean added, in query's dtype)
        if out is not None:
            return out
    out = None
    if store.kernel_ok and softcap is None and store.n_codes and g * t <= MAX_KERNEL_ROWS:
        qg = query.float().reshape(b, hkv, g * t, d)  # query head h reads KV head h // g
        out = _attend_kernel(store, qg, attention_mask, scaling, hq, t)
    if out is None and store.backend != "torch" and softcap is None:
        out = _attend_sdpa(store, query, attention_mask, scaling)
    if out is None:
        out = _attend_reference(store, query, attention_mask, scaling, softcap)
    if store.mu_v is not None:  # [B, H_kv, D_v] -> query head h reads KV head h // g
        dv = store.mu_v.shape[-1]
        out = (out.reshape(b, t, hkv, g, dv) + store.mu_v[:, None, :, None, :]).reshape(b, t, hq, dv)
    return out.to(query.dtype)


def _attend_groups(store, query: torch.Tensor, attention_mask, scaling: float, softcap) -> torch.Tensor:
    """:func:`attend` of a store coded in head groups: query heads ``h * g .. (h + 1) * g`` read KV head h, so each
    group's query heads attend over the group alone -> [B, t, H_q, D_v] in query's dtype."""
    b, hq, t, _ = query.shape
    g = hq // store.heads
    if t == 1 and attention_mask is None and softcap is None and store.backend == "cpu" and query.dtype in _KERNEL_DTYPES:
        out = _attend_cpu_heads(store, query, scaling)  # (every run in one C call)
        if out is not None:
            return out
    out = None
    for view in store.head_views():
        rows = slice(view.head_slice.start * g, view.head_slice.stop * g)
        mask = attention_mask
        if mask is not None and mask.shape[1] != 1:  # [B, H_q, t, L]: the group's query heads
            mask = mask[:, rows]
        o = attend(view, query[:, rows], mask, scaling, softcap)
        if out is None:
            out = o.new_empty(b, t, hq, o.shape[-1])
        out[:, :, rows] = o
    return out


def _attend_reference(store, query, attention_mask, scaling, softcap) -> torch.Tensor:
    """The codecs' own estimators, part by part, in float32 -> [B, t, H_q, D]."""
    b, hq, t, d = query.shape
    hkv = store.keys.shape[1]
    g = hq // hkv
    exact_k = [k.float() for k in (store.sink_k, store.keys) if k is not None]
    deq = None
    if store.key_codes is not None and store.config.score_path == "dequantize":
        deq = store.key_codec.dequantize(store.key_codes)
    coded_v = None if store.value_codes is None else store.value_codec.dequantize(store.value_codes)
    values = _joined(store.sink_v, coded_v, store.values)
    outs = []
    for s0 in range(0, t, QUERY_CHUNK):  # bounded logits: [B, H_q, <= QUERY_CHUNK, L] at a time
        s1 = min(t, s0 + QUERY_CHUNK)
        qc = query[:, :, s0:s1].float().reshape(b, hkv, g * (s1 - s0), d)
        parts = [torch.matmul(qc, exact_k[0].transpose(-1, -2))] if store.sink_k is not None else []
        if store.key_codes is not None:
            parts.append(store.key_codec.inner_product(qc, store.key_codes) if deq is None
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
    return out.transpose(1, 2)


def _attend_sdpa(store, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
    """Prefill and chunks outside the kernels: torch SDPA over sinks + dequantized codes + window
    (the same scores as the codecs' inner products up to float error) -> [B, t, H_q, D] float32."""
    coded = store.key_codes is not None
    k = _joined(store.sink_k, store.key_codec.dequantize(store.key_codes) if coded else None, store.keys)
    v = _joined(store.sink_v, store.value_codec.dequantize(store.value_codes) if coded else None, store.values)
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    return masked_sdpa(query.float(), k, v, mask, scaling).transpose(1, 2)


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """torch SDPA of q [B, H_q, t, D] over k/v [B, H_kv, L, D] (H_kv dividing H_q) under ``mask`` -> [B, H_q, t, D].

    4-d always (torch runs 3-d inputs through its unfused math path on the CPU).  On CUDA with GQA the K/V are
    repeated per query head: its fused kernels take no ``enable_gqa`` with a mask, and the math fallback would hold
    [B, H_q, t, L] float32 logits (17 GB for a 4k chunk over 32k tokens); K/V once per query head costs far less."""
    g = q.shape[1] // k.shape[1]
    if q.is_cuda and g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _attend_kernel(store, qg: torch.Tensor, attention_mask, scaling: float, hq: int, t: int):
    """Codes through the paged decode core (one block per sequence), sinks + window exactly, in one
    call: -> [B, t, H_q, D] float32, or None when the mask over the codes differs between rows or heads."""
    b, hkv, rows, d = qg.shape
    n_sink, n_codes = store.n_sink, store.n_codes
    # sinks and window as two segments, read in place in their dtype by the CPU kernel (no copy per call)
    keys, values = _exact_parts(store)
    ne = sum(x.shape[-2] for x in keys)
    bias = bias_x = None
    if attention_mask is not None:
        mask = _additive(attention_mask)  # [B, 1|H_q, t, L]
        codes = mask[..., n_sink:n_sink + n_codes]
        if mask.shape[1] != 1 or (t > 1 and not bool((codes == codes[:, :, :1]).all())):
            return None
        bias = codes[:, 0, 0]  # [B, N]: the same for every head and row
        mx = torch.cat([mask[..., :n_sink], mask[..., n_sink + n_codes:]], dim=-1)  # [B, 1, t, n_x]
        # row g * t + i of KV head h is query head h * g + g' at new token i: broadcast over heads (and the group)
        bias_x = mx if t == 1 else mx.unsqueeze(2).expand(b, 1, hq // hkv, t, ne).reshape(b, 1, rows, ne)
    key_fields, value_fields, capacity = store.kernel_fields()
    if bias is None and bias_x is None and store.backend == "cpu":  # no mask: the step's arguments kept
        from qjl.kernels.cpu.launch import paged_decode_step

        step = _cpu_step(key_fields, b, n_codes, max(capacity, 1), len(keys))
        out = paged_decode_step(qg, store.key_codec, key_fields, store.value_codec, value_fields, step,
                                segments=tuple(zip(keys, values)), q_scale=scaling)  # (scaled in the call)
        return out.reshape(b, hq, t, d).transpose(1, 2)
    block_table, start, end = _kept_ranges(key_fields, b, n_codes, qg.device)
    out = kernels.paged_decode(qg * scaling, store.key_codec, key_fields, store.value_codec, value_fields,
                               block_table, max(capacity, 1), start, end, exact=(keys, values, bias_x),
                               code_bias=bias, backend=store.backend, max_codes=n_codes)
    return out.reshape(b, hq, t, d).transpose(1, 2)


def _attend_cpu_call(store, query: torch.Tensor, scaling: float):
    """A decode step (one new token per sequence, no mask) through the layer's kept
    :class:`qjl.kernels.cpu.launch.DecodeCall` (one C call: codes, sinks and window, the value mean added, the output
    in query's dtype) -> [B, 1, H_q, D], or None where it does not serve the layer (no codes yet, value and key
    dims that differ, a query not fp32/fp16/bf16, a key codec with per-block query maps, a value mean not held as
    contiguous float32)."""
    b, hq, _, d = query.shape
    n_codes, hkv, mu_v = store.n_codes, store.heads, store.mu_v
    if (not n_codes or store.value_dim != d or query.dtype not in _KERNEL_DTYPES
            or (mu_v is not None and (mu_v.dtype != torch.float32 or not mu_v.is_contiguous()))):
        return None
    g = hq // hkv
    q = query.reshape(b, hkv, g, d).contiguous()  # query head h reads KV head h // g
    keys, values = _exact_parts(store)
    key_fields, value_fields, capacity = store.kernel_fields()
    kc, vc = store.key_codec, store.value_codec
    params = (b, hkv, g, d, q.dtype, n_codes, capacity, len(keys), id(value_fields), id(kc), id(vc), id(mu_v))

    def build():  # (the call holds every object whose id is in params: no id is reused while it is kept)
        from qjl.kernels.cpu.launch import DecodeCall

        step = _cpu_step(key_fields, b, n_codes, max(capacity, 1), len(keys))
        return DecodeCall(q, kc, key_fields, vc, value_fields, step, mean=mu_v)

    call = _kept(key_fields, "attend_call", params, build)
    if not call.served:
        return None
    out = torch.empty(b, 1, hq, d, dtype=query.dtype)
    call(q, tuple(zip(keys, values)), q_scale=scaling, out=out.view(b, hkv, g, d))
    return out


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _attend_cpu_heads(store, query: torch.Tensor, scaling: float):
    """A decode step (one new token per sequence, no mask) of a store coded in runs of KV heads, every run in one C
    call (:class:`qjl.kernels.cpu.launch.DecodeHeads`, kept in the first run's key fields' memo until a flush):
    :func:`_attend_cpu_call` of each run, written into one output -> [B, 1, H_q, D], or None where a run is not
    served by it (the runs then attend one by one)."""
    b, hq, _, d = query.shape
    views, n_codes, hkv, mu_v = store.head_views(), store.n_codes, store.heads, store.mu_v
    if (not n_codes or store.value_dim != d or not all(v.kernel_ok for v in views)
            or (mu_v is not None and (mu_v.dtype != torch.float32 or not mu_v.is_contiguous()))):
        return None
    g = hq // hkv
    q = query.reshape(b, hkv, g, d).contiguous()  # query head h reads KV head h // g
    fields = [v.kernel_fields() for v in views]
    sinks = store.sink_k is not None
    segments = 1 + sinks
    params = (b, hkv, g, d, q.dtype, n_codes, segments, id(mu_v),
              tuple((cap, id(vf), id(v.key_codec), id(v.value_codec)) for v, (_, vf, cap) in zip(views, fields)))

    def build():  # (the call holds every object whose id is in params: no id is reused while it is kept)
        from qjl.kernels.cpu.launch import DecodeCall, DecodeHeads

        calls = []
        for v, (kf, vf, cap) in zip(views, fields):
            rows = slice(v.head_slice.start, v.head_slice.stop)
            step = _cpu_step(kf, b, n_codes, max(cap, 1), segments)
            calls.append(DecodeCall(q[:, rows].contiguous(), v.key_codec, kf, v.value_codec, vf, step))
        return DecodeHeads(calls, mean=mu_v)

    call = _kept(fields[0][0], "attend_heads", params, build)
    if not call.served:
        return None
    keys, values = _exact_parts(store)
    out = torch.empty(b, 1, hq, d, dtype=query.dtype)
    call(q, tuple(zip(keys, values)), q_scale=scaling, out=out.view(b, hkv, g, d))
    return out


def _ranges(b: int, n_codes: int, dev) -> tuple:
    """(block_table [B, 1], start [B], end [B]) int32 of codes [0, n_codes) in one block per sequence, built where
    the kernel reads them (no host-to-device copies per layer and step)."""
    return (torch.arange(b, dtype=torch.int32, device=dev)[:, None], torch.zeros(b, dtype=torch.int32, device=dev),
            torch.full((b,), n_codes, dtype=torch.int32, device=dev))


def _kept(key_fields, name: str, params: tuple, build):
    """``build()``, kept in the key fields' memo under ``name`` until ``params`` change (one entry each: a flush,
    which changes the codes' count, replaces it)."""
    hit = key_fields.memo.get(name)
    if hit is None or hit[0] != params:
        hit = key_fields.memo[name] = (params, build())
    return hit[1]


def _kept_ranges(key_fields, b: int, n_codes: int, dev) -> tuple:
    """:func:`_ranges`, kept between steps (no tensor built per layer and step: on a GPU each would be a launch)."""
    return _kept(key_fields, "attend_ranges", (b, n_codes, dev), lambda: _ranges(b, n_codes, dev))


def _cpu_step(key_fields, b: int, n_codes: int, block_size: int, segments: int):
    """The C kernel's :class:`qjl.kernels.cpu.launch.DecodeStep` of codes [0, n_codes) in one block per sequence,
    kept between steps."""
    from qjl.kernels.cpu.launch import DecodeStep

    def build():
        table, start, end = _ranges(b, n_codes, torch.device("cpu"))
        return DecodeStep(table, block_size, start, end, segments=segments)

    return _kept(key_fields, "attend_step", (b, n_codes, block_size, segments), build)
