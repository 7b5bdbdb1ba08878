"""The plain-PyTorch reference of every decode kernel, and exact merges of partial softmaxes.

:func:`paged_decode_reference` has the signature of :func:`qjl.kernels.paged.paged_decode` and computes
the same attention one sequence at a time from the codecs' declared views (:mod:`qjl.codecs.views`):

* each key term scores ``norm[t] * <qt, centroids[code[t]]>`` with ``qt = codec.score_queries(q)[i]``;
* values are ``zero + scale * centroids[code]`` in the value codec's basis, mixed by the softmax
  weights (the token at code position t into accumulator ``t % cycles`` of the view) and mapped back once
  per row with ``codec.unmix``;
* exact tokens join the same float32 softmax.

A partial softmax of a key set is ``(m, l, o)``: the row max of the logits, ``l = sum exp(s - m)`` and
``o = sum exp(s - m) v``; :func:`merge_partials` combines partials of disjoint key sets exactly (split-K
blocks of a kernel, or codes with exact tokens).
"""

from __future__ import annotations

import functools

import torch

from qjl.core.packing import unpack_bits

__all__ = ["paged_decode_reference", "encode_reference", "gather_codes", "merge_partials", "merge_stacked_partials",
           "partial_softmax",
           "finite_max"]


def gather_codes(fields: dict, names, block_row: torch.Tensor, block_size: int, h: int, start: int, end: int) -> dict:
    """{name: entries of tokens [start, end) of KV head ``h`` of one sequence, [n, *shape]} (a copy)."""
    pos = torch.arange(start, end, device=block_row.device)
    blocks, slots = block_row.long()[pos // block_size], pos % block_size
    return {n: fields[n].gather(blocks, torch.tensor(h, device=pos.device), slots) for n in names}


def _values(packed, rows: dict) -> torch.Tensor:
    """What packed codes ``rows[packed.field]`` stand for (:meth:`PackedCodes.values`): [n, length] float32."""
    return packed.values(unpack_bits(rows[packed.field], packed.bits, packed.length))


def _shared_rows(fields: dict, names, block_row, h: int, start: int, end: int, block_size: int) -> dict | None:
    """Per-block shared entries (stride_token 0) of the blocks holding tokens [start, end), {name: [n, *shape]}."""
    if not names:
        return None
    pos = torch.arange(start, end, device=block_row.device)
    blocks = block_row.long()[pos // block_size]
    return {n: fields[n].gather(blocks, torch.tensor(h, device=pos.device), torch.zeros_like(blocks)) for n in names}


def _key_logits(q, codec, view, fields, block_row, block_size, h, start, end) -> torch.Tensor:
    """q [R, D] -> logits [R, n] over coded tokens [start, end) of KV head h."""
    rows = gather_codes(fields, {n for t in view.terms for n in (t.codes.field, t.norm)}, block_row, block_size, h,
                        start, end)
    shared = _shared_rows(fields, view.shared, block_row, h, start, end, block_size)
    if shared is None:
        qts = [qt.unsqueeze(0) for qt in codec.score_queries(q.float())]  # [1, R, len]
    else:  # one query map per token's block: q [n, R, D] against shared [n, k]
        qts = codec.score_queries(q.float().unsqueeze(0).expand(end - start, -1, -1), shared)
    s = 0
    for term, qt in zip(view.terms, qts):
        k = _values(term.codes, rows) * rows[term.norm].float().unsqueeze(-1)  # [n, len]
        s = s + (qt * k.unsqueeze(1)).sum(-1).T if qt.shape[0] > 1 else s + qt[0] @ k.T
    return s


def _in_cycles(v: torch.Tensor, cycles: int, start: int) -> torch.Tensor:
    """Rows v [n, length] of code positions start.. -> [n, cycles * length]: row i in the accumulator of position
    ``(start + i) % cycles`` (zeros elsewhere), so that ``p @ result`` mixes each position into its own."""
    if cycles == 1:
        return v
    n, length = v.shape
    out = v.new_zeros(n, cycles, length)
    acc = (torch.arange(start, start + n, device=v.device) % cycles)
    out[torch.arange(n, device=v.device), acc] = v
    return out.reshape(n, cycles * length)


def _mixed_values(view, fields, block_row, block_size, h, start, end) -> torch.Tensor:
    """v [n, cycles * length] float32 in the value codec's basis (:func:`_in_cycles`)."""
    names = {view.codes.field, view.scale} | ({view.zero} if view.zero else set())
    rows = gather_codes(fields, names, block_row, block_size, h, start, end)
    group = torch.arange(view.codes.length, device=block_row.device) // view.group_size
    scale = rows[view.scale].float().reshape(end - start, -1)[:, group]
    v = _values(view.codes, rows) * scale
    if view.zero:
        v = v + rows[view.zero].float().reshape(end - start, -1)[:, group]
    return _in_cycles(v, view.cycles, start)


def paged_decode_reference(q, key_codec, key_fields: dict, value_codec, value_fields: dict, block_table,
                           block_size: int, code_start, code_end, *, exact=None, code_bias=None) -> torch.Tensor:
    """Plain torch, one sequence and KV head at a time; see :func:`qjl.kernels.paged.paged_decode`."""
    from qjl.kernels.paged import check_exact, check_paged, joined_exact

    check_paged(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size, code_start, code_end)
    kview, vview = key_codec.score_view(), value_codec.mix_view()
    exact = joined_exact(check_exact(exact, q))
    b, hkv, r, d = q.shape
    out = torch.empty(b, hkv, r, d, dtype=torch.float32, device=q.device)
    for i in range(b):
        s0, s1 = int(code_start[i]), int(code_end[i])
        for h in range(hkv):
            logits, vals = [], []
            if s1 > s0:
                lg = _key_logits(q[i, h], key_codec, kview, key_fields, block_table[i], block_size, h, s0, s1)
                if code_bias is not None:
                    lg = lg + code_bias[i, s0:s1].float()
                logits.append(lg)
            if exact is not None and exact[0].shape[2]:
                xk, xv, xb = exact
                lx = q[i, h].float() @ xk[i, h].float().T
                logits.append(lx if xb is None else lx + xb.expand(b, hkv, r, -1)[i, h].float())
            if not logits:
                out[i, h] = float("nan")
                continue
            p = torch.softmax(torch.cat(logits, -1), dim=-1)
            o = torch.zeros(r, d, device=q.device)
            n_c = s1 - s0
            if n_c > 0:
                v = _mixed_values(vview, value_fields, block_table[i], block_size, h, s0, s1)
                o = value_codec.unmix(p[:, :n_c] @ v)
            if exact is not None and exact[0].shape[2]:
                o = o + p[:, n_c:] @ exact[1][i, h].float()
            out[i, h] = o
    return out


def finite_max(m: torch.Tensor) -> torch.Tensor:
    """m with -inf replaced by 0 (a row whose logits are all -inf contributes exp(-inf - 0) = 0)."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def partial_softmax(s: torch.Tensor, v: torch.Tensor):
    """logits s [..., R, n], values v [..., n, D] -> (m [..., R], l [..., R], o [..., R, D])."""
    m = s.amax(dim=-1)
    p = torch.exp(s - finite_max(m).unsqueeze(-1))
    return m, p.sum(dim=-1), torch.matmul(p, v.float())


def merge_partials(partials):
    """Combine partial softmaxes [(m, l, o), ...] of disjoint key sets -> (m, l, o) at their common max.

    All tensors share shapes (m, l: [...], o: [..., n]); a part whose logits were all -inf (m = -inf, l = 0)
    contributes nothing (its weight exp(-inf - m) is 0)."""
    m = functools.reduce(torch.maximum, [p[0] for p in partials])
    safe = finite_max(m)
    l_tot, o_tot = 0, 0
    for pm, pl, po in partials:
        w = torch.exp(pm - safe)
        l_tot = l_tot + w * pl
        o_tot = o_tot + w.unsqueeze(-1) * po
    return m, l_tot, o_tot


def merge_stacked_partials(m: torch.Tensor, l: torch.Tensor, o: torch.Tensor, dim: int = 1):
    """:func:`merge_partials` of parts stacked along ``dim`` (m, l: [..., S, ...], o: m's shape + [n]) in a
    fixed number of tensor operations, whatever the number of parts S (a kernel's split-K partials)."""
    mx = m.amax(dim=dim)
    w = torch.exp(m - finite_max(mx).unsqueeze(dim))
    return mx, (w * l).sum(dim=dim), (w.unsqueeze(-1) * o).sum(dim=dim)


def encode_reference(codec, x: torch.Tensor, positions: torch.Tensor | None = None):
    """The plain-torch mirror of the C encoder (:func:`qjl.kernels.encode.store_cpu`, ``quantize.c``'s
    ``encode_row``), op for op in the same order, so its codes and stored norms are the C encoder's bit for bit:
    ``ss = sum_j x_j^2`` in float64 over j in order, ``norm = float32(sqrt(ss))``, ``u = x / (norm if norm > 0 else
    1)``, ``y_k = sum_j u_j M[k, j]`` in float32 over j in order (products and sums rounded apart; M the vector's
    rotation: ``rotations[position % K]`` for a pass over K rotations in turn), cells as ``torch.bucketize``
    (``codec.cells``) with ``cos = sum_k y_k cent[cell_k]``, or for a vector codebook each group's nearest codeword
    (:func:`qjl.core.vq_codebook.nearest_reference`) with ``cos = sum_k y_k table[e, k % g]``, in float32 over k in
    order; ``cos = max(cos, cos_floor)``; the stored norm ``norm / cos`` (where positive) with ``correct_norm``, in
    the norm's dtype.

    x: [..., dim] float; ``positions``: int, broadcastable to x's lead shape (each vector's position in its
    sequence; needed for rotations in turn) -> :class:`qjl.Codes` (``codes`` [..., nbytes] uint8, ``norm`` [...]) of
    ``codec`` (a codec the C encoder stores: :func:`qjl.kernels.encode.can_store_cpu`).  Slow (loops over the
    dimensions): for tests.
    """
    from qjl.codecs.base import Codes
    from qjl.core.lloyd_max import bucket
    from qjl.core.packing import pack_bits
    from qjl.core.validation import check_fits, check_vectors
    from qjl.core.vq_codebook import codeword_norms, nearest_reference, split_codes
    from qjl.kernels.encode import cpu_pass, pass_matrices_t

    p = cpu_pass(codec)
    if p is None:
        raise TypeError(f"codec: the C encoder covers rotate-and-quantize codecs (TurboQuantMSE, TurboQuantVQ), got "
                        f"{type(codec).__name__}")
    check_vectors("x", x, codec.dim)
    if p.cycles > 1 and positions is None:
        raise ValueError(f"positions: {codec!r} codes vectors over rotations in turn by their positions")
    xf = x.float()
    ss = torch.zeros(xf.shape[:-1], dtype=torch.float64)
    for j in range(xf.shape[-1]):
        ss = ss + xf[..., j].double() * xf[..., j].double()
    norm = ss.sqrt().float()
    u = xf / torch.where(norm > 0, norm, torch.ones_like(norm)).unsqueeze(-1)
    mt = pass_matrices_t(p)  # [dim, n] or [K, dim, n]
    if p.cycles > 1:  # each vector's own rotation: [..., dim, n]
        mt = mt[torch.broadcast_to(torch.as_tensor(positions).long(), xf.shape[:-1]) % p.cycles]
    n = mt.shape[-1]
    y = torch.zeros(*xf.shape[:-1], n)
    for j in range(mt.shape[-2]):
        y = y + u[..., j:j + 1] * mt[..., j, :]
    if p.table is None:
        idx = bucket(y, p.boundaries.float())
        chosen = p.centroids.float()[idx]
    else:
        table = p.table.float()
        g = table.shape[1]
        e = nearest_reference(y.reshape(-1, g), table, codeword_norms(table)).reshape(*y.shape[:-1], n // g)
        chosen = table[e].reshape(y.shape)
        idx = split_codes(e, g, p.bits)
    cos = torch.zeros(xf.shape[:-1])
    for k in range(n):
        cos = cos + y[..., k] * chosen[..., k]
    cos = torch.maximum(cos, torch.tensor(float(p.cos_floor)))
    check_fits("norm of x", norm, p.norm_dtype)
    stored = norm / torch.where(cos > 0, cos, torch.ones_like(cos)) if p.correct_norm else norm
    check_fits("corrected norm of x" if p.correct_norm else "norm of x", stored, p.norm_dtype)
    return Codes(tuple(x.shape[:-1]), {p.codes: pack_bits(idx, p.bits), p.norm: stored.to(p.norm_dtype)})
