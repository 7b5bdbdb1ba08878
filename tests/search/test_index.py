"""Index: search quality against exact search, metrics, streaming add, remove, rerank, bad input."""

import pytest
import torch

from qjl.search import Index, IndexConfig


def _data(n=2000, d=64, nq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(16, d, generator=g)
    x = centers[torch.randint(0, 16, (n,), generator=g)] + 0.8 * torch.randn(n, d, generator=g)
    q = x[:nq] + 0.3 * torch.randn(nq, d, generator=g)
    return x, q


def _recall(found, truth):
    return sum(len(set(a) & set(b)) for a, b in zip(found.tolist(), truth.tolist())) / truth.numel()


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
def test_recall_grows_with_bits_and_scores_are_estimates(metric):
    x, q = _data()
    if metric == "ip":
        truth = torch.topk(q @ x.T, 10).indices
    elif metric == "cosine":
        truth = torch.topk(torch.nn.functional.normalize(q, dim=1) @ torch.nn.functional.normalize(x, dim=1).T, 10).indices
    else:
        truth = torch.topk(-torch.cdist(q, x), 10).indices
    recalls = []
    for bits in (1, 2, 4):
        ix = Index.create(64, codec="tq-mse-rn", bits=bits, metric=metric)
        ix.add(x)
        s, ids = ix.search(q, 10)
        recalls.append(_recall(ids, truth))
        if metric == "l2":
            assert (s[:, 1:] >= s[:, :-1]).all()  # distances ascending
        else:
            assert (s[:, 1:] <= s[:, :-1]).all()
    assert recalls[0] < recalls[1] < recalls[2] and recalls[2] > 0.8, recalls
    # 4-bit scores estimate the true value: squared distance / inner product of the returned ids
    exact = {"ip": lambda: (q.unsqueeze(1) * x[ids]).sum(-1),
             "cosine": lambda: torch.nn.functional.cosine_similarity(q.unsqueeze(1), x[ids], dim=-1),
             "l2": lambda: ((q.unsqueeze(1) - x[ids]) ** 2).sum(-1)}[metric]()
    assert (s - exact).abs().max() < 0.1 * exact.abs().max()


@pytest.mark.parametrize("codec", ["tq-mse", "tq-mse-rn", "tq-prod", "qjl", "polar"])
def test_every_codec_searches_and_backends_agree(codec):
    x, q = _data(n=600)
    ix = Index.create(64, codec=codec, bits=3)
    ix.add(x)
    s1, i1 = ix.search(q, 5)
    s2, i2 = ix.search(q, 5, backend="torch")
    assert torch.allclose(s1, s2, atol=1e-4 * float(s2.abs().max()), rtol=0)
    assert (i1 == i2).float().mean() > 0.95  # order may differ only between near-equal scores
    truth = torch.topk(q @ x.T, 5).indices
    assert _recall(i1, truth) > 0.3


def test_streaming_add_equals_one_add_and_ids_are_kept():
    x, q = _data(n=900)
    one = Index.create(64, bits=2)
    one.add(x, ids=torch.arange(900) * 10)
    parts = Index.create(64, bits=2)
    for s in range(0, 900, 250):
        parts.add(x[s:s + 250], ids=torch.arange(s, min(900, s + 250)) * 10)
    a, b = one.search(q, 7), parts.search(q, 7)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])
    assert (a[1] % 10 == 0).all()


def test_remove_by_id():
    x, q = _data(n=500)
    ix = Index.create(64, bits=4)
    ix.add(x)
    top = ix.search(q[:1], 3)[1][0]
    assert ix.remove(top[:2]) == 2 and len(ix) == 498
    assert ix.remove(torch.tensor([10_000])) == 0
    after = ix.search(q[:1], 3)[1][0]
    assert top[0] not in after and top[1] not in after and after[0] == top[2]
    assert ix.add(x[:1])[0] == 500  # fresh ids never reuse removed ones


def test_rerank_is_exact_on_the_shortlist_and_counted():
    x, q = _data(n=1500)
    plain = Index.create(64, bits=1)
    rr = Index.create(64, bits=1, rerank=10)
    plain.add(x)
    rr.add(x)
    truth = torch.topk(q @ x.T, 10).indices
    s, ids = rr.search(q, 10)
    assert _recall(ids, truth) > _recall(plain.search(q, 10)[1], truth)
    assert torch.allclose(s, (q.unsqueeze(1) * x[ids]).sum(-1), atol=1e-4)
    assert rr.nbytes()["rerank_vectors"] == 4 * 1500 * 64
    assert rr.bits_per_dim() == pytest.approx(plain.bits_per_dim() + 32)


