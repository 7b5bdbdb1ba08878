"""Hugging Face integration: an attention function that reads the compressed cache.

``patch_attention(model)`` is the one call that switches a transformers model to
the ``"qjl"`` attention implementation.  For layers held by a
:class:`qjl.integrations.transformers.layer.QJLCacheLayer` it attends over sinks + codes + the exact window; for
every other layer (sliding-window layers kept exact, or a plain ``DynamicCache``)
it defers to transformers' SDPA attention, so a patched model still works with
any cache.  Nothing is patched at import time.
"""

from __future__ import annotations

import torch

__all__ = ["patch_attention", "qjl_attention_forward", "ATTN_NAME"]

ATTN_NAME = "qjl"


def qjl_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """query: [B, H_q, t, D]; key/value: [B, H_kv, t', D] -> ([B, t, H_q, D], None)."""
    layer = getattr(key, "_qjl_layer", None)
    if layer is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    del key._qjl_layer
    if dropout and module.training:
        raise ValueError("the qjl attention is for inference: attention dropout must be 0 (call model.eval())")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return layer.attend(query, attention_mask, scaling, kwargs.get("softcap")), None


def patch_attention(model) -> None:
    """Register the "qjl" attention (and its mask) with transformers and switch ``model`` to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    AttentionInterface.register(ATTN_NAME, qjl_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, eager_mask)  # an explicit additive mask, never skipped
    model.set_attn_implementation(ATTN_NAME)
