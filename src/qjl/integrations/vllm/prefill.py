"""Prefill and chunk rows through vLLM's own CPU attention kernel, over the history decoded from the pages.

A chunk after a sequence's first attends to that sequence's history: exact sinks, decoded codes and exact window,
then its own tokens (:func:`.paged.sequence_kv`, written straight into token-major buffers of the model's dtype; the
codes decoded by the C kernel's rows, :func:`qjl.kernels.cpu.rows.value_rows`, where it loads: 7.3 -> 3.4 ms of
a 512-token chunk's 35 ms over 3.5k tokens, scratch timing of one layer).  :func:`.paged.paged_attention_reference` runs that through
torch's float32 SDPA; on the CPU vLLM's native kernel (``cpu_attention_with_kv_cache``, the one its own CPU backend
calls, in the model's dtype) is about 1.5-1.7x faster on a 512-token chunk of the embedded model (scratch timing
of one layer, 28 against 47 ms over 4k tokens).  :class:`VLLMPrefill` writes each sequence's keys and values, in
the model's dtype, into a scratch paged cache of contiguous blocks (vLLM's ``cpu_attn_reshape_and_cache``, so the
kernel reads its own layout) and calls the kernel with that cache's block table; what it attends is the same
tokens as the reference, rounded to the model's dtype (bf16 in the engine: below the codes' own error).

A sliding-window layer's history starts at the first position its chunk's first token sees, not at 0: its
tokens are given to the kernel from there (positions shifted by a constant, which changes neither causality nor
the window) with vLLM's own ``sliding_window``.  Used only on the CPU, and only where vLLM's CPU ops load (an x86
vLLM CPU build): elsewhere, and if the first call of the kernel raises, the reference runs (logged once).  vLLM's
ops are imported at the first call.

The kernel's variant is the one vLLM's own CPU backend picks (:func:`kernel_isa`): on a CPU with AMX tiles (Intel
Sapphire Rapids and later) and a bf16 model that is ``"amx"``, 3.5x faster than ``"vec"`` on a 512-token chunk over
4k tokens of the embedded model (6.2 against 21.5 ms, scratch timing of the kernel alone); a fixed ``"vec"`` made
this prefill 2.5x slower than native's on such machines (5.1 against 2.1 s for a 4k-token prompt).

Over a long history a chunk attends in the codecs' rotated basis (:func:`.paged.rotated_basis`, ``rotate="auto"``):
the codes are read without the inverse rotation and the chunk's queries, its own keys and values, the exact tokens
and its output are rotated instead (the same scores and mixes, the rotations being orthogonal); see
:meth:`VLLMPrefill.basis` for where it is taken and what it measured.
"""

from __future__ import annotations

import functools
import logging

import torch

from .paged import chunk_sequences, paged_attention_reference, rotated_basis, sequence_kv

__all__ = ["VLLMPrefill", "SCRATCH_BLOCK", "kernel_isa"]

SCRATCH_BLOCK = 128  # tokens per block of the scratch cache (a multiple of 32, as vLLM's CPU kernels ask)
logger = logging.getLogger(__name__)


def _cpu_ops():
    """vLLM's CPU attention ops, or None where they do not load (no vLLM, or a build without them)."""
    try:
        import vllm._custom_ops as ops

        torch.ops._C.cpu_attention_with_kv_cache  # noqa: B018 (raises where the CPU kernels are not built)
    except (ImportError, AttributeError, RuntimeError):
        return None
    return ops


@functools.lru_cache(maxsize=None)
def _amx_ready() -> bool:
    """AMX tiles present and this process allowed to use them (torch asks the kernel once; without that permission an
    AMX instruction is an illegal instruction, not an exception)."""
    try:
        return bool(torch.cpu._is_amx_tile_supported()) and bool(torch.cpu._init_amx())
    except (AttributeError, RuntimeError):
        return False


def kernel_isa(dtype: torch.dtype, head_size: int, block_size: int = SCRATCH_BLOCK) -> str:
    """The variant of vLLM's CPU attention kernel for a scratch cache of ``block_size``-token blocks, chosen as vLLM's
    CPU backend chooses it for x86 (``_get_attn_isa`` in ``vllm.v1.attention.backends.cpu_attn``; a test holds the two
    together): ``"vec16"`` for head sizes that are a multiple of 16 but not of 32, ``"amx"`` for bf16 where the CPU
    has AMX tiles (and the process may use them), else ``"vec"``."""
    if head_size % 32 and head_size % 16 == 0:
        return "vec16"
    if dtype == torch.bfloat16 and block_size % 32 == 0 and _amx_ready():
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


