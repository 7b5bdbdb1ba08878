"""CPU quantization (C bucketing) against the codecs' own quantize: codes bit-exact."""

import pytest
import torch

from qjl import kernels
from qjl.codecs.turboquant import TurboQuantMSE

pytestmark = pytest.mark.skipif(not kernels.cpu_available(), reason="the C kernels do not build here")


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("correct", [False, True])
def test_cpu_quantize_equals_reference(bits, correct):
    codec = TurboQuantMSE(64, bits, seed=bits, correct_norm=correct)
    x = torch.randn(2, 3, 50, 64, generator=torch.Generator().manual_seed(bits)) * 2
    got, want = kernels.quantize_cpu(codec, x), codec.quantize(x)
    assert torch.equal(got.fields["codes"], want.fields["codes"])
    if correct:  # the cosine is summed in another order: at most one fp16 ulp apart
        a, b = got.fields["norm"].float(), want.fields["norm"].float()
        assert ((a - b).abs() <= b.abs() * 2**-10).all()
    else:
        assert torch.equal(got.fields["norm"], want.fields["norm"])


def test_cpu_quantize_refuses_bad_input_like_the_reference():
    from qjl.codecs.polarquant import PolarQuant
    from qjl.codecs.sketch import QJLSketch

    codec = TurboQuantMSE(64, 3)
    x = torch.randn(4, 64)
    x[2, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        kernels.quantize_cpu(codec, x)
    with pytest.raises(ValueError, match="last dimension 64"):
        kernels.quantize_cpu(codec, torch.randn(4, 63))
    with pytest.raises(TypeError, match="floating"):
        kernels.quantize_cpu(codec, torch.ones(4, 64, dtype=torch.long))
    with pytest.raises(TypeError, match="codec"):
        kernels.quantize_cpu(PolarQuant(64), torch.randn(2, 64))
    assert kernels.can_quantize_cpu(codec) and not kernels.can_quantize_cpu(QJLSketch(64, 128))


def test_quantize_with_names_a_bad_backend():
    c, x = TurboQuantMSE(32, 3), torch.randn(2, 5, 32)
    ref = c.quantize(x)
    got = kernels.quantize_with("torch", c, x)
    assert all(torch.equal(got.fields[n], ref.fields[n]) for n in ref.fields)
    with pytest.raises(ValueError, match="backend"):
        kernels.quantize_with("auto", c, x)


def _dtype_grid(dtype):
    """Every finite value of a 1- or 2-byte float dtype, the midpoints between neighbours (ties to even) and
    points a quarter of the way, both signs, within the dtype's range."""
    n = 256 if dtype.itemsize == 1 else 65536
    raw = torch.arange(n, dtype=torch.int32)
    vals = (raw.to(torch.uint8) if n == 256 else raw.to(torch.int16)).view(dtype).float()
    vals = torch.unique(vals[torch.isfinite(vals)]).double()
    mids = (vals[1:] + vals[:-1]) / 2
    quarter = vals[:-1] + (vals[1:] - vals[:-1]) / 4
    out = torch.cat([vals, mids, quarter, -mids, -quarter]).float()
    return out[out.abs() <= torch.finfo(dtype).max]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_stored_norm_conversion_is_torchs(dtype):
    """The C store converts float32 to the norm's dtype exactly as ``.to(dtype)`` (round to nearest even, subnormals,
    signed zeros): every value of the dtype, every tie between neighbours, and random floats."""
    from qjl.kernels.cpu import build
    from qjl.kernels.cpu.binding import DTYPES as _DTYPES

    mod = build.load()
    g = torch.Generator().manual_seed(1)
    v = torch.cat([_dtype_grid(dtype) if dtype.itemsize < 4 else torch.zeros(0),
                   torch.randn(100_000, generator=g) * torch.logspace(-9, 4, 100_000).float(),
                   torch.tensor([0.0, -0.0, torch.finfo(dtype).max, torch.finfo(dtype).tiny])])
    v = v[v.abs() <= torch.finfo(dtype).max].contiguous()  # beyond the range the callers refuse first
    out = torch.empty(v.numel(), dtype=dtype)
    ffi = mod.ffi
    assert mod.lib.qjl_store_scalars(ffi.cast("float *", v.data_ptr()), v.numel(), _DTYPES[dtype],
                                     ffi.cast("uint8_t *", out.data_ptr())) == 0
    assert torch.equal(out.view(torch.uint8), v.to(dtype).view(torch.uint8))


def _pool(blocks=7, heads=3, slots=5, entry=40, seed=0):
    """A page pool [blocks, heads, slots, entry bytes] of random bytes and its fields (codes at byte 0, norm after)."""
    from qjl.kernels.paged import PagedField

    buf = torch.randint(0, 256, (blocks, heads, slots, entry), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    strides = (heads * slots * entry, slots * entry, entry)
    return buf, lambda off, dtype, shape: PagedField(buf, off, *strides, dtype, shape)


@pytest.mark.parametrize("norm_dtype", ["fp16", "bf16", "fp8", "fp32"])
@pytest.mark.parametrize("bits,correct", [(1, False), (3, True), (4, True), (5, False)])
def test_encoded_rows_stored_into_pages_are_the_reference_codes(norm_dtype, bits, correct):
    """store_cpu: each token's codes and norm land at its (block, slot) for every head, bit for bit
    ``encode_reference``'s (the torch mirror of the C order), and no other byte changes; with ``bounds``
    precomputed (store_bounds) the same; bad positions and shapes are refused before anything is stored."""
    from qjl.kernels.cpu.launch import store_bounds
    from qjl.kernels.reference import encode_reference

    codec = TurboQuantMSE(64, bits, seed=bits, correct_norm=correct, norm_dtype=norm_dtype)
    p = kernels.cpu_pass(codec)
    nbytes = (64 * bits + 7) // 8
    buf, field = _pool(entry=nbytes + 4)
    before = buf.clone()
    codes_f, norm_f = field(0, torch.uint8, (nbytes,)), field(nbytes, p.norm_dtype, ())

    def store_rows(x, codes_f, norm_f, blocks, slots, bounds=None):
        kernels.store_cpu([(codec, x, codes_f, norm_f)], blocks, slots, bounds)

    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(9, 3, 64, generator=g) * 3).bfloat16()
    cells = torch.randperm(7 * 5, generator=g)[:9]
    blocks, slots = cells // 5, cells % 5
    store_rows(x, codes_f, norm_f, blocks, slots)
    want = encode_reference(codec, x)
    heads = torch.arange(3)[None, :]
    assert torch.equal(codes_f.gather(blocks[:, None], heads, slots[:, None]), want.fields["codes"])
    assert torch.equal(norm_f.gather(blocks[:, None], heads, slots[:, None]).view(torch.uint8),
                       want.fields["norm"].view(torch.uint8))
    before_bad = buf.clone()
    for b, sl in ((blocks + 7, slots), (blocks, slots - 5)):  # past the pool, negative: refused, nothing stored
        with pytest.raises(ValueError, match="reach byte"):
            store_rows(x, codes_f, norm_f, b, sl)
    with pytest.raises(ValueError, match="slots must"):
        store_rows(x, codes_f, norm_f, blocks, slots.float())
    with pytest.raises(ValueError, match=r"x must be \[9, 3, 64\]"):
        store_rows(x[:-1], codes_f, norm_f, blocks, slots)
    with pytest.raises(ValueError, match="cannot hold"):
        store_rows(x, norm_f, norm_f, blocks, slots)
    with pytest.raises(ValueError, match="one entry per token"):
        store_rows(x, codes_f, norm_f, blocks[:0], slots[:0])
    with pytest.raises(ValueError, match="one entry per token"):
        store_rows(x, codes_f, norm_f, blocks, slots[:-1])
    far = store_bounds(blocks + 7, slots)  # precomputed bounds are what is checked and written
    with pytest.raises(ValueError, match="reach byte"):
        store_rows(x, codes_f, norm_f, blocks, slots, bounds=far)
    assert torch.equal(buf, before_bad)
    store_rows(x, codes_f, norm_f, blocks, slots, bounds=store_bounds(blocks, slots))
    assert torch.equal(buf, before_bad)  # the same bytes again: passing the bounds changes nothing
    touched = torch.zeros(7, 3, 5, dtype=torch.bool)
    touched[blocks[:, None], heads, slots[:, None]] = True
    assert torch.equal(buf[~touched], before[~touched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_c_encoder_equals_its_reference_and_the_codec_but_at_boundaries(dtype):
    """The C encoder (strided rows in three dtypes, zero rows, rows of tiny entries) against encode_reference: codes
    and norms bit for bit.  Against ``codec.quantize`` (a BLAS rotation): codes differ only on coordinates whose
    rotated value lies within 1e-6 of a cell boundary, and on at most 1e-4 of them; norms within one ulp."""
    from qjl.kernels.reference import encode_reference

    codec = TurboQuantMSE(64, 3, seed=5, correct_norm=True, norm_dtype="fp16")
    p = kernels.cpu_pass(codec)
    g = torch.Generator().manual_seed(1)
    big = torch.randn(400, 5, 64, generator=g)[:, 1:4].to(dtype)  # tokens x 3 heads, strided
    big[0, 0] = 0.0
    big[1, 1] = 1e-30 if dtype == torch.float32 else 0.0
    buf, field = _pool(blocks=80, heads=3, slots=5, entry=24 + 2)
    codes_f, norm_f = field(0, torch.uint8, (24,)), field(24, torch.float16, ())
    blocks, slots = torch.arange(400) // 5, torch.arange(400) % 5
    kernels.store_cpu([(codec, big, codes_f, norm_f)], blocks, slots)
    heads = torch.arange(3)[None, :]
    got_codes = codes_f.gather(blocks[:, None], heads, slots[:, None])
    got_norm = norm_f.gather(blocks[:, None], heads, slots[:, None])
    want = encode_reference(codec, big)
    assert torch.equal(got_codes, want.fields["codes"])
    assert torch.equal(got_norm.view(torch.int16), want.fields["norm"].view(torch.int16))
    from qjl.core.packing import unpack_bits

    torch_codes = codec.quantize(big)
    a, b = unpack_bits(got_codes, 3, 64), unpack_bits(torch_codes.fields["codes"], 3, 64)
    if dtype == torch.float32:  # entries of 1e-30: float32 squares underflow in torch's norm (the codec then
        # quantizes a vector of norm 1e-29 as if it were a unit vector); the C norm sums in float64, so the row
        # gets the codes of its direction: those of the same row scaled up
        assert torch.equal(a[1, 1], unpack_bits(codec.quantize(torch.ones(64)).fields["codes"], 3, 64))
        a[1, 1] = b[1, 1]
    differ = a != b
    assert differ.float().mean() <= 1e-4
    if differ.any():
        xf = big.float()
        y = p.matrix.apply(xf / xf.norm(dim=-1, keepdim=True).clamp_min(1e-30))
        gap = (y[differ].unsqueeze(-1) - p.boundaries.float()).abs().min(-1).values
        assert (gap <= 1e-6).all()
    n1, n2 = got_norm.float(), torch_codes.fields["norm"].float()
    assert ((n1 - n2).abs() <= torch.finfo(torch.float16).eps * n2.abs()).all()


def test_bad_rows_write_nothing():
    """NaN/Inf or a norm beyond its dtype: the reference's ValueError from the encoder, before any byte is stored
    (the vLLM writer encodes keys and values before storing either)."""
    from qjl.integrations.vllm.layout import layer_layout
    from qjl.integrations.vllm.paged import page_fields
    from qjl.integrations.vllm.settings import VLLMSettings
    from qjl.integrations.vllm.writes import write_codes

    codec = TurboQuantMSE(64, 3, norm_dtype="fp8")
    x = torch.randn(4, 3, 64)
    with pytest.raises(ValueError, match="norm of x overflows"):
        kernels.encode_rows_cpu(codec, x * 1000)
    with pytest.raises(ValueError, match="norm of x overflows"):  # finite entries, a norm beyond float32
        kernels.encode_rows_cpu(TurboQuantMSE(64, 3, norm_dtype="fp32"), x * 1e37)
    for big in (x * 1000, x * 1e37):  # the reference says the same
        with pytest.raises(ValueError, match="norm of x overflows"):
            TurboQuantMSE(64, 3, norm_dtype="fp32" if big.abs().max() > 1e30 else "fp8").quantize(big)
    x[2, 1, 7] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        kernels.encode_rows_cpu(codec, x)
    lay = layer_layout(VLLMSettings(preset="tq-k45v3"), 3, 30, 64, 16, torch.bfloat16)
    pages = torch.zeros(4, 3, 16, lay.content_bytes // 2, dtype=torch.bfloat16)
    fields = page_fields(lay, pages)
    k, v = torch.randn(5, 3, 64).bfloat16(), torch.randn(5, 3, 64).bfloat16()
    v[4, 2, 0] = float("nan")  # only the values are bad: the keys must not be stored either
    with pytest.raises(ValueError, match="NaN or Inf"):
        write_codes(lay, fields, k, v, torch.arange(5) + 16)
    assert not pages.view(torch.int16).any()
    write_codes(lay, fields, k, v.nan_to_num(), torch.arange(5) + 16)
    assert pages.view(torch.int16).any()


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6, 8])
def test_cell_moments_equal_the_torch_reference(bits):
    """The C moments (cells counted, or by a branchless search above 5 bits) against ``lloyd_max.cell_moments``: rows of rotated unit
    vectors, entries exactly on every boundary (a tie counts the boundary as not below), beyond both ends
    and zero rows; float64 sums in another order, so within 1e-12 relative."""
    from qjl.core.lloyd_max import cell_moments
    from qjl.kernels.cpu import launch

    codec = TurboQuantMSE(64, bits, seed=bits)
    bnd, cent = codec.boundaries, codec.centroids
    y = torch.randn(200, 64, generator=torch.Generator().manual_seed(bits))
    y = y / y.norm(dim=-1, keepdim=True)
    y[0, : bnd.numel()] = bnd[:64]  # ties
    y[1, :8] = torch.tensor([-2.0, 2.0, -1.0, 1.0, 0.0, -0.0, 1e-30, -1e-30])
    y[2] = 0.0
    got = launch.cell_moments(y.reshape(4, 50, 64), bnd, cent)
    want = cell_moments(y.reshape(4, 50, 64), bnd, cent)
    for a, b in zip(got, want):
        assert a.dtype == torch.float64 and a.shape == (4, 50)
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert torch.equal(want[1].flatten()[2], (cent[torch.bucketize(torch.zeros(64), bnd)].double() ** 2).sum())
    wide = torch.randn(3, 600, generator=torch.Generator().manual_seed(9)) / 8  # rows longer than the C chunk (256)
    for a, b in zip(launch.cell_moments(wide, bnd, cent), cell_moments(wide, bnd, cent)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", ["c", "torch"])
def test_cell_moments_refuse_bad_input(impl):
    from qjl.core.lloyd_max import cell_moments
    from qjl.kernels.cpu import launch

    fn = launch.cell_moments if impl == "c" else cell_moments
    c = TurboQuantMSE(64, 3)
    y = torch.randn(5, 64)
    y[3, 7] = float("inf")
    with pytest.raises(ValueError, match="finite|NaN or Inf"):
        fn(y, c.boundaries, c.centroids)
    with pytest.raises(ValueError, match="codebook"):
        fn(torch.randn(5, 64), c.boundaries[:-1], c.centroids)
    with pytest.raises(ValueError, match="codebook"):
        fn(torch.randn(5, 64), c.boundaries[:5], c.centroids[:6])
    with pytest.raises(TypeError, match="y must"):
        fn(torch.ones(5, 64, dtype=torch.long), c.boundaries, c.centroids)
    with pytest.raises(TypeError, match="centroids"):
        fn(torch.randn(5, 64), c.boundaries, c.centroids.long())


def _positional_quantize(codec, x, positions):
    """codec.quantize of x [N, H, dim], token i at positions[i] (each head's vector alone at that position)."""
    from qjl.codecs.base import Codes

    parts = [codec.quantize(x[i].unsqueeze(-2), start=int(positions[i])) for i in range(x.shape[0])]
    return Codes(tuple(x.shape[:-1]), {n: torch.stack([c.fields[n].reshape(c.fields[n].shape[0], *c.fields[n].shape[2:])
                                                       for c in parts]) for n in parts[0].fields})


VQ_CASES = {  # the codecs the C encoder stores beyond one rotation's scalar cells
    "vq2": dict(name="turboquant_vq", bits=2, norm_dtype="fp8"),
    "vq3": dict(name="turboquant_vq", bits=3),
    "vq4": dict(name="turboquant_vq", bits=4, norm_dtype="bf16"),
    "vq2-cycled": dict(name="turboquant_vq", bits=2, cycles=8, norm_dtype="fp8"),
    "mse2-cycled": dict(name="turboquant_mse", bits=2, cycles=3),
    "mse3-cycled-plain-norm": dict(name="turboquant_mse", bits=3, cycles=5, correct=False),
}


@pytest.mark.parametrize("case", sorted(VQ_CASES))
def test_c_encoder_stores_vector_codebooks_and_rotations_in_turn(case):
    """Vector codebooks (each group's nearest codeword, its fields packed, the norm corrected by the clamped cosine)
    and rotations in turn (token at position p by rotation p mod K) through the C store: codes and norms bit for bit
    ``encode_reference``'s, codes equal to ``codec.quantize`` at each token's position on all but a rare coordinate
    within float32 rounding of a decision boundary, norms within one ulp; the same vectors at positions K apart get
    the same codes and at other positions other codes."""
    from qjl.codecs.turboquant import TurboQuantMSE
    from qjl.codecs.vq import TurboQuantVQ
    from qjl.core.packing import unpack_bits
    from qjl.kernels.reference import encode_reference

    c = dict(VQ_CASES[case])
    cls = TurboQuantVQ if c.pop("name") == "turboquant_vq" else TurboQuantMSE
    codec = cls(64, c.pop("bits"), seed=3, correct_norm=c.pop("correct", True), **c)
    p = kernels.cpu_pass(codec)
    assert kernels.can_store_cpu(codec) and not kernels.can_quantize_cpu(codec) and not kernels.can_quantize(codec)
    nbytes = (64 * codec.bits + 7) // 8
    nsize = torch.empty(0, dtype=p.norm_dtype).element_size()
    buf, field = _pool(blocks=40, heads=3, slots=5, entry=nbytes + nsize, seed=2)
    codes_f, norm_f = field(0, torch.uint8, (nbytes,)), field(nbytes, p.norm_dtype, ())
    g = torch.Generator().manual_seed(4)
    x = torch.randn(150, 3, 64, generator=g) * 2
    x[7] = x[3]  # one token again, at a position K further (same codes) or not (rotations in turn: others)
    positions = torch.randint(0, 4000, (150,), generator=g)
    positions[7] = positions[3] + codec.cycles
    x[8], positions[8] = x[3], positions[3] + 1
    cells = torch.randperm(200, generator=g)[:150]
    blocks, slots = cells // 5, cells % 5
    kernels.store_cpu([(codec, x, codes_f, norm_f)], blocks, slots,
                      positions=positions if codec.cycles > 1 else None)
    heads = torch.arange(3)[None, :]
    got_c = codes_f.gather(blocks[:, None], heads, slots[:, None])
    got_n = norm_f.gather(blocks[:, None], heads, slots[:, None])
    want = encode_reference(codec, x, positions[:, None])
    assert torch.equal(got_c, want.fields["codes"])
    assert torch.equal(got_n.view(torch.uint8), want.fields["norm"].view(torch.uint8))
    ref = _positional_quantize(codec, x, positions) if codec.cycles > 1 else codec.quantize(x)
    a, b = unpack_bits(got_c, codec.bits, 64), unpack_bits(ref.fields["codes"], codec.bits, 64)
    assert (a != b).float().mean() <= 1e-3
    n1, n2 = got_n.float(), ref.fields["norm"].float()
    assert ((n1 - n2).abs() <= torch.finfo(p.norm_dtype).eps * n2.abs()).all()
    assert torch.equal(got_c[7], got_c[3])
    assert torch.equal(got_c[8], got_c[3]) == (codec.cycles == 1)


def test_rotations_in_turn_need_positions_and_store_nothing_without():
    """A store over rotations in turn: missing, short, float or negative positions are refused by name before any
    byte changes; the scalar/vector codecs the Triton and the bucketing kernels do not run are refused by them."""
    from qjl.codecs.turboquant import TurboQuantMSE
    from qjl.codecs.vq import TurboQuantVQ

    codec = TurboQuantVQ(64, 2, cycles=4, correct_norm=True)
    p = kernels.cpu_pass(codec)
    buf, field = _pool(entry=16 + 2)
    before = buf.clone()
    codes_f, norm_f = field(0, torch.uint8, (16,)), field(16, p.norm_dtype, ())
    x, blocks, slots = torch.randn(4, 3, 64), torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2, 3])
    for bad in (None, torch.tensor([1, 2, 3]), torch.tensor([0.0, 1, 2, 3]), torch.tensor([0, 1, -2, 3])):
        with pytest.raises(ValueError, match="positions"):
            kernels.store_cpu([(codec, x, codes_f, norm_f)], blocks, slots, positions=bad)
    assert torch.equal(buf, before)
    for c in (codec, TurboQuantMSE(64, 2, cycles=3), TurboQuantVQ(64, 3)):
        with pytest.raises(TypeError, match="codec"):
            kernels.quantize_cpu(c, torch.randn(2, 64))
        with pytest.raises(TypeError, match="codec"):
            kernels.quantize(c, torch.randn(1, 2, 64))
