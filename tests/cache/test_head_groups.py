"""Widths per KV head (#14): a layer whose runs of KV heads have codecs of their own (``LayerStore.assign_heads``)
holds, attends, crops, selects and undoes on each run of heads exactly as a store coding every head with that run's
codecs does on those heads."""

from dataclasses import replace

import pytest
import torch

from qjl import kernels
from qjl.cache.attention import attend
from qjl.cache.config import CodecSpec, QJLConfig
from qjl.cache.storage import LayerStore

# two pairs of different widths (the vector keys and cycled values auto uses, and wider scalar ones)
A = (CodecSpec("turboquant_vq", {"bits": 3, "correct_norm": True}),
     CodecSpec("turboquant_mse", {"bits": 2, "correct_norm": True, "cycles": 8, "norm_dtype": "fp8"}))
B = (CodecSpec("turboquant_mse", {"bits": 5, "correct_norm": True}),
     CodecSpec("turboquant_mse", {"bits": 4, "correct_norm": True, "cycles": 8}))
B_, H, HQ, D, LAYER = 2, 3, 6, 64, 5  # KV heads 0-1 coded with A, head 2 with B; two query heads per KV head
SPLIT = [slice(0, 2), slice(2, 3)]

KERNELS = ["torch"] + (["cpu"] if kernels.cpu_available() else [])


def _configs(kernel: str, heavy: int = 2):
    auto = QJLConfig.auto(3.0, residual_length=8, flush_block=4, sink_tokens=2, heavy_tokens=heavy, kernel=kernel)
    one = lambda pair: replace(auto, allocation=None, key=pair[0], value=pair[1], late_key=None)  # noqa: E731
    return auto, one(A), one(B)


def _grouped(auto):
    """A pending store of the auto config, given A on heads 0-1 and B on head 2 (the codecs built with the layer's
    seeds, as the allocation's candidates are)."""
    store = LayerStore(LAYER, auto)
    seed = auto.seed + 1000 * LAYER
    return store, [(heads, k, v, (k.build(D, seed), v.build(D, seed + 1))) for heads, (k, v) in zip(SPLIT, (A, B))]


def _step(store, k, v, q, mask, assign=None):
    """One forward through a store as the transformers layer runs it -> attention [B, t, H_q, D]."""
    store.append(k, v)
    store.before_attention(mask, q, 0.125)
    if assign is not None and store.pending:
        store.assign_heads(assign)
    out = attend(store, q, mask, 0.125)
    store.after_attention()
    return out


