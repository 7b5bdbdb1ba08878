"""Save and load an :class:`~qjl.search.index.Index`: one ``torch.save`` file of tensors and plain values.

The codec is not pickled: it is rebuilt from the config (its rotation, sketch and codebook are
seeded, hence identical in every process) and checked against a fingerprint saved with the
codes (the codebook and the first rows of the rotation applied to a fixed probe), so a file is
never read with a codec that would decode it differently.  Files are written to a temporary
name and renamed, and read with ``weights_only=True`` (no code runs on load).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from .index import Index, IndexConfig

__all__ = ["save_index", "load_index", "FORMAT"]

FORMAT = "qjl.search.Index/2"  # 2: a centered inner-product index stores <c, x> (cdots); /1 files are refused
_FIELDS = ("codes", "factors", "norms", "cdots", "ids", "vectors", "centroids", "offsets", "center_vec")


def _fingerprint(index: Index) -> torch.Tensor:
    probe = torch.linspace(-1, 1, index.config.dim).unsqueeze(0)
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(4, index.config.dim, generator=gen)
    codes, factors = index.codec.encode(x)
    return torch.cat([codes.float().flatten(), factors.float().flatten(), probe.flatten()[:1]])


def save_index(index: Index, path) -> None:
    path = Path(path)
    state = {"format": FORMAT, "config": dataclasses.asdict(index.config), "next_id": index.next_id,
             "train_seconds": index.train_seconds, "fingerprint": _fingerprint(index)}
    state.update({name: getattr(index, name) for name in _FIELDS})
    state["codes"] = index.row_codes()  # rows on disk, whatever the layout in memory
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def load_index(path) -> Index:
    state = torch.load(Path(path), weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} file")
    index = Index(IndexConfig(**state["config"]))
    if not torch.equal(_fingerprint(index), state["fingerprint"]):
        raise ValueError(f"{path} was written by a codec that encodes differently from this version's")
    n = state["ids"].numel()
    if state["codes"].shape != (n, index.codec.stride) or state["factors"].shape != (index.codec.nseg, n):
        raise ValueError(f"{path} is corrupt: codes {tuple(state['codes'].shape)}, factors "
                         f"{tuple(state['factors'].shape)} for {n} ids")
    for name in Index.OPTIONAL_ROWS:
        held, stored = getattr(index, name), state.get(name)
        if (held is None) != (stored is None) or (stored is not None and stored.shape[0] != n):
            raise ValueError(f"{path} is corrupt: {name} does not match its config and {n} ids")
    for name in _FIELDS:
        if name != "codes":
            setattr(index, name, state[name])
    index.set_row_codes(state["codes"])
    index.next_id, index.train_seconds = state["next_id"], state["train_seconds"]
    return index
