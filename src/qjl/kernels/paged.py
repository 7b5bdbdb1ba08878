"""The paged decode contract: where a layer's fields live, and the public launcher every backend serves.

PAGED ADDRESSING (shared with the vLLM backend): field ``f`` of coded token ``t`` of sequence ``b``,
KV head ``h``, is the ``f.dtype`` array of shape ``f.shape`` at byte address

    f.buffer.data_ptr() + f.offset + block_table[b, t // block_size] * f.stride_block
                        + h * f.stride_head + (t % block_size) * f.stride_token

(``stride_token = 0``: one entry per block and head, e.g. QJL's ``outlier_idx``).  vLLM's pages and
transformers' contiguous codes (one block per sequence, ``block_table = arange(B)[:, None]``,
``block_size`` = the code length; :meth:`PagedField.of`) are both this addressing.  Fields are named
as in the codecs' :class:`qjl.Codes`; the codecs' views (:mod:`qjl.codecs.views`) say which fields a
kernel reads and how.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["PagedField", "paged_decode", "check_paged"]


@dataclass(frozen=True)
class PagedField:
    """One stored field of every token of a paged pool (see the module docstring for the addressing).

    buffer: the tensor holding it (addresses are relative to ``buffer.data_ptr()``); offset and
    strides in bytes; dtype and shape of one entry (``shape=(nbytes,)`` uint8 for packed codes,
    ``()`` for a norm, ``(groups,)`` for token-wise scales).
    """

    buffer: torch.Tensor
    offset: int
    stride_block: int
    stride_head: int
    stride_token: int
    dtype: torch.dtype
    shape: tuple

    @staticmethod
    def of(t: torch.Tensor, shared: bool = False) -> "PagedField":
        """A field of contiguous codes: ``t`` [B, H, N, *shape] (``shared``: [B, H, *shape], one entry per
        sequence and head) as one block per sequence."""
        entry_dims = t.ndim - (2 if shared else 3)
        if entry_dims and not t[(0,) * (t.ndim - entry_dims)].is_contiguous():
            t = t.contiguous()  # an entry's elements must be consecutive
        es = t.element_size()
        token = 0 if shared else t.stride(2) * es
        shape = tuple(t.shape[2:] if shared else t.shape[3:])
        return PagedField(t, 0, t.stride(0) * es, t.stride(1) * es, token, t.dtype, shape)

    @property
    def entry_bytes(self) -> int:
        return math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()

    def raw_bytes(self) -> torch.Tensor:
        """The bytes from ``buffer.data_ptr()`` on, as a 1-d uint8 tensor (no copy)."""
        t = self.buffer
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        return raw[t.storage_offset() * t.element_size():]

    def gather(self, blocks: torch.Tensor, heads: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Broadcastable int tensors of a common shape S -> the entries [*S, *shape] (a copy)."""
        blocks, heads, slots = torch.broadcast_tensors(blocks.long(), heads.long(), slots.long())
        addr = self.offset + blocks * self.stride_block + heads * self.stride_head + slots * self.stride_token
        idx = addr.unsqueeze(-1) + torch.arange(self.entry_bytes, device=addr.device)
        raw = self.raw_bytes()[idx]
        return raw.view(self.dtype).reshape(*idx.shape[:-1], *self.shape)


