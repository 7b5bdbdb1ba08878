"""A layer store's contents as plain tensors, for byte-for-byte comparisons in tests."""

import torch


def state(store) -> dict:
    """Everything a store holds, as plain tensors and ints (for byte-for-byte comparisons)."""
    out = {"len": store.seq_length(), "init": store.is_initialized}
    if not store.is_initialized:
        return out
    for name in ("keys", "values", "sink_k", "sink_v", "mu", "row_start"):
        t = getattr(store, name)
        out[name] = None if t is None else t.clone()
    for name in ("key_codes", "value_codes"):
        c = getattr(store, name)
        out[name] = None if c is None else {k: v.clone() for k, v in (*c.fields.items(), *c.shared.items())}
    return out


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype ==
                                                                          torch.float8_e4m3fn else a,
                                                                          b.view(torch.uint8) if b.dtype ==
                                                                          torch.float8_e4m3fn else b)
    return a == b