def _same_on_heads(out, refs):
    """out [B, t, H_q, D] against the references on the query heads of each run (two per KV head)."""
    for heads, ref in zip(SPLIT, refs):
        rows = slice(2 * heads.start, 2 * heads.stop)
        torch.testing.assert_close(out[:, :, rows], ref[:, :, rows], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_head_groups_attend_like_one_pair_per_store(kernel):
    """Prefill, then chunks and decode steps (masked and not: the kernels' decode call, their rows with a mask,
    SDPA and the reference path) after the codes form, heavy tokens, sinks, key and value means included."""
    auto, ca, cb = _configs(kernel)
    g = torch.Generator().manual_seed(3)
    stores = [_grouped(auto), (LayerStore(LAYER, ca), None), (LayerStore(LAYER, cb), None)]
    for t in (40, 7, 1, 1, 20, 12, 1):  # (20 tokens: 40 rows a KV head, beyond the kernels: SDPA)
        k, v = torch.randn(B_, H, t, D, generator=g), torch.randn(B_, H, t, D, generator=g)
        q = torch.randn(B_, HQ, t, D, generator=g)
        n = stores[1][0].seq_length() + t
        mask = None if t == 1 else torch.zeros(B_, 1, t, n).masked_fill(
            torch.ones(t, n, dtype=torch.bool).triu(n - t + 1), float("-inf"))
        outs = [_step(s, k, v, q, mask, assign) for s, assign in stores]
        _same_on_heads(outs[0], outs[1:])
    grouped = stores[0][0]
    assert grouped.groups is not None and grouped.n_codes > 0 and not grouped.pending
    assert grouped.n_codes == stores[1][0].n_codes and grouped.seq_length() == stores[1][0].seq_length()
    if kernel == "cpu":
        assert all(gr.kernel_ok for gr in grouped.groups)


def test_head_groups_hold_each_runs_codes_and_nothing_else():
    """The codes held are each run's own: the bytes of a run equal its share of the one-pair store's, and the
    layer's whole code bytes their sum; the grouped store refuses to hand out one pair's codes."""
    auto, ca, cb = _configs("torch")
    g = torch.Generator().manual_seed(4)
    k, v, q = torch.randn(1, H, 60, D, generator=g), torch.randn(1, H, 60, D, generator=g), torch.randn(1, HQ, 60, D)
    (grouped, runs), sa, sb = _grouped(auto), LayerStore(LAYER, ca), LayerStore(LAYER, cb)
    _step(grouped, k, v, q, None, runs)
    _step(sa, k, v, q, None)
    _step(sb, k, v, q, None)
    for s in (grouped, sa, sb):
        s.flush()
    assert grouped.n_codes == sa.n_codes == sb.n_codes > 0
    parts = grouped.nbytes()
    want = {p: (2 * sa.nbytes()[p] + sb.nbytes()[p]) / 3 for p in ("key_codes", "value_codes")}
    assert parts["key_codes"] == pytest.approx(want["key_codes"], rel=0.02)
    assert parts["value_codes"] == pytest.approx(want["value_codes"], rel=0.02)
    for run, other in zip(grouped.groups, (sa, sb)):
        mine, theirs = run.kc.view(), other.key_codes
        for name, t in mine.fields.items():
            assert torch.equal(t, theirs.fields[name][:, run.heads]), name
    with pytest.raises(RuntimeError, match="groups"):
        grouped.key_codes  # noqa: B018
    with pytest.raises(RuntimeError, match="groups"):
        grouped.kernel_fields()


def test_head_groups_count_their_copies_of_the_value_mean():
    """Each run keeps a contiguous copy of its rows of the value mean for the kernels (where its rows are not
    contiguous in the store's: a batch of 2); those copies are storage held, counted under 'smoothing'."""
    auto, _, _ = _configs("torch")
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(B_, H, 40, D, generator=g), torch.randn(B_, H, 40, D, generator=g)
    grouped, runs = _grouped(auto)
    _step(grouped, k, v, torch.randn(B_, HQ, 40, D, generator=g), None, runs)
    _step(grouped, k[:, :, :1], v[:, :, :1], torch.randn(B_, HQ, 1, D, generator=g), None)  # a decode step
    means = [grouped.mu, grouped.mu_v]
    copies = [run.mean[1] for run in grouped.groups if run.mean is not None]
    assert all(m is not None for m in means) and len(copies) == len(grouped.groups)
    ptrs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in means + copies}
    assert len(ptrs) == len(means) + len(copies)  # (each copy its own storage)
    assert grouped.nbytes()["smoothing"] == sum(ptrs.values())


