"""Decode rows through :func:`qjl.kernels.paged_decode`: one kernel call per layer and step (no vLLM import).

The backend's decode contract (:func:`.paged.paged_decode_reference`: a history of ``n`` tokens, its first
``sinks`` and last ``window`` tokens exact in the pages' exact slots, the current token exact from
``forward``'s arguments) maps onto the kernel's (a coded range per sequence plus exact tokens merged into
the same softmax) like this, for all decode rows of the batch at once:

* coded range ``[start, end)`` with ``start = min(sinks, n)`` and ``end = max(start, w0)``, ``w0`` the exact
  window's start (:func:`.layout.window_start`: the last ``sinks + window`` tokens past block 0, whose blocks ring
  over the sink slots too);
* exact tokens ``[B, H_kv, 2 sinks + window + 1, D]`` as two segments: the sink slots and the ring-window slots,
  read in place from the pages (:class:`qjl.kernels.paged.PagedRows`; the torch and Triton paths gather them),
  and the current token; slots a short sequence does not have yet are masked with ``-inf`` in ``xbias``
  (with a sliding window W: no sinks, the codes from position ``n + 1 - W``);
* queries ``[B, H_q, D]`` become the kernel's rows ``[B, H_kv, g, D]`` (query head ``i`` reads KV head
  ``i // g``), multiplied by the softmax scale.

What depends only on the step's metadata (ranges, exact-slot addresses, the mask) is a :class:`DecodeRows`,
built once per step and shared by every layer (:mod:`.step`).  The kernel is the C core on CPU tensors and
the Triton kernel on CUDA tensors (``backend="auto"``); the result equals
:func:`.paged.paged_decode_reference` within float32 rounding (``tests/integrations/test_vllm_decode.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...kernels import pick_backend
from ...kernels.cpu.launch import DecodeStep, paged_decode_step
from ...kernels.paged import PagedRows, extent_bytes, field_geometry, kernel_readable, paged_decode
from .layout import check_sliding_window, exact_slot, window_start
from .paged import check_output

_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # written in place by the C kernel

__all__ = ["DecodeRows", "decode_rows", "code_ranges", "exact_tokens", "paged_decode_kernel", "decode_function"]


def code_ranges(seq_lens: torch.Tensor, sinks: int, window: int, sliding_window: int | None = None, *,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) [B] int64 of the coded tokens of histories of ``seq_lens`` [B] tokens (the current token at
    position ``seq_lens``; with a sliding window W it sees history from position ``seq_lens + 1 - W`` on); the
    exact window after ``end`` (:func:`.layout.window_start`)."""
    n = seq_lens.long()
    start = n.clamp(max=sinks)
    if check_sliding_window(sliding_window) is not None:
        start = torch.maximum(start, (n + 1 - sliding_window).clamp(min=0))
    return start, torch.maximum(start, window_start(n, sinks, window, block_size=block_size))


