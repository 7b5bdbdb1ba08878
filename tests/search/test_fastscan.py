"""Fast scan: layouts round trip, C kernel against the torch reference (shortlist bit-exact), the exact scan."""

import pytest
import torch

from qjl.search import Index
from qjl.search.codecs import SearchCodec, scan_centroids
from qjl.search.fastscan import (FastLayout, fast_layout, fastscan, fastscan_torch, from_blocks, nibble_tables,
                                 planes_to_rows, quantize_tables, rows_to_planes, to_blocks)
from qjl.core.packing import pack_bits
from qjl.search.scan import c_available

needs_c = pytest.mark.skipif(not c_available(), reason="the C build is missing")


@pytest.mark.parametrize("n", [1, 31, 32, 77])
def test_blocks_round_trip(n):
    codes = torch.randint(0, 256, (n, 12), dtype=torch.uint8)
    blocks = to_blocks(codes)
    assert blocks.shape == (-(-n // 32), 24, 16)
    assert torch.equal(from_blocks(blocks, n), codes)


@pytest.mark.parametrize("bits,scan_bits", [(1, 1), (2, 2), (2, 1), (3, 2), (3, 1), (4, 4), (4, 2)])
@pytest.mark.parametrize("nc", [37, 64])
def test_planes_round_trip(bits, scan_bits, nc):
    fl = FastLayout(nc, bits, scan_bits)
    idx = torch.randint(0, 1 << bits, (50, nc))
    rows = pack_bits(idx, bits)
    planes = rows_to_planes(rows, fl)
    assert planes.shape == (50, fl.row_bytes) and fl.n_nibbles % 2 == 0 and fl.n_scan % 2 == 0
    assert torch.equal(planes_to_rows(planes, fl), rows)
    if fl.rbits:  # each plane is the general packing of its digits
        assert torch.equal(planes[:, :fl.n_scan // 2], pack_bits(idx >> fl.rbits, fl.scan_bits))
        assert torch.equal(planes[:, fl.n_scan // 2:], pack_bits(idx & ((1 << fl.rbits) - 1), fl.rbits))
    assert 8 * fl.row_bytes <= nc * bits + 16  # at most a byte of padding per plane


def test_layout_checks():
    for bits, sb in [(3, 4), (4, 1), (1, 2), (5, 1)]:
        with pytest.raises(ValueError, match="bits"):
            FastLayout(64, bits, sb)
    assert fast_layout(64, 3).scan_bits == 2 and fast_layout(64, 1).scan_bits == 1


def test_quantized_tables_within_half_a_step():
    lutf = torch.randn(3, 10, 16)
    lut8, delta, beta = quantize_tables(lutf)
    back = lut8.float() * delta.view(-1, 1, 1) + lutf.amin(-1, keepdim=True)
    assert ((back - lutf).abs() <= 0.5001 * delta.view(-1, 1, 1)).all()
    assert torch.allclose(beta, lutf.amin(-1).sum(-1))


def test_scan_centroids_are_conditional_means():
    cs = scan_centroids(384, 3, 2)
    c = scan_centroids(384, 3, 3)
    for h in range(4):  # between the two cells it merges, nearer the inner (more probable) one
        lo, hi = sorted((c[2 * h], c[2 * h + 1]), key=abs)
        assert min(lo, hi) < cs[h] < max(lo, hi) and abs(cs[h] - lo) < abs(cs[h] - hi)
    assert all(abs(a + b) < 1e-9 for a, b in zip(cs, reversed(cs)))  # the density is symmetric


def _problem(bits, scan_bits, nc=45, n=700, nq=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    fl = FastLayout(nc, bits, scan_bits)
    idx = torch.randint(0, 1 << bits, (n, nc), generator=g)
    blocks = to_blocks(rows_to_planes(pack_bits(idx, bits), fl))
    c = torch.sort(torch.randn(1 << bits, generator=g)).values
    r = bits - scan_bits
    cs = c.view(1 << scan_bits, 1 << r).mean(1)
    y = torch.randn(nq, nc, generator=g)
    f = torch.rand(n, generator=g) + 0.5
    return fl, idx, blocks, c, cs, y, f


@needs_c
@pytest.mark.parametrize("bits,scan_bits", [(1, 1), (2, 2), (2, 1), (3, 2), (3, 1), (4, 4), (4, 2)])
@pytest.mark.parametrize("with_terms", [False, True])
def test_c_fastscan_matches_reference(bits, scan_bits, with_terms):
    fl, idx, blocks, c, cs, y, f = _problem(bits, scan_bits)
    n, k = idx.shape[0], 10
    add = torch.randn(n) if with_terms else None
    ranges = torch.tensor([[[0, 700], [0, 0]], [[37, 500], [600, 640]], [[699, 700], [0, 3]],
                           [[64, 96], [5, 6]], [[100, 101], [0, 0]]])
    bias = torch.randn(5, 2) if with_terms else None
    exact = f * (y @ c[idx].T) + (add if add is not None else 0)  # [nq, n]
    for shortlist in (n, 40, 10):
        s1, i1 = fastscan(blocks, n, fl, f, add, y, cs, c, ranges, bias, k, shortlist, threads=2)
        s2, i2 = fastscan_torch(blocks, n, fl, f, add, y, cs, c, ranges, bias, k, shortlist)
        assert torch.equal(i1, i2)
        fin = torch.isfinite(s2)
        assert torch.equal(fin, torch.isfinite(s1)) and torch.allclose(s1[fin], s2[fin], atol=1e-4, rtol=0)
        # every returned score is the exact estimate of its row (+ its range's bias)
        for q in range(5):
            for s, i in zip(s1[q][fin[q]].tolist(), i1[q][fin[q]].tolist()):
                b = 0.0
                for r, (lo, hi) in enumerate(ranges[q].tolist()):
                    if lo <= i < hi and bias is not None:
                        b = float(bias[q, r])
                assert abs(s - float(exact[q, i]) - b) < 1e-4
    # a shortlist of every row: the exact top k
    s1, i1 = fastscan(blocks, n, fl, f, add, y[:1], cs, c, ranges[:1], None if bias is None else bias[:1], k, n)
    assert torch.equal(i1[0], torch.topk(exact[0], k).indices)


@needs_c
@pytest.mark.parametrize("nq", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_c_fastscan_batches_and_slices_agree(nq, threads):
    """Query batches (3 per pass) and vector slices (fewer batches than threads) give one answer."""
    fl, idx, blocks, c, cs, y, f = _problem(2, 2, nc=64, n=1000, nq=nq, seed=1)
    ranges = torch.tensor([[[0, 1000]]]).expand(nq, 1, 2).contiguous()
    ref = fastscan_torch(blocks, 1000, fl, f, None, y, cs, c, ranges, None, 8, 40)
    for shared in (True, False):
        got = fastscan(blocks, 1000, fl, f, None, y, cs, c, ranges, None, 8, 40, threads=threads, shared=shared)
        assert torch.equal(got[1], ref[1])


@needs_c
@pytest.mark.parametrize("signs", ["positive", "mixed"])
def test_c_fastscan_shortlist_ties_and_block_bounds(signs):
    """Many equal approximate scores (repeated rows: ties go to the lower row), shortlists compacted many
    times, and factors of both signs (the per-block bound that skips blocks only holds for factors >= 0):
    the kernel's answer is the reference's."""
    fl, idx, blocks, c, cs, y, f = _problem(1, 1, nc=40, n=3000, nq=6, seed=3)
    idx = idx[torch.arange(3000) % 97]  # 97 distinct rows, each repeated ~31 times
    blocks = to_blocks(rows_to_planes(pack_bits(idx, 1), fl))
    f = f[torch.arange(3000) % 97].clone()
    if signs == "mixed":
        f[::5] = -f[::5]
    add = torch.randn(3000)[torch.arange(3000) % 97] if signs == "mixed" else None
    ranges = torch.tensor([[[0, 3000]]]).expand(6, 1, 2).contiguous()
    for k, shortlist in ((5, 5), (10, 64), (20, 300)):
        ref = fastscan_torch(blocks, 3000, fl, f, add, y, cs, c, ranges, None, k, shortlist)
        for threads in (1, 2):
            got = fastscan(blocks, 3000, fl, f, add, y, cs, c, ranges, None, k, shortlist, threads=threads)
            assert torch.equal(got[1], ref[1])


@needs_c
@pytest.mark.parametrize("bits", [1, 2])
def test_c_fastscan_block_bound_skips_nothing_it_should_keep(bits):
    """Distinct rows, a shortlist as small as k (every shortlisted row is an answer): a block is only
    skipped when none of its rows can enter the shortlist, so the answer is the reference's exactly."""
    fl, idx, blocks, c, cs, y, f = _problem(bits, bits, nc=48, n=6000, nq=16, seed=4)
    ranges = torch.tensor([[[0, 6000]]]).expand(16, 1, 2).contiguous()
    g = torch.Generator().manual_seed(5)
    cases = {  # each term of the bound matters in one case: a bound that dropped it would skip kept rows
        "tight": (torch.ones(6000), None, y, c, cs, None),  # equal factors, no add: the block's best approx
        "add": (f, 3.0 * torch.randn(6000, generator=g), y, c, cs, None),  # add terms as large as the scores
        "negative": (f, None, y.abs(), -c.abs().flip(0), -cs.abs().flip(0), None),  # every delta S + beta < 0
        "bias": (f, None, y, c, cs, 20.0 * torch.randn(16, 1, generator=g)),
    }
    for name, (ff, add, yy, cc, ccs, bias) in cases.items():
        for k, shortlist in ((5, 5), (10, 16)):
            ref = fastscan_torch(blocks, 6000, fl, ff, add, yy, ccs, cc, ranges, bias, k, shortlist)
            got = fastscan(blocks, 6000, fl, ff, add, yy, ccs, cc, ranges, bias, k, shortlist, threads=1)
            assert torch.equal(got[1], ref[1]), name


def test_bad_arguments_are_named():
    fl, idx, blocks, c, cs, y, f = _problem(2, 2)
    ranges = torch.tensor([[[0, 700]]] * 5)
    with pytest.raises(ValueError, match="overlap"):
        fastscan(blocks, 700, fl, f, None, y, cs, c, torch.tensor([[[0, 10], [5, 20]]] * 5), None, 5, 10)
    with pytest.raises(ValueError, match="bias"):
        fastscan(blocks, 700, fl, f, None, y, cs, c, ranges, torch.zeros(5, 2), 5, 10)
    with pytest.raises(ValueError, match="shortlist"):
        fastscan(blocks, 700, fl, f, None, y, cs, c, ranges, None, 5, 4)
    with pytest.raises(ValueError, match="y must"):
        fastscan(blocks, 700, fl, f, None, y[:, :3], cs, c, ranges, None, 5, 10)


def test_nibble_tables_sum_to_the_scan_plane_estimate():
    fl, idx, blocks, c, cs, y, f = _problem(3, 2, nc=45, n=50, nq=2)
    lutf = nibble_tables(y, cs, fl)
    planes = from_blocks(blocks, 50)
    nib = torch.stack([planes & 15, planes >> 4], -1).reshape(50, -1)[:, :fl.n_scan].long()
    got = lutf.reshape(2, -1)[:, nib + 16 * torch.arange(fl.n_scan)].sum(-1)
    assert torch.allclose(got, y @ cs[idx >> 1].T, atol=1e-5)


@pytest.mark.parametrize("codec,bits,scan_bits,rotation", [
    ("tq-mse-rn", 2, 0, "haar"), ("qjl", 1, 0, "haar"), ("tq-mse", 4, 4, "haar"), ("tq-mse-rn", 3, 0, "haar"),
    ("tq-mse-rn", 4, 0, "haar"), ("tq-mse-rn", 2, 1, "haar"), ("tq-mse-rn", 1, 0, "hadamard"),
    ("tq-mse-rn", 3, 0, "hadamard")])
def test_index_fast_and_float_scans_agree(codec, bits, scan_bits, rotation):
    x, q = torch.randn(1500, 48 if rotation == "hadamard" else 64), torch.randn(12, 48 if rotation == "hadamard" else 64)
    dim = x.shape[1]  # 48 -> 64 coordinates with the padded Hadamard rotation
    fast = Index.create(dim, codec=codec, bits=bits, scan_bits=scan_bits, rotation=rotation)
    slow = Index.create(dim, codec=codec, bits=bits, fastscan=False, rotation=rotation)
    assert fast.codec.n_coords == (64 if rotation == "hadamard" else dim)
    assert fast.fast and not slow.fast
    fast.add(x)
    slow.add(x)
    fast.remove(torch.tensor([3, 700]))
    slow.remove(torch.tensor([3, 700]))
    a, b = fast.search(q, 10), slow.search(q, 10)
    if fast.fast.rbits == 0:  # the shortlist of 64 holds the top 10 of these tables: the float scan's answer
        assert (a[1] == b[1]).float().mean() > 0.97 and torch.allclose(a[0], b[0], atol=1e-4)
    else:  # ranked by the top bits first: (almost) the same top 10, every score the exact estimate
        overlap = sum(len(set(u) & set(v)) for u, v in zip(a[1].tolist(), b[1].tolist())) / a[1].numel()
        assert overlap > (0.95 if fast.fast.scan_bits == 2 else 0.85)  # random 64-d data: near ties abound
        full = slow.search(q, len(slow))
        for qi in range(12):
            pos = {i: j for j, i in enumerate(full[1][qi].tolist())}
            want = torch.stack([full[0][qi, pos[i]] for i in a[1][qi].tolist()])
            assert torch.allclose(a[0][qi], want, atol=1e-4)
    assert torch.equal(fast.row_codes(), slow.codes)
    assert fast.bits_per_dim() == slow.bits_per_dim()  # 64 coordinates: no plane padding


def test_search_codec_query_coords_and_centroids_give_its_estimate():
    sc = SearchCodec("tq-mse-rn", 48, 3)
    x, q = torch.randn(20, 48), torch.randn(3, 48)
    codes, factors = sc.encode(x)
    from qjl.core.packing import unpack_bits

    idx = unpack_bits(codes, 3, sc.n_coords)
    est = factors[0].float() * (sc.query_coords(q) @ sc.centroids()[idx].T)
    assert torch.allclose(est, sc.score(q, codes, factors), atol=1e-5)
