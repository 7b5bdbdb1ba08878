"""LayerStore: owned storage, honest bytes, cheap growth, all-or-nothing updates (issue #11)."""

import pytest
import torch

from qjl import CodecSpec, QJLConfig
from qjl.cache.buffers import storage_bytes
from qjl.cache.storage import LayerStore
from cache_state import same, state

TQ = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 4}), value=CodecSpec("turboquant_mse", {"bits": 3}),
               late_key=None, residual_length=8, flush_block=4, sink_tokens=2)
FP8 = QJLConfig.preset("tq-k3v2", residual_length=8, flush_block=4, sink_tokens=2, late_key=None)
KIVI = QJLConfig(key=CodecSpec("kivi", {"bits": 4, "group_size": 4}), value=CodecSpec("uniform", {"bits": 4}),
                 late_key=None, residual_length=8, flush_block=4, sink_tokens=2)


def _kv(t, b=1, h=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)


def test_store_owns_its_tensors():
    """Nothing the store holds shares storage with the caller's tensors (#11.1): the prompt can be freed."""
    store = LayerStore(0, TQ)
    k, v = _kv(40)
    store.append(k, v)
    store.flush()
    held = storage_bytes(t for ts in store.parts().values() for t in ts)
    assert k.untyped_storage().data_ptr() not in held and v.untyped_storage().data_ptr() not in held
    before = state(store)
    k.fill_(7.0)
    v.fill_(7.0)
    assert same(state(store), before)
    assert store.n_sink == 2 and store.n_codes == 28 and store.n_window == 10


def test_nbytes_counts_the_storage_held():
    """nbytes() is the storage behind every tensor, capacity included, each storage once."""
    store = LayerStore(0, TQ)
    for step in range(60):
        store.append(*_kv(1 if step else 30, seed=step))
        store.flush()
        held = sum(storage_bytes(t for ts in store.parts().values() for t in ts).values())
        assert sum(store.nbytes().values()) == held
    codes = store.key_codes
    used = sum(t.numel() * t.element_size() for t in codes.fields.values())
    assert used <= store.nbytes()["key_codes"] <= used * (1 + 1 / 64) + 4 * 2 * 34  # spare <= 1/64 or one block


