"""Writing tokens into vLLM's pages: codes for every token, exact copies for sinks and windows (no vLLM import).

Field addressing is :mod:`.paged`'s contract; the page layout is :mod:`.layout`'s; which tokens go where in
a step is the :class:`.step.StepPlan`'s (computed once per step).
"""

from __future__ import annotations

import torch

from ...codecs.base import Codes
from ...kernels.paged import FieldMap, fit_field, role_fields
from .layout import PageLayout, exact_slot, window_start

__all__ = ["write_codes", "c_store_jobs", "exact_writes", "write_exact"]


def _write_positions(plan, n: int) -> torch.Tensor:
    """The step plan's positions of its ``n`` written tokens (what codes over rotations in turn depend on), or
    ValueError (before anything is stored) where there is no plan to give them."""
    if plan is None or plan.write_positions is None or len(plan.write_positions) != n:
        raise ValueError(f"codecs over rotations in turn code tokens by their positions: the write needs the step's "
                         f"plan (its positions of the {n} tokens); nothing stored")
    return plan.write_positions


def _codes(codec, x: torch.Tensor, plan=None) -> Codes:
    """x [N, H, D] -> codec.quantize(x)'s codes, through the fastest quantizer for x's device (C on CPU
    tensors, Triton on CUDA; bit-exact with the codec's own).  A codec over rotations in turn (``positional``:
    TurboQuant's ``cycles``) codes each token by its position in its sequence, which the step's ``plan`` gives
    (:meth:`.step.StepPlan.position_groups`; token at position p as ``codec.quantize(x, start=p)`` codes it)."""
    from ... import kernels

    backend = kernels.pick_backend(x.device)
    if not getattr(codec, "positional", False):
        return kernels.quantize_with(backend, codec, x.float())
    _write_positions(plan, x.shape[0])
    n, h = x.shape[:2]
    fields = None
    for k, sel in plan.position_groups(codec.cycles, x.device):
        c = kernels.quantize_with(backend, codec, x[sel].float().reshape(-1, 1, x.shape[-1]), start=k)  # position k
        if fields is None:
            fields = {name: torch.empty(n, h, *t.shape[2:], dtype=t.dtype, device=x.device)
                      for name, t in c.fields.items()}
        for name, t in c.fields.items():
            fields[name][sel] = t.reshape(len(sel), h, *t.shape[2:])
    return Codes((n, h), fields)


def _cpu_stored(codec) -> bool:
    """The C encoder stores this role's codes straight into its fields (TurboQuant MSE and its vector codebooks, over
    one rotation or several in turn; no per-block fit: :func:`qjl.kernels.encode.store_cpu`)."""
    from ... import kernels

    return kernels.can_store_cpu(codec)  # (no per-block fit: its codecs have no single CPU pass)


def _quantize_keys(codec, k: torch.Tensor, blocks, offs, key_fields: dict) -> Codes:
    """k: [N, H, D] of tokens at (blocks, offs) -> Codes lead [N, H]; a per-block fit (QJL's outlier channels, a split
    codec's chosen channels: ``fit_field``) is chosen from the tokens written first into a block and stored in it."""
    name = fit_field(codec)
    if name is None:
        return _codes(codec, k)
    h, dev = k.shape[1], k.device
    heads = torch.arange(h, device=dev)
    out = []
    for blk in torch.unique(blocks).tolist():
        sel = (blocks == blk).nonzero().flatten()
        kb = k[sel].float().transpose(0, 1)  # [H, n, D]
        field = key_fields[name]
        if bool((offs[sel] == 0).any()):  # the block starts in this write: choose its channels now
            idx, = codec.fit(kb)
            field.scatter(torch.tensor(blk, device=dev), heads, torch.tensor(0, device=dev), idx)
        else:
            idx = field.gather(torch.tensor(blk, device=dev), heads, torch.tensor(0, device=dev))
        c = codec.quantize(kb, idx.long())
        out.append((sel, c))
    fields = {n: torch.empty(k.shape[0], h, *t.shape[2:], dtype=t.dtype, device=dev)
              for n, t in out[0][1].fields.items()}
    for sel, c in out:
        for n, t in c.fields.items():
            fields[n][sel] = t.transpose(0, 1)
    return Codes((k.shape[0], h), fields)


def _roles(layout: PageLayout, fields, key: torch.Tensor, value: torch.Tensor) -> list:
    """[(role, codec, role's fields, x, (codes field, norm field) where the C encoder stores x, else None)], the
    fields' part worked out once per layout and device where ``fields`` is a :class:`FieldMap`."""
    from ... import kernels

    memo_key = ("roles", id(layout), key.device.type, value.device.type)
    memo = fields.memo if isinstance(fields, FieldMap) else {}
    hit = memo.get(memo_key)
    if hit is None or hit[0] is not layout:
        parts = []
        for role, codec, x in (("key", layout.key_codec, key), ("value", layout.value_codec, value)):
            fmap = role_fields(fields, role)
            stored = None
            if x.device.type == "cpu" and _cpu_stored(codec):
                p = kernels.cpu_pass(codec)
                stored = (fmap[p.codes], fmap[p.norm])
            parts.append((role, codec, fmap, stored))
        hit = memo[memo_key] = (layout, parts)  # (the layout kept: its id stays its own)
    return [(role, codec, fmap, x, stored) for (role, codec, fmap, stored), x in zip(hit[1], (key, value))]


