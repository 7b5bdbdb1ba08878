"""Constant tensors (codebooks, rotations, sketches, packing tables) on the data's device, copied there once.

A codec builds its constants on the CPU; on a GPU every call would otherwise copy them host-to-device again
(a synchronizing copy per constant, per layer, per decode step).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["on_device"]

_COPIES: dict = {}  # (id(constant), device) -> (weak reference to the constant, its copy on the device)


def on_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``: ``t`` itself when it is there already, else one copy per (tensor, device), kept for
    as long as ``t`` lives.  Only for tensors that are never modified in place (codec constants)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if t.device == device:
        return t
    key = (id(t), str(device))
    hit = _COPIES.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]
    copy = t.to(device)
    _COPIES[key] = (weakref.ref(t), copy)
    weakref.finalize(t, _COPIES.pop, key, None)
    return copy
