"""Widths from the prompt: the error proxy against Monte Carlo, and the allocation within its budget."""

import pytest
import torch

from qjl.cache.allocation import (AutoBits, choose_widths, layer_sensitivity, predicted_error,
                                  residual_head_weights)


def _attention(q, k, v, scale):
    return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v


def test_sensitivity_predicts_the_output_error():
    """S_K and S_V of the proxy against the mean squared output error of random isotropic errors with
    E||e_t||^2 = D ||k_t||^2 (what a rotation codec adds).  400 draws: the values' error is linear (exact up
    to sampling: relative standard error ~ sqrt(2/400) = 7% per coordinate sum, tolerance 15%); the keys'
    is first-order in D (D = 0.01, tolerance 20%)."""
    g = torch.Generator().manual_seed(0)
    d, n, r, scale = 32, 200, 8, 32 ** -0.5
    q, k, v = (torch.randn(1, 1, m, d, generator=g) for m in (r, n, n))
    k = k * 2.0
    s_k, s_v = layer_sensitivity(q, k, v, None, scale, slice(0, n))
    base = _attention(q, k, v, scale)
    dist, ek, ev = 0.01, [], []
    for _ in range(400):
        noise_k = torch.randn(k.shape, generator=g) * k.norm(dim=-1, keepdim=True) * (dist / d) ** 0.5
        noise_v = torch.randn(v.shape, generator=g) * v.norm(dim=-1, keepdim=True) * (dist / d) ** 0.5
        ek.append((_attention(q, k + noise_k, v, scale) - base).square().sum())
        ev.append((_attention(q, k, v + noise_v, scale) - base).square().sum())
    assert torch.stack(ev).mean().item() == pytest.approx(dist * s_v, rel=0.15)
    assert torch.stack(ek).mean().item() == pytest.approx(dist * s_k, rel=0.20)


def _sensitivity_direct(q, k, v, mask, scale, tokens):
    """S_K, S_V summed term by term (the module doc's formulas), in float64: q [B, H_q, R, D], k, v [B, H_kv, L, D],
    mask [B, 1|H_q, R, L] additive (or None)."""
    b, hq, r, d = q.shape
    g = hq // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)  # [B, H_q, L, D]
    logits = q.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        logits = logits + mask.double()
    p = torch.softmax(logits, -1).nan_to_num(0.0)
    o = p @ v
    s_k = s_v = 0.0
    for t in range(*tokens.indices(k.shape[2])):
        p2 = p[..., t].square()  # [B, H_q, R]
        dist2 = (v[:, :, t].unsqueeze(2) - o).square().sum(-1)
        s_k += (q.double().square().sum(-1) * p2 * k[:, :, t].square().sum(-1).unsqueeze(-1) * dist2).sum().item()
        s_v += (p2 * v[:, :, t].square().sum(-1).unsqueeze(-1)).sum().item()
    return s_k * scale ** 2 / d, s_v


