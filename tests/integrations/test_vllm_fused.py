"""A decode-only step of a layer in one C call (:mod:`qjl.integrations.vllm.fused`) against the backend's general
path (key smoothing, code store, attention and exact copies called apart): two identical page pools, one served by
each, must hold the same bytes and give the same outputs, bit for bit, step after step; steps the one call does not
serve are left to the general path untouched.  No vLLM import."""

import pytest
import torch

from qjl import kernels
from qjl.integrations.vllm.decode import paged_decode_kernel
from qjl.integrations.vllm.fused import fused_decode
from qjl.integrations.vllm.layout import layer_layout
from qjl.integrations.vllm.paged import page_fields
from qjl.integrations.vllm.settings import VLLMSettings
from qjl.integrations.vllm.smoothing import smooth_keys, smooth_values
from qjl.integrations.vllm.step import StepPlan, forward_batch
from qjl.integrations.vllm.writes import write_codes

pytestmark = pytest.mark.skipif(not kernels.cpu_available(), reason="no C build")

D = 64
SCALE = D ** -0.5


class Twin:
    """Two copies of one layer's page pool (shuffled blocks), fed the same steps."""

    def __init__(self, settings, hkv=2, hq=6, block_size=16, sliding=None, dtype=torch.bfloat16, seed=0):
        self.lay = layer_layout(settings, 20, 30, D, block_size, dtype, sliding_window=sliding)
        pages = torch.zeros(40, hkv, block_size, self.lay.content_bytes // dtype.itemsize, dtype=dtype)
        self.pages = [pages, pages.clone()]
        self.fields = [page_fields(self.lay, p) for p in self.pages]
        self.gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(40, generator=self.gen).tolist()
        self.hkv, self.hq, self.bs, self.dtype = hkv, hq, block_size, dtype
        self.blocks, self.lens = {}, {}

    def plan(self, chunks: dict):
        qsl, lens = [0], []
        for i, c in chunks.items():
            n0 = self.lens.get(i, 0)
            bl = self.blocks.setdefault(i, [])
            while len(bl) * self.bs < n0 + c:
                bl.append(self.free.pop())
            self.lens[i] = n0 + c
            qsl.append(qsl[-1] + c), lens.append(n0 + c)
        width = max(len(self.blocks[i]) for i in chunks) + 1
        table = torch.tensor([self.blocks[i] + [0] * (width - len(self.blocks[i])) for i in chunks])
        lay = self.lay
        return StepPlan.build(torch.tensor(qsl), torch.tensor(lens), table, lay.block_size, lay.sinks, lay.window,
                              sliding_window=lay.sliding_window)

    def tokens(self, t, scale=2.0):
        x = lambda *s: (torch.randn(*s, generator=self.gen) * scale).to(self.dtype)  # noqa: E731
        return x(t, self.hq, D), x(t, self.hkv, D), x(t, self.hkv, D)

    def general(self, which, plan, q, k, v, out_dtype):
        """What the backend's forward does without the one call."""
        lay, fields = self.lay, self.fields[which]
        out = torch.full(q.shape, 7.0, dtype=out_dtype)
        if lay.smooth_keys:
            k = smooth_keys(fields, plan, k)
        mu = None
        if lay.smooth_values:
            v, mu = smooth_values(fields, plan, q, k, v, SCALE)
        write_codes(lay, fields, k, v, None, plan=plan)
        got = forward_batch(lay, fields, q, k, v, plan.block_table, plan.query_start_loc, plan.seq_lens, SCALE,
                            paged_decode_kernel, plan=plan, out=None if mu is not None else out)
        if mu is not None:
            got.view(q.shape[0], self.hkv, -1, D).add_(mu.unsqueeze(2))
            out.copy_(got)
        return out

    def step(self, chunks: dict, out_dtype=torch.bfloat16, fused_expected=True, scale=2.0):
        plan = self.plan(chunks)
        q, k, v = self.tokens(plan.query_start_loc[-1].item(), scale)
        out = torch.full(q.shape, 7.0, dtype=out_dtype)
        got = fused_decode(self.lay, self.fields[0], plan, q, k, v, SCALE, out)
        assert (got is not None) == fused_expected, chunks
        if got is None:
            got = self.general(0, plan, q, k, v, out_dtype)
        else:
            assert got is out
        want = self.general(1, plan, q, k, v, out_dtype)
        assert torch.equal(got, want), chunks
        assert torch.equal(self.pages[0].view(torch.uint8), self.pages[1].view(torch.uint8)), chunks
        return got


CASES = [  # (preset, settings overrides, KV heads, query heads, block size, sliding window)
    ("tq-k3v2", {}, 3, 9, 16, None),  # the 5x preset as served: 4 sinks, no window, key smoothing
    ("tq-k45v3", {}, 2, 6, 16, None),  # the default: key and value smoothing, 4 sinks, a window of 4
    ("tq-k45v3", {"smooth_keys": False}, 2, 4, 16, None),  # value smoothing alone
    ("tq-k45v3", {"smooth_values": False, "window": 4}, 2, 6, 16, None),  # exact window copies every step
    ("tq-k3v2", {"smooth_keys": False, "sinks": 0}, 2, 4, 8, None),  # no smoothing, no exact slot
    ("tq-k45v3", {"sinks": 2, "window": 5}, 2, 6, 16, 20),  # a sliding-window layer (no means kept)
    ("tqv-k3v2", {}, 3, 9, 16, None),  # vector codebooks, values over 8 rotations in turn (their positions)
    ("tqv-k3v2", {"smooth_keys": False, "sinks": 0}, 2, 4, 8, None),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-sw{c[5]}" for c in CASES])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_one_call_equals_the_general_path(case, out_dtype):
    preset, over, hkv, hq, bs, sliding = case
    twin = Twin(VLLMSettings(preset=preset, **over), hkv, hq, bs, sliding=sliding)
    twin.step({"a": 40, "b": 3, "c": 2 * bs + 5}, out_dtype, fused_expected=False)  # prefill: the general path
    for _ in range(3):
        twin.step({"a": 1, "b": 1, "c": 1}, out_dtype)
    twin.step({"a": 1, "d": 1}, out_dtype, fused_expected=False)  # d starts: its key mean is taken now
    twin.step({"a": 1, "c": 1, "d": 1}, out_dtype)
    twin.step({"a": 1, "c": 4}, out_dtype, fused_expected=False)  # a chunk row beside a decode row


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[5], CASES[6]], ids=["5x", "default", "sliding", "5x-vq"])
def test_a_kept_store_serves_steps_that_differ(case):
    """A layer's DecodeStore fills one kept struct in place: steps of other batch sizes, with and without exact
    rows, and outputs of other dtypes, one after another, each equal bit for bit to the general path (nothing of
    one step's fields is left for the next)."""
    preset, over, hkv, hq, bs, sliding = case
    twin = Twin(VLLMSettings(preset=preset, **over), hkv, hq, bs, sliding=sliding)
    twin.step({"a": 40, "b": 3, "c": 2 * bs + 5}, fused_expected=False)
    for chunks, dtype in (({"a": 1, "b": 1, "c": 1}, torch.bfloat16), ({"b": 1}, torch.float32),
                          ({"a": 1, "c": 1}, torch.bfloat16), ({"a": 1, "b": 1, "c": 1}, torch.float32),
                          ({"c": 1}, torch.bfloat16)):
        twin.step(chunks, dtype)


