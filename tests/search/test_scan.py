"""The C scan against its torch reference, and the tables against the codecs' own estimates."""

import pytest
import torch

from qjl.search.codecs import SearchCodec
from qjl.search.scan import Layout, Segment, build_luts, c_available, scan, scan_torch

needs_c = pytest.mark.skipif(not c_available(), reason="the C scan could not be built here")


def _layout(bits_list, coords):
    segs, off = [], 0
    for b in bits_list:
        nb = (coords * b + 7) // 8
        segs.append(Segment(off, nb, b, coords))
        off += nb
    return Layout(tuple(segs), off)


@needs_c
@pytest.mark.parametrize("bits_list", [[1], [2], [3], [4], [8], [2, 1], [3, 1]])
@pytest.mark.parametrize("coords", [37, 64])
def test_c_scan_matches_reference(bits_list, coords):
    n, nq, k = 700, 4, 10
    lay = _layout(bits_list, coords)
    codes = torch.randint(0, 256, (n, lay.stride), dtype=torch.uint8)
    luts = build_luts(lay, [torch.randn(nq, coords, 1 << b) for b in bits_list])
    factors, add = torch.rand(len(bits_list), n), torch.randn(n)
    ranges = torch.tensor([[[0, 200], [350, 700]], [[0, 0], [10, 20]], [[0, 700], [0, 0]], [[5, 6], [600, 603]]])
    s1, i1 = scan(codes, lay, factors, add, luts, ranges, k)
    s2, i2 = scan_torch(codes, lay, factors, add, luts, ranges, k)
    bound = 1e-5 * (factors.abs().sum(0).max() * luts.abs().max() * lay.lut_size / 256 + add.abs().max())
    assert torch.allclose(s1, s2, rtol=0, atol=float(bound), equal_nan=True) or torch.equal(s1.isinf(), s2.isinf())
    fin = torch.isfinite(s2)
    assert torch.allclose(s1[fin], s2[fin], rtol=0, atol=float(bound))
    assert torch.equal(i1, i2)
    # query 1 sees 10 vectors: exactly those, each once; query 3 sees 4: the rest is -1 / -inf
    assert sorted(i1[1].tolist()) == list(range(10, 20))
    assert (i1[3, 4:] == -1).all() and torch.isinf(s1[3, 4:]).all()


@pytest.mark.parametrize("name", ["tq-mse", "tq-mse-rn", "tq-prod", "qjl"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_tables_reproduce_the_codec_estimate(name, bits):
    """sum of the group tables over a code == the codec's own inner_product (float32 rounding)."""
    dim, n, nq = 80, 300, 3
    sc = SearchCodec(name, dim, bits, seed=3)
    x, q = torch.randn(n, dim), torch.randn(nq, dim)
    codes, factors = sc.encode(x)
    luts = build_luts(sc.layout, sc.tables(q))
    ranges = torch.tensor([[[0, n]]] * nq)
    s, i = scan_torch(codes, sc.layout, factors.float(), None, luts, ranges, n)
    ref = sc.score(q, codes, factors)
    got = torch.full((nq, n), float("nan")).scatter_(1, i, s)
    scale = ref.abs().max()
    assert torch.allclose(got, ref, atol=2e-5 * float(scale), rtol=0)


def test_layout_checks():
    with pytest.raises(ValueError, match="bits"):
        Segment(0, 5, 5, 8)
    with pytest.raises(ValueError, match="nbytes"):
        Segment(0, 3, 2, 64)
    lay = _layout([2], 16)
    with pytest.raises(ValueError, match="codes"):
        scan_torch(torch.zeros(3, 5, dtype=torch.uint8), lay, torch.ones(1, 3), None,
                   torch.zeros(1, lay.lut_size), torch.zeros(1, 1, 2, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="k must"):
        scan_torch(torch.zeros(3, 4, dtype=torch.uint8), lay, torch.ones(1, 3), None,
                   torch.zeros(1, lay.lut_size), torch.zeros(1, 1, 2, dtype=torch.int64), 0)
