"""Writing tokens into vLLM's pages: codes for every token, exact copies for sinks and windows (no vLLM import).

Field addressing is :mod:`.paged`'s contract; the page layout is :mod:`.layout`'s.
"""

from __future__ import annotations

import torch

from ...codecs.base import Codes
from .layout import PageLayout, exact_slot

__all__ = ["write_codes", "write_exact"]


def _role(fields: dict, role: str) -> dict:
    p = role + "."
    return {n[len(p):]: f for n, f in fields.items() if n.startswith(p)}


def _quantize_keys(codec, k: torch.Tensor, blocks, offs, key_fields: dict) -> Codes:
    """k: [N, H, D] of tokens at (blocks, offs) -> Codes lead [N, H]; per-block outlier channels
    (QJL) are chosen from the tokens written first into a block and stored in it."""
    if "outlier_idx" not in key_fields:
        return codec.quantize(k.float())
    h = k.shape[1]
    heads = torch.arange(h)
    out = []
    for blk in torch.unique(blocks).tolist():
        sel = (blocks == blk).nonzero().flatten()
        kb = k[sel].float().transpose(0, 1)  # [H, n, D]
        field = key_fields["outlier_idx"]
        if bool((offs[sel] == 0).any()):  # the block starts in this write: choose its channels now
            idx = codec.select_outliers(kb)
            field.scatter(torch.tensor(blk), heads, torch.tensor(0), idx)
        else:
            idx = field.gather(torch.tensor(blk), heads, torch.tensor(0))
        c = codec.quantize(kb, idx.long())
        out.append((sel, c))
    fields = {n: torch.empty(k.shape[0], h, *t.shape[2:], dtype=t.dtype) for n, t in out[0][1].fields.items()}
    for sel, c in out:
        for n, t in c.fields.items():
            fields[n][sel] = t.transpose(0, 1)
    return Codes((k.shape[0], h), fields)


def write_codes(layout: PageLayout, fields: dict, key: torch.Tensor, value: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """Quantize key/value [N, H_kv, D] and store the codes at ``slot_mapping`` [N] (block * block_size +
    offset; negative slots are padding and skipped)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if slot_mapping.numel() == 0:
        return
    slots = slot_mapping.long().cpu() if key.device.type == "cpu" else slot_mapping.long()
    blocks, offs = slots // layout.block_size, slots % layout.block_size
    heads = torch.arange(key.shape[1], device=key.device)
    kf, vf = _role(fields, "key"), _role(fields, "value")
    kc = _quantize_keys(layout.key_codec, key, blocks, offs, kf)
    vc = layout.value_codec.quantize(value.float())
    for role_fields, codes in ((kf, kc), (vf, vc)):
        for name, t in codes.fields.items():
            role_fields[name].scatter(blocks[:, None], heads[None, :], offs[:, None], t)


def write_exact(layout: PageLayout, fields: dict, key: torch.Tensor, value: torch.Tensor,
                slot_mapping: torch.Tensor, positions: torch.Tensor, seq_ends: torch.Tensor) -> None:
    """Store exact copies of the sinks, of each sequence's last ``window`` tokens and of each block's
    last ``window`` tokens (so a block reused through the prefix cache holds the window a request
    starting right after it reads).

    key/value [N, H_kv, D]; positions [N] absolute token positions; seq_ends [N] the length of
    the token's sequence after this step.  When two tokens of one call map to one slot, the later
    position wins.
    """
    if layout.sinks + layout.window == 0:
        return
    pos = positions.long()
    need = pos < layout.sinks
    if layout.window:
        need |= (pos >= seq_ends.long() - layout.window) | (pos % layout.block_size >= layout.block_size - layout.window)
    need &= slot_mapping >= 0
    if not bool(need.any()):
        return
    slots, pos, k, v = slot_mapping[need].long(), pos[need], key[need], value[need]
    blocks = slots // layout.block_size
    ex = exact_slot(pos, layout.sinks, layout.window)
    cell = blocks * (layout.sinks + layout.window) + ex
    uniq, inv = torch.unique(cell, return_inverse=True)
    latest = torch.full((len(uniq),), -1, dtype=torch.long).scatter_reduce(0, inv, pos, "amax")
    win = pos == latest[inv]
    heads = torch.arange(key.shape[1], device=key.device)
    fe = _role(fields, "exact")
    fe["key"].scatter(blocks[win, None], heads[None, :], ex[win, None], k[win])
    fe["value"].scatter(blocks[win, None], heads[None, :], ex[win, None], v[win])