@pytest.mark.parametrize("kernel", KERNELS)
def test_head_groups_crop_select_and_undo(kernel):
    """Crop into the codes, batch selection and snapshot / restore apply to every run's codes alike (no heavy
    tokens: a crop below them is refused)."""
    auto, ca, cb = _configs(kernel, heavy=0)
    g = torch.Generator().manual_seed(5)
    stores = [_grouped(auto), (LayerStore(LAYER, ca), None), (LayerStore(LAYER, cb), None)]
    k, v, q = (torch.randn(B_, H, 50, D, generator=g), torch.randn(B_, H, 50, D, generator=g),
               torch.randn(B_, HQ, 50, D, generator=g))
    for s, assign in stores:
        _step(s, k, v, q, None, assign)
        s.flush()
    snaps = [s.snapshot() for s, _ in stores]
    for s, _ in stores:
        s.crop(20)  # the window and codes
        s.select(torch.tensor([1, 1, 0]))
    assert stores[0][0].n_codes == stores[1][0].n_codes and stores[0][0].batch == 3
    q1 = torch.randn(3, HQ, 1, D, generator=g)
    k1, v1 = torch.randn(3, H, 1, D, generator=g), torch.randn(3, H, 1, D, generator=g)
    outs = [_step(s, k1, v1, q1, None) for s, _ in stores]
    _same_on_heads(outs[0], outs[1:])
    for (s, _), snap in zip(stores, snaps):
        s.restore(snap)
    assert stores[0][0].batch == B_ and stores[0][0].n_codes == stores[1][0].n_codes
    q2 = torch.randn(B_, HQ, 1, D, generator=g)
    k2, v2 = torch.randn(B_, H, 1, D, generator=g), torch.randn(B_, H, 1, D, generator=g)
    outs = [_step(s, k2, v2, q2, None) for s, _ in stores]
    _same_on_heads(outs[0], outs[1:])


def test_assign_heads_names_what_is_wrong():
    auto, _, _ = _configs("torch")
    store, runs = _grouped(auto)
    store.append(torch.randn(1, H, 20, D), torch.randn(1, H, 20, D))
    with pytest.raises(ValueError, match="at least two"):
        store.assign_heads(runs[:1])
    with pytest.raises(ValueError, match="cover"):
        store.assign_heads([(slice(0, 1),) + runs[0][1:], runs[1]])  # head 1 missing
    with pytest.raises(ValueError, match="cover"):
        store.assign_heads([runs[0], (slice(2, 4),) + runs[1][1:]])  # beyond the heads
    split = CodecSpec("turboquant_split", {"bits": 3})
    with pytest.raises(ValueError, match="fit"):
        store.assign_heads([runs[0][:3] + ((split.build(D, 0), runs[0][3][1]),), runs[1]])
    assert store.pending and store.groups is None  # nothing changed
    store.assign_heads(runs)
    with pytest.raises(RuntimeError, match="already"):
        store.assign_heads(runs)


def _decode_ready(auto, runs, g, n=40):
    """A store of ``auto`` given ``runs`` (None: A for the layer) after an ``n``-token prefill and a flush: codes,
    sinks, a window and both means, ready for decode steps."""
    store = LayerStore(LAYER, auto)
    k, v = torch.randn(B_, H, n, D, generator=g), torch.randn(B_, H, n, D, generator=g)
    _step(store, k, v, torch.randn(B_, HQ, n, D, generator=g), None, runs)
    if runs is None and store.pending:  # (a one-pair store of A, with the codecs the runs are given)
        seed = auto.seed + 1000 * LAYER
        store.assign(*A, codecs=(A[0].build(D, seed), A[1].build(D, seed + 1)))
    store.flush()
    return store