def test_fp16_pages_and_an_output_it_leaves_alone():
    """fp16 pages and outputs are served bit for bit too; an output buffer that is not contiguous is left to the
    general path (None, nothing stored)."""
    fp16 = Twin(VLLMSettings(preset="tq-k3v2"), dtype=torch.float16)
    fp16.step({"a": 30}, fused_expected=False)
    fp16.step({"a": 1}, torch.float16)
    plan = fp16.plan({"a": 1})
    q, k, v = fp16.tokens(1)
    before = fp16.pages[0].clone()
    strided = torch.empty(1, 6, 2 * D, dtype=torch.float16)[:, :, ::2]
    assert fused_decode(fp16.lay, fp16.fields[0], plan, q, k, v, SCALE, strided) is None
    assert torch.equal(fp16.pages[0].view(torch.uint8), before.view(torch.uint8))


def test_a_non_finite_key_stores_nothing():
    twin = Twin(VLLMSettings(preset="tq-k3v2"))
    twin.step({"a": 30, "b": 20}, fused_expected=False)
    before = twin.pages[0].clone()
    plan = twin.plan({"a": 1, "b": 1})
    q, k, v = twin.tokens(2)
    k[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN|finite"):
        fused_decode(twin.lay, twin.fields[0], plan, q, k, v, SCALE, torch.empty(2, 6, D, dtype=torch.bfloat16))
    assert torch.equal(twin.pages[0].view(torch.uint8), before.view(torch.uint8))


def test_decode_store_checks_what_changes_per_step():
    """The DecodeStore a layer keeps (qjl.kernels.cpu.launch): wrong tensors, positions beyond the pages and a key
    mean's block outside its field are refused by name with nothing stored; a buffer that moved is seen."""
    from qjl.kernels.cpu.launch import DecodeStore, store_bounds
    from qjl.kernels.encode import encode_store
    from qjl.kernels.paged import PagedField, role_fields
    from qjl.integrations.vllm.writes import c_store_jobs

    twin = Twin(VLLMSettings(preset="tq-k3v2"), hkv=2, hq=4)
    twin.step({"a": 30, "b": 20}, fused_expected=False)
    lay, fields = twin.lay, twin.fields[0]
    plan = twin.plan({"a": 1, "b": 1})
    q, k, v = twin.tokens(2)
    ex = (fields["exact.key"], fields["exact.value"])
    step = plan.decode.cpu_step(ex, 2, True)
    store = encode_store(c_store_jobs(lay, fields, k, v), fields.memo)[0]
    kf, vf = role_fields(fields, "key"), role_fields(fields, "value")
    qr = q.reshape(2, 2, 2, D)
    one = DecodeStore(qr, lay.key_codec, kf, lay.value_codec, vf, step, store, mu_field=fields["smooth.key"],
                      exact_fields=ex)
    assert one.served and one.holds(lay.key_codec, kf, lay.value_codec, vf, store, fields["smooth.key"], ex)
    before = twin.pages[0].clone()
    bounds = plan.store_bounds()
    with pytest.raises(ValueError, match="key must be"):
        one(qr, k[:1], v, step, bounds)
    with pytest.raises(ValueError, match="q must be"):
        one(qr[:, :1], k, v, step, bounds)
    far = store_bounds(torch.tensor([0, 10 ** 6]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="bounds"):
        one(qr, k, v, step, far)
    with pytest.raises(TypeError, match="FieldMaps"):
        DecodeStore(qr, lay.key_codec, dict(kf), lay.value_codec, vf, step, store, exact_fields=ex)
    f = fields["smooth.key"]  # means in a buffer that holds one block: the sequences' block 0 lies beyond it
    small = PagedField(f.buffer[:f.stride_block], f.offset, f.stride_block, f.stride_head, f.stride_token, f.dtype,
                       f.shape)
    if int(plan.block_table[:, 0].max()) > 0:
        cramped = DecodeStore(qr, lay.key_codec, kf, lay.value_codec, vf, step, store, mu_field=small,
                              exact_fields=ex)
        with pytest.raises(ValueError, match="block 0 outside"):
            cramped(qr, k, v, step, bounds)
    # exact copies written by the call (the backend's write_exact): refused without write_fields, by shape and dtype,
    # and (checked in C before anything is stored) outside their buffer or of a row not in the step
    rows, offs = torch.tensor([0, 1]), torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="without write_fields"):
        one(qr, k, v, step, bounds, writes=(rows, offs, offs))
    writer = DecodeStore(qr, lay.key_codec, kf, lay.value_codec, vf, step, store, mu_field=fields["smooth.key"],
                         exact_fields=ex, write_fields=ex)
    with pytest.raises(ValueError, match="k_off must be"):
        writer(qr, k, v, step, bounds, writes=(rows, offs.int(), offs))
    room = ex[0].buffer.numel()
    for bad_rows, bad_off in ((rows, torch.full((2, 2), room - 1)), (rows, torch.full((2, 2), -2)),
                              (torch.tensor([0, 2]), offs)):
        with pytest.raises(ValueError, match="writes: an exact copy"):
            writer(qr, k, v, step, bounds, writes=(bad_rows, bad_off, offs))
    assert torch.equal(twin.pages[0].view(torch.uint8), before.view(torch.uint8))
    assert one.unmoved()
    buf = fields["key.codes"].buffer  # (every field's buffer: the layer's bytes) swapped for a copy in place
    buf.set_(buf.clone().untyped_storage())
    assert not one.unmoved()
    with pytest.raises(ValueError, match="moved"):
        one(qr, k, v, step, bounds)


def test_values_over_rotations_in_turn_need_the_tokens_positions():
    """A store whose value job codes by position (tqv-k3v2's values over 8 rotations in turn): a call without the
    tokens' positions, or with negative ones, is refused by name before anything is stored; with them it stores what
    the general path stores (test_one_call_equals_the_general_path)."""
    from qjl.kernels.cpu.launch import DecodeStore
    from qjl.kernels.encode import encode_store
    from qjl.kernels.paged import role_fields
    from qjl.integrations.vllm.writes import c_store_jobs

    twin = Twin(VLLMSettings(preset="tqv-k3v2"), hkv=2, hq=4)
    twin.step({"a": 30, "b": 20}, fused_expected=False)
    lay, fields = twin.lay, twin.fields[0]
    plan = twin.plan({"a": 1, "b": 1})
    q, k, v = twin.tokens(2)
    ex = (fields["exact.key"], fields["exact.value"]) if lay.sinks + lay.window else None
    step = plan.decode.cpu_step(ex, 2, True)
    store = encode_store(c_store_jobs(lay, fields, k, v), fields.memo)[0]
    assert store.positional
    qr = q.reshape(2, 2, 2, D)
    one = DecodeStore(qr, lay.key_codec, role_fields(fields, "key"), lay.value_codec, role_fields(fields, "value"),
                      step, store, mu_field=fields["smooth.key"], exact_fields=ex if step.rows is not None else None)
    before = twin.pages[0].clone()
    for bad in (None, torch.tensor([29, -1]), torch.tensor([29])):
        with pytest.raises(ValueError, match="positions"):
            one(qr, k, v, step, plan.store_bounds(), positions=bad)
    assert torch.equal(twin.pages[0].view(torch.uint8), before.view(torch.uint8))
    rc, *_ = one(qr, k, v, step, plan.store_bounds(), positions=plan.write_positions)
    assert rc == 0 and not torch.equal(twin.pages[0].view(torch.uint8), before.view(torch.uint8))
