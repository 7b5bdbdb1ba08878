"""Key and value smoothing: exact for softmax, a smaller error for keys / values with a shared offset, counted
in bytes; the value mean weighted by the prompt's attention."""

import torch

from qjl import CodecSpec, QJLConfig
from qjl.cache.attention import attend
from qjl.cache.smoothing import attention_weighted_mean, channel_mean
from qjl.cache.storage import LayerStore


def test_channel_mean_skips_padding():
    k = torch.randn(2, 3, 10, 8)
    mu = channel_mean(k, torch.tensor([0, 4]))
    assert torch.allclose(mu[0], k[0].mean(1)) and torch.allclose(mu[1], k[1, :, 4:].mean(1))
    assert torch.equal(channel_mean(k[1:, :, 4:]), mu[1:])  # bit-identical to the row alone


def _store(smooth, bits=3, kernel="torch", residual=8):
    key = CodecSpec("turboquant_mse", {"bits": bits, "correct_norm": True})
    cfg = QJLConfig(key=key, value=CodecSpec("turboquant_mse", {"bits": 8}), late_key=None, residual_length=residual,
                    flush_block=4, sink_tokens=2, smooth_keys=smooth, smooth_values=False, kernel=kernel,
                    exact_dtype=None)
    return LayerStore(0, cfg)


def _keys_with_offset(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 2, n, 64, generator=g)
    k[..., :4] += 20.0  # a few channels carry a large shared offset (as in real models)
    return k, torch.randn(1, 2, n, 64, generator=g)


def _run(store, k, v, q):
    store.append(k[:, :, :40], v[:, :, :40])
    store.before_attention(None)
    store.flush()
    store.append(k[:, :, 40:], v[:, :, 40:])
    return attend(store, q, None, 64 ** -0.5)


def _errors_by_path(make, mean: str, k, v, q, exact) -> dict:
    """{(smoothing on, kernel): attention error} of stores ``make(on, kernel)`` after :func:`_run`; checks that 28
    tokens were coded, that the mean attribute ``mean`` is fitted iff on, that the kernel reads the codes, and that
    every path gives the same error."""
    errs = {}
    for on in (False, True):
        for kernel in ("torch", "auto"):
            store = make(on, kernel)
            out = _run(store, k, v, q)
            assert store.n_codes == 28 and (getattr(store, mean) is not None) == on
            assert kernel == "torch" or store.kernel_ok
            errs[on, kernel] = (out - exact).norm().item()
        assert abs(errs[on, "torch"] - errs[on, "auto"]) < 1e-3 * exact.norm()  # every path alike
    return errs


def test_smoothing_keeps_softmax_exact_and_helps_codes():
    """Every stored key shifted by the same mu leaves attention unchanged; with codes, smoothing removes
    the offset the rotation would spread over every coordinate, so the error drops."""
    k, v = _keys_with_offset(41)
    q = torch.randn(1, 4, 1, 64)
    exact = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                             scale=64 ** -0.5).transpose(1, 2)
    for smooth in (False, True):  # everything exact: smoothing changes nothing (up to float rounding)
        assert torch.allclose(_run(_store(smooth, residual=64), k, v, q), exact, atol=1e-5)
    errs = _errors_by_path(lambda on, kernel: _store(on, bits=3, kernel=kernel), "mu", k, v, q, exact)
    assert errs[True, "torch"] < 0.5 * errs[False, "torch"], errs
    store = _store(True)
    _run(store, k, v, q)
    assert store.nbytes()["smoothing"] == 1 * 2 * 64 * 4  # mu: fp32 [B, H, D], counted


def _vstore(smooth_values, vbits=8, kernel="torch", residual=8, smooth_keys=False):
    cfg = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 8, "correct_norm": True}),
                    value=CodecSpec("turboquant_mse", {"bits": vbits, "correct_norm": True}), late_key=None,
                    residual_length=residual, flush_block=4, sink_tokens=2, smooth_keys=smooth_keys,
                    smooth_values=smooth_values, kernel=kernel, exact_dtype=None)
    return LayerStore(0, cfg)


def _values_with_offset(n, seed=0, batch=1):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(batch, 2, n, 64, generator=g)
    v += 3.0 * torch.randn(batch, 2, 1, 64, generator=g)  # a shared offset per KV head, 3x each token's spread
    return torch.randn(batch, 2, n, 64, generator=g), v


def _exact(q, k, v, softcap=None):
    logits = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 64 ** -0.5
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return (logits.softmax(-1) @ v.repeat_interleave(2, 1)).transpose(1, 2)


