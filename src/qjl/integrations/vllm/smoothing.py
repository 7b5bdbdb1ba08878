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
"""

from __future__ import annotations

import torch

from .step import StepPlan

__all__ = ["MIN_TOKENS", "smooth_keys"]

MIN_TOKENS = 16  # a first step with fewer tokens stores mu = 0 (the mean of a few keys is a poor centre)


def _step(plan: StepPlan, device) -> tuple:
    """(first blocks [B] and zeros [B] on ``device``, token -> sequence [T] or None when token i is sequence i, and
    the sequences whose position 0 is in this step as (sequence, first row, end row)), once per step."""
    hit = plan.memo.get("smooth")
    if hit is None:
        qsl, lens = plan.query_start_loc, plan.seq_lens
        b = len(lens)
        qlen = qsl[1:] - qsl[:-1]
        first = ((lens == qlen) & (qlen > 0)).nonzero().flatten().tolist()  # all its tokens are in this step
        starts = [(i, int(qsl[i]), int(qsl[i + 1])) for i in first]
        seq_of = None if bool((qlen == 1).all()) else plan.token_seqs.to(device)
        blocks = plan.block_table[:b, 0].long().to(device)
        hit = plan.memo["smooth"] = (blocks, torch.zeros_like(blocks), seq_of, starts, int(qsl[-1]))
    return hit


def smooth_keys(fields: dict, plan: StepPlan, key: torch.Tensor) -> torch.Tensor:
    """The step's keys [T, H_kv, D] (padding removed) -> ``key - mu[sequence]`` float32, storing ``mu`` for the
    sequences that start in this step (see the module docstring).  ``fields`` must hold ``smooth.key``."""
    f = fields.get("smooth.key") if hasattr(fields, "get") else None
    if f is None:
        raise ValueError("fields: no 'smooth.key' field (pages of a layout built with smooth_keys=True)")
    if not isinstance(key, torch.Tensor) or not key.dtype.is_floating_point:
        raise TypeError(f"key must be a float tensor, got {getattr(key, 'dtype', type(key).__name__)}")
    blocks, zeros, seq_of, starts, t = _step(plan, key.device)
    if key.ndim != 3 or key.shape[0] != t or key.shape[2:] != f.shape:
        raise ValueError(f"key must be [{t}, H_kv, {f.shape[0]}] (the step's tokens), got {tuple(key.shape)}")
    h = key.shape[1]
    if starts:
        means = []
        for i, r0, r1 in starts:  # every mean checked before any is stored
            x = key[r0:r1].float()
            mu = x.mean(0) if r1 - r0 >= MIN_TOKENS else torch.zeros_like(x[0])
            if not bool(torch.isfinite(mu).all()):
                raise ValueError(f"key: sequence {i}'s first keys are not finite; its key mean cannot be kept")
            means.append((i, mu))
        heads = torch.arange(h, device=key.device)
        for i, mu in means:
            f.scatter(blocks[i], heads, zeros[i], mu)
    mu = f.read(plan.addresses("smooth.key", f, h, blocks, zeros))  # [B, H, D], as stored
    if seq_of is not None:
        mu = mu.index_select(0, seq_of)
    return key.to(torch.float32, copy=True).sub_(mu)  # (a copy: the caller's keys are left as they are)
