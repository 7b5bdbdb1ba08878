"""The fused C encoder is bit-exact with its torch reference (TurboQuantMSE.quantize's bucket + pack_bits on
y / norm); the search codec's codes equal TurboQuantMSE's up to float32 rounding at cell edges."""

import pytest
import torch

from qjl.core.lloyd_max import sphere_codebook
from qjl.search.encode import encode_lloyd_max, encode_lloyd_max_torch
from qjl.search.scan import c_available
from qjl import TurboQuantMSE


@pytest.mark.skipif(not c_available(), reason="the C build is missing")
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [64, 80, 13, 384])
@pytest.mark.parametrize("scaled", [False, True])
def test_c_encoder_bit_exact(bits, dim, scaled):
    """dims with and without a remainder past the 8-wide groups (13: mostly the scalar tail)."""
    book = sphere_codebook(dim, bits)
    g = torch.Generator().manual_seed(bits * 1000 + dim)
    y = torch.nn.functional.normalize(torch.randn(257, dim, generator=g), dim=1)
    y[0] = 0  # an all-zero vector: every coordinate in the middle cell
    y[1, :3] = torch.tensor(book.boundaries[:3] if len(book.boundaries) >= 3 else book.boundaries * 3)  # on a boundary
    y[2, :] = torch.tensor(book.boundaries).repeat(dim // len(book.boundaries) + 1)[:dim]  # every edge, in every lane
    norm = None
    if scaled:  # the kernel divides by the norm: equal to torch's y / norm, edges included
        norm = torch.rand(257, generator=g) * 3 + 0.25
        y = y * norm.unsqueeze(-1)
        norm[0] = 1.0
    c1, d1 = encode_lloyd_max(y, book, bits, norm=norm)
    c2, d2 = encode_lloyd_max_torch(y, book, bits, norm=norm)
    assert torch.equal(c1, c2)
    assert torch.allclose(d1, d2, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bits", [1, 3, 4])
@pytest.mark.parametrize("n,shifted,rotation", [(500, False, "haar"), (2 * 1024 + 37, True, "haar"),
                                                (1100, True, "hadamard"), (1100, True, "hadamard-kron")])
def test_search_codec_matches_turboquant(bits, n, shifted, rotation):
    """Rows in several encode chunks (ENCODE_ROWS), each shifted by ``shift`` inside encode, in order; the padded
    Hadamard rotation (48 -> 64 coordinates) applied as one dense map equals TurboQuantMSE's transform."""
    from qjl.search.codecs import ENCODE_ROWS, SearchCodec

    assert ENCODE_ROWS == 1024  # the second case spans three chunks
    dim = {"haar": 64, "hadamard": 48, "hadamard-kron": 96}[rotation]
    sc = SearchCodec("tq-mse-rn", dim, bits, rotation=rotation)
    g = torch.Generator().manual_seed(n + bits)
    x = torch.randn(n, dim, generator=g) * 4
    shift = torch.randn(dim, generator=g) if shifted else None
    codes, factors = sc.encode(x, shift=shift)
    ref = TurboQuantMSE(dim, bits, rotation, correct_norm=True).quantize(x - shift if shifted else x)
    ref_rot = TurboQuantMSE(dim, bits, rotation).rotation.apply(x[:5])
    assert torch.allclose(sc.query_coords(x[:5]), ref_rot, atol=1e-5 * float(ref_rot.abs().max()))
    # rotate-then-divide against divide-then-rotate: codes differ only where a coordinate is within float32
    # rounding of a cell edge (then by one cell), so almost never
    from qjl.core.packing import unpack_bits

    n_coords = sc.codec.rotation.out_dim  # 64 (haar at 64, padded 48), 96 (unpadded hadamard-kron)
    a, b = unpack_bits(codes, bits, n_coords), unpack_bits(ref.fields["codes"], bits, n_coords)
    assert (a != b).float().mean() < 1e-3 and (a - b).abs().max() <= 1
    same = (a == b).all(-1)
    assert same.float().mean() > 0.95
    # the correction divides by <u, u_hat>, summed in another order: at most one float16 ulp apart
    ulp = torch.finfo(torch.float16).eps * ref.fields["norm"].float().abs()
    assert ((factors[0].float() - ref.fields["norm"].float()).abs()[same] <= ulp[same]).all()


def test_encoder_rejects_bad_input():
    book = sphere_codebook(64, 2)
    with pytest.raises(TypeError, match="y must"):
        encode_lloyd_max(torch.zeros(3, 64, dtype=torch.float64), book, 2)
    with pytest.raises(TypeError, match="norm must"):
        encode_lloyd_max(torch.zeros(3, 64), book, 2, norm=torch.ones(4))
    with pytest.raises(ValueError, match="norm must be > 0"):
        encode_lloyd_max(torch.zeros(3, 64), book, 2, norm=torch.zeros(3))


@pytest.mark.parametrize("bits,scan_bits", [(2, 1), (3, 1), (3, 2), (4, 2)])
@pytest.mark.parametrize("dim", [64, 20, 384])
def test_encoder_writes_the_fast_scan_planes(bits, scan_bits, dim):
    """rbits > 0: the C encoder (and its reference) write rows_to_planes(codes) directly."""
    from qjl.search.fastscan import FastLayout, rows_to_planes

    book = sphere_codebook(dim, bits)
    y = torch.nn.functional.normalize(torch.randn(99, dim, generator=torch.Generator().manual_seed(dim)), dim=1)
    fl = FastLayout(dim, bits, scan_bits)
    rows, d0 = encode_lloyd_max_torch(y, book, bits)
    for enc in (encode_lloyd_max, encode_lloyd_max_torch):
        planes, d = enc(y, book, bits, rbits=fl.rbits)
        assert torch.equal(planes, rows_to_planes(rows, fl))
        assert torch.allclose(d, d0, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="rbits"):
        encode_lloyd_max(y, book, bits, rbits=bits)


def test_search_codec_names_a_bad_shift():
    from qjl.search.codecs import SearchCodec

    sc = SearchCodec("tq-mse-rn", 64, 2)
    for bad in (torch.zeros(63), torch.zeros(2, 64), torch.zeros(64, dtype=torch.long), [0.0] * 64):
        with pytest.raises(ValueError, match="shift"):
            sc.encode(torch.randn(4, 64), shift=bad)