def test_ivf_trains_probes_and_all_lists_equals_flat():
    x, q = _data(n=3000)
    flat = Index.create(64, bits=3)
    flat.add(x)
    ivf = Index.create(64, bits=3, nlist=16, by_residual=False)
    with pytest.raises(ValueError, match="not trained"):
        ivf.add(x)
    assert ivf.train(x) > 0 and ivf.train_seconds > 0
    ivf.add(x)
    s_all, i_all = ivf.search(q, 10, nprobe=16)
    s_flat, i_flat = flat.search(q, 10)
    assert torch.equal(i_all, i_flat) and torch.allclose(s_all, s_flat, atol=1e-5)
    truth = torch.topk(q @ x.T, 10).indices
    r1, r4 = _recall(ivf.search(q, 10, nprobe=1)[1], truth), _recall(ivf.search(q, 10, nprobe=4)[1], truth)
    assert r1 <= r4 <= _recall(i_flat, truth) + 1e-9
    assert "centroids" in ivf.nbytes()


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("codec", ["tq-mse-rn", "tq-prod"])
def test_ivf_residuals_beat_raw_codes_and_scores_stay_estimates(metric, codec):
    """Encoding x - c_list (faiss's by_residual) spends the bits on what tells a list's vectors apart."""
    x, q = _data(n=3000, nq=100)  # 1,000 true neighbours: residuals won by 3-12 points in every seed tried
    truth = torch.topk(q @ x.T if metric == "ip" else -torch.cdist(q, x), 10).indices
    recall, err = {}, {}
    for residual in (False, True):
        ix = Index.create(64, codec=codec, bits=2, nlist=16, metric=metric, by_residual=residual)
        ix.train(x)
        ix.add(x)
        recall[residual] = _recall(ix.search(q, 10, nprobe=16)[1], truth)
        backends = [ix.search(q, 10, nprobe=4, backend=b) for b in ("c", "torch")]
        assert (backends[0][1] == backends[1][1]).float().mean() > 0.95
        s, ids = ix.search(q, 3000, nprobe=16)  # every vector: the estimate's error, unconditioned
        exact = (q.unsqueeze(1) * x[ids]).sum(-1) if metric == "ip" else ((q.unsqueeze(1) - x[ids]) ** 2).sum(-1)
        err[residual] = s - exact
    assert recall[True] > recall[False]
    assert err[True].abs().mean() < 0.8 * err[False].abs().mean()
    assert err[True].mean().abs() < 0.1 * err[True].abs().mean()  # unbiased: the centroid term is exact


def test_bytes_count_everything():
    ix = Index.create(384, codec="tq-mse-rn", bits=1, fastscan=False)
    ix.add(torch.randn(10, 384))
    assert ix.nbytes() == {"codes": 480, "factors": 20, "ids": 80}
    fast = Index.create(384, codec="tq-mse-rn", bits=1)
    fast.add(torch.randn(10, 384))
    assert fast.nbytes()["codes"] == 32 * 48  # blocks of 32 vectors: the padding is held, so counted
    assert ix.bits_per_dim() == pytest.approx((48 + 2) * 8 / 384)
    l2 = Index.create(384, codec="tq-prod", bits=2, metric="l2")
    assert l2.bits_per_dim() == pytest.approx((48 + 48 + 2 + 2 + 2) * 8 / 384)
    # the padded Hadamard rotation codes 512 coordinates of a 384-d vector: 4/3 the code bits, counted
    had = Index.create(384, codec="tq-mse-rn", bits=1, rotation="hadamard", fastscan=False)
    had.add(torch.randn(10, 384))
    assert had.nbytes()["codes"] == 10 * 64 and had.bits_per_dim() == pytest.approx((64 + 2) * 8 / 384)
    with pytest.raises(ValueError, match="rotation"):
        Index.create(384, codec="qjl", bits=1, rotation="hadamard")
    # the unpadded Hadamard rotation of order 384 (12 x 32): the code bits of the dense rotation
    kron = Index.create(384, codec="tq-mse-rn", bits=1, rotation="hadamard-kron", fastscan=False)
    kron.add(torch.randn(10, 384))
    assert kron.nbytes()["codes"] == 10 * 48 and kron.bits_per_dim() == pytest.approx((48 + 2) * 8 / 384)
    with pytest.raises(ValueError, match="dim"):
        Index.create(100, codec="tq-mse-rn", bits=1, rotation="hadamard-kron")