def test_value_smoothing_is_exact_on_every_path():
    """mu_v subtracted from every stored value and added back to the output: the attention is unchanged (the
    weights sum to 1) through the reference (with and without softcapping), SDPA (several new tokens with a
    kernel backend) and the kernel (one new token), with or without key smoothing."""
    k, v = _values_with_offset(41)
    for t in (1, 3):
        q = torch.randn(1, 4, t, 64)
        for kernel in ("torch", "auto"):
            for smooth_keys in (False, True):
                store = _vstore(True, kernel=kernel, residual=64, smooth_keys=smooth_keys)
                store.append(k[:, :, :40], v[:, :, :40])
                store.before_attention(None, torch.randn(1, 4, 40, 64), 64 ** -0.5)
                store.append(k[:, :, 40:41], v[:, :, 40:41])
                assert store.mu_v is not None and store.mu_v.shape == (1, 2, 64)
                assert store.values.abs().mean() < 0.5 * v[:, :, :41].abs().mean()  # what is stored is centered
                # no mask: every new query sees all 41 tokens
                assert torch.allclose(attend(store, q, None, 64 ** -0.5), _exact(q, k, v), atol=1e-5)
        store = _vstore(True, kernel="torch", residual=64)
        store.append(k, v)
        store.before_attention(None, torch.randn(1, 4, 41, 64), 64 ** -0.5, 5.0)
        assert torch.allclose(attend(store, q, None, 64 ** -0.5, softcap=5.0), _exact(q, k, v, 5.0), atol=1e-5)


def test_value_smoothing_helps_codes_alike_on_every_path():
    """With 2-bit value codes, the offset no longer costs bits: the error drops by more than half; the kernel
    path (one new token) and the reference agree; mu_v is fp32 [B, H, D_v] and counted."""
    k, v = _values_with_offset(41, seed=1)
    q = torch.randn(1, 4, 1, 64)
    exact = _exact(q, k, v)
    errs = _errors_by_path(lambda on, kernel: _vstore(on, vbits=2, kernel=kernel), "mu_v", k, v, q, exact)
    assert errs[True, "torch"] < 0.5 * errs[False, "torch"], errs
    store = _vstore(True, vbits=2)
    _run(store, k, v, q)
    assert store.nbytes()["smoothing"] == 1 * 2 * 64 * 4
    both = _vstore(True, vbits=2, smooth_keys=True)
    _run(both, k, v, q)
    assert both.nbytes()["smoothing"] == 2 * 1 * 2 * 64 * 4  # key and value means, each counted


def test_value_smoothing_per_row_skips_padding_and_follows_select():
    """A left-padded row's mean is over its real tokens; selecting rows reorders mu_v with everything else."""
    k, v = _values_with_offset(20, seed=2, batch=2)
    store = _vstore(True, residual=64)
    store.append(k, v)
    mask = torch.ones(2, 1, 20, 20, dtype=torch.bool)
    mask[1, ..., :5] = False  # row 1: 5 padding tokens
    store.before_attention(mask)
    assert torch.allclose(store.mu_v[0], v[0].mean(1)) and torch.allclose(store.mu_v[1], v[1, :, 5:].mean(1))
    mu = store.mu_v.clone()
    store.select(torch.tensor([1, 0]))
    assert torch.equal(store.mu_v, mu[[1, 0]])


def test_value_smoothing_bad_input_leaves_store_unchanged():
    """A value the exact dtype cannot hold after the shift is refused by the append, which changes nothing."""
    wide = CodecSpec("turboquant_mse", {"bits": 4, "norm_dtype": "fp32"})
    cfg = QJLConfig(key=wide, value=wide, late_key=None, residual_length=64, flush_block=4, smooth_values=True,
                    exact_dtype="fp16")
    store = LayerStore(0, cfg)
    k, v = _values_with_offset(8)
    store.append(k, v - 40000.0)
    store.before_attention(None)
    n, held = store.seq_length(), store.values.clone()
    big = torch.full((1, 2, 1, 64), 30000.0)  # fits fp16, but not once mu_v (about -40000) is subtracted
    try:
        store.append(k[:, :, :1], big)
    except ValueError as e:
        assert "value_states" in str(e)
    else:
        raise AssertionError("an unstorable shifted value was accepted")
    assert store.seq_length() == n and torch.equal(store.values, held)


