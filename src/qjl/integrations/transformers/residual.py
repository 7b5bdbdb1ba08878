"""What ``QJLConfig.auto`` needs of the model beyond the attention call: the residual stream a layer's error lands in.

An attention layer's output error ``delta o_h`` (query head h, [D]) enters the residual stream through the output
projection, ``delta h = sum_h W_o^(h) delta o_h``, and what the model downstream sees of it is its size relative to
the residual stream there (the next normalization divides by the stream's RMS).  So the allocation weighs each
layer's predicted attention-output error by ``gain_h / E||h_l||^2``
(:class:`qjl.cache.allocation.AutoBits` ``residual_weights``):

* ``gain_h = ||W_o^(h)||_F^2 / D`` -- the mean squared gain of the output projection's columns of query head h (for
  an error spread evenly over the head's D coordinates, ``E||W_o^(h) e||^2 = gain_h E||e||^2``);
* ``E||h_l||^2`` -- the mean squared norm of the residual stream entering decoder layer l, over the positions of the
  prompt's last queries (the ones the proxy measures).

:func:`install` hooks every decoder layer once per model (:func:`qjl.patch_attention` calls it): a pre-hook keeps a
reference to the layer's input hidden states while the layer runs, a post-hook drops it, so nothing is computed or
held beyond the running layer.  :func:`residual_terms` reads them in that layer's attention call.  A model whose
decoder layers cannot be found (no child ``self_attn`` with a ``layer_idx``) or whose attention has no ``o_proj``
gets None: its allocation stays unweighted (``memory_report()`` says which).
"""

from __future__ import annotations

import torch

__all__ = ["install", "holding", "residual_terms", "output_gain"]

_FLAG = "_qjl_residual_slot"  # the hook slot, on the model and on each hooked attention module


def _decoder_layers(model) -> list:
    """[(layer_idx, decoder layer module)] for the modules whose child ``self_attn`` carries a ``layer_idx``."""
    found = []
    for module in model.modules():
        attn = getattr(module, "self_attn", None)
        idx = getattr(attn, "layer_idx", None)
        if isinstance(attn, torch.nn.Module) and isinstance(idx, int):
            found.append((idx, module))
    return found


def install(model) -> bool:
    """Hook ``model``'s decoder layers so that a layer's attention call can read the residual stream entering it
    (once per model; later calls do nothing).  -> whether the decoder layers were found."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    slot = getattr(model, _FLAG, None)
    if slot is not None:
        return bool(slot["layers"])
    layers = _decoder_layers(model)
    slot = {"layers": len(layers), "current": None}

    def enter(idx):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs.get("hidden_states")
            slot["current"] = (idx, h) if isinstance(h, torch.Tensor) else None
        return hook

    def leave(module, args, kwargs, output):
        slot["current"] = None

    for idx, module in layers:
        module.register_forward_pre_hook(enter(idx), with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True, always_call=True)  # (also when the layer raises)
        setattr(module.self_attn, _FLAG, slot)  # (read by residual_terms from the attention module)
    setattr(model, _FLAG, slot)
    return bool(layers)


def holding(model) -> bool:
    """Whether ``model``'s hooks hold a decoder layer's input now (only while that layer runs)."""
    slot = getattr(model, _FLAG, None)
    return slot is not None and slot["current"] is not None


def output_gain(module, heads: int, head_dim: int) -> torch.Tensor | None:
    """``[heads]`` float64 (summed from float32 column norms): ``||W_o^(h)||_F^2 / head_dim`` of the attention ``module``'s ``o_proj`` (columns of query
    head h), or None where there is no such projection of ``heads * head_dim`` inputs."""
    for name, v in (("heads", heads), ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    proj = getattr(module, "o_proj", None)
    w = getattr(proj, "weight", None)
    if not isinstance(w, torch.Tensor):
        return None
    w = w.to_local() if hasattr(w, "to_local") else w  # (a tensor-parallel shard: this rank's heads' columns)
    if w.ndim != 2 or w.shape[1] != heads * head_dim:
        return None
    cols = torch.linalg.vector_norm(w.detach(), dim=0, dtype=torch.float32)  # (no float64 copy of a large matrix)
    return cols.double().square().view(heads, head_dim).sum(-1) / head_dim


def residual_terms(module, query: torch.Tensor, rows: int) -> tuple | None:
    """``(gain [H_q], energy)`` for the attention ``module`` now running with ``query`` [B, H_q, t, D]: the output
    projection's per-head gain (:func:`output_gain`) and ``E||h||^2`` of the residual stream entering its decoder
    layer over its last ``rows`` positions (batch rows and positions averaged); None where either is unknown (no
    hooks, another layer's input held, no ``o_proj``, a zero or non-finite stream)."""
    if not isinstance(query, torch.Tensor) or query.ndim != 4:
        raise ValueError(f"query must be a tensor [B, H_q, t, D], got {tuple(getattr(query, 'shape', ())) or query!r}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an int >= 1, got {rows!r}")
    slot = getattr(module, _FLAG, None)
    current = None if slot is None else slot["current"]
    if current is None or current[0] != getattr(module, "layer_idx", None):
        return None
    h = current[1]
    if h.ndim != 3 or h.shape[1] < 1:
        return None
    gain = output_gain(module, query.shape[1], query.shape[-1])
    if gain is None:
        return None
    energy = float(torch.linalg.vector_norm(h[:, -rows:], dim=-1, dtype=torch.float32).double().square().mean())
    if not (energy > 0 and energy < float("inf")):
        return None
    return gain.to(query.device), energy
