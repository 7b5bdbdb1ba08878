"""TurboQuant with vector codebooks (qjl.codecs.vq, qjl.core.vq_codebook).

Distortions: 6,000 unit vectors at d = 64 per width; one vector's squared error is a sum over 64 coordinates
(relative spread ~0.2), so the mean has a relative standard error ~0.3% and the 12% margin over the scalar code
is > 30 standard errors (the measured gains are 13-17%).
"""

import pytest
import torch

from qjl import TurboQuantMSE
from qjl.codecs.registry import make_codec
from qjl.codecs.vq import COS_FLOOR, TurboQuantVQ
from qjl.core.packing import unpack_bits
from qjl.core.vq_codebook import GROUPS, group_table

D = 64


def _unit(n, d, seed):
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_vector_codebook_beats_the_scalar_code_at_the_same_bytes(bits):
    x = _unit(6000, D, bits)
    vq, sc = TurboQuantVQ(D, bits, seed=1, norm_dtype="fp32"), TurboQuantMSE(D, bits, seed=1, norm_dtype="fp32")
    err = {c: float((c.dequantize(c.quantize(x)) - x).square().sum(-1).mean()) for c in (vq, sc)}
    assert err[vq] < 0.88 * err[sc]
    assert err[vq] >= 4.0 ** -bits  # the rate-distortion bound of Gaussian coordinates
    assert vq.bit_budget() == sc.bit_budget()
    assert vq.quantize(x).fields["codes"].shape == sc.quantize(x).fields["codes"].shape


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codes_are_the_nearest_codeword_of_each_group(bits):
    """Brute force: every group's joint code is the codeword nearest the rotated unit vector's coordinates."""
    codec = TurboQuantVQ(D, bits, seed=3)
    x = torch.randn(300, D, generator=torch.Generator().manual_seed(4))
    g = GROUPS[bits]
    idx = unpack_bits(codec.quantize(x).fields["codes"], bits, D)
    e = codec.joint_codes(idx)  # [300, D / g]
    y = codec.rotation.apply(x / x.norm(dim=-1, keepdim=True)).reshape(300, D // g, g).double()
    d2 = (y.unsqueeze(-2) - codec.table.double()).square().sum(-1)  # [300, D / g, codewords]
    assert torch.equal(e, d2.argmin(-1))
    assert int(e.max()) < 2 ** (g * bits)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("d", [64, 96, 36, 20])
def test_codewords_read_straight_from_the_packed_stream(bits, d):
    """stored_codewords (what rotated / dequantize read) equals the per-coordinate fields joined, for every codeword
    in every position, at dimensions whose packed bytes do not fill whole words."""
    g = GROUPS[bits]
    if d % g:
        pytest.skip("the group divides the dimension")
    codec = TurboQuantVQ(d, bits, seed=1)
    e = torch.randint(0, 2 ** (g * bits), (5, 7, d // g), generator=torch.Generator().manual_seed(d + bits))
    from qjl.core.packing import pack_bits
    from qjl.core.vq_codebook import split_codes

    packed = pack_bits(split_codes(e, g, bits), bits)
    assert torch.equal(codec.stored_codewords(packed), e)
    assert torch.equal(codec.stored_codewords(packed), codec.joint_codes(unpack_bits(packed, bits, d)))
    with pytest.raises(TypeError, match="packed"):
        codec.stored_codewords(packed.long())
    with pytest.raises(ValueError, match="bytes per vector"):
        codec.stored_codewords(packed[..., :-1])
    codes = codec.quantize(torch.randn(9, d))
    assert torch.equal(codec.rotated(codes), codec.table[codec.joint_codes(unpack_bits(codes.fields["codes"], bits, d))]
                       .reshape(9, d) * codes.fields["norm"].float().unsqueeze(-1))


def test_reconstruction_is_the_norm_times_the_rotated_back_codewords():
    codec = TurboQuantVQ(D, 2, seed=5, norm_dtype="fp32")
    x = torch.randn(7, 3, D)
    codes = codec.quantize(x)
    e = codec.joint_codes(unpack_bits(codes.fields["codes"], 2, D))
    want = codec.rotation.inverse(codec.table[e].reshape(7, 3, D)) * x.norm(dim=-1, keepdim=True)
    assert torch.allclose(codec.dequantize(codes), want, atol=1e-5)
    # a reconstruction re-quantizes to its own codes (each codeword is nearest itself)
    again = codec.quantize(codec.dequantize(codes))
    assert torch.equal(again.fields["codes"], codes.fields["codes"])
    q = torch.randn(7, 2, D)
    assert torch.allclose(codec.inner_product(q, codec.quantize(x[:, 0])), q @ codec.dequantize(codec.quantize(x[:, 0])).mT,
                          atol=1e-4)


def test_the_view_reads_codes_g_at_a_time():
    """PackedCodes.values (the formula every kernel is tested against) gives the codec's rotated reconstruction."""
    for bits in (2, 3, 4):
        codec = TurboQuantVQ(D, bits, seed=2, norm_dtype="fp32")
        codes = codec.quantize(torch.randn(11, D))
        view = codec.mix_view()
        assert view.codes.group == GROUPS[bits] and view.rotated and codec.score_view().terms[0].codes.group == GROUPS[bits]
        unit = view.codes.values(unpack_bits(codes.fields["codes"], bits, D))
        assert torch.allclose(unit * codes.fields["norm"].unsqueeze(-1), codec.rotated(codes), atol=1e-6)
    qv = codec.quantize_view()  # a pass with the table: the C encoder's, not the Triton kernel's (scalar cells)
    assert qv.passes[0].table is codec.table and qv.passes[0].group == GROUPS[bits] and not qv.plain


def test_norm_correction_and_its_clamp_bound_the_stored_norm():
    codec = TurboQuantVQ(D, 2, seed=1, correct_norm=True, norm_dtype="fp32")
    x = torch.randn(500, D)
    xh = codec.dequantize(codec.quantize(x))
    assert torch.allclose((x * xh).sum(-1), x.square().sum(-1), rtol=1e-4)  # <x, x_hat> = ||x||^2
    fp8 = TurboQuantVQ(D, 2, seed=1, correct_norm=True, norm_dtype="fp8")
    assert fp8.norm_limit() == pytest.approx(448 * COS_FLOOR)
    big = _unit(200, D, 9) * fp8.norm_limit() * 0.999
    fp8.quantize(big)  # within the limit: no overflow
    fp8.check_storable(big)
    with pytest.raises(ValueError, match="norm_dtype"):
        fp8.check_storable(torch.randn(3, D) * 1000)


def test_rotations_in_turn_with_vector_codebooks():
    """cycles: position t coded by rotation t % K, positions continued across calls (as TurboQuantMSE)."""
    x = torch.randn(2, 19, D, generator=torch.Generator().manual_seed(6))
    cyc = TurboQuantVQ(D, 2, seed=4, correct_norm=True, cycles=4)
    codes = cyc.quantize(x)
    late = cyc.quantize(x[:, 5:], start=5)
    assert torch.equal(late.fields["codes"], codes.fields["codes"][:, 5:])
    assert torch.allclose(cyc.dequantize(late, start=5), cyc.dequantize(codes)[:, 5:], atol=1e-6)
    assert cyc.mix_view().cycles == 4 and cyc.score_view() is None


def test_tables_are_kmeans_fixed_points():
    """Each shipped table is (near) a fixed point of Lloyd's iteration on fresh draws of the data it was trained for
    (coordinates of unit vectors at d = 64): moving every codeword to the mean of its cell lowers the distortion by
    under 1%, and its distortion per coordinate is the documented one (240k draws: ~0.3% standard error)."""
    documented = {2: 0.0955, 3: 0.0292, 4: 0.0079}
    for bits, g in GROUPS.items():
        table = group_table(bits).double()
        assert table.shape == (2 ** (g * bits), g)
        u = torch.randn(240_000 * g // D, D, generator=torch.Generator().manual_seed(bits), dtype=torch.float64)
        x = (u / u.norm(dim=1, keepdim=True) * D ** 0.5).reshape(-1, g)  # unit-variance coordinates at d = 64
        a = torch.cdist(x, table).argmin(1)
        before = float((x - table[a]).square().sum(1).mean()) / g
        s = torch.zeros_like(table).index_add_(0, a, x)
        n = torch.bincount(a, minlength=table.shape[0]).double().unsqueeze(1)
        assert bool((n > 0).all())
        step = s / n
        after = float((x - step[torch.cdist(x, step).argmin(1)]).square().sum(1).mean()) / g
        assert after > 0.99 * before
        assert before == pytest.approx(documented[bits], rel=0.04)
    assert torch.allclose(group_table(2, 0.5), group_table(2) * 0.5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        TurboQuantVQ(D, 1)
    with pytest.raises(ValueError, match="bits"):
        TurboQuantVQ(D, 5)
    with pytest.raises(ValueError, match="dim"):
        TurboQuantVQ(30, 2)  # 30 is not a multiple of 4
    TurboQuantVQ(30, 3)  # but of 2
    with pytest.raises(AttributeError, match="boundaries"):
        TurboQuantVQ(D, 2).boundaries
    assert isinstance(make_codec("turboquant_vq", D, bits=3, cycles=2), TurboQuantVQ)
    with pytest.raises(ValueError, match="x"):
        TurboQuantVQ(D, 2).quantize(torch.full((2, D), float("nan")))


def test_the_reference_search_does_not_depend_on_its_chunk():
    """``nearest_reference`` scores ``chunk`` groups at a time (16,384 on a CPU, 2^25 / k on a GPU): every chunk,
    ragged last ones included, gives the same indices, and they are the nearest codewords by brute force."""
    from qjl.core.vq_codebook import nearest_reference

    for bits in (2, 3):
        codec = TurboQuantVQ(D, bits)
        t, sq = codec.table, codec.table.double().square().sum(-1).float()
        y = torch.randn(3001, codec.group, generator=torch.Generator().manual_seed(bits)) / D ** 0.5
        want = nearest_reference(y, t, sq)
        brute = torch.cdist(y.double(), t.double()).argmin(-1)
        assert (want == brute).float().mean() > 0.999  # float32 scores: a near tie may go either way
        for chunk in (1, 7, 1000, 3001, 1 << 20):
            assert torch.equal(nearest_reference(y, t, sq, chunk=chunk), want)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="chunk"):
            nearest_reference(y, t, sq, chunk=bad)


def test_the_c_nearest_codeword_search_equals_the_reference():
    """The C search (used for 1,024 groups and more on a CPU) returns the reference's indices, ties included (a
    codeword itself, equidistant points between two codewords), for every table; so codes do not depend on the path."""
    from qjl.core.vq_codebook import nearest_reference
    from qjl.kernels.cpu import launch

    if not launch.available():
        pytest.skip("the C kernels do not build here")
    from qjl.kernels.cpu.store import vq_nearest

    for bits in (2, 3, 4):
        codec = TurboQuantVQ(D, bits)
        t, sq = codec.table, codec.table.double().square().sum(-1).float()
        y = torch.randn(5000, codec.group, generator=torch.Generator().manual_seed(bits)) / D ** 0.5
        y[:64] = t[:64]  # exact codewords
        y[64:127] = (t[:63] + t[1:64]) / 2  # midpoints
        y[128] = 0.0
        want = nearest_reference(y, t, sq)
        assert torch.equal(vq_nearest(y, t, sq), want)
        assert torch.equal(want[:64], torch.arange(64))
        big = torch.randn(3, 700, D, generator=torch.Generator().manual_seed(7))  # 3 x 700 x 64 / g groups: C
        rows = codec.rotation.apply(big / big.norm(dim=-1, keepdim=True)).reshape(-1, codec.group)
        assert torch.equal(vq_nearest(rows, t, sq), nearest_reference(rows, t, sq))
    with pytest.raises(ValueError, match="finite"):
        vq_nearest(torch.full((4, 2), float("nan")), TurboQuantVQ(D, 3).table, torch.ones(64))


def _grid_points(grid, n, seed):
    """Pairs a grid search must get right: rotated-coordinate-like pairs, the squares' edges and the floats just
    beside them, and pairs beyond the grid."""
    g = torch.Generator().manual_seed(seed)
    edges = grid.lo + torch.arange(grid.cells + 1) / grid.inv
    e = edges[torch.randint(0, grid.cells + 1, (4000, 2), generator=g)].float()
    return torch.cat([torch.randn(20000, 2, generator=g) / n ** 0.5, e, torch.nextafter(e, torch.full_like(e, 1.0)),
                      torch.nextafter(e, torch.full_like(e, -1.0)), torch.randn(2000, 2, generator=g) * 3 / n ** 0.5])


@pytest.mark.parametrize("bits,n", [(3, 64), (4, 64), (4, 128), (3, 32)])
def test_the_grid_search_of_pairs_equals_the_reference(bits, n):
    """The candidate lists (qjl.core.vq_codebook.search_grid) hold every codeword the reference can pick in their
    square, so the C grid search returns the reference's indices: on the squares' edges and the floats beside
    them, at midpoints between codewords (ties), at the codewords, beyond the grid; dropping one listed codeword
    of a central square changes some answers (the points exercise the lists)."""
    from qjl.core.vq_codebook import SearchGrid, nearest_reference, search_grid
    from qjl.kernels.cpu import launch

    grid = search_grid(bits, n)
    codec = TurboQuantVQ(n, bits)
    t, sq = codec.table, codec.table.double().square().sum(-1).float()
    counts = grid.off[1:] - grid.off[:-1]
    assert int(counts.min()) >= 1 and float(counts.float().mean()) < t.shape[0] / 8  # every square lists a few
    i, j = torch.randint(0, t.shape[0], (2, 5000), generator=torch.Generator().manual_seed(1))
    y = torch.cat([_grid_points(grid, n, bits), (t[i] + t[j]) / 2, t]).contiguous()
    want = nearest_reference(y, t, sq)
    # the lists themselves (no C): each in-grid point's answer is listed in its square
    sq_idx = ((y - grid.lo) * grid.inv).floor().long()
    inside = ((sq_idx >= 0) & (sq_idx < grid.cells)).all(-1)
    cell = sq_idx[inside, 0] * grid.cells + sq_idx[inside, 1]
    lists = [set(grid.cand[grid.off[c]:grid.off[c + 1]].tolist()) for c in range(grid.cells ** 2)]
    assert all(int(w) in lists[int(c)] for c, w in zip(cell, want[inside]))
    if not launch.available():
        pytest.skip("the C kernels do not build here")
    from qjl.kernels.cpu.store import vq_nearest

    assert torch.equal(vq_nearest(y, t, sq, grid), want)
    # a central square missing the codeword its points mostly pick answers differently
    c = (grid.cells // 2) * grid.cells + grid.cells // 2
    picked = want[inside][cell == c]
    drop = int(picked.mode().values)
    keep = torch.ones(grid.cand.shape[0], dtype=torch.bool)
    lo_, hi_ = int(grid.off[c]), int(grid.off[c + 1])
    keep[lo_ + grid.cand[lo_:hi_].tolist().index(drop)] = False
    off = grid.off.clone()
    off[c + 1:] -= 1
    broken = SearchGrid(grid.lo, grid.inv, grid.cells, off, grid.cand[keep].contiguous())
    assert not torch.equal(vq_nearest(y, t, sq, broken), want)
    with pytest.raises(ValueError, match="grid"):
        vq_nearest(torch.zeros(8, 4), group_table(2), torch.ones(256), grid)
    empty = SearchGrid(grid.lo, grid.inv, grid.cells, torch.zeros_like(grid.off), grid.cand)
    with pytest.raises(ValueError, match="grid"):
        vq_nearest(y, t, sq, empty)
    for bad in ({"n": 0}, {"n": 64.0}, {"cells": -1}, {"reach": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            search_grid(bits, **{"n": n, **bad})
    with pytest.raises(ValueError, match="int32"):
        vq_nearest(y, t, sq, SearchGrid(grid.lo, grid.inv, grid.cells, grid.off.long(), grid.cand))


@pytest.mark.parametrize("bits,grid", [(2, False), (3, True), (4, True), (4, False)])
def test_the_c_moments_equal_the_reference_codewords_sums(bits, grid):
    """``vq_moments`` (what the width allocation reads a vector candidate's error from) picks the reference's
    codewords and sums ``<y, c>`` and ``||c||^2`` over them in float64; through the codec's ``cell_moments`` too."""
    from qjl.core.vq_codebook import nearest_reference, search_grid
    from qjl.kernels.cpu import launch

    if not launch.available():
        pytest.skip("the C kernels do not build here")
    from qjl.kernels.cpu.store import vq_moments

    codec = TurboQuantVQ(D, bits, seed=3)
    g, t, sq = codec.group, codec.table, codec.table.double().square().sum(-1).float()
    y = codec.rotation.apply(_unit(600, D, bits)).contiguous()
    y[0, :g] = t[5]  # a codeword itself, and a pair beyond any grid
    y[1, :2] = 1.0
    code = nearest_reference(y.reshape(-1, g), t, sq).reshape(600, D // g)
    c = t[code].double()
    want = ((y.reshape(600, D // g, g).double() * c).sum((-1, -2)), c.square().sum((-1, -2)))
    got = vq_moments(y, t, sq, search_grid(bits, D) if grid else None)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(codec.cell_moments(y.reshape(3, 200, D)), want):
        torch.testing.assert_close(a, b.reshape(3, 200), rtol=1e-12, atol=1e-12)
    bad = y.clone()
    bad[7, 3] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        vq_moments(bad, t, sq)
    with pytest.raises(ValueError, match="multiple"):
        vq_moments(y[:, :D - 1], t, sq)
