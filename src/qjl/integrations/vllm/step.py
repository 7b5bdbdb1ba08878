"""One step of the backend: its indices, computed once for every layer, and a layer's forward (no vLLM import).

vLLM gives every attention layer of a step the same metadata (``query_start_loc``, ``seq_lens``,
``block_table``, ``slot_mapping``).  Everything the backend derives from it -- which rows decode, their
coded ranges and exact slots, where each token's codes and exact copies go -- is the same for all layers,
so :class:`StepPlan` computes it once per step (the backend caches it on the metadata) and each layer only
turns those token indices into byte addresses of its own fields, memoized per field geometry (layers that
share a layout share them).  Per layer and step: quantize and store the new tokens' codes
(:func:`.writes.write_codes`), attend (:func:`forward_batch`: decode rows in one call of the decode
function, prefill / chunk rows through :func:`.paged.paged_attention_reference`), store the exact copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...kernels.paged import role_fields
from .decode import DecodeRows, decode_rows
from .layout import PageLayout
from .paged import check_output, paged_attention_reference, paged_decode_reference
from .writes import exact_writes, write_exact

__all__ = ["StepPlan", "forward_batch", "token_positions"]


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor):
    """(positions [T], seq_ends [T], decode [B]) of a batch: query_start_loc [B + 1], seq_lens [B] (after the step)."""
    qsl = query_start_loc.long().cpu()
    qlen = qsl[1:] - qsl[:-1]
    seq_lens = seq_lens.long().cpu()
    seq_of = torch.repeat_interleave(torch.arange(len(qlen)), qlen)
    row = torch.arange(int(qsl[-1])) - qsl[:-1][seq_of]
    return (seq_lens - qlen)[seq_of] + row, seq_lens[seq_of], qlen == 1


@dataclass
class StepPlan:
    """The token indices of one step (see the module docstring); build with :meth:`build`.

    ``query_start_loc`` [B + 1] and ``seq_lens`` [B] (tokens after the step) on the CPU; ``write_*``: the
    tokens whose codes are stored (rows into the step's tokens, or None for all, and their block / offset);
    ``decode_seqs`` / ``decode_token_rows`` / ``decode_history`` (their tokens before this one) and ``decode``:
    the one-token rows and their :class:`DecodeRows`;
    ``prefill``: (sequence, first row, end row) of the other sequences; ``exact_*``: the tokens whose exact
    copies are stored (rows, block, exact slot); ``token_seqs``: each token's sequence; ``write_positions``: the
    position in its sequence of each token whose codes are stored (CPU; what codes over rotations in turn depend on).
    """

    block_size: int
    sinks: int
    window: int
    sliding_window: int | None
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    write_rows: torch.Tensor | None
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    decode_seqs: torch.Tensor
    decode_token_rows: torch.Tensor
    decode_history: torch.Tensor
    decode: DecodeRows | None
    prefill: list
    exact_rows: torch.Tensor
    exact_blocks: torch.Tensor
    exact_slots: torch.Tensor
    memo: dict = field(default_factory=dict)
    token_seqs: torch.Tensor | None = None  # [T] (CPU): the sequence of each of the step's tokens
    write_positions: torch.Tensor | None = None  # [written tokens] (CPU): their positions in their sequences

    @classmethod
    def build(cls, query_start_loc, seq_lens, block_table, block_size: int, sinks: int, window: int,
              slot_mapping: torch.Tensor | None = None, sliding_window: int | None = None) -> "StepPlan":
        """query_start_loc [B + 1], seq_lens [B] (after the step), block_table [B, max_blocks] (its device is
        the pages'), slot_mapping [>= T] (block * block_size + offset, negative = padding; None: from the
        block table); sliding_window: the layers' window (:class:`.layout.PageLayout`), if any."""
        dev = block_table.device
        qsl, lens = query_start_loc.long().cpu(), seq_lens.long().cpu()
        positions, seq_ends, is_dec = token_positions(qsl, lens)
        t = int(qsl[-1])
        seq_of = torch.repeat_interleave(torch.arange(len(lens)), qsl[1:] - qsl[:-1])
        if slot_mapping is None:
            slots = block_table.long().cpu()[seq_of, positions // block_size] * block_size + positions % block_size
        else:
            slots = slot_mapping[:t].long().cpu()
        keep = slots >= 0
        rows = None if bool(keep.all()) else keep.nonzero().flatten()
        kept = slots if rows is None else slots[rows]
        dec = is_dec.nonzero().flatten()
        history = lens[dec] - 1
        drows = (decode_rows(block_table[dec.to(dev)], history, block_size, sinks, window, sliding_window)
                 if len(dec) else None)
        prefill = [(i, int(qsl[i]), int(qsl[i + 1])) for i in (~is_dec).nonzero().flatten().tolist()
                   if qsl[i + 1] > qsl[i]]
        erows, eblocks, eslots = exact_writes(positions, seq_ends, slots, block_size, sinks, window)
        return cls(block_size, sinks, window, sliding_window, qsl, lens, block_table, rows,
                   (kept // block_size).to(dev),
                   (kept % block_size).to(dev), dec, qsl[dec], history, drows, prefill, erows, eblocks.to(dev),
                   eslots.to(dev), token_seqs=seq_of, write_positions=positions if rows is None else positions[rows])

    def position_groups(self, cycles: int, device) -> list:
        """[(k, rows on ``device``)]: the written tokens (rows into them) whose positions are k mod ``cycles``, for
        codes over rotations in turn; worked out once per step for every layer."""
        key = ("position_groups", cycles, str(device))
        if key not in self.memo:
            turn = self.write_positions % cycles
            self.memo[key] = [(k, (turn == k).nonzero().flatten().to(device)) for k in torch.unique(turn).tolist()]
        return self.memo[key]

    def store_bounds(self) -> tuple:
        """:func:`qjl.kernels.cpu.store.store_bounds` of the step's code writes (``write_blocks``,
        ``write_offsets``), computed once for every layer's store."""
        if "store_bounds" not in self.memo:
            from qjl.kernels.cpu.store import store_bounds

            self.memo["store_bounds"] = store_bounds(self.write_blocks, self.write_offsets)
        return self.memo["store_bounds"]

    def addresses(self, tag: str, f, num_heads: int, blocks, slots) -> torch.Tensor:
        """``f.addresses(blocks[:, None], heads[None, :], slots[:, None])`` [N, H, entry_bytes], memoized by
        ``tag`` and the field's geometry."""
        key = (tag, f.offset, f.stride_block, f.stride_head, f.stride_token, f.entry_bytes, num_heads)
        if key not in self.memo:
            heads = torch.arange(num_heads, device=blocks.device)
            self.memo[key] = f.addresses(blocks[:, None], heads[None, :], slots[:, None])
        return self.memo[key]



def forward_batch(layout: PageLayout, fields: dict, q, k, v, block_table, query_start_loc, seq_lens, scale: float,
                  decode=None, plan: StepPlan | None = None, out: torch.Tensor | None = None,
                  prefill=None) -> torch.Tensor:
    """One attention layer over a mixed batch whose codes are already written (:func:`.writes.write_codes`).

    q [T, H_q, D], k/v [T, H_kv, D] the batch's own tokens; query_start_loc [B + 1] and seq_lens [B]
    (tokens after this step) on the CPU.  One-token rows go through ``decode`` (the paged contract of
    :mod:`.paged`, default :func:`.paged.paged_decode_reference`) in one call, the others through ``prefill``
    (:func:`.paged.paged_attention_reference`'s signature, and the default; the backend passes
    :class:`.prefill.VLLMPrefill` on the CPU); then the exact copies are written.  ``plan``: the step's
    :class:`StepPlan` (built here when None).  Returns [T, H_q, D] float32, or ``out`` (None, or a contiguous
    float tensor of T * H_q * D elements, e.g. vLLM's output buffer) with the result written into it in its dtype.
    """
    decode = paged_decode_reference if decode is None else decode
    prefill = paged_attention_reference if prefill is None else prefill
    if plan is None:
        plan = StepPlan.build(query_start_loc, seq_lens, block_table, layout.block_size, layout.sinks, layout.window,
                              sliding_window=layout.sliding_window)
    if (plan.block_size, plan.sinks, plan.window, plan.sliding_window) != (
            layout.block_size, layout.sinks, layout.window, layout.sliding_window):
        raise ValueError("plan: built for another block size, sinks, window or sliding window than this layout's")
    t, hq, d = q.shape
    target = out
    dst = None if out is None else check_output(out, t, hq, d).view(t, hq, d)
    every = plan.decode is not None and not plan.prefill and len(plan.decode_seqs) == t  # rows 0..T-1 decode
    out = None if every else dst if dst is not None else torch.empty(t, hq, d, dtype=torch.float32, device=q.device)
    if plan.decode is not None:
        ex = (fields["exact.key"], fields["exact.value"]) if layout.sinks + layout.window else None
        rows = None if every else plan.decode_token_rows.to(q.device)
        sel = (lambda x: x) if every else (lambda x: x[rows])  # noqa: E731
        got = decode(sel(q), role_fields(fields, "key"), role_fields(fields, "value"), plan.decode.block_table,
                     plan.decode_history, layout.block_size, key_codec=layout.key_codec,
                     value_codec=layout.value_codec, scale=scale, num_kv_heads=k.shape[1], exact=ex,
                     sinks=layout.sinks, window=layout.window, current=(sel(k), sel(v)), rows=plan.decode,
                     sliding_window=layout.sliding_window, out=dst if every else None)
        if every:
            out = got
        else:
            out[rows] = got.to(out.dtype)  # (index_put converts nothing itself)
    for i, r0, r1 in plan.prefill:  # prefill / chunk rows, one sequence at a time
        out[r0:r1] = prefill(q[r0:r1], k[r0:r1], v[r0:r1], fields, block_table[i:i + 1], torch.tensor([0, r1 - r0]),
                             plan.seq_lens[i:i + 1], layout, scale)
    write_exact(plan, fields, k, v)
    return out if dst is None else target  # (with ``out``: every row written into it)
