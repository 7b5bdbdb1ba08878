"""The paged decode contract: the reference against the codecs' own attention, and every backend the
machine runs against the reference on vLLM-like pools (shuffled block tables, block sizes that do not
divide the lengths, per-block outlier channels, ragged code ranges, exact tokens)."""

import pytest
import torch

from kernel_cases import PAIRS, Case, close, codec_pair
from paged_pool import paged_pool
from qjl import kernels
from qjl.kernels.paged import PagedField, paged_decode
from qjl.kernels.reference import merge_partials, paged_decode_reference, partial_softmax

TOL = 1e-4  # output scale; fp32 sums over D and tokens in another order

BACKENDS = ["torch"] + (["cpu"] if kernels.cpu_available() else [])


@pytest.mark.parametrize("name", ["tq3-tq2", "tq4-uni3", "qjl-outliers-uni2", "qjl-hadamard-tq2"])
def test_reference_equals_codec_attention(name):
    """The reference scores with the views = the codecs' own estimators, and mixes their reconstructions."""
    c = Case(name, b=2, h=2, rows=3, n=50, masked=False)
    want = torch.softmax(c.kc.inner_product(c.q, c.kcodes), -1) @ c.vc.dequantize(c.vcodes)
    close(c.reference(), want, 1e-5)


def test_reference_merges_exact_tokens_like_one_softmax():
    c = Case("tq3-tq2", b=1, h=2, rows=4, n=40, masked=False, n_exact=9)
    xk, xv, xb = c.exact
    s = torch.cat([c.kc.inner_product(c.q, c.kcodes), c.q @ xk.transpose(-1, -2) + xb], -1)
    v = torch.cat([c.vc.dequantize(c.vcodes), xv], -2)
    close(c.reference(), torch.softmax(s, -1) @ v, 1e-5)