def test_code_growth_is_amortized():
    """Flushing token after token copies O(N) code bytes in all (geometric growth), not O(N^2): here at
    most GROWTH + 6 copies per token, where a concatenation per flush copies N / 2 per token (750)."""
    from qjl.cache.buffers import GROWTH

    store = LayerStore(0, QJLConfig(residual_length=4, flush_block=1, sink_tokens=0, late_key=None, kernel="torch"))
    store.append(*_kv(8))
    copied, last = 0, None
    for step in range(1500):
        store.append(*_kv(1, seed=step))
        store.flush()
        ptr = store.key_codes.fields["codes"].untyped_storage().data_ptr()
        if last is not None and ptr != last:
            copied += store.n_codes - 1  # a reallocation copies the codes held before this flush
        last = ptr
    assert store.n_codes == 1504
    assert copied <= (GROWTH + 6) * store.n_codes, copied
    assert store.nbytes()["key_codes"] <= (1 + 1 / GROWTH) * 1504 * 2 * (64 * 4 // 8 + 2) + 2 * 34


@pytest.mark.parametrize("bad,match", [
    (lambda k, v: (k[:, :, :4], v[:, :, :5]), "same \\[B, H_kv, t\\]"),
    (lambda k, v: (k.masked_fill(torch.rand_like(k) < 0.01, float("nan")), v), "NaN or Inf"),
    (lambda k, v: (k, v.masked_fill(torch.rand_like(v) < 0.01, float("inf"))), "NaN or Inf"),
    (lambda k, v: (k[:, :1], v[:, :1]), "holds B=1, H_kv=2"),
    (lambda k, v: (k[..., :32], v), "key dim 64"),
    (lambda k, v: (k.long(), v), "floating"),
    (lambda k, v: (k[0], v[0]), "4 dimensions"),
    (lambda k, v: ("keys", v), "torch.Tensor"),
])
def test_rejected_update_changes_nothing(bad, match):
    """#11.2/#11.5: a rejected update raises on the call that brings it and leaves the store as it was."""
    store = LayerStore(0, TQ)
    store.append(*_kv(20))
    store.flush()
    before = state(store)
    with pytest.raises((TypeError, ValueError), match=match):
        store.append(*bad(*_kv(5, seed=1)))
    assert same(state(store), before)
    store.append(*_kv(1, seed=2))  # and it goes on working
    assert store.seq_length() == 21


def test_norm_beyond_the_norm_dtype_is_refused_on_arrival():
    """#11.3: the 5x preset stores value norms in fp8 (max 448): a value of norm 1e5 is refused by the
    update that brings it, naming the option to change -- not accepted and failing at a later flush."""
    store = LayerStore(0, FP8)
    store.append(*_kv(20))
    before = state(store)
    k, v = _kv(1, seed=3)
    with pytest.raises(ValueError, match="norm_dtype"):
        store.append(k, v * 1e5 / v.norm())
    assert same(state(store), before)
    for step in range(12):  # flushes keep working
        store.append(*_kv(1, seed=10 + step))
        store.flush()
    assert store.seq_length() == 32 and store.n_codes > 0
    wide = LayerStore(0, QJLConfig.preset("tq-k3v2", value=CodecSpec("turboquant_mse", {"bits": 2, "norm_dtype": "fp16"})))
    wide.append(k, v * 3e4 / v.norm())  # a norm fp8 cannot hold fits fp16 norms
    flat = torch.full_like(v, 60.0)  # every entry below the fp8 codec's norm limit (84), the norm (480) beyond 448
    with pytest.raises(ValueError, match="norm_dtype"):
        store.append(k, flat)
    assert store.seq_length() == 32


def test_empty_update_is_a_no_op():
    store = LayerStore(0, TQ)
    store.append(*_kv(0))
    assert store.seq_length() == 0
    store.append(*_kv(12))
    before = state(store)
    store.append(*_kv(0))
    assert same(state(store), before)


def test_kivi_crop_into_a_group_is_refused_before_any_change():
    """#11.3: crop that cuts into a KIVI token group raises and leaves the store unchanged."""
    store = LayerStore(0, KIVI)
    store.append(*_kv(30))
    store.flush()
    assert store.n_codes == 20 and store.n_window == 8
    before = state(store)
    with pytest.raises(ValueError, match="multiple of 4"):
        store.crop(10)  # 8 from the window, 2 from a group of 4
    assert same(state(store), before)
    store.crop(12)
    assert store.seq_length() == 18 and store.n_codes == 16


def test_crop_back_into_the_sinks_and_continue():
    store = LayerStore(0, TQ)
    store.append(*_kv(30))
    store.flush()
    store.crop(29)
    assert store.seq_length() == 1 and store.n_sink == 0
    store.append(*_kv(20, seed=4))
    store.flush()
    assert store.seq_length() == 21 and store.n_sink == 2


def test_select_checks_the_index_first():
    store = LayerStore(0, TQ)
    store.append(*_kv(20, b=2))
    store.flush()
    before = state(store)
    for bad in (torch.tensor([0, 2]), torch.tensor([0.0, 1.0]), torch.tensor([[0, 1]])):
        with pytest.raises(ValueError, match="index"):
            store.select(bad)
        assert same(state(store), before)
    store.select(torch.tensor([1, 1, 0]))
    assert store.batch_size == 3 and torch.equal(store.keys[2], before["keys"][0])


def test_code_buffer_fields_are_kept_until_the_buffers_change():
    """CodeBuffer.paged_fields: one FieldMap over the whole capacity, the same object while codes are appended in
    place (so the kernels keep their checks), a new one when the buffers grow, are reindexed or restored, and none
    kept for buffers the store let go."""
    import gc
    import weakref

    from qjl.cache.buffers import CodeBuffer
    from qjl.codecs import TurboQuantMSE

    codec = TurboQuantMSE(64, 3, seed=0)
    buf = CodeBuffer()
    assert buf.paged_fields() is None
    buf.append(codec.quantize(torch.randn(2, 3, 5, 64)))
    fm = buf.paged_fields()
    assert fm is buf.paged_fields() and fm["codes"].buffer is buf.fields["codes"]
    assert fm["codes"].buffer.shape[2] == buf.capacity >= 5
    state = buf.state()
    while buf.capacity == state[0]["codes"].shape[2]:  # appended in place: the same map
        assert buf.paged_fields() is fm
        buf.append(codec.quantize(torch.randn(2, 3, 1, 64)))
    grown = buf.paged_fields()  # the buffers grew: a new map over them
    assert grown is not fm and grown["codes"].buffer is buf.fields["codes"]
    old = weakref.ref(grown["codes"].buffer)
    buf.select(torch.tensor([1]))
    assert buf.paged_fields()["codes"].buffer.shape[0] == 1
    del grown
    gc.collect()
    assert old() is None  # the grown buffers, let go by select, are not kept alive by a map
    buf.restore(state)
    assert buf.paged_fields()["codes"].buffer is state[0]["codes"]


SPLIT = QJLConfig(key=CodecSpec("turboquant_split", {"bits": 2, "split_bits": 4, "n_split": 16}),
                  value=CodecSpec("turboquant_mse", {"bits": 3}), late_key=None, residual_length=8, flush_block=4,
                  sink_tokens=2, smooth_keys=True, smooth_values=False, heavy_tokens=0)


def test_split_keys_fit_to_the_prompts_queries_then_drop_them():
    """A key codec that fits to queries (``fits_queries``) gets the prompt's last queries (their root mean square per
    KV head and channel: all it reads), with the first flushed block (the keys as stored: smoothed, after the
    sinks); they are held (and counted) only until then, and follow a row selection; the choice is the one the full
    query rows give."""
    g = torch.Generator().manual_seed(5)
    k, v = _kv(40, b=2)
    q = torch.randn(2, 4, 6, 64, generator=g) * torch.linspace(0.1, 3.0, 64)  # 2 query heads per KV head
    store = LayerStore(0, SPLIT)
    store.append(k, v)
    store.before_attention(None, q, 64 ** -0.5)
    assert store.fit_q.shape == (2, 2, 1, 64) and store.nbytes()["fit"] >= store.fit_q.numel() * 4
    store.select(torch.tensor([1, 0]))
    rows = q[[1, 0]].reshape(2, 2, 12, 64)  # query heads 2h, 2h + 1 read KV head h
    assert torch.allclose(store.fit_q.square(), rows.square().mean(-2, keepdim=True), rtol=1e-5)
    block = (k[[1, 0], :, 2:30] - store.mu.unsqueeze(2)).to(store.exact_dtype).float()  # as the window holds them
    store.flush()
    assert store.fit_q is None and store.n_codes == 28
    want, = store.key_codec.fit(block, queries=rows)
    assert torch.equal(store.key_fit[0], want)
    assert not torch.equal(want, store.key_codec.fit(block)[0])  # the queries changed the choice
    assert torch.equal(store.key_codes.shared["split_idx"].long(), want)


def test_values_over_rotations_in_turn_are_coded_at_their_positions():
    """Flushes of a cycled value codec code each token with the rotation of its code position: the codes held
    after token-by-token flushes (and a crop and regrowth) equal the one-shot codes of the same tokens."""
    cfg = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 4}),
                    value=CodecSpec("turboquant_mse", {"bits": 2, "cycles": 8, "correct_norm": True}),
                    late_key=None, residual_length=8, flush_block=4, sink_tokens=2, kernel="torch",
                    smooth_keys=False, smooth_values=False)
    store = LayerStore(0, cfg)
    k, v = _kv(30)
    store.append(k[:, :, :17], v[:, :, :17])
    store.flush()
    for t in range(17, 30):
        store.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        store.flush()
    store.crop(9)  # back into the codes, then regrow over the same positions
    for t in range(21, 30):
        store.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        store.flush()
    n = store.n_codes
    want = store.value_codec.quantize(v[:, :, 2:2 + n])
    assert n >= 16 and torch.equal(store.value_codes.fields["codes"], want.fields["codes"])
    assert not torch.equal(store.value_codes.fields["codes"], store.value_codec.quantize(v[:, :, 3:3 + n]).fields["codes"])


