"""Key smoothing in vLLM's pages: each sequence's key mean, kept in its block 0 (no vLLM import).

As :mod:`qjl.cache.smoothing` does for transformers' cache: every key of a sequence is replaced by
``k - mu`` before anything is stored or attended (codes, exact copies, the current tokens), with ``mu``
[H_kv, D] the mean of that sequence's keys in its first step (its prompt's first chunk).  Softmax does not
change when every score of a query shifts by the same ``q . mu``, so this is exact before quantization; the
codecs then see keys without the large component they share.

Where ``mu`` lives: the layout's per-block field ``smooth.key`` (:class:`.layout.PageLayout`), of which a
sequence uses its block 0's.  The step that writes a sequence's position 0 computes ``mu`` and stores it
there (rounded to the field's dtype; what is stored is what every later step reads back, so one sequence
uses one ``mu`` throughout).  A request that reuses block 0 through vLLM's prefix cache reads the ``mu``
that its codes were written with.  Sliding-window layers keep no ``mu`` (vLLM frees the blocks that leave
the window): they are not smoothed.

Value smoothing (:func:`smooth_values`, :func:`add_value_mean`), as :mod:`qjl.cache.smoothing` does it: every
value of a sequence becomes ``v - mu_v`` before anything is stored or attended, and ``mu_v`` is added back to
the attention output, which is exact for any softmax (its weights sum to 1).  ``mu_v`` [H_kv, D] is the mean of
the first step's values weighted by the attention that step's last :data:`VALUE_MEAN_ROWS` queries (and the GQA
group of each KV head) pay them, over the tokens after the sinks and before the exact window
(:func:`qjl.cache.smoothing.attention_weighted_mean`; the plain mean measured worse there), kept in ``smooth.value``
of block 0 like ``mu``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...cache.smoothing import VALUE_MEAN_ROWS, attention_weighted_mean
from .step import StepPlan

__all__ = ["MIN_TOKENS", "smooth_keys", "first_step_weights", "smooth_values", "add_value_mean"]

MIN_TOKENS = 16  # a first step with fewer tokens stores mu = 0 (the mean of a few keys is a poor centre)


class _Step(NamedTuple):
    """A step's indices for the means, once per step: each sequence's first block [B] and zeros [B] (its slot),
    token -> sequence [T] (None when token i is sequence i), the sequences whose position 0 is in this step as
    (sequence, first row, end row), and the step's token count."""

    blocks: torch.Tensor
    zeros: torch.Tensor
    seq_of: torch.Tensor | None
    starts: list
    tokens: int


def _step(plan: StepPlan, device) -> _Step:
    hit = plan.memo.get("smooth")
    if hit is None:
        qsl, lens = plan.query_start_loc, plan.seq_lens
        b = len(lens)
        qlen = qsl[1:] - qsl[:-1]
        first = ((lens == qlen) & (qlen > 0)).nonzero().flatten().tolist()  # all its tokens are in this step
        starts = [(i, int(qsl[i]), int(qsl[i + 1])) for i in first]
        seq_of = None if bool((qlen == 1).all()) else plan.token_seqs.to(device)
        blocks = plan.block_table[:b, 0].long().to(device)
        hit = plan.memo["smooth"] = _Step(blocks, torch.zeros_like(blocks), seq_of, starts, int(qsl[-1]))
    return hit


def _checked(fields: dict, field: str, option: str, plan: StepPlan, tensors: dict) -> tuple:
    """The mean's field and the step's (memoized) indices, after checking ``fields`` holds ``field`` and that every
    one of ``tensors`` (name -> tensor) is a float tensor, the last one [T, H_kv, D] -> (field, step tuple)."""
    f = fields.get(field) if hasattr(fields, "get") else None
    if f is None:
        raise ValueError(f"fields: no {field!r} field (pages of a layout built with {option}=True)")
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a float tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    name, x = list(tensors.items())[-1]
    step = _step(plan, x.device)
    t = step.tokens
    if x.ndim != 3 or x.shape[0] != t or x.shape[2:] != f.shape:
        raise ValueError(f"{name} must be [{t}, H_kv, {f.shape[0]}] (the step's tokens), got {tuple(x.shape)}")
    return f, step


def _keep_and_read(f, tag: str, plan: StepPlan, step: _Step, means: list, h: int, device) -> torch.Tensor:
    """Store each (sequence, mean [H, D]) of ``means`` in its block 0's field ``f`` (named ``tag``), then read every sequence's
    back -> per token [T, H, D] (per sequence where every token is its own sequence), as stored (its dtype)."""
    blocks, zeros, seq_of = step.blocks, step.zeros, step.seq_of
    if means:  # (only in a sequence's first step: nothing is built per decode step)
        heads = torch.arange(h, device=device)
        for i, mu in means:
            f.scatter(blocks[i], heads, zeros[i], mu)
    mu = f.read(plan.addresses(tag, f, h, blocks, zeros))  # [B, H, D] in the field's dtype
    return mu if seq_of is None else mu.index_select(0, seq_of)