def test_attention_weighted_mean_follows_its_definition():
    """mu_v[b, h] = sum_j w_j v_j / sum_j w_j, w_j the mean attention of the last `rows` query rows (and the GQA
    group) under the mask, over the tokens to be coded (after the row's sinks, before the window); without a
    query, uniform weights; a row whose range is empty falls back to all its real tokens."""
    g = torch.Generator().manual_seed(5)
    b, h, hq, t, n, d, dv = 2, 2, 4, 5, 12, 8, 6
    q, k, v = (torch.randn(b, hq, t, d, generator=g), torch.randn(b, h, n, d, generator=g),
               torch.randn(b, h, n, dv, generator=g))
    mask = torch.ones(b, 1, t, n, dtype=torch.bool)
    mask[..., n - t:] = torch.ones(t, t, dtype=torch.bool).tril()  # causal over the last t tokens
    mask[1, ..., :3] = False  # row 1: 3 padding tokens
    starts = torch.tensor([0, 3])
    for rows, skip_first, skip_last, cap in ((64, 1, 4, None), (2, 0, 0, 0.5), (3, 2, 9, None)):
        mu = attention_weighted_mean(v, starts, skip_first, skip_last, q, k, mask, 0.3, cap, rows=rows)
        for bi in range(b):
            for hi in range(h):
                w = torch.zeros(n)
                used = range(max(t - rows, 0), t)
                for qh in range(hi * 2, hi * 2 + 2):  # query heads of KV head hi
                    for r in used:
                        logits = (k[bi, hi] @ q[bi, qh, r]) * 0.3
                        logits = logits if cap is None else torch.tanh(logits / cap) * cap
                        logits[~mask[bi, 0, r]] = float("-inf")
                        w += logits.softmax(-1) / (2 * len(used))
                keep = torch.zeros(n, dtype=torch.bool)
                keep[int(starts[bi]) + skip_first: n - skip_last] = True
                if not keep.any() or w[keep].sum() == 0:
                    keep = torch.arange(n) >= starts[bi]
                want = (w[keep, None] * v[bi, hi, keep]).sum(0) / w[keep].sum()
                assert torch.allclose(mu[bi, hi], want, atol=1e-5), (rows, skip_first, skip_last, bi, hi)
    plain = attention_weighted_mean(v, starts, 1, 4)  # no query: uniform over the range
    assert torch.allclose(plain[0], v[0, :, 1:8].mean(1)) and torch.allclose(plain[1], v[1, :, 4:8].mean(1))


def test_value_mean_weighted_by_attention_where_the_plain_mean_hurts():
    """Queries attend to tokens whose values are near zero (as in several layers of the embedded model) while
    the others carry a large offset: subtracting the plain mean would raise the error of the attended tokens'
    codes; the attention-weighted mean does not (it lowers it here)."""
    g = torch.Generator().manual_seed(7)
    n, d = 60, 64
    direction = torch.randn(d, generator=g)
    k = 0.1 * torch.randn(1, 2, n, d, generator=g)
    k[:, :, 10:30] += direction  # the tokens the queries look at
    v = 5.0 * torch.randn(1, 2, 1, d, generator=g) + torch.randn(1, 2, n, d, generator=g)
    v[:, :, 10:30] = 0.3 * torch.randn(1, 2, 20, d, generator=g)
    q = (2.0 * direction).expand(1, 4, 8, d).clone() + 0.1 * torch.randn(1, 4, 8, d, generator=g)
    exact = _exact(q[:, :, -1:], k, v)
    errs = {}
    for mode in ("off", "plain", "weighted"):
        store = _vstore(mode != "off", vbits=2)
        store.append(k[:, :, :59], v[:, :, :59])
        store.before_attention(None, q[:, :, :-1] if mode == "weighted" else None, 64 ** -0.5)
        store.flush()
        store.append(k[:, :, 59:], v[:, :, 59:])
        errs[mode] = (attend(store, q[:, :, -1:], None, 64 ** -0.5) - exact).norm().item()
    assert errs["plain"] > 1.5 * errs["off"] and errs["weighted"] < errs["off"], errs


def _hstore(heavy, kernel="torch", vbits=2, kbits=2, residual=8):
    cfg = QJLConfig(key=CodecSpec("turboquant_mse", {"bits": kbits, "correct_norm": True}),
                    value=CodecSpec("turboquant_mse", {"bits": vbits, "correct_norm": True}), late_key=None,
                    residual_length=residual, flush_block=4, sink_tokens=2, smooth_keys=False, smooth_values=False,
                    heavy_tokens=heavy, kernel=kernel, exact_dtype=None)
    return LayerStore(0, cfg)


