"""The backend's kernel decode path (:mod:`qjl.integrations.vllm.decode`) against its plain-torch reference.

One layer's page pool is filled the way the backend fills it (a prefill step through
:func:`.step.forward_batch`, then decode steps: codes written first, exact copies after the attention);
at every decode step all decode rows of the batch go through :func:`paged_decode_kernel` in one call and
through :func:`.paged.paged_decode_reference`, with the same arguments.  Histories shorter than
``sinks + window`` (down to none), GQA, several presets and layouts, the C kernel and the Triton kernel
(through its interpreter, set in conftest.py; natively on a GPU with ``TRITON_INTERPRET=0``, the pool then
on CUDA) are covered.  No vLLM import.
"""

import pytest
import torch
from kernel_cases import TRITON_DEVICE

from qjl import kernels
from qjl.integrations.vllm.decode import (code_ranges, decode_function, decode_rows, paged_decode_kernel)
from qjl.integrations.vllm.layout import layer_layout
from qjl.integrations.vllm.paged import page_fields, paged_decode_reference
from qjl.integrations.vllm.settings import VLLMSettings
from qjl.integrations.vllm.step import StepPlan, forward_batch
from qjl.integrations.vllm.writes import write_codes, write_exact

D = 64
TOL = 1e-4  # relative to the output's largest entry: float32 sums in another order (qjl.kernels.paged_decode)


def _backends():
    out = []
    out.append(pytest.param("cpu", marks=pytest.mark.skipif(not kernels.cpu_available(), reason="no C build")))
    out.append(pytest.param("triton", marks=pytest.mark.skipif(not kernels.triton_usable(TRITON_DEVICE),
                                                                reason="Triton interpreter unavailable")))
    return out


class Pool:
    """One layer of a preset in a shuffled page pool, sequences written as the backend writes them."""

    def __init__(self, settings: VLLMSettings, hkv: int, hq: int, block_size: int, layer: int = 20,
                 num_blocks: int = 40, seed: int = 0, device="cpu", sliding: int | None = None):
        self.lay = layer_layout(settings, layer, 30, D, block_size, torch.bfloat16, sliding_window=sliding)
        self.device = torch.device(device)
        self.pages = torch.zeros(num_blocks, hkv, block_size, self.lay.content_bytes // 2, dtype=torch.bfloat16,
                                 device=device)
        self.fields = page_fields(self.lay, self.pages)
        self.gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.hkv, self.hq, self.bs = hkv, hq, block_size
        self.blocks, self.lens = {}, {}

    def _x(self, *shape):
        return (torch.randn(*shape, generator=self.gen) * 2).bfloat16().to(self.device)

    def step(self, chunks: dict, decode=paged_decode_reference, compare=None, out_dtype=None):
        """Run one step of {seq: new tokens}; ``compare(decode args, kw)`` is called on the decode rows
        between the code writes and the attention (what the backend's forward does)."""
        ids = list(chunks)
        qsl, lens = [0], []
        for i in ids:
            n0 = self.lens.get(i, 0)
            bl = self.blocks.setdefault(i, [])
            while len(bl) * self.bs < n0 + chunks[i]:
                bl.append(self.free.pop())
            self.lens[i] = n0 + chunks[i]
            qsl.append(qsl[-1] + chunks[i]), lens.append(n0 + chunks[i])
        width = max(len(self.blocks[i]) for i in ids) + 1  # a spare column: the table is wider than needed
        table = torch.tensor([self.blocks[i] + [0] * (width - len(self.blocks[i])) for i in ids], device=self.device)
        t = qsl[-1]
        q, k, v = self._x(t, self.hq, D), self._x(t, self.hkv, D), self._x(t, self.hkv, D)
        qsl, lens = torch.tensor(qsl, device=self.device), torch.tensor(lens, device=self.device)
        lay = self.lay
        plan = StepPlan.build(qsl, lens, table, lay.block_size, lay.sinks, lay.window,
                              sliding_window=lay.sliding_window)
        write_codes(lay, self.fields, k, v, None, plan=plan)
        if compare is not None and plan.decode is not None:
            rows = plan.decode_token_rows
            kf = {n[4:]: f for n, f in self.fields.items() if n.startswith("key.")}
            vf = {n[6:]: f for n, f in self.fields.items() if n.startswith("value.")}
            ex = (self.fields["exact.key"], self.fields["exact.value"]) if lay.sinks + lay.window else None
            args = (q[rows], kf, vf, plan.decode.block_table, plan.seq_lens[plan.decode_seqs] - 1, lay.block_size)
            kw = dict(key_codec=lay.key_codec, value_codec=lay.value_codec, scale=D ** -0.5, num_kv_heads=self.hkv,
                      exact=ex, sinks=lay.sinks, window=lay.window, current=(k[rows], v[rows]), rows=plan.decode,
                      sliding_window=lay.sliding_window)
            compare(args, kw)
            write_exact(plan, self.fields, k, v)
            return None
        if out_dtype is None:
            return forward_batch(lay, self.fields, q, k, v, table, qsl, lens, D ** -0.5, decode, plan=plan)
        out = torch.full((t, self.hq, D), 7.0, dtype=out_dtype, device=self.device)  # as vLLM's output buffer
        got = forward_batch(lay, self.fields, q, k, v, table, qsl, lens, D ** -0.5, decode, plan=plan, out=out)
        assert got is out
        return out