def c_store_jobs(layout: PageLayout, fields, key: torch.Tensor, value: torch.Tensor) -> list | None:
    """[(codec, x, codes field, norm field)] of the key and the value role where the C encoder stores both
    (:func:`qjl.kernels.encode.store_cpu`'s jobs, as :func:`write_codes` passes them), else None."""
    jobs = [(codec, x, *stored) for _, codec, _, x, stored in _roles(layout, fields, key, value) if stored is not None]
    return jobs if len(jobs) == 2 else None


def write_codes(layout: PageLayout, fields: dict, key: torch.Tensor, value: torch.Tensor,
                slot_mapping: torch.Tensor | None, plan=None) -> None:
    """Quantize key/value [N, H_kv, D] and store the codes at ``slot_mapping`` [N] (block * block_size +
    offset; negative slots are padding and skipped), or where the step's :class:`.step.StepPlan` ``plan``
    says (its byte addresses are reused by every layer of the same layout).  Values over rotations in turn (their
    codes depend on the token's position) need ``plan``: ValueError without, before anything is stored."""
    if plan is not None:
        if plan.write_rows is not None:
            rows = plan.write_rows.to(key.device)
            key, value = key[rows], value[rows]
        blocks, offs = plan.write_blocks, plan.write_offsets
    else:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        slots = slot_mapping.long().cpu() if key.device.type == "cpu" else slot_mapping.long()
        blocks, offs = slots // layout.block_size, slots % layout.block_size
    if key.shape[0] == 0:
        return
    from ... import kernels

    h = key.shape[1]
    c_jobs, torch_roles = [], []
    for role, codec, fmap, x, stored in _roles(layout, fields, key, value):
        if stored is not None:
            c_jobs.append((codec, x, *stored))
        else:
            torch_roles.append((role, codec, fmap, x))
    # every role encoded before any is stored (nothing half-written on bad input): the torch roles' Codes first,
    # then the C roles in one call that checks all of them before it stores anything
    encoded = [(role, fmap, _quantize_keys(codec, x, blocks, offs, fmap) if role == "key" else
                _codes(codec, x, plan))
               for role, codec, fmap, x in torch_roles]
    if c_jobs:  # the positions' checks: once per step when a plan is shared by the layers
        positions = (_write_positions(plan, key.shape[0])
                     if any(getattr(codec, "positional", False) for codec, *_ in c_jobs) else None)
        kernels.store_cpu(c_jobs, blocks, offs, plan.store_bounds() if plan is not None else None,
                          memo=fields.memo if isinstance(fields, FieldMap) else None, positions=positions)
    for role, fmap, enc in encoded:
        for name, t in enc.fields.items():
            f = fmap[name]
            if plan is not None:
                f.write(plan.addresses(f"codes.{role}.{name}", f, h, blocks, offs), t)
            else:
                f.scatter(blocks[:, None], torch.arange(h, device=blocks.device)[None, :], offs[:, None], t)


def exact_writes(positions, seq_ends, slots, block_size: int, sinks: int, window: int):
    """(rows, blocks, exact slots) [M] of the tokens whose exact copies are stored: the sinks, each
    sequence's exact window (:func:`.layout.window_start`) and each block's last ring of tokens (``window`` in
    block 0, ``sinks + window`` later: so a block reused through the prefix cache holds the window a request
    starting right after it reads).  positions, seq_ends (the sequence's length after the step) and slots [N] per
    token; when two tokens of one step map to one cell, the later position wins."""
    empty = torch.empty(0, dtype=torch.long)
    if sinks + window == 0:
        return empty, empty, empty
    ring = torch.where(positions < block_size, window, sinks + window)  # ring slots of each token's block
    need = (positions < sinks) | ((positions >= sinks) & (
        (positions >= window_start(seq_ends, sinks, window, block_size=block_size))
        | (positions % block_size >= block_size - ring)))
    need &= slots >= 0
    rows = need.nonzero().flatten()
    if not len(rows):
        return empty, empty, empty
    pos, blocks = positions[rows], slots[rows] // block_size
    ex = exact_slot(pos, sinks, window, block_size=block_size)
    cell = blocks * (sinks + window) + ex
    uniq, inv = torch.unique(cell, return_inverse=True)
    latest = torch.full((len(uniq),), -1, dtype=torch.long).scatter_reduce(0, inv, pos, "amax")
    win = pos == latest[inv]
    return rows[win], blocks[win], ex[win]


def write_exact(plan, fields: dict, key: torch.Tensor, value: torch.Tensor) -> None:
    """Store the exact copies the step's :class:`.step.StepPlan` selects (:func:`exact_writes`); key/value
    [T, H_kv, D] are the step's tokens."""
    if not len(plan.exact_rows):
        return
    rows = plan.exact_rows.to(key.device)
    for name, x in (("exact.key", key), ("exact.value", value)):
        f = fields[name]
        # (index_select, not x[rows]: advanced indexing opens an OpenMP region; see PagedField.read)
        f.write(plan.addresses(name, f, x.shape[1], plan.exact_blocks, plan.exact_slots), x.index_select(0, rows))