def _paged(c, block_size, seed=0):
    per_k = dict(c.kcodes.fields)
    shared = {}
    if c.kcodes.shared:  # one entry per block: the sequence's channels repeated
        nb = -(-c.k.shape[2] // block_size)
        shared = {n: t.unsqueeze(2).expand(*t.shape[:2], nb, *t.shape[2:]) for n, t in c.kcodes.shared.items()}
    kf, table = paged_pool(per_k, shared, None, block_size, seed)
    vf, _ = paged_pool(dict(c.vcodes.fields), {}, None, block_size, seed)
    return kf, vf, table


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize("name", ["tq3-tq2", "tq4-uni3", "qjl-outliers-uni2"])
def test_paged_pool_equals_contiguous(name, block_size, backend):
    """The same codes in a shuffled paged pool and contiguous: the same attention, every backend."""
    c = Case(name, b=2, h=3, rows=4, n=61, n_exact=5, ragged=True)
    want = c.reference()
    kf, vf, table = _paged(c, block_size, seed=block_size)
    got = paged_decode(c.q, c.kc, kf, c.vc, vf, table, block_size, c.start, c.end, exact=c.exact, code_bias=c.bias,
                       backend=backend)
    close(got, want, TOL)


@pytest.mark.parametrize("backend", BACKENDS + (["triton"] if kernels.triton_usable(torch.device("cpu")) else []))
def test_per_block_outlier_channels(backend):
    """QJL outlier channels chosen per block (vLLM): each block's tokens scored with its own query split."""
    kc, vc = codec_pair("qjl-outliers-uni2", 64)
    g = torch.Generator().manual_seed(5)
    b, h, n, bs, rows = 2, 2, 40, 16, 3
    k, v, q = torch.randn(b, h, n, 64, generator=g), torch.randn(b, h, n, 64, generator=g), torch.randn(b, h, rows, 64, generator=g)
    k[..., :20, 3] *= 8  # a channel that is an outlier only in the first block
    nb = -(-n // bs)
    per, idxs = {}, []
    for j in range(nb):
        kb = k[:, :, j * bs:(j + 1) * bs]
        idx = kc.select_outliers(kb)
        codes = kc.quantize(kb, idx)
        idxs.append(codes.shared["outlier_idx"])
        for name, t in codes.fields.items():
            per.setdefault(name, []).append(t)
    per = {name: torch.cat(ts, 2) for name, ts in per.items()}
    shared = {"outlier_idx": torch.stack(idxs, 2)}
    assert not torch.equal(idxs[0], idxs[1])
    kf, table = paged_pool(per, shared, None, bs, seed=1)
    vf, _ = paged_pool(dict(vc.quantize(v).fields), {}, None, bs, seed=1)
    start, end = torch.zeros(b, dtype=torch.int32), torch.full((b,), n, dtype=torch.int32)
    # the reference, block by block from the codec's own estimator
    logits = torch.cat([kc.inner_product(q, __import__("qjl").Codes((b, h, min(bs, n - j * bs)),
                                                                      {nm: t[:, :, j * bs:(j + 1) * bs] for nm, t in per.items()},
                                                                      {"outlier_idx": idxs[j]}))
                        for j in range(nb)], -1)
    want = torch.softmax(logits, -1) @ vc.dequantize(vc.quantize(v))
    close(paged_decode_reference(q, kc, kf, vc, vf, table, bs, start, end), want, 1e-5)
    close(paged_decode(q, kc, kf, vc, vf, table, bs, start, end, backend=backend), want, TOL)


def test_merge_partials_equals_one_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 3, 8, generator=g), torch.randn(2, 10, 8, generator=g), torch.randn(2, 10, 8, generator=g)
    whole = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
    parts = [partial_softmax(q @ k[:, :4].transpose(-1, -2), v[:, :4]), partial_softmax(q @ k[:, 4:].transpose(-1, -2), v[:, 4:])]
    _, l_, o = merge_partials(parts)
    assert torch.allclose(o / l_.unsqueeze(-1), whole, atol=1e-6)


def test_paged_field_of_reads_what_it_views():
    t = torch.arange(2 * 3 * 5 * 4, dtype=torch.float16).reshape(2, 3, 5, 4)
    f = PagedField.of(t)
    got = f.gather(torch.tensor([1]), torch.tensor([2]), torch.tensor([3]))
    assert torch.equal(got[0], t[1, 2, 3])


def test_bad_arguments_are_named():
    c = Case("tq3-tq2", b=2, h=2, rows=3, n=20)
    q, kc, kf, vc, vf, bt, bs, s, e = c.args()
    with pytest.raises(ValueError, match="q must be"):
        paged_decode(q[0], kc, kf, vc, vf, bt, bs, s, e, backend="torch")
    with pytest.raises(ValueError, match="block_table"):
        paged_decode(q, kc, kf, vc, vf, bt[:1], bs, s, e, backend="torch")
    with pytest.raises(ValueError, match="key_fields lacks"):
        paged_decode(q, kc, {"norm": kf["norm"]}, vc, vf, bt, bs, s, e, backend="torch")
    with pytest.raises(ValueError, match="code_start"):
        paged_decode(q, kc, kf, vc, vf, bt, bs, e, s, backend="torch")
    with pytest.raises(ValueError, match="exact"):
        paged_decode(q, kc, kf, vc, vf, bt, bs, s, e, exact=(q, q), backend="torch")
    with pytest.raises(ValueError, match="kernel must be"):
        paged_decode(q, kc, kf, vc, vf, bt, bs, s, e, backend="gpu")
    with pytest.raises(ValueError, match="maps only"):
        paged_decode(q, kc, kf, vc, vf, bt, bs - 1, s, e, backend="torch")
    import dataclasses

    far = dict(kf, norm=dataclasses.replace(kf["norm"], stride_head=kf["norm"].stride_head * 4))
    for backend in BACKENDS:  # an address past the buffer is refused before any kernel reads it
        with pytest.raises(ValueError, match="reach byte"):
            paged_decode(q, kc, far, vc, vf, bt, bs, s, e, backend=backend)
    neg = bt.clone()
    neg[1, 0] = -1
    for backend in BACKENDS:  # ranges and blocks (the C kernel checks them itself, before reading any)
        with pytest.raises(ValueError, match="code_start/code_end must satisfy"):
            paged_decode(q, kc, kf, vc, vf, bt, bs, e, s, backend=backend)
        with pytest.raises(ValueError, match="maps only"):
            paged_decode(q, kc, kf, vc, vf, bt, bs - 1, s, e, backend=backend)
        with pytest.raises(ValueError, match="must be >= 0"):
            paged_decode(q, kc, kf, vc, vf, neg, bs, s, e, backend=backend)
    big = bt.clone()
    big[0, 0] = 10_000  # a block past the pool: refused by every backend, also after a call that passed
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="reach past the end"):
            paged_decode(q, kc, kf, vc, vf, big, bs, s, e, backend=backend)
    with pytest.raises(ValueError, match="packed codes"):
        paged_decode(q, kc, dict(kf, codes=kf["norm"]), vc, vf, bt, bs, s, e, backend="torch")


def test_pairs_are_known():
    assert len(PAIRS) == len(set(PAIRS))
    with pytest.raises(ValueError):
        codec_pair("nope", 64)
