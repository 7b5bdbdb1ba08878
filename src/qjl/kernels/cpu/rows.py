"""Launcher of the CPU rows (``rows.c``): the stored vectors of one sequence's tokens read through its
block-table row (:func:`value_rows`), and the same formula in plain torch (:func:`value_rows_reference`)."""

from __future__ import annotations

import torch

from .binding import X_DTYPES, Args, check_groups, fill_view, i32, require

__all__ = ["value_rows", "value_rows_reference"]


def _rows_args(codec, fields: dict, block_row, block_size: int, heads: int, start: int, end: int,
               unmix: bool = False):
    """:func:`value_rows`' arguments checked (ValueError naming the argument) -> the codec's mix view."""
    from qjl.kernels.paged import mix_view

    view = mix_view(codec)
    if view is None:
        raise ValueError(f"codec {type(codec).__name__} declares no mix view: its codes are not read as vectors")
    if view.cycles > 1 and not unmix:
        raise ValueError(f"codec {codec!r} codes vectors over {view.cycles} rotations in turn (MixView.cycles): its "
                         "rows have no one basis to be read in; read them mapped back (value_rows(..., unmix=True))")
    if not isinstance(block_row, torch.Tensor) or block_row.ndim != 1 or block_row.dtype.is_floating_point:
        raise ValueError(f"block_row must be a 1-d int tensor, got {getattr(block_row, 'shape', block_row)!r}")
    for name, x in (("block_size", block_size), ("heads", heads), ("start", start), ("end", end)):
        if isinstance(x, bool) or not isinstance(x, int) or x < (1 if name in ("block_size", "heads") else 0):
            raise ValueError(f"{name} must be a {'positive' if name in ('block_size', 'heads') else 'non-negative'} "
                             f"int, got {x!r}")
    if block_row.numel() and not -2**31 <= int(block_row.min()) <= int(block_row.max()) < 2**31:
        raise ValueError("block_row: block indices must fit int32 (as vLLM's block tables hold them)")
    if end < start or end > block_row.shape[0] * block_size:
        raise ValueError(f"start={start}, end={end}: need start <= end <= {block_row.shape[0] * block_size} (the "
                         f"tokens block_row maps)")
    return view


def value_rows_reference(codec, fields: dict, block_row, block_size: int, heads: int, start: int,
                         end: int) -> torch.Tensor:
    """:func:`value_rows` in plain torch: the codec's :class:`qjl.codecs.views.MixView` formula over the fields'
    entries gathered through ``block_row`` -> [end - start, heads, n] float32 (the codec's basis; ValueError for a
    codec over rotations in turn, ``MixView.cycles > 1``, whose rows are in one basis per code position)."""
    from qjl.core.packing import unpack_bits

    view, row = _rows_args(codec, fields, block_row, block_size, heads, start, end), block_row.long()
    t = torch.arange(start, end)
    blocks, slots, hs = row[t // block_size][:, None], (t % block_size)[:, None], torch.arange(heads)[None, :]
    n, gs = view.codes.length, view.group_size
    cent = view.codes.values(unpack_bits(fields[view.codes.field].gather(blocks, hs, slots),
                                         view.codes.bits, n))  # [L, H, n]
    group = torch.arange(n) // gs

    def per_coordinate(name):  # [L, H] or [L, H, groups] -> [L, H, n]
        x = fields[name].gather(blocks, hs, slots).float()
        return x.unsqueeze(-1) if x.ndim == 2 else x[..., group]

    out = per_coordinate(view.scale) * cent
    return out if view.zero is None else per_coordinate(view.zero) + out


def value_rows(codec, fields: dict, block_row, block_size: int, heads: int, start: int, end: int,
               threads: int | None = None, *, unmix: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """The stored vectors of tokens [start, end) of one sequence, read through its block-table row ``block_row``
    ([max_blocks] int) from paged ``fields`` (:class:`qjl.kernels.paged.PagedField` by name; the codec's
    :class:`qjl.codecs.views.MixView` says which), every head -> [end - start, heads, n] in the codec's basis, equal
    bit for bit to :func:`value_rows_reference` (one C call, ``rows.c``); with ``unmix``, mapped back by the codec's
    unmix matrix (:func:`qjl.kernels.paged.unmix_matrix`: TurboQuant's inverse rotation) row by row inside the call,
    [end - start, heads, dim], the reference's rows times that matrix within float32 rounding (fused
    multiply-adds, summed in order); a vector codebook's codes (``PackedCodes.group`` g > 1,
    :class:`qjl.codecs.vq.TurboQuantVQ`) are read as :meth:`qjl.codecs.views.PackedCodes.values` reads them (each
    group's g fields one joint code e, coordinate c ``centroids[e g + c % g]``), bit for bit too; for a codec over K
    rotations in turn (``MixView.cycles``, TurboQuant's
    ``cycles=K``) the row of code position t times the matrix's rows ``[k n, (k + 1) n)``, k = t % K (such rows are
    read with ``unmix`` only: ValueError without).  ``out``: None (a new float32 tensor), or an fp32 / fp16 / bf16
    CPU tensor of that shape whose last dimension is contiguous (e.g. a slice of a larger buffer), written in place
    (rounded as ``.to()`` rounds) and returned.  ``threads``: torch's by default.  ValueError naming the argument
    for a codec without a mix view, a bad ``out``, fields outside their buffers or a block outside them."""
    from qjl.kernels.paged import mix_room, unmix_matrix

    view = _rows_args(codec, fields, block_row, block_size, heads, start, end, unmix)
    check_groups(f"codec {codec!r}", (view.codes,))
    mod = require()
    top, name = mix_room(codec, fields, heads, block_size, torch.device("cpu"))
    u = unmix_matrix(codec) if unmix else None
    shape = (end - start, heads, view.codes.length if u is None else u.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype not in X_DTYPES
          or out.device.type != "cpu" or (out.numel() and out.stride(2) != 1)):
        raise ValueError(f"out must be None or an fp32/fp16/bf16 CPU tensor {list(shape)} with a contiguous last "
                         f"dimension, got {getattr(out, 'dtype', type(out).__name__)} "
                         f"{tuple(getattr(out, 'shape', ()))}")
    if end == start:
        return out
    a = Args(mod.ffi)
    vv = mod.ffi.new("qjl_value_view *")
    fill_view(a, vv, view, fields)
    if u is not None:
        vv.unmix, vv.out_dim = a.ptr(u), u.shape[1]
    r32 = i32(block_row)  # (an int32 row is passed as it is)
    es = out.element_size()
    rc = mod.lib.qjl_value_rows(vv, a.ptr(r32, "int32_t *"), r32.numel(), block_size, heads, start, end,
                                int(min(top, 2**62)), a.ptr(out, "uint8_t *"), X_DTYPES[out.dtype],
                                out.stride(0) * es, out.stride(1) * es,
                                torch.get_num_threads() if threads is None else threads)
    if rc == -4:
        raise ValueError("block_row: the blocks holding tokens [start, end) must be >= 0")
    if rc == -5:
        raise ValueError(f"{name}: block_row reaches past the end of its buffer (blocks up to {top} fit)")
    if rc:
        raise ValueError(f"value_rows: the C kernel refused its arguments or had no memory for its buffers "
                         f"(code {rc})")
    return out