def _close(a, b):
    assert a.shape == b.shape and a.dtype == torch.float32
    assert bool(torch.isfinite(a).all())
    err = float((a - b).abs().max())
    assert err <= TOL * float(b.abs().max()), err


CASES = [  # (preset, settings overrides, KV heads, query heads, block size[, sliding window])
    ("tq-k45v3", {}, 2, 6, 16),
    ("tq-k45v3", {"sinks": 2, "window": 5}, 2, 6, 16, 20),  # a sliding-window layer: no sinks, W - 1 >= window
    ("tq-k3v2", {}, 2, 4, 8, 13),
    ("tq-k45v3", {"sinks": 2, "window": 5}, 1, 4, 8),
    ("tq-k3v2", {}, 2, 4, 16),  # window 0 (the preset's default): sinks only
    ("tq-k3v2", {"sinks": 0}, 2, 2, 16),  # no exact slot at all: the current token only
    ("qjl-paper", {"window": 3}, 2, 6, 16),  # per-block outlier channels (shared fields)
    ("tqv-k3v2", {}, 2, 4, 16),  # vector codebooks (pairs of 3-bit keys, quads of 2-bit values), one rotation
    ("tqv-k3v2", {"window": 3}, 1, 3, 8),
]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}" + (f"-sw{c[5]}" if len(c) > 5 else "") for c in CASES])
def test_kernel_decode_matches_the_reference(case, backend):
    preset, over, hkv, hq, bs, *sliding = case
    s = VLLMSettings(preset=preset, **over)
    pool = Pool(s, hkv, hq, bs, device=TRITON_DEVICE if backend == "triton" else "cpu",
                sliding=sliding[0] if sliding else None)
    assert kernels.supports(pool.lay.key_codec, pool.lay.value_codec)
    # histories: none, shorter than sinks + window, straddling blocks, several blocks
    short = max(1, pool.lay.sinks + pool.lay.window - 2)
    pool.step({"a": 0 + 1, "b": short, "c": 2 * bs + 3, "d": bs})
    seen = []

    def compare(args, kw):
        ref = paged_decode_reference(*args, **kw)
        got = paged_decode_kernel(*args, **kw, backend=backend)
        _close(got, ref)
        seen.append(args[0].shape[0])

    for _ in range(2 if backend == "triton" else 3):
        pool.step({"a": 1, "b": 1, "c": 1, "d": 1}, compare=compare)
    pool.step({"e": 1, "b": 1, "c": 5}, compare=compare)  # a new one-token sequence beside a chunk row
    assert seen[:2] == [4, 4] and seen[-1] == 2


def test_decode_function_follows_the_setting():
    assert decode_function(VLLMSettings()) is paged_decode_kernel
    assert decode_function(VLLMSettings(decode="torch")) is paged_decode_reference
    with pytest.raises(ValueError, match="decode"):
        VLLMSettings(decode="cuda")


