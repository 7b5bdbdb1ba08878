"""What a layer store accepts, checked before anything changes (issue #11).

Every check raises ``TypeError``/``ValueError`` naming the argument, what is allowed and what was
received.  ``check_values`` also refuses vectors the store could not hold later: a key or value whose
norm the codec's norm dtype cannot represent (e.g. the 5x preset's fp8 value norms, max 448) is refused
when it arrives, with the option to change -- never accepted into the window to fail at a later flush.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_shapes", "check_values", "check_crop", "check_index"]


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [B, H_kv, t, D], got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor (fp16/bf16/fp32), got {x.dtype}")
    if x.ndim != 4:
        raise ValueError(f"{name} must be [B, H_kv, t, D] (4 dimensions), got shape {tuple(x.shape)}")


def check_shapes(store, keys, values) -> None:
    """Types, ranks, matching [B, H_kv, t] of keys and values, and the store's sizes once it has tokens."""
    _check_tensor("key_states", keys)
    _check_tensor("value_states", values)
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"key_states and value_states must have the same [B, H_kv, t]: got {tuple(keys.shape)} "
                         f"({keys.shape[2]} key tokens) and {tuple(values.shape)} ({values.shape[2]} value tokens)")
    if keys.device != values.device:
        raise ValueError(f"key_states and value_states must be on one device, got {keys.device} and {values.device}")
    if store.is_initialized:
        want = (store.batch, store.heads, store.key_dim, store.value_dim)
        got = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
        if got != want:
            raise ValueError(f"layer {store.layer_idx} holds B={want[0]}, H_kv={want[1]}, key dim {want[2]}, value "
                             f"dim {want[3]}; got key_states {tuple(keys.shape)}, value_states {tuple(values.shape)}")
        if keys.device != store.device:
            raise ValueError(f"layer {store.layer_idx} is on {store.device}, got key_states on {keys.device}")


def _first_bad(x: torch.Tensor) -> str:
    b, h, t, _ = (int(i) for i in (~torch.isfinite(x)).nonzero()[0])
    return f"batch {b}, head {h}, token {t}"


def _codecs(store, role: str) -> list:
    """[(codec, KV heads it codes)] of one role: the layer's codec, each head group's, or every candidate."""
    every = slice(None)
    if store.key_codec is not None:
        return [(store.key_codec if role == "key" else store.value_codec, every)]
    if store.groups is not None:
        return [(g.key_codec if role == "key" else g.value_codec, g.heads) for g in store.groups]
    cands = getattr(store, "candidates", None)  # widths still to be chosen: every candidate must hold it
    return [(c, every) for c in (cands[0] if role == "key" else cands[1])] if cands else []


def _largest(*xs) -> list:
    """The largest |entry| of each tensor (0.0 for an empty one, NaN/inf where it holds one), read back in one
    transfer: on a GPU one synchronization per call rather than one per tensor."""
    tops = [x.abs().amax().float() if x.numel() else None for x in xs]
    live = [t for t in tops if t is not None]
    got = iter(torch.stack(live).tolist() if live else [])
    return [0.0 if t is None else next(got) for t in tops]


def check_values(store, keys, values) -> None:
    """Finite values that the exact dtype and the codecs (norms, scales) can store.  One reduction per tensor in the
    common case (decode steps call this per layer): the largest |entry| of what is stored answers finiteness (a NaN
    or inf propagates into it), the exact dtype's range, and every norm at once (``||x|| <= sqrt(D) max|x|``); the
    exact checks run only where that bound does not settle them."""
    k = store.stored_keys(keys)
    v = store.stored_values(values)
    big = dict(zip(("key_states", "value_states"), _largest(k, v)))
    for name, raw in (("key_states", keys), ("value_states", values)):
        if not math.isfinite(big[name]) and not bool(torch.isfinite(raw).all()):
            raise ValueError(f"{name} contain NaN or Inf (first at {_first_bad(raw)}); the cache refuses them "
                             "rather than store them (check the model's dtype for overflow)")
    top = torch.finfo(store.exact_dtype).max
    for name in ("key_states", "value_states"):
        if big[name] > top:  # inf too (finite inputs whose stored form overflowed)
            raise ValueError(f"{name} hold a value {big[name]:.4g} beyond the exact window's dtype "
                             f"{store.exact_dtype} (max {top:g}); use QJLConfig(exact_dtype='fp32') or None (the "
                             "model's dtype)")
    for role, x, name in (("key", k, "key_states"), ("value", v, "value_states")):
        bound = big[name] * math.sqrt(x.shape[-1])  # no vector's norm exceeds it
        for codec, heads in _codecs(store, role):
            limit = codec.norm_limit()
            if limit is not None and bound <= limit:
                continue
            fit = store.key_fit if role == "key" and store.key_fit is not None else ()
            try:
                codec.check_storable(x[:, heads], f"{role}_states", *fit)
            except ValueError as e:
                raise ValueError(f"layer {store.layer_idx}, {e}: QJLConfig({role}=CodecSpec(..., {{'norm_dtype': "
                                 f"'fp16'}})), or a preset without fp8 norms") from None


def check_crop(store, n) -> None:
    """``n`` tokens can be dropped from the end of this layer (whole codes, not into a padded batch's sinks)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"crop takes an int number of tokens, got {type(n).__name__} {n!r}")
    held = store.seq_length()
    if n < 0 or n > held:
        raise ValueError(f"cannot crop {n} tokens from layer {store.layer_idx} holding {held} (0..{held} allowed)")
    into_codes = n - store.n_window
    if into_codes > 0 and store.key_codec is not None:
        unit = store.key_codec.tokens_per_code
        c = min(into_codes, store.n_codes)
        if c % unit:
            raise ValueError(f"cannot crop {n} tokens from layer {store.layer_idx}: {c} of them are codes of "
                             f"{unit} tokens each ({store.key_codec!r}); crop a multiple of {unit} from the codes "
                             f"(the window holds {store.n_window})")
    width = store.order_width()
    if width and held - n < width:
        raise ValueError(f"cannot crop layer {store.layer_idx} of a left-padded batch (or one holding heavy tokens) "
                         f"below its first {width} tokens (the slots reordered for sinks, padding "
                         "and heavy tokens); reset the cache instead")


def check_index(store, index) -> torch.Tensor:
    """A 1-D integer index of batch rows, each in [0, B)."""
    if not isinstance(index, torch.Tensor):
        index = torch.as_tensor(index)
    if index.dtype.is_floating_point or index.dtype == torch.bool or index.ndim != 1:
        raise ValueError(f"index must be a 1-D integer tensor of batch rows, got {index.dtype} shape "
                         f"{tuple(index.shape)}")
    if store.is_initialized and index.numel() and (int(index.min()) < 0 or int(index.max()) >= store.batch):
        raise ValueError(f"index values must lie in [0, {store.batch}) (the batch size), got "
                         f"{int(index.min())}..{int(index.max())}")
    return index.long()