@dataclass
class DecodeRows:
    """The decode rows' indices every layer of a step shares (see the module docstring).

    start, end: [B] int64, the coded range; blocks, slots: [B, 1, E] int64 (``E = 2 sinks + window`` rows: the
    sinks, then the window's at most ``sinks + window`` tokens), where each exact row lives (absent rows point at
    block 0, slot 0 and are masked); valid: [B, E] bool.
    ``memo`` holds byte addresses per field geometry (layers with the same layout share them).
    """

    block_table: torch.Tensor
    block_size: int
    start: torch.Tensor
    end: torch.Tensor
    blocks: torch.Tensor
    slots: torch.Tensor
    valid: torch.Tensor
    memo: dict = field(default_factory=dict)

    def bias(self, with_current: bool) -> torch.Tensor:
        """xbias [B, 1, 1, E (+1)] float32: 0 for present exact tokens, -inf for absent ones."""
        key = ("bias", with_current)
        if key not in self.memo:
            ok = self.valid
            if with_current:
                ok = torch.cat([ok, torch.ones(ok.shape[0], 1, dtype=torch.bool, device=ok.device)], dim=1)
            b = torch.zeros(ok.shape, dtype=torch.float32, device=ok.device).masked_fill_(~ok, float("-inf"))
            self.memo[key] = b[:, None, None, :]
        return self.memo[key]

    def kernel_ranges(self) -> tuple:
        """(block_table, start, end) as contiguous int32, as the CPU kernel reads them (converted once per step)."""
        if "int32" not in self.memo:
            self.memo["int32"] = tuple(t.to(torch.int32).contiguous() for t in (self.block_table, self.start, self.end))
        return self.memo["int32"]

    def cpu_step(self, exact, num_kv_heads: int, current: bool):
        """The step's :class:`qjl.kernels.cpu.launch.DecodeStep` (ranges, exact-slot offsets, bias) for the C kernel,
        built once per exact-field geometry and shared by the layers (each reads the offsets in its own pages).
        exact: the (key, value) PagedFields of a layer's exact slots, or None when ``sinks + window == 0``."""
        e = self.valid.shape[1]
        if e and exact is None:
            raise ValueError("exact must be given when sinks or window is non-zero")
        geom = tuple(field_geometry(f) for f in exact) if e else None
        key = ("cpu_step", geom, num_kv_heads, current)
        step = self.memo.get(key)
        if step is None:
            rows = (self.read(exact[0], num_kv_heads), self.read(exact[1], num_kv_heads)) if e else None
            table, start, end = self.kernel_ranges()
            step = self.memo[key] = DecodeStep(table, self.block_size, start, end, rows=rows, segments=int(current),
                                               xbias=self.bias(current) if e or current else None)
        return step

    def read(self, f, num_heads: int) -> PagedRows:
        """The exact slots of PagedField ``f`` as :class:`qjl.kernels.paged.PagedRows` [B, H, E, D] (read in place
        by the CPU kernel; ``.gather()`` copies them out)."""
        key = ("read", field_geometry(f), num_heads, extent_bytes(f.buffer))
        rows = self.memo.get(key)
        if rows is None:  # the offsets and their bounds check, once per field geometry (layers share them)
            rows = self.memo[key] = PagedRows.at(f, self.blocks[:, 0, :], self.slots[:, 0, :], num_heads)
        return rows if rows.field is f else PagedRows(f, rows.offsets, rows.heads)


