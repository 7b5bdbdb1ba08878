"""Key smoothing: subtract a per-channel mean from every stored key.

For a layer and KV head, keys share a large common component (a few channels carry a bias 10-50x the
median in some models).  A data-oblivious codec spreads that offset over every rotated coordinate and
spends its bits on it.  Subtracting the channel mean ``mu`` of the sequence's first keys (its prompt)
removes it, and is exact for attention: every score of a query shifts by the same ``q . mu``, which
softmax ignores -- provided *every* key the query sees is shifted (sinks, codes, window and the new
tokens alike).  The store does that: it centers keys as they arrive, so every attention path (reference,
SDPA, the kernels) reads smoothed keys without knowing it.

Not exact when the logits are soft-capped (``tanh(s / c) * c`` is not shift-invariant):
:func:`softcap_of` finds such models; :class:`qjl.QJLCache` turns smoothing off there with a warning.
``mu`` is fp32 ``[B, H_kv, D]``, stored exactly and counted in the cache's bytes.
"""

from __future__ import annotations

import torch

__all__ = ["channel_mean", "softcap_of"]


def channel_mean(keys: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
    """keys: [B, H, n, D]; starts: [B] first real token of each row (left padding) -> mu [B, H, D] float32.

    The mean over each row's tokens from ``starts[b]`` on (all ``n`` without ``starts``); a row with no
    real token gets mu = 0.
    """
    b, h, n, d = keys.shape
    out = torch.zeros(b, h, d, dtype=torch.float32, device=keys.device)
    for row in range(b):  # one reduction per row, the same whether or not the row is padded in a batch
        s = 0 if starts is None else int(starts[row])
        if s < n:
            out[row] = keys[row, :, s:].float().mean(dim=1)
    return out


def softcap_of(model_config) -> float | None:
    """The attention logit softcap of a transformers config (Gemma 2 style), or None."""
    text = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    cap = getattr(text, "attn_logit_softcapping", None)
    return float(cap) if cap else None