def test_forward_batch_with_the_kernel_equals_the_reference_run():
    """Two identical pools, one served by the kernel and one by the reference, over mixed steps."""
    s = VLLMSettings(preset="tq-k45v3", sinks=2, window=4)
    a, b = Pool(s, 2, 6, 16, seed=3), Pool(s, 2, 6, 16, seed=3)
    for chunks in ({"x": 20, "y": 1}, {"x": 1, "y": 1, "z": 7}, {"x": 1, "y": 1, "z": 1}, {"y": 1, "z": 1}):
        got = a.step(chunks, decode=decode_function(s))
        ref = b.step(chunks, decode=paged_decode_reference)
        _close(got, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("decode", ["kernel", "reference"])
def test_forward_batch_writes_the_output_buffer(dtype, decode):
    """forward_batch(out=...) (vLLM's output buffer, the model's dtype): decode-only steps written in place by the C
    kernel, mixed steps row by row; equal bit for bit to the float32 result converted with ``.to()``."""
    s = VLLMSettings(preset="tq-k45v3", sinks=2, window=4)
    fn = decode_function(s) if decode == "kernel" else paged_decode_reference
    a, b = Pool(s, 2, 6, 16, seed=4), Pool(s, 2, 6, 16, seed=4)
    for chunks in ({"x": 20, "y": 1}, {"x": 1, "y": 1}, {"x": 1, "y": 1, "z": 7}, {"x": 1, "y": 1, "z": 1}):
        got = a.step(chunks, decode=fn, out_dtype=dtype)
        ref = b.step(chunks, decode=fn)
        assert got.dtype == dtype and torch.equal(got, ref.to(dtype)), chunks


def test_code_ranges_and_exact_rows():
    # block 16: within block 0 the window is its last 3; past it, the last 2 + 3 (the sink slots ring there too)
    start, end = code_ranges(torch.tensor([0, 1, 3, 4, 10, 16, 17, 20, 40]), sinks=2, window=3, block_size=16)
    assert start.tolist() == [0, 1, 2, 2, 2, 2, 2, 2, 2] and end.tolist() == [0, 1, 2, 2, 7, 13, 13, 15, 35]
    # a sliding window of 8: the current token (position n) sees positions n - 7 ... n - 1 of its history
    start, end = code_ranges(torch.tensor([0, 5, 8, 10, 40]), sinks=0, window=3, sliding_window=8, block_size=16)
    assert start.tolist() == [0, 0, 1, 3, 33] and end.tolist() == [0, 2, 5, 7, 37]
    with pytest.raises(ValueError, match="sliding window"):
        decode_rows(torch.tensor([[0]]), torch.tensor([3]), block_size=8, sinks=0, window=8, sliding_window=8)
    for bad in (0, 8.0, True):
        with pytest.raises(ValueError, match="sliding_window"):
            code_ranges(torch.tensor([5]), sinks=0, window=3, sliding_window=bad, block_size=16)
    table = torch.tensor([[5, 6, 7], [1, 2, 3]])
    rows = decode_rows(table, torch.tensor([3, 20]), block_size=8, sinks=2, window=3)
    # sequence 0 (3 tokens): sinks 0, 1 and window token 2; sequence 1: sinks 0, 1, window 15 ... 19 (past block 0
    # the last sinks + window: 15 in block 1 of the table, 16-19 in block 2, at slot t % 5)
    assert rows.valid.tolist() == [[True, True, True, False, False, False, False], [True] * 7]
    assert rows.blocks[1, 0].tolist() == [1, 1, 2, 3, 3, 3, 3] and rows.slots[1, 0].tolist() == [0, 1, 0, 1, 2, 3, 4]


def test_kernel_decode_refuses_bad_heads():
    s = VLLMSettings(preset="tq-k45v3")
    pool = Pool(s, 2, 6, 16)
    pool.step({"a": 9})

    def compare(args, kw):
        with pytest.raises(ValueError, match="num_kv_heads"):
            paged_decode_kernel(*args, **{**kw, "num_kv_heads": 4})

    pool.step({"a": 1}, compare=compare)