class VLLMPrefill:
    """A ``prefill`` for :func:`.step.forward_batch`, with :func:`.paged.paged_attention_reference`'s signature:
    q [T, H_q, D] (the model's dtype), the batch's own k/v [T, H_kv, D], history from the pages -> [T, H_q, D]
    float32.  vLLM's kernel variant is :func:`kernel_isa`'s (vLLM's own choice: ``"amx"`` for bf16 on AMX CPUs,
    ``"vec16"`` where ``D`` is not a multiple of 32, else ``"vec"``); ``rotate``: ``"auto"`` (the rotated basis
    where :meth:`basis` finds it pays), ``"always"`` (where the codecs allow it) or ``"never"``; ``usable`` /
    ``ran`` say whether the kernel is used / has run in this process."""

    def __init__(self, rotate: str = "auto"):
        if rotate not in ("auto", "always", "never"):
            raise ValueError(f"rotate must be 'auto', 'always' or 'never', got {rotate!r}")
        self.ops = None
        self.usable = None  # None: not tried yet; then True / False for this process
        self.ran = False  # the kernel has run once: a later failure is a bug, raised
        self.rotate = rotate

    def _ready(self) -> bool:
        if self.usable is None:
            self.ops = _cpu_ops()
            self.usable = self.ops is not None
            if not self.usable:
                logger.info("qjl backend: vLLM's CPU attention ops are not available; prefill uses torch SDPA")
        return self.usable

    def __call__(self, q, k, v, fields: dict, block_table, query_start_loc, seq_lens, layout, scale: float):
        if q.device.type != "cpu" or not self._ready():
            return paged_attention_reference(q, k, v, fields, block_table, query_start_loc, seq_lens, layout, scale)
        try:
            return self._attend(q, k, v, fields, block_table, query_start_loc, seq_lens, layout, scale)
        except RuntimeError as e:  # a kernel this build cannot run here: the reference from now on
            if self.ran:
                raise
            self.usable = False
            logger.warning("qjl backend: vLLM's CPU attention kernel failed (%s); prefill uses torch SDPA", e)
            return paged_attention_reference(q, k, v, fields, block_table, query_start_loc, seq_lens, layout, scale)

    def basis(self, layout, d: int, c: int, n: int, hq: int, hkv: int):
        """The rotated basis (:func:`.paged.rotated_basis`) where this chunk reads it: always / never, or (auto)
        where its history's rows (keys and values, 2 H_kv n) are at least 2.5x the rows it rotates instead (its
        queries and outputs, its own keys and values: 2 (H_q + H_kv) c).  Measured on one layer of the embedded
        model, a 512-token chunk (Intel Xeon with AMX, 2 threads): 3.03 -> 3.73 ms over 512 tokens, 6.16 -> 6.25
        over 2,048, 9.46 -> 8.91 over 3,584, 17.8 -> 16.1 over 7,168 (the break-even near 2.5k tokens).  A
        sliding-window layer's history is at most its window."""
        seen = n if layout.sliding_window is None else min(n, int(layout.sliding_window))
        if self.rotate == "never" or (self.rotate == "auto" and 2 * (2 * hkv * seen) < 5 * (hq + hkv) * c):
            return None
        return rotated_basis(layout.key_codec, layout.value_codec, d)  # (the matrices memoized per codec)

    def _attend(self, q, k, v, fields, block_table, query_start_loc, seq_lens, layout, scale):
        ops = self.ops
        t, hq, d = q.shape
        hkv = k.shape[1]
        dt = q.dtype
        isa = kernel_isa(dt, d)
        heads = torch.arange(hkv)
        out = torch.empty(t, hq, d, dtype=torch.float32)
        for i, r0, r1, c, n in chunk_sequences(query_start_loc, seq_lens):
            basis = self.basis(layout, d, c, n, hq, hkv)
            kk, vv, pos = sequence_kv(k[r0:r1], v[r0:r1], fields, block_table[i].long(), c, n, layout, heads, dt,
                                      basis=basis)
            length = kk.shape[0]
            first = n + c - length  # 0, or where a sliding window's history starts
            if not torch.equal(pos, torch.arange(first, n + c)):
                raise ValueError(f"sequence {i}: its history is not positions {first}..{n + c - 1} in order")
            window = -1 if layout.sliding_window is None else int(layout.sliding_window)
            nb = -(-length // SCRATCH_BLOCK)
            cache = torch.empty(nb, hkv, 2 * SCRATCH_BLOCK, d, dtype=dt)  # every block but the last filled below;
            cache[-1].zero_()  # the kernel reads whole tiles: the last block's unused slots zero, not stale NaNs
            kc, vc = cache.chunk(2, dim=2)  # vLLM's view: per block and head, the keys' rows then the values'
            ops.cpu_attn_reshape_and_cache(kk, vv, kc, vc, torch.arange(length), isa)
            lens = torch.tensor([length], dtype=torch.int32)
            starts = torch.tensor([0, c], dtype=torch.int32)
            meta = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=1, num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=lens, dtype=dt,
                query_start_loc=starts, causal=True, sliding_window_size=window, isa=isa, enable_kv_split=False)
            o = torch.empty(c, hq, d, dtype=dt)
            qi = q[r0:r1].contiguous() if basis is None else (q[r0:r1].float() @ basis[0]).to(dt)
            ops.cpu_attention_with_kv_cache(
                query=qi, key_cache=kc, value_cache=vc, output=o, query_start_loc=starts,
                seq_lens=lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=window,
                block_table=torch.arange(nb, dtype=torch.int32)[None], softcap=0.0, scheduler_metadata=meta,
                s_aux=None)
            if basis is None:
                out[r0:r1] = o
            else:
                torch.matmul(o.float(), basis[1].T, out=out[r0:r1])  # back to the model's basis
            self.ran = True
        return out