_C_FLUSH = QJLConfig(key=CodecSpec("turboquant_vq", {"bits": 3, "correct_norm": True}),
                     value=CodecSpec("turboquant_mse", {"bits": 2, "cycles": 8, "correct_norm": True,
                                                        "norm_dtype": "fp8"}),
                     late_key=None, residual_length=8, flush_block=4, sink_tokens=2, kernel="cpu",
                     smooth_keys=False, smooth_values=False)


def _counting(monkeypatch):
    """kernels.store_cpu wrapped to count its calls."""
    from qjl import kernels

    calls = []
    real = kernels.store_cpu
    monkeypatch.setattr(kernels, "store_cpu", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.skipif(not __import__("qjl").kernels.cpu_available(), reason="the C kernel does not build here")
def test_decode_flushes_of_vector_and_cycled_codecs_are_stored_by_the_c_encoder(monkeypatch):
    """On the CPU backend, flushes after the first (codes held) of codecs codec.quantize codes in torch (vector
    codebooks, rotations in turn) go through the C encoder straight into the code buffers: the codes and norms held
    equal the C encoder's torch mirror (encode_reference) bit for bit at every code position, through a crop and
    regrowth, at batch 2; against codec.quantize they differ only where a rotated coordinate lies within rounding
    of a cell boundary (rare)."""
    from qjl.kernels.reference import encode_reference

    calls = _counting(monkeypatch)
    store = LayerStore(0, _C_FLUSH)
    k, v = _kv(60, b=2)
    store.append(k[:, :, :17], v[:, :, :17])
    store.flush()  # the first block: codec.quantize (no codes held yet)
    first = store.n_codes
    assert first and not calls
    for t in range(17, 45):
        store.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        store.flush()
    assert len(calls) == (store.n_codes - first) // 4 > 0
    store.crop(9)  # back into the codes, then regrow over the same positions
    for t in range(36, 60):
        store.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        store.flush()
    n = store.n_codes
    pos = torch.arange(first, n)
    for codec, x, held in ((store.key_codec, k, store.key_codes), (store.value_codec, v, store.value_codes)):
        x = x[:, :, 2 + first:2 + n].to(store.exact_dtype)  # (the window's tokens, as they are coded)
        want = encode_reference(codec, x, positions=pos[None, None].expand(2, 2, -1))
        for name in ("codes", "norm"):
            got = held.fields[name][:, :, first:]
            assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                               want.fields[name].view(torch.uint8) if got.dtype == torch.float8_e4m3fn
                               else want.fields[name]), name
        torch_codes = codec.quantize(x, start=first).fields["codes"]
        rows = (held.fields["codes"][:, :, first:] != torch_codes).any(-1)
        assert rows.float().mean() <= 0.02  # (rare boundary cases at most)


@pytest.mark.skipif(not __import__("qjl").kernels.cpu_available(), reason="the C kernel does not build here")
def test_a_c_flush_that_fails_stores_nothing(monkeypatch):
    """A C store refused mid-flush leaves the store as it was (the room reserved is not counted, the window keeps
    its tokens), and the next flush codes the same tokens."""
    from qjl import kernels

    store = LayerStore(0, _C_FLUSH)
    k, v = _kv(30)
    store.append(k[:, :, :17], v[:, :, :17])
    store.flush()
    store.append(k[:, :, 17:21], v[:, :, 17:21])
    before = state(store)
    real = kernels.store_cpu

    def refused(*a, **kw):
        raise ValueError("refused")

    monkeypatch.setattr(kernels, "store_cpu", refused)
    with pytest.raises(ValueError, match="refused"):
        store.flush()
    assert same(state(store), before)
    monkeypatch.setattr(kernels, "store_cpu", real)
    n = store.n_codes
    store.flush()
    assert store.n_codes == n + 4 and store.seq_length() == 21
