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
