"""The coded keys' score scale fitted from the prompt (QJLConfig.fit_key_scale, qjl.cache.key_scale): the search finds
each head's minimum, the error is the attention's as defined, the store folds gamma into exactly the key norms of
every flush, per sequence, blind to padding, and the option is refused where it cannot apply."""

import pytest
import torch

from qjl import CodecSpec, QJLConfig
from qjl.cache.attention import attend
from qjl.cache.key_scale import GAMMA_MAX, GAMMA_MIN, fit_key_scale, scale_error

TOL = 0.005
from qjl.cache.storage import LayerStore


def test_the_search_finds_each_heads_minimum():
    """Exact for a parabola (one vertex), close for a curve that is not one, the nearest bound for a minimum
    outside the interval; five evaluations in three calls, every head at once."""
    target = torch.tensor([[0.83, 0.9, 1.0], [0.97, 0.95, 0.81]])
    calls = []

    def err(g):
        calls.append(g.shape)
        return (g - target) ** 2

    got = fit_key_scale(err)
    assert got.shape == target.shape and got.dtype == torch.float32
    assert (got - target).abs().max() <= 1e-5
    assert len(calls) == 3 and [c[0] for c in calls] == [3, 1, 1]
    flat = lambda g: (g - target) ** 4 + 0.3 * (g - target) ** 2 * (g > target)  # noqa: E731 (its minimum: 0)
    assert flat(fit_key_scale(flat)).max() <= 1e-5
    edge = fit_key_scale(lambda g: (g - torch.tensor([[0.5, 1.5]])) ** 2)
    assert edge[0, 0] == GAMMA_MIN and edge[0, 1] == GAMMA_MAX


def _parts(seed=0, b=2, h=2, g=3, r=4, s=3, n=20, w=6, d=8):
    gen = torch.Generator().manual_seed(seed)
    x = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return dict(query=x(b, h, g, r, d), exact_k=x(b, h, s, d), exact_v=x(b, h, s, d), coded_k=x(b, h, n, d),
                coded_hat=x(b, h, n, d), coded_v=x(b, h, n, d), window_k=x(b, h, w, d), window_v=x(b, h, w, d))


def attention_error(gammas, scaling, softcap=None, coded_visible=None, **parts):
    return scale_error(**parts, scaling=scaling, softcap=softcap, coded_visible=coded_visible)(gammas)


def _error_by_definition(p, gamma: float, scaling: float, visible=None, softcap=None) -> torch.Tensor:
    """attention_error written out row by row: row r of each query head sees the sinks, the coded tokens (unless
    hidden) and the window's first w - R + r + 1 tokens."""
    b, h, g, r, d = p["query"].shape
    w = p["window_k"].shape[2]
    out = torch.zeros(b, h)
    for bi in range(b):
        for hi in range(h):
            tot = 0.0
            for gi in range(g):
                for ri in range(r):
                    q = p["query"][bi, hi, gi, ri]
                    seen = w - r + ri + 1
                    keep = slice(None) if visible is None else visible[bi]
                    ks = [p["exact_k"][bi, hi], p["coded_k"][bi, hi][keep], p["window_k"][bi, hi, :seen]]
                    kh = [p["exact_k"][bi, hi], p["coded_hat"][bi, hi][keep], p["window_k"][bi, hi, :seen]]
                    vs = torch.cat([p["exact_v"][bi, hi], p["coded_v"][bi, hi][keep], p["window_v"][bi, hi, :seen]])
                    cap = (lambda x: x) if softcap is None else (lambda x: torch.tanh(x / softcap) * softcap)
                    exact = torch.softmax(cap(torch.cat(ks) @ q * scaling), 0) @ vs
                    lg = [kh[0] @ q * scaling, gamma * (kh[1] @ q) * scaling, kh[2] @ q * scaling]
                    tot += (torch.softmax(cap(torch.cat(lg)), 0) @ vs - exact).square().sum()
            out[bi, hi] = tot / (g * r)
    return out


