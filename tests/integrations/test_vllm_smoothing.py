"""Key and value smoothing in the vLLM backend's pages, without vLLM (default suite): a sequence's steps run as the backend
runs them (smooth, write the codes, attend) on its page layout, against exact attention."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from qjl.integrations.vllm.decode import decode_function, paged_decode_kernel
from qjl.integrations.vllm.layout import layer_layout
from qjl.integrations.vllm.paged import page_fields
from qjl.integrations.vllm.settings import VLLMSettings
from qjl.integrations.vllm.smoothing import MIN_TOKENS, add_value_mean, smooth_keys, smooth_values
from qjl.integrations.vllm.step import StepPlan, forward_batch
from qjl.integrations.vllm.writes import write_codes

HKV, HQ, D, BS = 2, 4, 64, 16


def _pages(settings, dtype=torch.float32, nblocks=12, sliding_window=None):
    lay = layer_layout(settings, 3, 8, D, BS, dtype, sliding_window=sliding_window)
    pages = torch.zeros(nblocks, HKV, BS, lay.content_bytes // torch.empty(0, dtype=dtype).element_size(),
                        dtype=dtype)
    return lay, page_fields(lay, pages)


def _run(lay, fields, table, q, k, v, cuts, decode):
    """One sequence through steps [cuts[i], cuts[i + 1]) as the backend does: -> outputs [T, H_q, D]."""
    outs = []
    for s0, s1 in zip(cuts[:-1], cuts[1:]):
        qsl, lens = torch.tensor([0, s1 - s0]), torch.tensor([s1])
        plan = StepPlan.build(qsl, lens, table, BS, lay.sinks, lay.window)
        kk = smooth_keys(fields, plan, k[s0:s1]) if lay.smooth_keys else k[s0:s1]
        vv, mu = smooth_values(fields, plan, q[s0:s1], kk, v[s0:s1], D ** -0.5) if lay.smooth_values else (v[s0:s1],
                                                                                                          None)
        write_codes(lay, fields, kk, vv, None, plan=plan)
        o = forward_batch(lay, fields, q[s0:s1], kk, vv, table, qsl, lens, D ** -0.5, decode, plan=plan)
        outs.append(o if mu is None else add_value_mean(o, mu))
    return torch.cat(outs)


def _exact(q, k, v):
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, enable_gqa=True, scale=D ** -0.5)
    return o[0].transpose(0, 1)


def _data(n, offset, seed=0, value_offset=0.0):
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(HKV, D, generator=g) * offset  # the component every key of a head shares
    k = torch.randn(n, HKV, D, generator=g) + common
    q, v = torch.randn(n, HQ, D, generator=g), torch.randn(n, HKV, D, generator=g)
    return q, k, v + torch.randn(HKV, D, generator=g) * value_offset


def _errors(data, decode, settings):
    """A 64-token prompt, then 32 one-token decode steps, with smoothing off and on (``settings(on, decode path)``)
    -> {on: relative error of the decode steps' outputs against exact attention}.  ``decode``: "torch", "auto", or
    "kernels-torch" (the kernels' torch reference, which joins the exact slots and the current token as the Triton
    path does)."""
    q, k, v = data
    cuts = [0, 64] + list(range(65, 97))
    ref = _exact(q, k, v)[64:]
    errs = {}
    for on in (False, True):
        s = settings(on, "torch" if decode == "torch" else "auto")
        lay, fields = _pages(s)
        table = torch.randperm(12, generator=torch.Generator().manual_seed(1))[None, :]
        fn = partial(paged_decode_kernel, backend="torch") if decode == "kernels-torch" else decode_function(s)
        out = _run(lay, fields, table, q, k, v, cuts, fn)[64:]
        errs[on] = float((out - ref).norm() / ref.norm())
    return errs


def test_layout_keeps_one_mean_per_block_and_head_counted_in_the_bytes():
    on, _ = _pages(VLLMSettings(preset="tq-k3v2", smooth_keys=True))
    off, _ = _pages(VLLMSettings(preset="tq-k3v2", smooth_keys=False))
    f = on.fields["smooth.key"]
    assert f.shared and f.shape == (D,) and "smooth.key" not in off.fields
    assert on.used_bytes >= off.used_bytes + f.nbytes
    slide, fields = _pages(VLLMSettings(preset="tq-k3v2", smooth_keys=True), sliding_window=32)
    assert not slide.smooth_keys and "smooth.key" not in fields  # vLLM frees the blocks that leave the window


@pytest.mark.parametrize("decode", ["torch", "auto", "kernels-torch"])
def test_smoothing_cuts_the_error_of_keys_with_a_shared_offset(decode):
    """3-bit keys with a large common component: smoothing removes it before quantization (a mean added instead
    of subtracted, or not applied to the current token, would not).  ``kernels-torch``: the kernels' torch
    reference, which joins the exact slots (fp16) and the smoothed current token (fp32) as the Triton path does."""
    errs = _errors(_data(96, offset=6.0), decode, lambda on, path: VLLMSettings(
        preset="tq-k3v2", smooth_keys=on, smooth_values=False, decode=path))
    assert errs[True] < 0.5 * errs[False], errs


def test_smoothing_is_exact_where_every_token_is_kept_exactly():
    """Sinks and window cover the whole sequence: smoothing only shifts each query's scores by q . mu."""
    n, cuts = 40, [0, 24] + list(range(25, 41))
    q, k, v = _data(n, offset=3.0, seed=2)
    outs = []
    for smooth in (False, True):
        s = VLLMSettings(preset="tq-k45v3", smooth_keys=smooth, sinks=4, window=48, decode="torch")
        lay, fields = _pages(s)
        outs.append(_run(lay, fields, torch.arange(12)[None, :], q, k, v, cuts, decode_function(s)))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(outs[0], _exact(q, k, v), atol=2e-5, rtol=2e-5)


def test_the_mean_comes_from_the_first_step_and_is_read_back_from_block_0():
    lay, fields = _pages(VLLMSettings(preset="tq-k3v2", smooth_keys=True))
    q, k, v = _data(48, offset=4.0, seed=3)
    table = torch.tensor([[5, 2, 7, 9]])
    _run(lay, fields, table, q, k, v, [0, 32, 48], decode_function(VLLMSettings(decode="torch")))
    mu = fields["smooth.key"].gather(torch.tensor(5), torch.arange(HKV), torch.tensor(0))
    assert torch.equal(mu, k[:32].mean(0).to(mu.dtype))  # the first step's keys (not the second's), stored rounded
    # another request reusing block 0 through the prefix cache: its keys get the same mean
    other = torch.tensor([[5, 11]])
    plan = StepPlan.build(torch.tensor([0, 1]), torch.tensor([BS + 1]), other, BS, lay.sinks, lay.window)
    x = torch.randn(1, HKV, D)
    assert torch.equal(smooth_keys(fields, plan, x), x - mu.float())  # what is stored is what every step uses


def test_a_short_first_step_keeps_a_zero_mean():
    lay, fields = _pages(VLLMSettings(preset="tq-k3v2", smooth_keys=True))
    k = torch.randn(MIN_TOKENS - 1, HKV, D) + 5
    plan = StepPlan.build(torch.tensor([0, len(k)]), torch.tensor([len(k)]), torch.arange(4)[None, :], BS,
                          lay.sinks, lay.window)
    assert torch.equal(smooth_keys(fields, plan, k), k)


def test_non_finite_first_keys_are_refused_and_no_mean_is_stored():
    lay, fields = _pages(VLLMSettings(preset="tq-k3v2", smooth_keys=True))
    k = torch.randn(2 * MIN_TOKENS, HKV, D)
    k[MIN_TOKENS + 3, 1, 5] = float("nan")  # in the second sequence
    table = torch.tensor([[1, 2], [3, 4]])
    plan = StepPlan.build(torch.tensor([0, MIN_TOKENS, 2 * MIN_TOKENS]), torch.tensor([MIN_TOKENS, MIN_TOKENS]),
                          table, BS, lay.sinks, lay.window)
    before = fields["smooth.key"].buffer.clone()
    with pytest.raises(ValueError, match="key: sequence 1"):
        smooth_keys(fields, plan, k)
    assert torch.equal(fields["smooth.key"].buffer, before)


def test_bad_arguments_are_refused_by_name():
    lay, fields = _pages(VLLMSettings(preset="tq-k3v2", smooth_keys=True))
    plan = StepPlan.build(torch.tensor([0, 20]), torch.tensor([20]), torch.arange(4)[None, :], BS, lay.sinks,
                          lay.window)
    before = fields["smooth.key"].buffer.clone()
    with pytest.raises(ValueError, match="key must be"):
        smooth_keys(fields, plan, torch.randn(19, HKV, D))  # not the step's 20 tokens
    with pytest.raises(ValueError, match="key must be"):
        smooth_keys(fields, plan, torch.randn(20, HKV, D + 1))
    with pytest.raises(TypeError, match="key must be a float tensor"):
        smooth_keys(fields, plan, torch.zeros(20, HKV, D, dtype=torch.int32))
    _, plain = _pages(VLLMSettings(preset="tq-k3v2", smooth_keys=False))
    with pytest.raises(ValueError, match="fields: no 'smooth.key'"):
        smooth_keys(plain, plan, torch.randn(20, HKV, D))
    assert torch.equal(fields["smooth.key"].buffer, before)


# value smoothing


def _values_on(preset="tq-k3v2", **kw):
    return VLLMSettings(preset=preset, smooth_keys=kw.pop("smooth_keys", False), smooth_values=True, **kw)


def test_layout_keeps_one_value_mean_per_block_and_head_counted_in_the_bytes():
    on, _ = _pages(_values_on())
    off, _ = _pages(VLLMSettings(preset="tq-k3v2", smooth_keys=False, smooth_values=False))
    f = on.fields["smooth.value"]
    assert f.shared and f.shape == (D,) and "smooth.value" not in off.fields and on.smooth_values
    assert on.used_bytes >= off.used_bytes + f.nbytes
    slide, fields = _pages(_values_on(), sliding_window=32)
    assert not slide.smooth_values and "smooth.value" not in fields


@pytest.mark.parametrize("decode", ["torch", "auto", "kernels-torch"])
def test_value_smoothing_cuts_the_error_of_values_with_a_shared_offset(decode):
    """2-bit values with a large common component: the mean is removed before quantization and added back to the
    output (a mean not added back, or added to the wrong query heads, would be far off)."""
    errs = _errors(_data(96, offset=0.0, value_offset=6.0, seed=4), decode, lambda on, path: VLLMSettings(
        preset="tq-k3v2", smooth_keys=False, smooth_values=on, decode=path))
    assert errs[True] < 0.5 * errs[False], errs


def test_value_smoothing_is_exact_where_every_token_is_kept_exactly():
    """Sinks and window cover the whole sequence: the softmax weights sum to 1, so subtracting mu_v from every
    value and adding it to the output changes nothing (keys smoothed too)."""
    n, cuts = 40, [0, 24] + list(range(25, 41))
    q, k, v = _data(n, offset=3.0, seed=2, value_offset=3.0)
    outs = []
    for smooth in (False, True):
        s = VLLMSettings(preset="tq-k45v3", smooth_keys=smooth, smooth_values=smooth, sinks=4, window=48,
                         decode="torch")
        lay, fields = _pages(s)
        outs.append(_run(lay, fields, torch.arange(12)[None, :], q, k, v, cuts, decode_function(s)))
    assert bool(fields["smooth.value"].buffer.abs().sum() > 0)
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(outs[0], _exact(q, k, v), atol=2e-5, rtol=2e-5)


def test_the_value_mean_is_weighted_by_the_first_steps_last_queries():
    from qjl.cache.smoothing import VALUE_MEAN_ROWS

    s = _values_on(sinks=4, window=8)
    lay, fields = _pages(s)
    n = 100
    q, k, v = _data(n + 16, offset=0.0, seed=5, value_offset=2.0)
    table = torch.tensor([[5, 2, 7, 9, 10, 11, 1, 3]])
    _run(lay, fields, table, q, k, v, [0, n, n + 16], decode_function(VLLMSettings(decode="torch")))
    mu = fields["smooth.value"].gather(torch.tensor(5), torch.arange(HKV), torch.tensor(0))
    # by hand: the last 64 queries' causal softmax over the first step's keys, averaged over each KV head's group
    # and rows, then the weighted mean of the values after the 4 sinks and before the 8-token window
    logits = torch.einsum("thd,shd->hts", q[:n], k[:n].repeat_interleave(HQ // HKV, 1)) * D ** -0.5
    logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))[:, n - VALUE_MEAN_ROWS:]
    w = torch.softmax(logits, -1).view(HKV, HQ // HKV, VALUE_MEAN_ROWS, n).mean((1, 2))  # [H_kv, n]
    w[:, :4], w[:, n - 8:] = 0, 0
    want = (w[:, :, None] * v[:n].transpose(0, 1)).sum(1) / w.sum(1, keepdim=True)
    torch.testing.assert_close(mu, want.to(mu.dtype), atol=1e-3, rtol=1e-3)  # stored in the exact dtype
    assert (mu.float() - v[:n].mean(0)).abs().max() > 1e-3  # not the plain mean
    # a prefix-cache reuse of block 0 reads the stored mean back
    other = torch.tensor([[5, 11]])
    plan = StepPlan.build(torch.tensor([0, 1]), torch.tensor([BS + 1]), other, BS, lay.sinks, lay.window)
    x = torch.randn(1, HKV, D)
    got, mu_tok = smooth_values(fields, plan, torch.randn(1, HQ, D), torch.randn(1, HKV, D), x, D ** -0.5)
    assert torch.equal(mu_tok, mu[None]) and torch.equal(got, x - mu.float())


@pytest.mark.parametrize("n", [10, 64, 200])
def test_first_step_weights_are_the_caches_attention_weights(n):
    """The pages' fast weights (no [n, n] mask) equal transformers' cache's ``attention_weights`` under a causal
    mask: exactly in float32, to bf16's precision in bf16 (the dtype vLLM passes)."""
    from qjl.cache.smoothing import VALUE_MEAN_ROWS, attention_weights
    from qjl.integrations.vllm.smoothing import first_step_weights

    g = torch.Generator().manual_seed(n)
    q, k = torch.randn(n, HQ, D, generator=g) * 2, torch.randn(n, HKV, D, generator=g) * 2
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    want = attention_weights(q.transpose(0, 1)[None], k.transpose(0, 1)[None], causal, D ** -0.5)[0]
    got = first_step_weights(q, k, D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert got.shape == (HKV, n) and torch.allclose(got.sum(-1), torch.ones(HKV))
    early = q.clone()
    early[: max(0, n - VALUE_MEAN_ROWS)] = 0  # only the last rows weigh
    torch.testing.assert_close(first_step_weights(early, k, D ** -0.5), got, atol=0, rtol=0)
    low = first_step_weights(q.bfloat16(), k, D ** -0.5)
    assert (low - want).abs().max() < 0.05 * want.abs().max()


def test_first_step_weights_refuse_bad_arguments_by_name():
    from qjl.integrations.vllm.smoothing import first_step_weights

    q, k = torch.randn(8, HQ, D), torch.randn(8, HKV, D)
    with pytest.raises(ValueError, match="query must be"):
        first_step_weights(q.int(), k, 1.0)
    with pytest.raises(ValueError, match="key must be"):
        first_step_weights(q, k[:0], 1.0)
    with pytest.raises(ValueError, match="does not match"):
        first_step_weights(q, k[:7], 1.0)
    with pytest.raises(ValueError, match="does not match"):
        first_step_weights(q[:, :3], k, 1.0)
    with pytest.raises(ValueError, match="rows"):
        first_step_weights(q, k, 1.0, rows=0)


def test_a_short_first_step_keeps_a_zero_value_mean():
    lay, fields = _pages(_values_on())
    n = MIN_TOKENS - 1
    plan = StepPlan.build(torch.tensor([0, n]), torch.tensor([n]), torch.arange(4)[None, :], BS, lay.sinks,
                          lay.window)
    v = torch.randn(n, HKV, D) + 5
    got, mu = smooth_values(fields, plan, torch.randn(n, HQ, D), torch.randn(n, HKV, D), v, D ** -0.5)
    assert torch.equal(got, v) and not bool(mu.any())


def test_non_finite_first_values_are_refused_and_no_value_mean_is_stored():
    lay, fields = _pages(_values_on())
    n = 2 * MIN_TOKENS
    v = torch.randn(n, HKV, D)
    v[MIN_TOKENS + 3, 1, 5] = float("inf")  # in the second sequence
    plan = StepPlan.build(torch.tensor([0, MIN_TOKENS, n]), torch.tensor([MIN_TOKENS, MIN_TOKENS]),
                          torch.tensor([[1, 2], [3, 4]]), BS, lay.sinks, lay.window)
    before = fields["smooth.value"].buffer.clone()
    with pytest.raises(ValueError, match="value: sequence 1"):
        smooth_values(fields, plan, torch.randn(n, HQ, D), torch.randn(n, HKV, D), v, D ** -0.5)
    assert torch.equal(fields["smooth.value"].buffer, before)


def test_value_smoothing_refuses_bad_arguments_by_name():
    lay, fields = _pages(_values_on())
    t = 20
    plan = StepPlan.build(torch.tensor([0, t]), torch.tensor([t]), torch.arange(4)[None, :], BS, lay.sinks,
                          lay.window)
    q, k, v = torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    before = fields["smooth.value"].buffer.clone()
    with pytest.raises(ValueError, match="value must be"):
        smooth_values(fields, plan, q, k, v[:-1], 1.0)
    with pytest.raises(ValueError, match="key must have"):
        smooth_values(fields, plan, q, k[:, :1], v, 1.0)
    with pytest.raises(ValueError, match="query must be"):
        smooth_values(fields, plan, q[:, :3], k, v, 1.0)
    with pytest.raises(TypeError, match="value must be a float tensor"):
        smooth_values(fields, plan, q, k, v.int(), 1.0)
    with pytest.raises(TypeError, match="query must be a float tensor"):
        smooth_values(fields, plan, None, k, v, 1.0)
    _, plain = _pages(VLLMSettings(preset="tq-k3v2", smooth_values=False))
    with pytest.raises(ValueError, match="fields: no 'smooth.value'"):
        smooth_values(plain, plan, q, k, v, 1.0)
    assert torch.equal(fields["smooth.value"].buffer, before)
    out = torch.zeros(t, HQ, D)
    mu = torch.arange(HKV, dtype=torch.float32)[None, :, None].expand(t, HKV, D)
    add_value_mean(out, mu)
    assert torch.equal(out[:, :HQ // HKV], torch.zeros(t, HQ // HKV, D))  # query heads 0-1 read KV head 0
    assert torch.equal(out[:, HQ // HKV:], torch.ones(t, HQ // HKV, D))
    with pytest.raises(TypeError, match="out must be a float32"):
        add_value_mean(out.half(), mu)
    with pytest.raises(ValueError, match="mu must be"):
        add_value_mean(out, mu[:, :, :3])