def test_heavy_tokens_are_the_most_attended_and_kept_exact():
    """heavy_tokens: the tokens to be coded that the prompt's last queries attend to most (averaged over KV heads)
    join the exact sinks (not the codes); attention over them is exact, every path alike, and the error drops;
    they are counted with the exact tokens."""
    g = torch.Generator().manual_seed(17)
    n, d = 60, 64
    direction = torch.randn(d, generator=g)
    k = torch.randn(1, 2, n, d, generator=g)
    k[:, :, [11, 23, 37]] += 3.0 * direction  # three mid tokens the queries look at, hence heavy
    v = torch.randn(1, 2, n, d, generator=g)
    q = (direction / direction.norm() * 6.0).expand(1, 4, 8, d).clone() + 0.3 * torch.randn(1, 4, 8, d, generator=g)
    exact = _exact(q[:, :, -1:], k, v)
    errs = {}
    for heavy in (0, 3):
        for kernel in ("torch", "auto"):
            store = _hstore(heavy, kernel)
            store.append(k[:, :, :59], v[:, :, :59])
            store.before_attention(None, q[:, :, :-1], 64 ** -0.5)
            store.flush()
            store.append(k[:, :, 59:], v[:, :, 59:])
            assert store.n_sink == 2 + heavy and store.n_codes == (59 - 2 - heavy - 8) // 4 * 4  # whole blocks
            if heavy:
                assert store.slot_order[0, 2:5].tolist() == [11, 23, 37]
                assert torch.equal(store.sink_k[0, :, 2:5], k[0, :, [11, 23, 37]])
                assert store.heavy_pos.dtype == torch.int32 and store.heavy_pos.tolist() == [[11, 23, 37]]
            errs[heavy, kernel] = (attend(store, q[:, :, -1:], None, 64 ** -0.5) - exact).norm().item()
        assert abs(errs[heavy, "torch"] - errs[heavy, "auto"]) < 1e-3 * exact.norm()
    assert errs[3, "torch"] < 0.5 * errs[0, "torch"], errs
    plain, heavy = _hstore(0), _hstore(3)
    for s in (plain, heavy):
        s.append(k, v)
        s.before_attention(None, q, 64 ** -0.5)
        s.flush()
    extra = heavy.nbytes()["exact"] - plain.nbytes()["exact"]
    assert extra >= 2 * 3 * 2 * 64 * 4  # 3 more exact tokens: keys and values, 2 heads, fp32 here


def test_heavy_tokens_need_attention_and_refuse_a_deep_crop():
    """Without any attention before the first flush there is nothing to rank: no heavy tokens.  A crop into the
    reordered slots is refused (nothing changes); a crop of the window works."""
    k, v = _values_with_offset(60)
    store = _hstore(3)
    store.append(k, v)
    store.flush()
    assert store.n_sink == 2 and store.slot_order is None
    store = _hstore(3)
    store.append(k, v)
    store.before_attention(None, torch.randn(1, 4, 8, 64), 64 ** -0.5)
    store.flush()
    assert store.n_sink == 5
    p, held = store.slot_order.shape[1], store.seq_length()
    store.crop(2)
    assert store.seq_length() == held - 2
    try:
        store.crop(store.seq_length() - p + 1)
    except ValueError as e:
        assert "heavy tokens" in str(e)
    else:
        raise AssertionError("a crop into the reordered slots was accepted")
    assert store.seq_length() == held - 2


def test_heavy_tokens_follow_a_batch_selection_before_the_sinks_form():
    """Rows reordered (beam search) between the prompt's attention and the first flush keep their own heavy tokens."""
    g = torch.Generator().manual_seed(19)
    d = 64
    k, v = torch.randn(2, 2, 60, d, generator=g), torch.randn(2, 2, 60, d, generator=g)
    direction = torch.randn(d, generator=g)
    k[0, :, [10, 20]] += 3.0 * direction  # row 0 looks at 10 and 20, row 1 at 30 and 40
    k[1, :, [30, 40]] += 3.0 * direction
    q = (direction / direction.norm() * 6.0).expand(2, 4, 4, d).clone()
    store = _hstore(2)
    store.append(k, v)
    store.before_attention(None, q, 64 ** -0.5)
    store.select(torch.tensor([1, 0]))
    store.flush()
    assert store.heavy_pos.tolist() == [[30, 40], [10, 20]]


def test_attention_weights_and_sink_order_name_bad_input():
    import pytest

    from qjl.cache.padding import sink_order
    from qjl.cache.smoothing import attention_weights

    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8)
    for bad, match in (((q, k[..., :4]), "does not match"), ((torch.randn(1, 3, 3, 8), k), "does not match"),
                       ((q[0], k), "query must be"), ((q, k.long()), "keys must be")):
        with pytest.raises(ValueError, match=match):
            attention_weights(*bad)
    with pytest.raises(ValueError, match="rows"):
        attention_weights(q, k, rows=0)
    with pytest.raises(ValueError, match="extra"):
        sink_order(torch.tensor([0, 1]), 2, torch.tensor([[5, 6]]))
    with pytest.raises(ValueError, match="extra"):
        sink_order(torch.tensor([0]), 2, torch.tensor([[5.0]]))