def check_paged(q, fields: dict, names, block_table, code_start, code_end) -> None:
    """ValueError naming the argument unless the shapes fit the contract (see :func:`paged_decode`)."""
    if not isinstance(q, torch.Tensor) or q.ndim != 4 or not q.dtype.is_floating_point:
        raise ValueError(f"q must be a float tensor [B, H_kv, R, D], got {getattr(q, 'shape', q)!r}")
    b = q.shape[0]
    for role, (given, wanted) in fields.items():
        missing = [n for n in wanted if n not in given]
        if missing:
            raise ValueError(f"{role} lacks the field(s) {missing} its codec's view reads (has {sorted(given)})")
        for n in wanted:
            f = given[n]
            if not hasattr(f, "buffer") or f.buffer.device != q.device:
                raise ValueError(f"{role}[{n!r}] must be a PagedField on {q.device}")
    if not isinstance(block_table, torch.Tensor) or block_table.ndim != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must be [B={b}, max_blocks], got {getattr(block_table, 'shape', block_table)!r}")
    for name, t in (("code_start", code_start), ("code_end", code_end)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (b,):
            raise ValueError(f"{name} must be a [B={b}] int tensor, got {getattr(t, 'shape', t)!r}")
    if bool((code_end < code_start).any()) or bool((code_start < 0).any()):
        raise ValueError("code_start/code_end must satisfy 0 <= code_start <= code_end")
    del names


def _check_exact(exact, q) -> None:
    if exact is None:
        return
    if not isinstance(exact, (tuple, list)) or len(exact) != 3:
        raise ValueError("exact must be None or a tuple (xk, xv, xbias)")
    xk, xv, xbias = exact
    b, h, r, d = q.shape
    if not isinstance(xk, torch.Tensor) or xk.ndim != 4 or tuple(xk.shape[:2]) != (b, h) or xk.shape[-1] != d:
        raise ValueError(f"exact: xk must be [{b}, {h}, n, {d}], got {getattr(xk, 'shape', xk)!r}")
    if not isinstance(xv, torch.Tensor) or xv.shape != xk.shape:
        raise ValueError(f"exact: xv must have xk's shape {tuple(xk.shape)}, got {getattr(xv, 'shape', xv)!r}")
    if xbias is not None and tuple(xbias.shape) != (b, h, r, xk.shape[2]):
        raise ValueError(f"exact: xbias must be [{b}, {h}, {r}, {xk.shape[2]}], got {tuple(xbias.shape)}")


def paged_decode(q: torch.Tensor, key_codec, key_fields: dict, value_codec, value_fields: dict,
                 block_table: torch.Tensor, block_size: int, code_start: torch.Tensor, code_end: torch.Tensor, *,
                 exact=None, code_bias: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Decode attention over paged codes (+ exact tokens), one call per layer and step.

    Args:
        q: [B, H_kv, R, D] float32, the query rows of KV head ``h`` (its GQA group x new tokens),
            already multiplied by the softmax scale.
        key_codec, value_codec: the layer's codecs; they must declare kernel views
            (:func:`qjl.codecs.views.kernel_readable`).
        key_fields, value_fields: {codec field name: :class:`PagedField`}.
        block_table: [B, max_blocks] int; block_size: tokens per block.
        code_start, code_end: [B] int, the coded tokens ``[start, end)`` of each sequence (token indices
            of the addressing; vLLM: ``[sinks, n - window)``, transformers: ``[0, N)``).
        exact: None or ``(xk, xv, xbias)``: exact tokens (sinks, window, the current token) merged into
            the same softmax; xk/xv [B, H_kv, n_x, D] (any float dtype), xbias [B, H_kv, R, n_x]
            additive (0 / -inf, e.g. a causal mask or ragged lengths) or None.
        code_bias: [B, >= max(code_end)] additive over coded token indices (e.g. left padding) or None.
        backend: "auto" (by device), "cpu", "triton" or "torch" (:func:`qjl.kernels.reference.paged_decode_reference`).

    Returns:
        [B, H_kv, R, D] float32: ``softmax(q . k) v`` over the sequence's coded and exact tokens, keys scored
        with the key codec's estimator and values mixed from the value codec's reconstruction.  Error against
        the float64-accurate result: float32 rounding of sums over ``D`` and over the tokens (the CPU and
        Triton kernels sum in another order than the reference: outputs agree within 1e-4 of their scale).
        A row that sees no token at all gets NaN (0 / 0), like a fully masked softmax.
    """
    from qjl import kernels

    backend = kernels.pick_backend(q.device, backend)
    _check_exact(exact, q)
    if backend == "cpu":
        from qjl.kernels.cpu import launch

        return launch.paged_decode(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size,
                                   code_start, code_end, exact=exact, code_bias=code_bias)
    if backend == "triton":
        from qjl.kernels.triton import launch

        return launch.paged_decode(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size,
                                   code_start, code_end, exact=exact, code_bias=code_bias)
    from qjl.kernels.reference import paged_decode_reference

    return paged_decode_reference(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size,
                                  code_start, code_end, exact=exact, code_bias=code_bias)