def test_bad_input_is_named_and_leaves_the_index_unchanged():
    x, q = _data(n=100)
    ix = Index.create(64, bits=2)
    ix.add(x, ids=torch.arange(100))
    before = (ix.codes.clone(), ix.ids.clone(), ix.factors.clone())
    bad_nan = x[:3].clone()
    bad_nan[1, 2] = float("nan")
    cases = [(ValueError, "x must have last dimension", lambda: ix.add(torch.randn(3, 65))),
             (ValueError, "NaN", lambda: ix.add(bad_nan)),
             (ValueError, "duplicate", lambda: ix.add(x[:2], ids=torch.tensor([500, 500]))),
             (ValueError, "already in the index", lambda: ix.add(x[:2], ids=torch.tensor([7, 500]))),
             (TypeError, "ids must be", lambda: ix.add(x[:2], ids=torch.tensor([1.0, 2.0]))),
             (TypeError, "x must be a floating", lambda: ix.add(torch.ones(2, 64, dtype=torch.int64))),
             (ValueError, "k=101 is larger", lambda: ix.search(q, 101)),
             (ValueError, "q must have last dimension", lambda: ix.search(torch.randn(2, 3), 1)),
             (ValueError, "k must be", lambda: ix.search(q, 0)),
             (ValueError, "backend", lambda: ix.search(q, 1, backend="gpu")),
             (TypeError, "ids must be", lambda: ix.remove([1, 2]))]
    for err, msg, call in cases:
        with pytest.raises(err, match=msg):
            call()
    assert torch.equal(ix.codes, before[0]) and torch.equal(ix.ids, before[1]) and torch.equal(ix.factors, before[2])
    for field, value in [("metric", "dot"), ("codec", "pq"), ("bits", 5), ("nlist", -1), ("dim", 0)]:
        with pytest.raises(ValueError, match=field):
            IndexConfig(**{"dim": 64, field: value})
    with pytest.raises(ValueError, match="flat index"):
        ix.train(x)


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_center_keeps_scores_estimates_and_helps_offset_data(metric):
    x, q = _data(n=1500)
    x, q = x + 3.0, q + 3.0  # a large common component, as real embeddings have
    truth = torch.topk(q @ x.T if metric == "ip" else -torch.cdist(q, x), 10).indices
    plain, cent = Index.create(64, bits=2, metric=metric), Index.create(64, bits=2, metric=metric, center=True)
    plain.add(x[:700])
    plain.add(x[700:])
    cent.add(x[:700])
    cent.add(x[700:])  # the center is the first batch's mean and stays
    assert torch.allclose(cent.center_vec, x[:700].mean(0))
    s, ids = cent.search(q, 10)
    assert _recall(ids, truth) > _recall(plain.search(q, 10)[1], truth)
    fine = Index.create(64, bits=4, metric=metric, center=True)
    fine.add(x)
    s, ids = fine.search(q, 10)
    exact = (q.unsqueeze(1) * x[ids]).sum(-1) if metric == "ip" else ((q.unsqueeze(1) - x[ids]) ** 2).sum(-1)
    assert (s - exact).abs().max() < 0.1 * exact.abs().max()
    assert cent.nbytes()["center"] == 4 * 64


def test_center_scores_queries_centered_and_counts_center_dots():
    """A centered 'ip' index scores <q - c, x - c> from the codes (+ stored <c, x>): its error scales with
    ||q - c|| ||x - c|| whatever ||c|| is; centering the vectors only would leave it growing with ||q||."""
    d, n = 64, 1000
    errs = {}
    for offset in (1.0, 10.0):
        g = torch.Generator().manual_seed(3)
        c = torch.randn(d, generator=g)
        c = offset * c / c.norm()
        x = c + torch.randn(n, d, generator=g) / d ** 0.5  # ||x - c|| ~ 1
        q = c + torch.randn(50, d, generator=g) / d ** 0.5
        plain, cent = Index.create(d, bits=2), Index.create(d, bits=2, center=True)
        plain.add(x)
        cent.add(x)
        for name, ix in (("plain", plain), ("center", cent)):
            s, ids = ix.search(q, 20)
            errs[name, offset] = float((s - (q.unsqueeze(1) * x[ids]).sum(-1)).abs().mean())
    assert errs["center", 10.0] < 1.5 * errs["center", 1.0], errs  # ~ the same error at 10x the offset
    assert errs["center", 10.0] < 0.2 * errs["plain", 10.0], errs
    nb = cent.nbytes()
    assert nb["center_dots"] == 2 * n and "center_dots" not in plain.nbytes()
    assert cent.bytes_per_vector() == plain.bytes_per_vector() + 2
    assert Index.create(d, bits=2, metric="l2", center=True).bytes_per_vector() == \
        Index.create(d, bits=2, metric="l2").bytes_per_vector()  # l2 keeps its centered norm, no <c, x>


def test_center_dots_that_overflow_float16_are_refused_and_leave_the_index_unchanged():
    ix = Index.create(8, bits=2, center=True)
    ix.add(torch.randn(10, 8, generator=torch.Generator().manual_seed(0)))
    big = (ix.center_vec / ix.center_vec.norm() * 1e6).expand(3, 8).clone()  # <c, x> = 1e6 ||c|| > 65504
    with pytest.raises(ValueError, match="center"):
        ix.add(big)
    assert len(ix) == 10 and ix.cdots.shape == (10,)


def test_default_rotation_is_the_unpadded_hadamard_where_the_dimension_allows():
    """rotation="auto": 'hadamard-kron' for dim = m 2^k (m in 1, 12, 20; >= 32) and the rotation codecs, else the
    dense 'haar'; the config holds the choice (so a saved index reloads with it), and explicit choices stand."""
    assert Index.create(384).config.rotation == "hadamard-kron"
    assert Index.create(64, codec="tq-prod", bits=2).config.rotation == "hadamard-kron"
    assert Index.create(100).config.rotation == "haar" and Index.create(24).config.rotation == "haar"
    assert Index.create(384, codec="qjl", bits=1).config.rotation == "haar"
    assert Index.create(384, rotation="haar").config.rotation == "haar"
    ix = Index.create(96, bits=2)
    ix.add(torch.randn(20, 96))
    assert ix.codec.codec.rotation.kind == "hadamard-kron" and ix.codec.n_coords == 96