@pytest.mark.skipif(not kernels.cpu_available(), reason="the C kernel does not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_groups_decode_in_one_call(dtype, monkeypatch, two_threads):
    """A decode step of a store coded in runs of KV heads is one C call over every run (DecodeHeads): runs that
    share one pair of codecs give the one-pair store's output bit for bit (the same work items and sums), runs of
    their own codecs each run's own call's output (within float error: the items' splits are chosen for all runs
    together), value means and sinks included, at batch 2 and in bf16."""
    from qjl.kernels.cpu import launch

    calls = []
    real = launch.DecodeHeads.__call__
    monkeypatch.setattr(launch.DecodeHeads, "__call__", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    auto, _, _ = _configs("cpu", heavy=0)
    g = torch.Generator().manual_seed(7)
    same = [(heads, *A, (A[0].build(D, auto.seed + 1000 * LAYER), A[1].build(D, auto.seed + 1000 * LAYER + 1)))
            for heads in (slice(0, 1), slice(1, 2), slice(2, 3))]
    # (600 tokens on two threads: a run alone would split its codes into two work items, the layer's call not)
    one = _decode_ready(auto, None, torch.Generator().manual_seed(7), 600)
    runs_same = _decode_ready(auto, same, torch.Generator().manual_seed(7), 600)
    _, runs = _grouped(auto)
    mixed = _decode_ready(auto, runs, torch.Generator().manual_seed(7))
    assert one.groups is None and runs_same.groups is not None and mixed.groups is not None
    assert one.mu_v is not None and one.sink_k is not None and one.n_codes > 0
    for _ in range(3):
        q = torch.randn(B_, HQ, 1, D, generator=g).to(dtype)
        k, v = torch.randn(B_, H, 1, D, generator=g), torch.randn(B_, H, 1, D, generator=g)
        n0 = len(calls)
        ref = _step(one, k, v, q, None)
        got = _step(runs_same, k, v, q, None)
        assert len(calls) == n0 + 1 and got.dtype == dtype
        assert torch.equal(got, ref)
        out = _step(mixed, k, v, q, None)
        assert len(calls) == n0 + 2
        for view in mixed.head_views():  # each run alone (its own DecodeCall), its value mean added
            rows = slice(2 * view.head_slice.start, 2 * view.head_slice.stop)
            alone = attend(view, q[:, rows], None, 0.125)
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out[:, :, rows], alone, rtol=tol, atol=tol)
    assert not torch.equal(out[:, :, :4], out[:, :, 4:].repeat(1, 1, 2, 1))  # (the runs' codecs differ)


@pytest.fixture
def two_threads():
    """The kernels' calls on two threads (the suite runs on one): their work items split by the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not kernels.cpu_available(), reason="the C kernel does not build here")
def test_decode_heads_names_what_is_wrong():
    from qjl.kernels.cpu import launch

    auto, _, _ = _configs("cpu", heavy=0)
    g = torch.Generator().manual_seed(8)
    store, runs = _grouped(auto)
    store = _decode_ready(auto, runs, g)
    q = torch.randn(B_, H, 2, D, generator=g)
    calls = []
    for view in store.head_views():
        kf, vf, cap = view.kernel_fields()
        step = launch.DecodeStep(torch.arange(B_, dtype=torch.int32)[:, None], cap,
                                 torch.zeros(B_, dtype=torch.int32), torch.full((B_,), store.n_codes,
                                                                                 dtype=torch.int32), segments=1)
        calls.append(launch.DecodeCall(q[:, view.head_slice].contiguous(), view.key_codec, kf, view.value_codec, vf,
                                       step))
    with pytest.raises(TypeError, match="calls"):
        launch.DecodeHeads([])
    with pytest.raises(ValueError, match="mean"):
        launch.DecodeHeads(calls, mean=torch.zeros(B_, H + 1, D))
    heads = launch.DecodeHeads(calls)
    segs = ((store.keys, store.values),)
    out = torch.empty(B_, H, 2, D)
    with pytest.raises(ValueError, match="q must be"):
        heads(q[:, :2].contiguous(), segs, q_scale=0.125, out=out)
    with pytest.raises(ValueError, match="out must be"):
        heads(q, segs, q_scale=0.125, out=out.double())
    with pytest.raises(ValueError, match="segments"):
        heads(q, segs * 2, q_scale=0.125, out=out)
    with pytest.raises(ValueError, match="q_scale"):
        heads(q, segs, q_scale=float("nan"), out=out)
    heads(q, segs, q_scale=0.125, out=out)
    for i, view in enumerate(store.head_views()):  # every run's rows as its own call writes them
        alone = torch.empty(B_, view.heads, 2, D)
        calls_i = calls[i]
        calls_i(q[:, view.head_slice].contiguous(), ((store.keys[:, view.head_slice],
                                                      store.values[:, view.head_slice]),),
                q_scale=0.125, out=alone)
        torch.testing.assert_close(out[:, view.head_slice], alone, rtol=1e-6, atol=1e-6)
