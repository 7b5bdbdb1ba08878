"""A layer's decode-only step on the CPU in one C call (no vLLM import).

The backend's general path runs a decode step as separate calls per layer -- key and value smoothing
(:mod:`.smoothing`), the code store (:func:`.writes.write_codes`), the attention (:func:`.step.forward_batch`) and
the value mean added back -- each with its own Python around a short C call; in the engine, where the model's other
work has emptied the caches between two layers, that Python cost about as much as the attention itself.
:func:`fused_decode` makes the same computation one call of a :class:`qjl.kernels.cpu.launch.DecodeStore` kept per
layer (``step.c``): the same arithmetic in the same order, so the pages and the output are equal bit for bit
(``tests/integrations/test_vllm_fused.py``).  It serves the steps where every token is a sequence's next token and
no sequence starts, on CPU tensors, with both roles stored by the C encoder; for any other step it returns None
before doing anything and the backend takes its general path.
"""

from __future__ import annotations

import torch

from ...kernels.paged import FieldMap
from .layout import PageLayout
from .step import StepPlan
from .writes import c_store_jobs

__all__ = ["fused_decode"]

_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _decode_only(plan: StepPlan, t: int) -> bool:
    """Every one of the step's ``t`` tokens is its sequence's next token, none padding, and no sequence starts in
    this step (its key mean would be taken now: the general path), once per step."""
    hit = plan.memo.get("fused")
    if hit is None:
        hit = plan.memo["fused"] = (plan.decode is not None and not plan.prefill and len(plan.decode_seqs) == t
                                    and plan.write_rows is None and bool((plan.seq_lens > 1).all()))
    return hit


def fused_decode(layout: PageLayout, fields, plan: StepPlan, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor | None:
    """The step of one layer through one C call, or None (nothing done) where it does not apply (module docstring).

    query [T, H_q, D], key / value [T, H_kv, D] the step's tokens (unsmoothed, as vLLM gives them); fields: the
    layer's page fields (a :class:`qjl.kernels.paged.FieldMap`); out: a contiguous [T, H_q, D] fp32/fp16/bf16 tensor
    the attention is written into (returned).  Codes and exact copies are stored as the general path stores them.
    """
    t, hq, d = query.shape
    if (query.device.type != "cpu" or not isinstance(fields, FieldMap)
            or out.dtype not in _OUT_DTYPES or not out.is_contiguous() or not _decode_only(plan, t)):
        return None
    memo = fields.memo
    hit = memo.get("fused")  # (layout, the layer's DecodeStore or None where the one call cannot serve it)
    if hit is not None and hit[0] is layout and hit[1] is None:
        return None
    h = key.shape[1]
    ex = (fields["exact.key"], fields["exact.value"]) if layout.sinks + layout.window else None
    step = plan.decode.cpu_step(ex, h, True)  # (the step's ranges, exact rows and bias: once for every layer)
    if hit is None or hit[0] is not layout or not hit[1].unmoved():
        hit = memo["fused"] = (layout, _build(layout, fields, step, ex, query, key, value))
    one = hit[1]
    if one is None:
        return None
    rc, job, _, k, v = one(query.reshape(t, h, hq // h, d), key, value, step, plan.store_bounds(), q_scale=scale,
                           out=out.view(t, h, hq // h, d), checked=True,  # (unmoved: asked just above)
                           positions=plan.write_positions if one.store.positional else None,
                           writes=_writes(plan, ex, h) if ex is not None else None)
    if rc:
        from ...kernels.encode import encode_store, raise_store_error

        jobs = c_store_jobs(layout, fields, key, value)
        raise_store_error(rc, jobs[job][0], (k, v)[job], encode_store(jobs, memo)[1][job])
    return out


def _writes(plan: StepPlan, ex: tuple, h: int):
    """The step's exact copies (:func:`.writes.write_exact`'s rows and byte offsets in the exact fields ``ex``), as
    the one call writes them (in the call, after the attention: the smoothed tokens, as the general path stores
    them); None where the step writes none.  Once per step and geometry of the exact fields."""
    if not len(plan.exact_rows):
        return None
    key = ("fused_writes", h) + tuple((f.offset, f.stride_block, f.stride_head, f.stride_token) for f in ex)
    hit = plan.memo.get(key)
    if hit is None:
        offs = [plan.addresses(name, f, h, plan.exact_blocks, plan.exact_slots)[..., 0].contiguous()
                for name, f in (("exact.key", ex[0]), ("exact.value", ex[1]))]
        hit = plan.memo[key] = (plan.exact_rows.long().contiguous(), *offs)
    return hit


def _build(layout: PageLayout, fields, step, ex, query, key, value):
    """The layer's :class:`qjl.kernels.cpu.launch.DecodeStore` for the step's ``step`` (its
    :class:`qjl.kernels.cpu.launch.DecodeStep`) and exact fields ``ex``, or None where the one call cannot serve it
    (codecs the C kernels do not read or store, query maps the kernel does not apply itself)."""
    from ...kernels import pick_backend
    from ...kernels.cpu.launch import DecodeStore
    from ...kernels.encode import encode_store
    from ...kernels.paged import kernel_readable, role_fields

    if not kernel_readable(layout.key_codec, layout.value_codec) or pick_backend(query.device) != "cpu":
        return None
    jobs = c_store_jobs(layout, fields, key, value)
    if jobs is None:
        return None
    t, hq, d = query.shape
    h = key.shape[1]
    one = DecodeStore(query.reshape(t, h, hq // h, d), layout.key_codec, role_fields(fields, "key"),
                      layout.value_codec, role_fields(fields, "value"), step, encode_store(jobs, fields.memo)[0],
                      mu_field=fields["smooth.key"] if layout.smooth_keys else None,
                      mu_v_field=fields["smooth.value"] if layout.smooth_values else None,
                      exact_fields=None if step.rows is None else ex, write_fields=ex)
    return one if one.served else None
