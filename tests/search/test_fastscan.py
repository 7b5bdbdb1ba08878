"""Fast scan: layout round trip, C kernel against the torch reference, equality with the float LUT scan."""

import pytest
import torch

from qjl.search import Index
from qjl.search.fastscan import (fastscan, fastscan_torch, from_blocks, nibble_tables, quantize_tables,
                                 to_blocks)
from qjl.search.scan import Layout, Segment, build_luts, c_available, scan_torch


@pytest.mark.parametrize("n", [1, 31, 32, 77])
def test_blocks_round_trip(n):
    codes = torch.randint(0, 256, (n, 12), dtype=torch.uint8)
    blocks = to_blocks(codes)
    assert blocks.shape == (-(-n // 32), 24, 16)
    assert torch.equal(from_blocks(blocks, n), codes)


def test_quantized_tables_within_half_a_step():
    lutf = torch.randn(3, 10, 16)
    lut8, delta, beta = quantize_tables(lutf)
    back = lut8.float() * delta.view(-1, 1, 1) + lutf.amin(-1, keepdim=True)
    assert ((back - lutf).abs() <= 0.5001 * delta.view(-1, 1, 1)).all()
    assert torch.allclose(beta, lutf.amin(-1).sum(-1))


@pytest.mark.skipif(not c_available(), reason="the C build is missing")
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_c_fastscan_matches_reference_and_float_scan(bits):
    coords, n, nq, k = 72, 700, 4, 10  # 72 * 1 bit = 9 bytes: an odd byte count
    seg = Segment(0, (coords * bits + 7) // 8, bits, coords)
    lay = Layout((seg,), seg.nbytes)
    codes = torch.randint(0, 256, (n, seg.nbytes), dtype=torch.uint8)
    table = torch.randn(nq, coords, 1 << bits)
    lutf, f = nibble_tables(seg, table), torch.rand(n) + 0.5
    ranges = torch.tensor([[[0, 700], [0, 0]], [[37, 500], [600, 640]], [[699, 700], [0, 3]], [[64, 96], [5, 6]]])
    blocks = to_blocks(codes)
    ref = scan_torch(codes, lay, f.unsqueeze(0), None, build_luts(lay, [table]), ranges, k)
    for shortlist in (n, 40):
        s1, i1 = fastscan(blocks, n, f, lutf, ranges, k, shortlist)
        s2, i2 = fastscan_torch(blocks, n, f, lutf, ranges, k, shortlist)
        assert torch.equal(i1, i2)
        fin = torch.isfinite(s2)
        assert torch.equal(fin, torch.isfinite(s1)) and torch.allclose(s1[fin], s2[fin], atol=1e-5, rtol=0)
        # the shortlist re-scored exactly: the float scan's answer (these random tables have no near-ties)
        assert torch.equal(i1, ref[1]) and torch.allclose(s1[fin], ref[0][fin], atol=1e-4, rtol=0)


@pytest.mark.parametrize("codec,bits", [("tq-mse-rn", 2), ("qjl", 1), ("tq-mse", 4)])
def test_index_fast_and_float_scans_agree(codec, bits):
    x, q = torch.randn(1500, 64), torch.randn(12, 64)
    fast, slow = Index.create(64, codec=codec, bits=bits), Index.create(64, codec=codec, bits=bits, fastscan=False)
    assert fast.fast and not slow.fast
    fast.add(x)
    slow.add(x)
    fast.remove(torch.tensor([3, 700]))
    slow.remove(torch.tensor([3, 700]))
    a, b = fast.search(q, 10), slow.search(q, 10)
    assert (a[1] == b[1]).float().mean() > 0.97 and torch.allclose(a[0], b[0], atol=1e-4)
    assert torch.equal(fast.row_codes(), slow.codes)