def test_attention_error_is_the_definition_causal_window_and_padding_included():
    p = _parts()
    scaling = 0.35
    got = attention_error(**p, gammas=torch.tensor([1.0, 0.9]).view(2, 1, 1), scaling=scaling)
    for i, gm in enumerate((1.0, 0.9)):
        assert torch.allclose(got[i], _error_by_definition(p, gm, scaling), rtol=1e-4, atol=1e-7)
    visible = torch.ones(2, 20, dtype=torch.bool)
    visible[1, :5] = False  # row 1's first five coded slots are padding
    got = attention_error(**p, gammas=torch.tensor([0.85]).view(1, 1, 1), scaling=scaling, coded_visible=visible)
    assert torch.allclose(got[0], _error_by_definition(p, 0.85, scaling, visible), rtol=1e-4, atol=1e-7)
    # softcapping: applied after the scale, as the attention applies it
    got = attention_error(**p, gammas=torch.tensor([0.9]).view(1, 1, 1), scaling=scaling, softcap=1.5,
                          coded_visible=visible)
    assert torch.allclose(got[0], _error_by_definition(p, 0.9, scaling, visible, softcap=1.5), rtol=1e-4, atol=1e-7)
    # a gamma per (sequence, head)
    per = torch.tensor([[0.9, 1.0], [0.8, 0.95]])
    got = attention_error(**p, gammas=per[None], scaling=scaling)[0]
    for bi in range(2):
        for hi in range(2):
            assert torch.allclose(got[bi, hi], _error_by_definition(p, float(per[bi, hi]), scaling)[bi, hi], rtol=1e-4)
    with pytest.raises(ValueError, match="query rows"):
        attention_error(**{**p, "window_k": p["window_k"][:, :, :2], "window_v": p["window_v"][:, :, :2]},
                        gammas=[1.0], scaling=scaling)


def _error_by_row_masks(p, gamma: float, scaling: float, vis) -> torch.Tensor:
    """The error written out row by row under each row's own mask ``vis`` [B, 1|H, G R, s + n + w] (slots: exact,
    coded, window), taken with the causal window; the mean over the rows that see some slot."""
    b, h, g, r, d = p["query"].shape
    w, n = p["window_k"].shape[2], p["coded_k"].shape[2]
    out = torch.zeros(b, h)
    for bi in range(b):
        for hi in range(h):
            tot, rows = 0.0, 0
            for gi in range(g):
                for ri in range(r):
                    q = p["query"][bi, hi, gi, ri]
                    causal = torch.arange(w) < w - r + ri + 1
                    m = vis[bi, min(hi, vis.shape[1] - 1), gi * r + ri]
                    ns = p["exact_k"].shape[2]
                    keep = torch.cat([m[:ns], m[ns:ns + n], m[ns + n:] & causal])
                    if not keep.any():
                        continue
                    ks = torch.cat([p["exact_k"][bi, hi], p["coded_k"][bi, hi], p["window_k"][bi, hi]])[keep]
                    vs = torch.cat([p["exact_v"][bi, hi], p["coded_v"][bi, hi], p["window_v"][bi, hi]])[keep]
                    scale = torch.cat([torch.ones(ns), torch.full((n,), gamma), torch.ones(w)])[keep]
                    kh = torch.cat([p["exact_k"][bi, hi], p["coded_hat"][bi, hi], p["window_k"][bi, hi]])[keep]
                    exact = torch.softmax(ks @ q * scaling, 0) @ vs
                    tot += (torch.softmax(scale * (kh @ q) * scaling, 0) @ vs - exact).square().sum()
                    rows += 1
            out[bi, hi] = tot / max(rows, 1)
    return out


@pytest.mark.parametrize("heads", [1, 2])
def test_each_rows_own_mask_is_the_definition(heads):
    """``visible``: a mask per query row over the slots (a sliding window's, say), with the causal window; a row that
    sees nothing counts for nothing."""
    p = _parts(seed=5)
    vis = torch.rand(2, heads, 12, 3 + 20 + 6, generator=torch.Generator().manual_seed(6)) > 0.3
    vis[0, 0, 1] = False  # sees nothing
    vis[1, -1, 5, :23] = False  # sees only window slots beyond its causal window: nothing either
    got = scale_error(**p, scaling=0.35, visible=vis)(torch.tensor([1.0, 0.85]).view(2, 1, 1))
    for i, gm in enumerate((1.0, 0.85)):
        assert torch.isfinite(got[i]).all()
        assert torch.allclose(got[i], _error_by_row_masks(p, gm, 0.35, vis), rtol=1e-4, atol=1e-7)
    none = torch.zeros(2, heads, 12, 29, dtype=torch.bool)
    none[..., :3] = True  # only the exact tokens: the error does not depend on gamma, and the fit leaves it at 1
    assert torch.equal(fit_key_scale(scale_error(**p, scaling=0.35, visible=none)), torch.ones(2, 2))
    with pytest.raises(ValueError, match="visible"):
        scale_error(**p, scaling=0.35, visible=vis[..., :-1])
    with pytest.raises(ValueError, match="visible"):
        scale_error(**p, scaling=0.35, visible=vis.float())