@pytest.mark.parametrize("heads_in_mask", [1, 6])
def test_sensitivity_equals_the_direct_sum(heads_in_mask):
    """The five-pass form (a - 2 o.w + |o|^2 c) against the term-by-term sum: GQA (6 query heads on 2 KV heads),
    a mask (shared or per head) with a row that sees nothing (its weights count as 0), a bool mask, tokens a sub-range."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 5, 16, generator=g)
    k, v = torch.randn(2, 2, 40, 16, generator=g) * 2, torch.randn(2, 2, 40, 16, generator=g)
    mask = torch.zeros(2, heads_in_mask, 5, 40)
    mask[..., 35:] = float("-inf")
    mask[1, :, 2] = float("-inf")  # a padded query row
    mask[0, -1, :, 10:20] = float("-inf")  # with a mask per head, the last head's differs
    tokens = slice(4, 30)
    want = _sensitivity_direct(q, k, v, mask, 0.25, tokens)
    for m in (mask, mask == 0):
        got = layer_sensitivity(q, k, v, m, 0.25, tokens)
        assert got == pytest.approx(want, rel=1e-5)
    one = mask[:1]  # a mask of batch 1 broadcast over the batch
    assert layer_sensitivity(q, k, v, one, 0.25, tokens) == pytest.approx(
        _sensitivity_direct(q, k, v, one.expand(2, -1, -1, -1), 0.25, tokens), rel=1e-5)
    assert layer_sensitivity(q, k, v, None, 0.25, tokens) == pytest.approx(
        _sensitivity_direct(q, k, v, None, 0.25, tokens), rel=1e-5)


def test_sensitivity_per_kv_head_is_each_heads_own():
    """``per_head``: each KV head's S_K, S_V are those of that head and its query group alone, and sum to the
    layer's."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 6, 5, 16, generator=g)
    k, v = torch.randn(2, 3, 40, 16, generator=g) * 2, torch.randn(2, 3, 40, 16, generator=g)
    k[:, 1] *= 3  # heads of different sensitivity
    mask = torch.zeros(2, 6, 5, 40)
    mask[..., 35:] = float("-inf")
    mask[0, 4:] = float("-inf")  # KV head 2's queries see nothing in row 0
    mask[0, 4:, :, :3] = 0.0
    tokens = slice(4, 30)
    s_k, s_v = layer_sensitivity(q, k, v, mask, 0.25, tokens, per_head=True)
    assert len(s_k) == len(s_v) == 3
    for h in range(3):
        want = _sensitivity_direct(q[:, 2 * h:2 * h + 2], k[:, h:h + 1], v[:, h:h + 1], mask[:, 2 * h:2 * h + 2],
                                   0.25, tokens)
        assert (s_k[h], s_v[h]) == pytest.approx(want, rel=1e-5)
    assert (sum(s_k), sum(s_v)) == pytest.approx(layer_sensitivity(q, k, v, mask, 0.25, tokens), rel=1e-9)


