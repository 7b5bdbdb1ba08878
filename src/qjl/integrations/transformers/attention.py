"""Hugging Face integration: an attention function that reads the compressed cache.

``patch_attention(model)`` is the one call that switches a transformers model to
the ``"qjl"`` attention implementation.  For layers held by a
:class:`qjl.integrations.transformers.layer.QJLCacheLayer` it attends over sinks + codes + the exact window; for
every other layer (sliding-window layers kept exact, or a plain ``DynamicCache``)
it defers to transformers' SDPA attention, so a patched model still works with
any cache.  Nothing is patched at import time.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["patch_attention", "qjl_attention_forward", "ATTN_NAME", "recording_queries"]

ATTN_NAME = "qjl"
_QUERY_RECORDERS = []  # callbacks (layer_idx, query, attention_mask, scaling, softcap), see recording_queries


@contextmanager
def recording_queries(callback):
    """Within the block, every attention call of a patched model also calls ``callback(layer_idx, query,
    attention_mask, scaling, softcap)`` first (query [B, H_q, t, D]; the mask as the attention receives it), e.g. to
    replay a prefill into another cache (:func:`qjl.integrations.transformers.prefill.record_updates`)."""
    _QUERY_RECORDERS.append(callback)
    try:
        yield
    finally:
        _QUERY_RECORDERS.remove(callback)


def qjl_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """query: [B, H_q, t, D]; key/value: [B, H_kv, t', D] -> ([B, t, H_q, D], None)."""
    for record in _QUERY_RECORDERS:
        record(getattr(module, "layer_idx", None), query, attention_mask,
               query.shape[-1] ** -0.5 if scaling is None else scaling, kwargs.get("softcap"))
    layer = getattr(key, "_qjl_layer", None)
    if layer is None:
        if kwargs.get("softcap") is not None:  # transformers' SDPA refuses softcapping (Gemma 2)
            return _softcapped_attention(query, key, value, attention_mask, scaling, kwargs["softcap"]), None
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    del key._qjl_layer
    if dropout and module.training:
        raise ValueError("the qjl attention is for inference: attention dropout must be 0 (call model.eval())")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return layer.attend(query, attention_mask, scaling, kwargs.get("softcap"), module=module), None


def _softcapped_attention(query, key, value, attention_mask, scaling, softcap) -> torch.Tensor:
    """Plain attention with logit softcapping for layers the cache keeps exact: query [B, H_q, t, D],
    key/value [B, H_kv, L, D], mask [B, 1|H, t, L] -> [B, t, H_q, D]."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    g = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
    logits = torch.tanh(torch.matmul(query.float(), k.float().transpose(-1, -2)) * scaling / softcap) * softcap
    if attention_mask is not None:
        m = attention_mask[..., : k.shape[-2]]
        logits = logits.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else logits + m.float()
    out = torch.matmul(torch.softmax(logits, dim=-1), v.float())
    return out.to(query.dtype).transpose(1, 2).contiguous()


def patch_attention(model) -> None:
    """Register the "qjl" attention (and its mask) with transformers and switch ``model`` to it; hook its decoder
    layers so that ``QJLConfig.auto`` can read the residual stream a layer's error enters
    (:func:`qjl.integrations.transformers.residual.install`: a reference held while the layer runs, nothing
    computed)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    AttentionInterface.register(ATTN_NAME, qjl_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, eager_mask)  # an explicit additive mask, never skipped
    model.set_attn_implementation(ATTN_NAME)
    from qjl.integrations.transformers.residual import install

    install(model)  # (QJLConfig.auto weighs each layer's error by the residual stream it enters)