def test_fit_recovers_a_known_inflation_of_the_coded_scores():
    """Coded keys that are the exact keys times c_h score c_h times too high: the fit undoes it, gamma = 1 / c_h."""
    p = _parts(seed=3, n=64)
    c = torch.tensor([[1.05, 1.1], [1.2, 1.02]])
    p["coded_hat"] = p["coded_k"] * c[:, :, None, None]
    got = fit_key_scale(lambda gm: attention_error(**p, gammas=gm, scaling=1.0))
    assert (got - 1 / c).abs().max() <= TOL


def _config(fit, kernel="torch", heavy=0, key="turboquant_mse"):
    key = CodecSpec(key, {"bits": 2, "correct_norm": True})
    return QJLConfig(key=key, value=CodecSpec("turboquant_mse", {"bits": 3}), late_key=None, residual_length=16,
                     flush_block=4, sink_tokens=2, heavy_tokens=heavy, smooth_values=False, kernel=kernel,
                     exact_dtype=None, fit_key_scale=fit)


def _prefill(store, k, v, q, mask=None):
    store.append(k, v)
    store.before_attention(mask, q, 32 ** -0.5)
    store.after_attention()
    store.flush()


def _kv(b=2, n=80, seed=0, h=2, d=32):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, n, d, generator=gen) * 3  # peaked scores: the noise of 2-bit codes matters
    return k, torch.randn(b, h, n, d, generator=gen), torch.randn(b, 2 * h, n, d, generator=gen) * 3


@pytest.mark.parametrize("kernel,key", [("torch", "turboquant_mse"), ("auto", "turboquant_vq")])
def test_the_store_folds_gamma_into_every_flushed_key_norm_and_nothing_else(kernel, key):
    """Later flushes too, through the Python coding (torch) and the C store (vector codebooks on the CPU)."""
    k, v, q = _kv()
    on, off = LayerStore(0, _config(True, kernel, key=key)), LayerStore(0, _config(False, kernel, key=key))
    for s in (on, off):
        _prefill(s, k[:, :, :60], v[:, :, :60], q[:, :, :60])
    gamma = on.key_scale
    assert gamma.shape == (2, 2) and on.scale_q is None and off.key_scale is None
    assert ((gamma >= GAMMA_MIN) & (gamma <= GAMMA_MAX)).all() and (gamma < 1).any()
    for t in range(60, 80):  # decode steps: later flushes scaled by the same gamma
        for s in (on, off):
            s.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
            s.before_attention(None, q[:, :, t:t + 1], 32 ** -0.5)
            s.after_attention()
    assert on.n_codes == off.n_codes > 42
    kon, koff = on.key_codes, off.key_codes
    assert torch.equal(kon.fields["codes"], koff.fields["codes"])
    want = (koff.fields["norm"].float() * gamma[:, :, None]).to(koff.fields["norm"].dtype)
    assert torch.equal(kon.fields["norm"], want)
    assert all(torch.equal(a, b) for a, b in zip(on.value_codes.fields.values(), off.value_codes.fields.values()))
    assert on.nbytes()["fit"] == off.nbytes()["fit"] + gamma.numel() * 4  # held, and counted
    # every attention path reads the scaled norms alike
    qq = q[:, :, -1:]
    outs = []
    for kern in ("torch", "auto"):
        s = LayerStore(0, _config(True, kernel=kern, key=key))
        _prefill(s, k[:, :, :60], v[:, :, :60], q[:, :, :60])
        assert torch.equal(s.key_scale, gamma)
        outs.append(attend(s, qq, None, 32 ** -0.5))
    assert torch.allclose(outs[0], outs[1], atol=2e-3)


def test_gamma_is_per_sequence_blind_to_padding_and_follows_select():
    k, v, q = _kv(seed=1)
    mask = torch.ones(2, 1, 60, 60, dtype=torch.bool)
    mask[1, ..., :5] = False  # row 1: five padding tokens
    a = LayerStore(0, _config(True, heavy=4))
    _prefill(a, k[:, :, :60], v[:, :, :60], q[:, :, :60], mask)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, :5] = 100 * torch.randn(2, 5, 32)  # other padding: the same gamma for the real tokens
    v2[1, :, :5] = -50.0
    b = LayerStore(0, _config(True, heavy=4))
    _prefill(b, k2[:, :, :60], v2[:, :, :60], q[:, :, :60], mask)
    assert torch.allclose(a.key_scale, b.key_scale, atol=1e-6)
    one = LayerStore(0, _config(True, heavy=4))  # row 0 alone: its own gamma
    _prefill(one, k[:1, :, :60], v[:1, :, :60], q[:1, :, :60])
    assert torch.allclose(one.key_scale, a.key_scale[:1], atol=1e-6)
    g = a.key_scale.clone()
    a.select(torch.tensor([1, 0]))
    assert torch.equal(a.key_scale, g[[1, 0]])