@pytest.mark.parametrize("per_head", [False, True])
def test_head_weights_weigh_each_query_heads_own_terms(per_head):
    """``head_weights`` [H_q]: the terms are each query head's own (its rows alone, against its KV head) times its
    weight, summed (per KV head: over its query group); uniform weights scale both sums; a weight on the wrong head
    would show."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 5, 16, generator=g)
    k, v = torch.randn(2, 2, 40, 16, generator=g) * 2, torch.randn(2, 2, 40, 16, generator=g)
    mask = torch.zeros(2, 6, 5, 40)
    mask[..., 35:] = float("-inf")
    tokens = slice(4, 30)
    w = torch.tensor([0.5, 2.0, 3.0, 0.25, 1.5, 4.0], dtype=torch.float64)
    own = [_sensitivity_direct(q[:, h:h + 1], k[:, h // 3:h // 3 + 1], v[:, h // 3:h // 3 + 1], mask[:, h:h + 1],
                               0.25, tokens) for h in range(6)]
    got = layer_sensitivity(q, k, v, mask, 0.25, tokens, per_head=per_head, head_weights=w)
    want_k = [sum(float(w[h]) * own[h][0] for h in range(3 * j, 3 * j + 3)) for j in range(2)]
    want_v = [sum(float(w[h]) * own[h][1] for h in range(3 * j, 3 * j + 3)) for j in range(2)]
    if per_head:
        assert got[0] == pytest.approx(want_k, rel=1e-5) and got[1] == pytest.approx(want_v, rel=1e-5)
    else:
        assert got == pytest.approx((sum(want_k), sum(want_v)), rel=1e-5)
    plain = layer_sensitivity(q, k, v, mask, 0.25, tokens)
    assert layer_sensitivity(q, k, v, mask, 0.25, tokens, head_weights=torch.full((6,), 3.0)) == pytest.approx(
        (3 * plain[0], 3 * plain[1]), rel=1e-9)
    for bad in (torch.ones(5), torch.ones(2, 3), torch.ones(0), torch.ones(12)):
        with pytest.raises(ValueError, match="head_weights"):
            layer_sensitivity(q, k, v, mask, 0.25, tokens, head_weights=bad)


def test_residual_head_weights_and_their_switch_name_bad_input():
    assert torch.equal(residual_head_weights(torch.tensor([2.0, 4.0]), 8.0),
                       torch.tensor([0.25, 0.5], dtype=torch.float64))
    for gain in (torch.tensor([1.0, -1.0]), torch.tensor([float("nan")]), torch.ones(2, 2)):
        with pytest.raises(ValueError, match="gain"):
            residual_head_weights(gain, 1.0)
    for energy in (0.0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match="energy"):
            residual_head_weights(torch.ones(2), energy)
    assert AutoBits(bits_per_value=3.0).residual_weights is True
    with pytest.raises(ValueError, match="residual_weights"):
        AutoBits(bits_per_value=3.0, residual_weights=1)
    from qjl import QJLConfig

    assert QJLConfig.named("auto-3.0u").allocation.residual_weights is False
    assert QJLConfig.named("auto-3.0lu").allocation.per_head is False
    assert "residual stream" in QJLConfig.named("auto-3.0").allocation.describe()


def test_widths_per_kv_head():
    """Units of (layer, KV head): the budget holds over all heads, the most sensitive head of a layer gets the most
    bits, a layer kept exact is kept so for all its heads, and one head per layer is the per-layer allocation."""
    heads = 3
    units = [_stats(1.0, 1.0), _stats(80.0, 1.0), _stats(1.0, 1.0),  # layer 0: head 1's keys matter
             _stats(1.0, 1.0), _stats(1.0, 1.0), _stats(1.0, 60.0),  # layer 1: head 2's values
             _stats(2.0, 2.0), _stats(1.0, 1.0), _stats(1.0, 1.0)]
    picks = choose_widths(units, budget=3.0, exact_bits=16, boundary=0, heads=heads)
    bits = [units[u]["keys"][k][0] + units[u]["values"][v][0] for u, (k, v) in enumerate(picks)]
    assert sum(bits) / (2 * len(units)) <= 3.0
    assert picks[1][0] > picks[0][0] and picks[1][0] > picks[2][0]
    assert picks[5][1] > picks[3][1] and picks[5][1] > picks[4][1]
    assert len(set(picks[0:3])) > 1  # the heads of a layer differ
    # a per-layer allocation can only give layer 0's three heads one width: its error is larger at the same bits
    layers = [dict(units[3 * i], s_k=sum(units[3 * i + h]["s_k"] for h in range(3)),
                   s_v=sum(units[3 * i + h]["s_v"] for h in range(3))) for i in range(3)]
    per_layer = [p for p in choose_widths(layers, 3.0, 16, 0) for _ in range(heads)]
    assert predicted_error(units, picks) < predicted_error(units, per_layer)
    assert choose_widths(layers, 3.0, 16, 0, heads=1) == choose_widths(layers, 3.0, 16, 0)
    big = [_stats(1e6, 1e6)] * heads + [_stats(1.0, 1.0)] * (5 * heads)
    exact = choose_widths(big, budget=5.0, exact_bits=16, boundary=1, heads=heads)
    assert exact[:heads] == [None] * heads and all(p is not None for p in exact[heads:])
    for bad in (0, 2, True):
        with pytest.raises(ValueError, match="heads"):
            choose_widths(units, 3.0, 16, 0, heads=bad)


def _greedy_reference(stats, budget, exact_bits, boundary, heads):
    """choose_widths re-evaluating every move of every unit at each step (what its kept best moves must equal)."""
    n, layers = len(stats), len(stats) // heads
    err = lambda u, r, i: stats[u]["s_" + r[0]] * stats[u][r][i][1]  # noqa: E731
    bits = lambda u, r, i: stats[u][r][i][0]  # noqa: E731
    choice = [{r: min(range(len(stats[u][r])), key=lambda i: (bits(u, r, i), err(u, r, i))) for r in ("keys", "values")}
              for u in range(n)]
    exact = [False] * layers
    cost = lambda u: bits(u, "keys", choice[u]["keys"]) + bits(u, "values", choice[u]["values"])  # noqa: E731
    error = lambda u: err(u, "keys", choice[u]["keys"]) + err(u, "values", choice[u]["values"])  # noqa: E731
    total, cap = sum(cost(u) for u in range(n)), 2 * budget * n
    while True:
        moves = []
        for u in range(n):
            l = u // heads
            if exact[l]:
                continue
            for r in ("keys", "values"):
                for i in range(len(stats[u][r])):
                    j = choice[u][r]
                    moves.append((bits(u, r, i) - bits(u, r, j), err(u, r, j) - err(u, r, i), u, r, i))
            if u % heads == 0 and (l < boundary or l >= layers - boundary):
                units = range(u, u + heads)
                moves.append((2 * exact_bits * heads - sum(cost(x) for x in units), sum(error(x) for x in units),
                              u, "exact", None))
        ok = [m for m in moves if m[0] > 0 and m[1] > 0 and total + m[0] <= cap + 1e-9]
        if not ok:
            return [None if exact[u // heads] else (choice[u]["keys"], choice[u]["values"]) for u in range(n)]
        extra, _, u, r, i = max(ok, key=lambda m: (m[1] / m[0], -m[2], m[3], -(m[4] or 0)))
        if r == "exact":
            exact[u // heads] = True
        else:
            choice[u][r] = i
        total += extra


def test_greedy_keeps_the_choices_of_re_evaluating_every_move():
    """choose_widths keeps each unit's best affordable move between steps: the same picks as re-evaluating every move
    (random sensitivities, budgets, boundaries, one to four heads per layer, exact layers among the choices)."""
    import random

    rng = random.Random(0)
    exact_seen = 0
    for _ in range(200):
        heads, layers = rng.choice([1, 2, 3, 4]), rng.choice([3, 5, 8])
        stats = [_stats(rng.lognormvariate(3, 3), rng.lognormvariate(2, 2)) for _ in range(heads * layers)]
        budget, boundary = rng.choice([2.8, 3.0, 3.5, 4.5, 5.5, 7.0, 9.0, 12.0]), rng.choice([0, 1, 2])
        want = _greedy_reference(stats, budget, 16, boundary, heads)
        assert choose_widths(stats, budget, 16, boundary, heads=heads) == want
        exact_seen += None in want
    assert exact_seen  # the exact option was exercised


def _stats(s_k, s_v):
    keys = [(2.25, 0.12), (3.25, 0.034), (4.25, 0.0093), (5.25, 0.0025)]
    values = [(2.125, 0.13), (3.25, 0.034), (4.25, 0.0093)]
    return {"s_k": s_k, "s_v": s_v, "keys": keys, "values": values}


def test_allocation_keeps_the_budget_and_spends_it_where_errors_are_large():
    stats = [_stats(1.0, 1.0), _stats(50.0, 1.0), _stats(1.0, 30.0), _stats(1.0, 1.0)]
    picks = choose_widths(stats, budget=3.0, exact_bits=16, boundary=0)
    bits = [stats[i]["keys"][k][0] + stats[i]["values"][v][0] for i, (k, v) in enumerate(picks)]
    assert sum(bits) / (2 * len(stats)) <= 3.0
    assert picks[1][0] > picks[0][0] and picks[2][1] > picks[0][1]  # the sensitive roles got the bits
    assert choose_widths(stats, 3.0, 16, 0) == picks  # deterministic
    uniform = [(1, 1)] * 4  # 3.25 + 3.25 everywhere: more bits than the budget, and still a larger error
    assert predicted_error(stats, picks) < predicted_error(stats, uniform)
    with pytest.raises(ValueError, match="below the cheapest"):
        choose_widths(stats, budget=1.5, exact_bits=16, boundary=0)


def test_exact_layers_only_at_the_boundary_and_only_when_worth_it():
    stats = [_stats(1e6, 1e6)] + [_stats(1.0, 1.0)] * 5
    picks = choose_widths(stats, budget=5.0, exact_bits=16, boundary=1)
    assert picks[0] is None and all(p is not None for p in picks[1:])
    assert all(p is not None for p in choose_widths(stats, budget=5.0, exact_bits=16, boundary=0))


def test_default_key_candidates_leave_out_2_bit_keys_from_3_bits_per_value():
    """2-bit keys are candidates only where the budget needs them (the proxy misranks them: module doc)."""
    from qjl.cache.allocation import AutoBits

    widths = lambda a: sorted(s.params["bits"] for s in a.key_candidates)  # noqa: E731
    assert widths(AutoBits(3.0)) == [3, 4, 5, 6]
    assert widths(AutoBits(2.5)) == [2, 3, 4, 5, 6]
    assert widths(AutoBits(3.0, key_candidates=(AutoBits(2.5).key_candidates[0],))) == [2]


def test_vector_codebook_candidates_are_measured_by_the_codecs_themselves():
    """With vector codebooks the 2-4-bit candidates are TurboQuantVQ codecs (their own, lower, distortion measured
    through quantize/dequantize, not the scalar cells' moments), a head size the group does not divide gets the scalar
    twin, and the 5-6-bit key candidates stay scalar."""
    from qjl import QJLConfig
    from qjl.cache.allocation import _distortion, candidate_codecs, distortions
    from qjl.codecs.turboquant import TurboQuantMSE
    from qjl.codecs.vq import TurboQuantVQ

    vec, sca = QJLConfig.auto(3.0, vector_values=True), QJLConfig.auto(3.0, vector_keys=False)
    one = QJLConfig.auto(3.0, vector_values=True, value_cycles=1)  # (a cycled codec is read through rotation 0)
    kv, vv = candidate_codecs(vec, 2, 64, 64)
    ks, vs = candidate_codecs(sca, 2, 64, 64)
    assert [type(c) for c in kv] == [TurboQuantVQ, TurboQuantVQ, TurboQuantMSE, TurboQuantMSE]  # 3, 4, 5, 6 bits
    assert all(type(c) is TurboQuantVQ and c.cycles == 8 for c in vv)
    x = torch.randn(1, 2, 300, 64, generator=torch.Generator().manual_seed(3))
    v1 = candidate_codecs(one, 2, 64, 64)[1]
    dv, ds, d1 = distortions(vv, x), distortions(vs, x), distortions(v1, x)
    dk = distortions(kv[:2], x)  # keys: the shared-rotation path with the vector cells' moments
    for c, a, b, a1 in zip(vv, dv, ds, d1):
        assert a == a1 and a1 == pytest.approx(_distortion(v1[vv.index(c)], x), rel=1e-5) and a < 0.92 * b, c
    for c, a in zip(kv[:2], dk):
        assert a == pytest.approx(_distortion(c, x), rel=1e-5), c
    assert all(c.rotation.seed == s.rotation.seed for c, s in zip(kv, ks))  # the layer's seeds, as before
    k66, v66 = candidate_codecs(vec, 0, 66, 66)  # 66 = 2 x 33: 2-bit groups of 4 do not divide it
    assert type(v66[0]) is TurboQuantMSE and v66[0].bits == 2 and type(v66[2]) is TurboQuantVQ  # 3 bits: pairs


@pytest.mark.parametrize("moments", ["c", "torch"])
def test_distortions_from_one_rotation_equal_the_codecs_own(moments, monkeypatch):
    """The batched path (one rotation per sample, each width's cell moments, every norm dtype's error from them)
    gives each codec's own quantize/dequantize distortion: fp16 and fp8 norms, with and without the norm
    correction, 2-6 bits, the moments from the C kernel or from torch; a padded Hadamard rotation and a codec
    with a per-sequence fit go through the codec itself."""
    from qjl.cache.allocation import _distortion, distortions
    from qjl.codecs.registry import make_codec
    from qjl.kernels.cpu import launch

    if moments == "torch":
        monkeypatch.setattr(launch, "available", lambda: False)
    elif not launch.available():
        pytest.skip("the C kernels do not build here")

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 200, 64, generator=g) * torch.linspace(0.2, 3.0, 64)
    x[0, 0, 0] = 0  # a zero vector
    codecs = [make_codec("turboquant_mse", 64, bits=b, seed=7, correct_norm=cn, norm_dtype=nd)
              for b in (2, 3, 4, 6) for cn in (True, False) for nd in ("fp16", "fp8")]
    codecs.append(make_codec("turboquant_mse", 48, bits=3, rotation="hadamard", seed=7))  # padded to 64
    for c, d in zip(codecs[:-1], distortions(codecs[:-1], x)):
        assert abs(d - _distortion(c, x)) <= 1e-5 * _distortion(c, x), c
    x48 = x[..., :48]
    assert distortions(codecs[-1:], x48) == [_distortion(codecs[-1], x48)]


def test_distortions_fall_back_where_a_norm_overflows_its_dtype():
    """Norms past float8's 448: the batched path hands the codec itself the sample, which refuses it."""
    from qjl.cache.allocation import distortions
    from qjl.codecs.registry import make_codec

    c = make_codec("turboquant_mse", 64, bits=2, norm_dtype="fp8")
    with pytest.raises(ValueError, match="norm"):
        distortions([c], torch.full((1, 1, 4, 64), 100.0))


def test_distortions_name_bad_input():
    from qjl.cache.allocation import distortions
    from qjl.codecs.registry import make_codec

    c = make_codec("turboquant_mse", 64, bits=3)
    assert distortions([], torch.zeros(1, 1, 4, 64)) == []
    with pytest.raises(ValueError, match="x"):
        distortions([c], torch.zeros(1, 1, 4, 32))  # wrong dimension
    with pytest.raises(ValueError, match="x"):
        distortions([c], torch.full((1, 1, 4, 64), float("nan")))


def test_planned_budget_names_bad_arguments():
    from qjl.cache.allocation import planned_budget

    assert planned_budget(3.0, 6400, 32, False, 64, 64) == pytest.approx(3.0 / (1 + 100 / 6400))
    # key / value means: one fp32 per row and channel, over the n tokens' key + value coordinates
    for sk, sv, dims in ((True, False, 64), (False, True, 32), (True, True, 96)):
        want = (3.0 - 32.0 * dims / (6400 * (64 + 32))) / (1 + 100 / 6400)
        assert planned_budget(3.0, 6400, 32, sk, 64, 32, smooth_values=sv) == pytest.approx(want)
    # heavy tokens: their positions, int32 per row, shared by the KV heads
    want = (3.0 - 32.0 * 64 / (6400 * 96) - 32.0 * 16 / (3 * 6400 * 96)) / (1 + 100 / 6400)
    assert planned_budget(3.0, 6400, 32, True, 64, 32, heavy_tokens=16, heads=3) == pytest.approx(want)
    # the fitted key scale: one fp32 per row
    want = (3.0 - 32.0 / (6400 * 96)) / (1 + 100 / 6400)
    assert planned_budget(3.0, 6400, 32, False, 64, 32, key_scale=True) == pytest.approx(want, rel=1e-12)
    assert planned_budget(3.0, 6400, 32, False, 64, 32, key_scale=True) < planned_budget(3.0, 6400, 32, False, 64, 32)
    for kw, name in ((dict(budget=0.0), "budget"), (dict(tokens=-1), "tokens"), (dict(flush_block=0), "flush_block"),
                     (dict(key_dim=1.5), "key_dim"), (dict(heavy_tokens=-1), "heavy_tokens"), (dict(heads=0), "heads")):
        args = dict(budget=3.0, tokens=100, flush_block=32, smooth_keys=True, key_dim=64, value_dim=64) | kw
        with pytest.raises(ValueError, match=name):
            planned_budget(**args)
    for name in ("smooth_keys", "smooth_values", "key_scale"):
        args = dict(budget=3.0, tokens=100, flush_block=32, smooth_keys=True, key_dim=64, value_dim=64) | {name: 1}
        with pytest.raises(TypeError, match=name):
            planned_budget(**args)


def test_split_keys_are_measured_in_the_queries_metric():
    """A split codec's distortion is read in the metric of the queries (fitted on one half, measured on the
    other): where later queries look at the loud channels it chose, its measured D falls below its plain
    ||e||^2 / ||k||^2; a rotation's D is its plain one whatever the queries (an even spread)."""
    from qjl.cache.allocation import SPLIT_KEYS, _distortion, distortions, query_weights

    g = torch.Generator().manual_seed(3)
    loud = torch.ones(64)
    loud[:16] = 5.0
    x = torch.randn(1, 2, 300, 64, generator=g) * loud
    q = torch.randn(1, 2, 64, 64, generator=g) * loud
    w = query_weights(q)
    assert w.shape == (1, 2, 64) and torch.allclose(w.mean(-1), torch.ones(1, 2))
    assert torch.equal(query_weights(torch.zeros(1, 1, 4, 8)), torch.ones(1, 1, 8))  # silent queries: uniform
    for bad in (None, torch.zeros(8), torch.zeros(1, 0, 8), torch.full((1, 2, 8), float("nan"))):
        with pytest.raises((ValueError, TypeError), match="queries"):
            query_weights(bad)
    split = SPLIT_KEYS[0].build(64, 7)  # 16 channels at 5 bits, 48 at 2
    from qjl import QJLConfig

    plain = QJLConfig().key.build(64, 7)
    (d_split, d_plain) = distortions([split, plain], x, fit=True, queries=(q[:, :, :32], q[:, :, 32:]))
    assert d_plain == pytest.approx(_distortion(plain, x), rel=1e-5)
    fit = split.fit(x, queries=q[:, :, :32])
    e2 = (split.dequantize(split.quantize(x, *fit)) - x).square()
    assert d_split == pytest.approx(float((e2 * query_weights(q[:, :, 32:]).unsqueeze(2)).sum() / x.square().sum()),
                                    rel=1e-5)
    # the loud channels hold 89% of the energy at 5 bits, the rest at 2: the queries see ~0.64x the plain error
    assert d_split < 0.75 * _distortion(split, x, *fit)


def test_a_budget_stated_at_a_length_holds_the_whole_caches_share():
    """``AutoBits(budget_tokens=N0)``: past N0 the codes get the bits the exact tokens' shrinking share frees, so
    the whole cache (codes + exact tokens) holds the same bits per token at the prompt's length as at N0; at or
    below N0, and without ``budget_tokens``, the budget is ``bits_per_value`` itself."""
    from qjl.cache.allocation import AutoBits

    auto, plain = AutoBits(2.72, budget_tokens=4096), AutoBits(2.72)
    exact, x = 140, 16.0
    per_token = lambda b, n: (b * (n - exact) + x * exact) / n  # noqa: E731  the whole cache's bits per token
    for n in (100, 1536, 4096):
        assert auto.codes_budget(n, exact, x) == plain.codes_budget(n, exact, x) == 2.72
    prev = 2.72
    for n in (4097, 6000, 8192, 32768):
        b = auto.codes_budget(n, exact, x)
        assert plain.codes_budget(n, exact, x) == 2.72
        assert per_token(b, n) == pytest.approx(per_token(2.72, 4096), rel=1e-12)
        assert prev < b < x
        prev = b
    # 8k: 140 exact fp16 tokens free ~0.24 bits per value for the codes
    assert auto.codes_budget(8192, exact, x) == pytest.approx(((2.72 * 3956 + 2240) * 2 - 2240) / 8052)
    assert auto.codes_budget(8192, 5000, x) == 2.72  # N0 holds no compressed tokens: nothing to restate
    for kw, name in ((dict(length=-1), "length"), (dict(exact=1.5), "exact"), (dict(exact_bits=0), "exact_bits")):
        with pytest.raises(ValueError, match=name):
            auto.codes_budget(**(dict(length=8192, exact=140, exact_bits=16.0) | kw))
    for bad in (0, True, 2.5, "4096"):
        with pytest.raises(ValueError, match="budget_tokens"):
            AutoBits(3.0, budget_tokens=bad)
    assert "whole cache at 4096 tokens" in auto.describe() and "whole cache" not in plain.describe()
