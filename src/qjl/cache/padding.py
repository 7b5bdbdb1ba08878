"""Left padding: each row's own first tokens as its attention sinks.

In a left-padded batch the first positions of a short row are padding.  A store keeps one slot order
for the whole batch -- ``sink_tokens`` sinks, then codes, then the exact window -- so for a row with
``p`` padding positions the sinks must be positions ``p .. p + S - 1``, not ``0 .. S - 1``.  When the
sinks are formed, the first ``P = S + max(p)`` slots of every row are reordered so that its real first
tokens come first (then its padding, then the rest in order); attention is order-free over keys, so
only the mask has to follow: :func:`remap_mask` reorders its first ``P`` columns the same way.

Padding is read from the attention mask of the first forward: a row's first real token is the first
key column some query of that row may attend to.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["row_starts", "order_width", "sink_order", "to_slots", "remap_mask", "zero_padding", "visible",
           "plainly_visible"]


def visible(mask: torch.Tensor) -> torch.Tensor:
    """A mask [B, 1|H, t, L] (bool: True = attend, or additive float) -> bool [B, 1|H, t, L]."""
    if mask.dtype == torch.bool:
        return mask
    return torch.isfinite(mask) & (mask > torch.finfo(mask.dtype).min / 2)


_STARTS = [None]  # (weakref to the last mask, its in-place version, its row starts)


def row_starts(mask: torch.Tensor | None, batch: int, device) -> torch.Tensor:
    """The first key column each row attends to: [B] int64 (0 without a mask; L for a row that sees nothing).
    Every layer of a prefill asks about the same mask: it is read once per (mask object, in-place version)."""
    if mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    hit = _STARTS[0]
    if hit is None or hit[0]() is not mask or hit[1] != mask._version:
        seen = visible(mask).any(dim=2).any(dim=1)  # [B, L]
        first = seen.int().argmax(dim=-1)
        hit = _STARTS[0] = (weakref.ref(mask), mask._version,
                            torch.where(seen.any(dim=-1), first, torch.full_like(first, seen.shape[-1])))
    return hit[2].clone()


def order_width(starts: torch.Tensor, sinks: int, extra: torch.Tensor | None = None) -> int:
    """``P``, the first slots :func:`sink_order` reorders (they cover each row's sinks, its padding and the last
    ``extra`` position), or 0 when nothing is reordered: no ``extra`` tokens, and no row padded (or no sinks)."""
    k = 0 if extra is None else extra.shape[1]
    pad = int(starts.max()) if starts.numel() else 0
    if k == 0:
        return sinks + pad if sinks and pad else 0
    return max(sinks + pad, int(extra.max()) + 1)


def sink_order(starts: torch.Tensor, sinks: int, extra: torch.Tensor | None = None) -> torch.Tensor | None:
    """Per-row order of the first ``P`` slots (:func:`order_width`): [B, P] positions, or None when nothing is
    reordered.

    starts: [B] each row's first real position; extra: [B, K] integer positions, each after its row's sinks (exact
    tokens chosen elsewhere, :mod:`qjl.cache.storage`), or None.  Slots: the row's ``sinks`` first real tokens, then
    its ``extra`` positions (ascending), then its padding, then every other position in order."""
    if extra is not None and (extra.dim() != 2 or extra.shape[0] != starts.shape[0] or extra.is_floating_point()):
        raise ValueError(f"extra must be an integer tensor [{starts.shape[0]}, K] (one row per sequence), got "
                         f"{extra.dtype} {tuple(extra.shape)}")
    p = order_width(starts, sinks, extra)
    if p == 0:
        return None
    dev = starts.device
    first = starts.long().unsqueeze(1) + torch.arange(sinks, device=dev)  # [B, S]
    chosen = (first[:, :0] if extra is None else extra.to(dev).long()).sort(dim=1).values  # [B, K]
    taken = torch.zeros(starts.shape[0], p, dtype=torch.bool, device=dev)
    taken.scatter_(1, torch.cat([first, chosen], dim=1), True)
    # the untaken positions in ascending order (padding first, then the rest): a stable sort puts them first
    rest = torch.sort(taken.to(torch.uint8), dim=1, stable=True).indices[:, : p - sinks - chosen.shape[1]]
    return torch.cat([first, chosen, rest], dim=1)


def to_slots(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Tokens ``x: [B, H, n, D]`` in position order -> slot order (the first ``P`` reordered per row)."""
    if order is None:
        return x
    p = order.shape[1]
    idx = order.to(x.device, torch.long)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
    return torch.cat([x[:, :, :p].gather(2, idx), x[:, :, p:]], dim=2)


def zero_padding(block: torch.Tensor, pads: torch.Tensor) -> torch.Tensor:
    """The block right after the sinks ``[B, H, n, D]`` with each row's first ``pads[b]`` tokens (its
    padding, in slot order) zeroed."""
    keep = torch.arange(block.shape[2], device=block.device).unsqueeze(0) >= pads.to(block.device).unsqueeze(1)
    return block * keep[:, None, :, None].to(block.dtype)


def remap_mask(mask: torch.Tensor | None, order: torch.Tensor | None) -> torch.Tensor | None:
    """Reorder the first ``P`` key columns of ``mask: [B, 1|H, t, L]`` by ``order: [B, P]`` (slot -> position)."""
    if mask is None or order is None:
        return mask
    p = order.shape[1]
    idx = order.to(mask.device, torch.long)[:, None, None, :].expand(mask.shape[0], mask.shape[1], mask.shape[2], p)
    return torch.cat([mask[..., :p].gather(-1, idx), mask[..., p:]], dim=-1)


_VISIBLE = [None]  # (weakref to the last mask, its in-place version, its first hidden column)


def plainly_visible(mask: torch.Tensor, width: int) -> bool:
    """Every row sees the mask's first ``width`` columns (bool True / additive 0).  Every layer of a step asks about
    the same mask tensor (with its own width): the first column hidden from some row is found once per (mask
    object, in-place version), so a GPU synchronizes once per step, not once per layer."""
    hit = _VISIBLE[0]
    if hit is None or hit[0]() is not mask or hit[1] != mask._version:
        hidden = (~mask if mask.dtype == torch.bool else mask != 0).reshape(-1, mask.shape[-1]).any(0).to(torch.int32)
        first, some = torch.stack([hidden.argmax(), hidden.amax()]).tolist() if hidden.numel() else (0, 0)
        hit = _VISIBLE[0] = (weakref.ref(mask), mask._version, first if some else mask.shape[-1])
    return width <= hit[2]