def smooth_keys(fields: dict, plan: StepPlan, key: torch.Tensor) -> torch.Tensor:
    """The step's keys [T, H_kv, D] (padding removed) -> ``key - mu[sequence]`` float32, storing ``mu`` for the
    sequences that start in this step (see the module docstring).  ``fields`` must hold ``smooth.key``."""
    f, step = _checked(fields, "smooth.key", "smooth_keys", plan, {"key": key})
    means = []
    for i, r0, r1 in step.starts:  # every mean checked before any is stored
        x = key[r0:r1].float()
        mu = x.mean(0) if r1 - r0 >= MIN_TOKENS else torch.zeros_like(x[0])
        if not bool(torch.isfinite(mu).all()):
            raise ValueError(f"key: sequence {i}'s first keys are not finite; its key mean cannot be kept")
        means.append((i, mu))
    mu = _keep_and_read(f, "smooth.key", plan, step, means, key.shape[1], key.device)
    return key.to(torch.float32, copy=True).sub_(mu)  # (a copy: the caller's keys are left as they are)


def first_step_weights(query: torch.Tensor, key: torch.Tensor, scale: float,
                       rows: int = VALUE_MEAN_ROWS) -> torch.Tensor:
    """The attention a sequence's first step pays its tokens -> w [H_kv, n] float32: query [n, H_q, D] and key
    [n, H_kv, D] of the step; its last ``rows`` queries attend causally (scores scaled by ``scale``), and each
    token's softmax weight is averaged over those rows and the GQA group of its KV head, as
    :func:`qjl.cache.smoothing.attention_weights` computes it.  The scores are computed in the query's dtype
    (the model's, bf16 in vLLM: about 3.6x faster than float32 for 8k tokens in a scratch timing on the Zen 4; the
    weights only choose the centre that is subtracted, which is exact whatever it is) and the softmax in float32, without the full [n, n] mask."""
    for name, x in (("query", query), ("key", key)):
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.ndim != 3 or not x.shape[0]:
            raise ValueError(f"{name} must be a float tensor [n >= 1, heads, D], got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    n, hq, d = query.shape
    h = key.shape[1]
    if key.shape[0] != n or key.shape[2] != d or hq % h:
        raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)}: the same tokens and "
                         "head size, and KV heads dividing the query heads")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive int, got {rows!r}")
    g, r = hq // h, min(rows, n)
    q = query[n - r:].permute(1, 0, 2).reshape(h, g * r, d)  # [H, g r, D]: heads of a group
    k = key.to(query.dtype).permute(1, 2, 0)  # [H, D, n]
    logits = torch.bmm(q, k).float().mul_(scale)  # [H, g r, n]
    tail = torch.ones(r, r, dtype=torch.bool, device=query.device).triu(1)  # row i sees keys up to n - r + i
    logits[:, :, n - r:].masked_fill_(tail.repeat(g, 1), float("-inf"))
    logits.sub_(logits.amax(-1, keepdim=True)).exp_()
    inv = logits.sum(-1).reciprocal_()  # [H, g r]
    return torch.bmm(inv.unsqueeze(1), logits).squeeze(1).div_(g * r)


def smooth_values(fields: dict, plan: StepPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scale: float) -> tuple:
    """The step's values [T, H_kv, D] -> (``value - mu_v[sequence]`` float32, ``mu_v`` per token [T, H_kv, D]
    as stored (the exact dtype), to give :func:`add_value_mean`), storing ``mu_v`` for the sequences that start in this step (module
    docstring).  query [T, H_q, D] and key [T, H_kv, D] (as attended: smoothed keys give the same weights) weigh
    the first step's values; ``scale``: the attention's.  ``fields`` must hold ``smooth.value``."""
    f, step = _checked(fields, "smooth.value", "smooth_values", plan, {"query": query, "key": key, "value": value})
    t, h = step.tokens, value.shape[1]
    if key.shape != value.shape:
        raise ValueError(f"key must have the values' shape {tuple(value.shape)}, got {tuple(key.shape)}")
    if query.ndim != 3 or query.shape[0] != t or query.shape[2] != key.shape[2] or query.shape[1] % h:
        raise ValueError(f"query must be [{t}, a multiple of {h} heads, {key.shape[2]}], got {tuple(query.shape)}")
    means = []
    for i, r0, r1 in step.starts:  # every mean checked before any is stored
        if r1 - r0 < MIN_TOKENS:
            mu = torch.zeros(h, f.shape[0], dtype=torch.float32, device=value.device)
        else:
            w = first_step_weights(query[r0:r1], key[r0:r1], scale)
            mu = attention_weighted_mean(value[r0:r1].transpose(0, 1)[None], skip_first=plan.sinks,
                                         skip_last=plan.window, weights=w[None])[0]
        if not bool(torch.isfinite(mu).all()):
            raise ValueError(f"value: sequence {i}'s first values (or their attention) are not finite; its "
                             "value mean cannot be kept")
        means.append((i, mu))
    mu = _keep_and_read(f, "smooth.value", plan, step, means, h, value.device)
    return value.to(torch.float32, copy=True).sub_(mu), mu


def add_value_mean(out: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """out [T, H_q, D] float32 (attention over smoothed values) += mu [T, H_kv, D] (any float dtype) of each query
    head's KV head (head ``j`` reads KV head ``j // (H_q / H_kv)``), in place, in float32; returns ``out``."""
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.ndim != 3:
        raise TypeError(f"out must be a float32 tensor [T, H_q, D], got {getattr(out, 'dtype', type(out).__name__)} "
                        f"{tuple(getattr(out, 'shape', ()))}")
    t, hq, d = out.shape
    if mu.ndim != 3 or mu.shape[0] != t or mu.shape[2] != d or hq % mu.shape[1]:
        raise ValueError(f"mu must be [{t}, H_kv dividing {hq}, {d}], got {tuple(mu.shape)}")
    h = mu.shape[1]
    out.view(t, h, hq // h, d).add_(mu.unsqueeze(2))
    return out