def test_a_sliding_window_fits_what_its_rows_see():
    """A compressed sliding-window layer: the fit's rows attend through their window, so the tokens none of them sees
    do not move gamma (unlike the full attention's fit); a window of one token sees no coded token: gamma 1; an
    explicit causal mask is no mask.  Left padding without sinks is hidden as the mask hides it."""
    from dataclasses import replace

    k, v, q = _kv(seed=2)
    length, width = 60, 24
    pos = torch.arange(length)

    def window(w):
        return ((pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - w))[None, None].expand(2, 1, -1, -1)

    cfg = replace(_config(True), smooth_keys=False)

    def fit(keys, mask, config=cfg):
        store = LayerStore(0, config)
        _prefill(store, keys[:, :, :length], v[:, :, :length], q[:, :, :length], mask)
        return store.key_scale

    full, slid = fit(k, None), fit(k, window(width))
    assert (slid - full).abs().max() > 1e-3
    k2 = k.clone()
    k2[:, :, 2:length - 16 - width + 1] = 5 * torch.randn(2, 2, length - 16 - width - 1, 32)  # unseen by every row
    assert torch.allclose(fit(k2, window(width)), slid, atol=1e-6)
    assert not torch.allclose(fit(k2, None), full, atol=1e-3)
    assert torch.equal(fit(k, window(1)), torch.ones(2, 2))
    assert torch.equal(fit(k, window(length)), full)  # the causal mask itself
    bare = replace(cfg, sink_tokens=0)
    pad = window(length).clone()
    pad[1, ..., :5] = False
    k3 = k.clone()
    k3[1, :, :5] = 100 * torch.randn(2, 5, 32)
    assert torch.allclose(fit(k, pad, bare), fit(k3, pad, bare), atol=1e-6)
    # with sinks, a padded row's sinks are its first real tokens (slots reordered): its rows see them
    base = fit(k, pad)
    k4 = k.clone()
    k4[1, :, 5:7] *= 4
    moved = fit(k4, pad)
    assert torch.allclose(moved[0], base[0], atol=1e-6) and (moved[1] - base[1]).abs().max() > 1e-4


def test_no_queries_before_the_first_flush_means_no_scale():
    k, v, _ = _kv()
    on, off = LayerStore(0, _config(True)), LayerStore(0, _config(False))
    for s in (on, off):
        s.append(k[:, :, :60], v[:, :, :60])
        s.before_attention(None)
        s.flush()
    assert torch.equal(on.key_scale, torch.ones(2, 2))
    assert torch.equal(on.key_codes.fields["norm"], off.key_codes.fields["norm"])


def test_config_checks_the_option():
    assert QJLConfig.auto(bits_per_value=3.0).fit_key_scale
    assert not QJLConfig.auto(bits_per_value=3.0, fit_key_scale=False).fit_key_scale
    assert not QJLConfig().fit_key_scale and "key scale fitted" in _config(True).describe(32)
    with pytest.raises(TypeError, match="fit_key_scale"):
        QJLConfig(fit_key_scale=1)
    with pytest.raises(ValueError, match="fit_key_scale.*qjl"):
        QJLConfig(key=CodecSpec("qjl", {}, per_dim={"sketch_dim": 2.0}), fit_key_scale=True)
    with pytest.raises(ValueError, match="fit_key_scale.*kivi"):
        QJLConfig(key=CodecSpec("kivi", {"bits": 2}), flush_block=32, fit_key_scale=True)


def test_bad_parts_and_search_arguments_are_named():
    p = _parts()
    with pytest.raises(ValueError, match="query"):
        scale_error(**{**p, "query": p["query"][0]}, scaling=1.0)
    with pytest.raises(ValueError, match="coded_hat"):
        scale_error(**{**p, "coded_hat": p["coded_hat"][..., :4]}, scaling=1.0)
    with pytest.raises(ValueError, match="coded_k, coded_hat, coded_v"):
        scale_error(**{**p, "coded_v": p["coded_v"][:, :, :5]}, scaling=1.0)
    with pytest.raises(ValueError, match="exact_k and exact_v"):
        scale_error(**{**p, "exact_v": None}, scaling=1.0)
    with pytest.raises(ValueError, match="coded_visible"):
        scale_error(**p, scaling=1.0, coded_visible=torch.ones(2, 20))
    with pytest.raises(TypeError, match="error_of"):
        fit_key_scale(None)
    with pytest.raises(ValueError, match="lo"):
        fit_key_scale(lambda g: g, lo=1.0, hi=0.9)