def decode_rows(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, sinks: int,
                window: int, sliding_window: int | None = None) -> DecodeRows:
    """:class:`DecodeRows` of decode rows with block_table [B, max_blocks] and seq_lens [B] tokens of history
    (``sliding_window``: the layer's window; its exact window then lies inside it: ``window < sliding_window``)."""
    if sliding_window is not None and (sinks or window >= sliding_window):
        raise ValueError(f"a sliding window of {sliding_window} keeps no sinks and fewer exact window tokens, got "
                         f"sinks={sinks}, window={window}")
    dev = block_table.device
    n = seq_lens.long().to(dev)
    start, end = code_ranges(n, sinks, window, sliding_window, block_size=block_size)
    j = torch.arange(2 * sinks + window, device=dev)
    pos = torch.where(j < sinks, j, end[:, None] + (j - sinks))  # [B, E]
    ok = torch.where(j < sinks, j < start[:, None], pos < n[:, None])
    pos = torch.where(ok, pos, torch.zeros_like(pos))  # an address every sequence has (block 0, slot 0)
    blocks = block_table.long().gather(1, pos // block_size)[:, None, :]
    slots = exact_slot(pos, sinks, window, block_size=block_size)[:, None, :]
    return DecodeRows(block_table, block_size, start, end, blocks, slots, ok)


def exact_tokens(exact, rows: DecodeRows, num_kv_heads: int, current=None):
    """(xk, xv [B, H_kv, n_x, D], xbias [B, 1, 1, n_x]) of the rows' exact slots and the current token
    (the last column), or None when there are none; with both, xk and xv are the two segments (a tuple each,
    as :func:`qjl.kernels.paged.paged_decode` takes them).

    exact: (key, value) PagedFields of the pages' exact slots, or None when ``sinks + window == 0``;
    current: None or (k, v) [B, H_kv, D].
    """
    ks, vs = [], []
    if rows.valid.shape[1]:
        if exact is None:
            raise ValueError("exact must be given when sinks or window is non-zero")
        ks.append(rows.read(exact[0], num_kv_heads))
        vs.append(rows.read(exact[1], num_kv_heads))
    if current is not None:
        ks.append(current[0].unsqueeze(2))
        vs.append(current[1].unsqueeze(2))
    if not ks:
        return None
    if len(ks) == 1:
        return ks[0], vs[0], rows.bias(current is not None)
    # two segments (exact slots, current token), taken in order (qjl.kernels.paged.check_exact): the CPU kernel
    # reads them where they are; the other backends join them
    return tuple(ks), tuple(vs), rows.bias(True)


def paged_decode_kernel(q, key_fields, value_fields, block_table, seq_lens, block_size, *, key_codec, value_codec,
                        scale: float, num_kv_heads: int, exact=None, sinks: int = 0, window: int = 0, current=None,
                        rows: DecodeRows | None = None, backend: str = "auto",
                        sliding_window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`.paged.paged_decode_reference`'s signature and result, computed by :func:`qjl.kernels.paged_decode`.

    q [B, H_q, D]; fields {codec field name: PagedField}; block_table [B, max_blocks]; seq_lens [B] tokens
    of history (the current token excluded); current None or (k, v) [B, H_kv, D].  rows: the step's
    :class:`DecodeRows` of these arguments (built here when None).  Returns [B, H_q, D] float32.
    ``backend``: "auto" (C on CPU, Triton on CUDA), "cpu", "triton" or "torch" (the kernels' reference).
    Codecs that declare no kernel views (:func:`qjl.kernels.supports`) are served by the backend's reference.
    ``out``: None, or a contiguous float tensor of B * H_q * D elements the result is written into (the C kernel
    writes fp32/fp16/bf16 in place, rounded as ``.to()``; others are copied into), returned as [B, H_q, D].
    """
    b, hq, d = q.shape
    check_output(out, b, hq, d)
    if hq % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide the {hq} query heads")
    if not kernel_readable(key_codec, value_codec):  # codecs without kernel views: the backend's reference
        from .paged import paged_decode_reference

        return paged_decode_reference(q, key_fields, value_fields, block_table, seq_lens, block_size,
                                      key_codec=key_codec, value_codec=value_codec, scale=scale,
                                      num_kv_heads=num_kv_heads, exact=exact, sinks=sinks, window=window,
                                      current=current, sliding_window=sliding_window, out=out)
    if rows is None:
        rows = decode_rows(block_table.to(q.device), seq_lens, block_size, sinks, window, sliding_window)
    key = ("backend", q.device, backend)
    chosen = rows.memo.get(key)
    if chosen is None:
        chosen = rows.memo[key] = pick_backend(q.device, backend)
    if chosen == "cpu":  # the step's ranges, exact offsets and bias checked once for every layer (same result)
        step = rows.cpu_step(exact, num_kv_heads, current is not None)
        if step.n_rows + step.segments == 0 and not bool((rows.end > rows.start).all()):
            raise ValueError("a decode row has no token to attend to (seq_lens 0 and no current token)")
        g = hq // num_kv_heads  # the query converted and scaled in the call, the result written in out's dtype
        dst = out.view(b, num_kv_heads, g, d) if out is not None and out.dtype in _OUT_DTYPES else None
        got = paged_decode_step(q.reshape(b, num_kv_heads, g, d), key_codec, key_fields, value_codec, value_fields,
                                step, exact_fields=None if step.rows is None else exact,
                                segments=() if current is None else (current,), q_scale=scale, out=dst)
        return got.view(b, hq, d) if out is None or dst is not None else out.view(b, hq, d).copy_(got.view(b, hq, d))
    ex = exact_tokens(exact, rows, num_kv_heads, current)
    if ex is None and not bool((rows.end > rows.start).all()):
        raise ValueError("a decode row has no token to attend to (seq_lens 0 and no current token)")
    qk = (q.float() * scale).reshape(b, num_kv_heads, hq // num_kv_heads, d)
    table, start, end = rows.kernel_ranges()
    got = paged_decode(qk, key_codec, key_fields, value_codec, value_fields, table, block_size, start, end, exact=ex,
                       backend=chosen).reshape(b, hq, d)
    return got if out is None else out.view(b, hq, d).copy_(got)


def decode_function(settings):
    """The function that serves the backend's decode rows: :func:`paged_decode_kernel` for ``decode="auto"`` and
    ``"kernel"`` (the C kernel on CPU, Triton on CUDA, the kernels' torch reference where neither runs), the backend's
    own plain-torch :func:`.paged.paged_decode_reference` for ``decode="torch"``."""
    if settings.decode == "torch":
        from .paged import paged_decode_reference

        return paged_decode_reference
    return paged_decode_kernel
