"""Triton kernels against the references: on the CPU through TRITON_INTERPRET=1 (set in conftest.py), or
natively on a GPU with ``TRITON_INTERPRET=0 pytest tests/kernels/test_triton*.py`` (``TRITON_DEVICE``).

Codes must be bit-exact; attention within a stated tolerance.  Shapes are small: the
interpreter runs every program in Python.  The paged decode kernel reads the same vLLM-like pools as the
CPU kernel's tests (:mod:`paged_pool`).
"""

import copy
import dataclasses
import os

import pytest
import torch

from kernel_cases import (CYCLED_PAIRS, GROUPED_PAIRS, PAIRS, TRITON_DEVICE as DEV, Case, OneAccumulator, close, codec_pair,
                          misreads_are_far, segment_views)
from paged_pool import paged_pool

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from qjl import kernels  # noqa: E402
from qjl.kernels.triton import launch as tk  # noqa: E402
from qjl.codecs.outliers import OutlierQJL  # noqa: E402
from qjl.codecs.sketch import QJLSketch  # noqa: E402
from qjl.codecs.turboquant import TurboQuantMSE  # noqa: E402
from qjl.integrations.transformers.names import cache_kwargs  # noqa: E402

TOL = 2e-5  # attention output, relative to its largest entry (fp32 sums in another order)

assert codec_pair  # the cases' codec pairs are shared with the CPU kernel tests


def _x(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * (1 + torch.rand(shape[-1], generator=g) * 3)).to(dtype).to(DEV)


def _same_codes(a, b):
    """Kernel codes (on DEV) equal the reference's (computed on the CPU from the same input)."""
    a = a.to("cpu")
    assert a.lead == b.lead and set(a.fields) == set(b.fields) and set(a.shared) == set(b.shared)
    for k in a.fields:
        assert torch.equal(a.fields[k], b.fields[k]), k
    for k in a.shared:
        assert torch.equal(a.shared[k], b.shared[k]), k


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("correct", [False, True])
def test_turboquant_quantize_bit_exact(bits, correct):
    codec = TurboQuantMSE(64, bits, seed=bits, correct_norm=correct)
    x = _x((2, 3, 21, 64), torch.float32, seed=bits)
    _same_codes(kernels.quantize(codec, x), codec.quantize(x.cpu()))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_head_dims_and_dtypes(d, dtype):
    x = _x((1, 2, 19, d), dtype, seed=d)
    for codec in (TurboQuantMSE(d, 3, seed=1), QJLSketch(d, 2 * d, "orthogonal", seed=2),
                  OutlierQJL(d, 2 * d, n_outliers=8, outlier_sketch_dim=32, seed=3)):
        _same_codes(kernels.quantize(codec, x), codec.quantize(x.cpu()))


@pytest.mark.parametrize("kind", ["gaussian", "orthogonal"])
def test_qjl_quantize_bit_exact_with_given_outliers(kind):
    codec = OutlierQJL(64, 128, n_outliers=4, outlier_sketch_dim=16, kind=kind, seed=5)
    x = _x((2, 3, 17, 64), torch.float32, seed=7)
    idx = codec.select_outliers(x.cpu())
    _same_codes(kernels.quantize(codec, x, idx.to(DEV)), codec.quantize(x.cpu(), idx))


def test_hadamard_sketch_quantize_agrees():
    """The kernel uses the materialized Hadamard sketch, the reference the fast transform: signs
    can only differ where a projection is ~0 (float rounding), never elsewhere."""
    codec = QJLSketch(64, 128, "hadamard", seed=1)
    x = _x((1, 1, 40, 64), torch.float32)
    got, want = kernels.quantize(codec, x).to("cpu"), codec.quantize(x.cpu())
    assert torch.allclose(got.fields["norm"], want.fields["norm"], rtol=1e-6, atol=0)
    from qjl.core.packing import unpack_signs

    diff = unpack_signs(got.fields["signs"]) != unpack_signs(want.fields["signs"])
    y = codec.project(x.cpu().float())
    assert (y[diff].abs() < 1e-4).all()


def test_pack_matrix_packs_like_pack_bits():
    from qjl.core.packing import pack_bits

    g = torch.Generator().manual_seed(0)
    for bits in (1, 3, 5):
        idx = torch.randint(0, 1 << bits, (4, 24), generator=g)
        m = tk.pack_matrix(24, bits, "cpu")
        planes = [((idx >> r) & 1).float() for r in range(bits)]
        packed = sum(torch.nn.functional.pad(p, (0, m.shape[1] - 24)) @ m[r] for r, p in enumerate(planes))
        assert torch.equal(packed[:, : (24 * bits + 7) // 8].to(torch.uint8), pack_bits(idx, bits))


@pytest.mark.parametrize("precision", ["auto", "ieee"])  # auto: "fma" for up to 8 rows
@pytest.mark.parametrize("name", PAIRS)
def test_paged_decode_every_codec(name, precision):
    c = Case(name, b=2, h=1, rows=3, d=64, n=37, n_exact=4, ragged=True)
    g = c.on(DEV)
    close(tk.paged_decode(*g.args(), exact=g.exact, code_bias=g.bias, splits=2, precision=precision).cpu(),
          c.reference(), TOL)


@pytest.mark.parametrize("name,d,rows", [("tq3-tq2", 64, 1), ("tq3-tq2", 128, 4), ("tq3-tq2", 256, 8),
                                         ("tq3-tq2", 64, 9), ("qjl-outliers-uni2", 128, 4), ("tq5-tq3", 256, 4)])
def test_paged_decode_head_dims_gqa_and_ragged_lengths(name, d, rows):
    """Real model shapes too: on a GPU these are the shapes that must fit its shared memory."""
    c = Case(name, b=2, h=2, rows=rows, d=d, n=45, seed=d + rows)  # 45: not a block multiple
    g = c.on(DEV)
    close(tk.paged_decode(*g.args(), code_bias=g.bias, block_n=16, splits=2).cpu(), c.reference(), TOL)


@pytest.mark.parametrize("precision", ["fma", "ieee"])
@pytest.mark.parametrize("d,rows", [(128, 4), (256, 8), (64, 1), (64, 9), (80, 3)])  # 80: no power of two
def test_paged_decode_products_head_dims_and_rows(d, rows, precision):
    """Both forms of the decode kernel's products (``fma``: broadcast tiles summed with tl.sum, rows padded from 2,
    the default up to 8 rows; ``ieee``: tl.dot in fp32, and what ``fma`` takes above 8 rows): the reference's
    result within the same bound; an unknown form is refused."""
    c = Case("tq3-tq2", b=2, h=2, rows=rows, d=d, n=45, seed=d + rows)
    g = c.on(DEV)
    close(tk.paged_decode(*g.args(), code_bias=g.bias, splits=2, precision=precision).cpu(), c.reference(), TOL)
    with pytest.raises(ValueError, match="precision"):
        tk.paged_decode(*g.args(), precision="bf16")


def test_product_form_follows_the_measured_tile_size():
    """"auto" takes the tl.sum products only for tiles up to the measured one (4 padded rows x 128 coordinates);
    an explicit "fma" up to 8 rows; beyond, the fp32 tl.dot."""
    for d, rows, auto, fma in [(128, 4, "fma", "fma"), (128, 3, "fma", "fma"), (64, 8, "fma", "fma"),
                               (128, 8, "ieee", "fma"), (256, 4, "ieee", "fma"), (128, 9, "ieee", "ieee")]:
        kc, vc = codec_pair("tq3-tq2", d)
        assert tk.product_form("auto", rows, kc, vc) == auto, (d, rows)
        assert tk.product_form("fma", rows, kc, vc) == fma, (d, rows)
        for given in ("ieee", "tf32"):  # taken as given
            assert tk.product_form(given, rows, kc, vc) == given
    for bad, rows in (("bf16", 4), ("FMA", 4), ("auto", 0), ("auto", True), ("auto", 2.0)):
        with pytest.raises(ValueError, match="precision" if rows == 4 else "rows"):
            tk.product_form(bad, rows, kc, vc)


def test_vouched_max_codes_skips_only_the_checks():
    """max_codes (the caller vouches for its ranges: no read-back from the GPU) gives the same output."""
    c = Case("tq3-tq2", b=2, h=2, rows=4, n=40, n_exact=2)
    g = c.on(DEV)
    want = tk.paged_decode(*g.args(), exact=g.exact, code_bias=g.bias)
    got = tk.paged_decode(*g.args(), exact=g.exact, code_bias=g.bias, max_codes=int((g.end - g.start).max()))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="max_codes"):
        kernels.paged_decode(*g.args(), max_codes=-1, backend="triton")


def _shuffled(c, block_size: int, seed: int) -> tuple:
    """A Case's codes in a shuffled pool of ``block_size``-slot blocks on DEV (a per-sequence shared field repeated
    in each block) -> (key fields, value fields, block table)."""
    blocks = -(-c.kcodes.lead[-1] // block_size)
    shared = {n: t.unsqueeze(2).expand(*t.shape[:2], blocks, *t.shape[2:]) for n, t in c.kcodes.shared.items()}
    kf, table = paged_pool(dict(c.kcodes.fields), shared, None, block_size, seed=seed, device=DEV)
    vf, _ = paged_pool(dict(c.vcodes.fields), {}, None, block_size, seed=seed, device=DEV)
    return kf, vf, table


@pytest.mark.parametrize("name", ["tq4-uni3", "qjl-outliers-uni2"])
def test_paged_decode_from_a_shuffled_pool(name):
    c = Case(name, b=2, h=2, rows=4, n=29, n_exact=3, ragged=True)
    kf, vf, table = _shuffled(c, 7, 2)
    g = c.on(DEV)
    got = tk.paged_decode(g.q, c.kc, kf, c.vc, vf, table, 7, g.start, g.end, exact=g.exact, code_bias=g.bias)
    close(got.cpu(), c.reference(), TOL)


def _cycled(name, **kw):
    """A Case of values over rotations in turn whose second sequence starts at code position 5 (no multiple of 3
    or 8: its residues differ from the ones counted from its start), with the reference of a kernel that mixes
    every token into one accumulator (mapped back by the first rotation), which must be far from the right one."""
    c = Case(name, **kw)
    c.start[1] = 5
    one = copy.copy(c)
    one.vc = OneAccumulator(c.vc)
    want = c.reference()
    assert (one.reference() - want).abs().max() > 0.1 * want.abs().max()  # so the tests below can tell
    return c, want


@pytest.mark.parametrize("precision,rows", [("auto", 3), ("ieee", 9)])  # auto: "fma" for 3 rows
@pytest.mark.parametrize("name", CYCLED_PAIRS)
def test_paged_decode_mixes_values_over_rotations_in_turn(name, precision, rows):
    """Values over K rotations in turn (K = 8, 3): the token at code position t mixed into accumulator t % K, the
    K accumulators mapped back by the unmix matrix [K n, d]: the reference's result over three splits of 16
    positions (a split's first position in each residue class is not the split's start), ragged starts, masked
    codes and exact tokens, both product forms."""
    c, want = _cycled(name, b=2, h=1, rows=rows, d=64, n=45, n_exact=4, ragged=True)
    g = c.on(DEV)
    got = tk.paged_decode(*g.args(), exact=g.exact, code_bias=g.bias, splits=3, precision=precision)
    close(got.cpu(), want, TOL)


@pytest.mark.parametrize("name", [*CYCLED_PAIRS, "tqsplit-tq3c3"])  # tqsplit: per-page query maps
def test_paged_decode_cycled_values_from_a_shuffled_pool(name):
    """Pages of 16 slots in a shuffled pool (K = 3 does not divide a page: a token's accumulator follows its code
    position, not its slot): the reference's result (the default splits)."""
    c, want = _cycled(name, b=2, h=2, rows=4, n=50, n_exact=3, ragged=True)
    kf, vf, table = _shuffled(c, 16, 3)
    g = c.on(DEV)
    got = tk.paged_decode(g.q, c.kc, kf, c.vc, vf, table, 16, g.start, g.end, exact=g.exact, code_bias=g.bias)
    close(got.cpu(), want, TOL)


def _grouped(name, **kw):
    """A Case of vector-codebook codes whose second sequence starts at code position 5 (a cycled value codec's
    residues are not counted from a sequence's start), and its reference, asserted far from the references of kernels
    that read the grouped side(s) as scalar codes or combine the fields in reverse order (so the tests can tell)."""
    c = Case(name, **kw)
    c.start[1] = 5
    return c, misreads_are_far(c)


@pytest.mark.parametrize("precision,rows", [("auto", 3), ("ieee", 9)])  # auto: "fma" for 3 rows
@pytest.mark.parametrize("name", GROUPED_PAIRS)
def test_paged_decode_reads_grouped_codes_from_a_shuffled_pool(name, precision, rows):
    """Vector-codebook codes (``PackedCodes.group`` g > 1: 2 bits in fours, 3 and 4 bits in pairs; a 3-bit pair's
    6-bit joint code straddles bytes) as keys, values (over 8 rotations in turn for vq3-vq2c8) or both: coordinate
    c read as ``centroids[e g + c % g]`` from its group's joint code e, the reference's result from pages of 7 slots
    in a shuffled pool, GQA rows, ragged starts and ends, masked codes and exact tokens, over three splits, both
    product forms; reading the groups as scalar codes or their fields in reverse order is far off (:func:`_grouped`)."""
    c, want = _grouped(name, b=2, h=2, rows=rows, d=64, n=40, n_exact=3, ragged=True, seed=rows)
    assert kernels.supports(c.kc, c.vc, "triton")
    kf, vf, table = _shuffled(c, 7, 4)
    g = c.on(DEV)
    got = tk.paged_decode(g.q, c.kc, kf, c.vc, vf, table, 7, g.start, g.end, exact=g.exact, code_bias=g.bias,
                          splits=3, precision=precision)
    close(got.cpu(), want, TOL)


def test_paged_decode_refuses_groups_it_cannot_read():
    """Grouped codes whose joint code is wider than a byte, or whose codebook is not [2^(g b) g]: a ValueError
    before any launch."""
    c = Case("vq4-vq3", b=1, h=1, rows=1, n=8)

    class Wide:
        def __init__(self, codec, packed):
            self.codec, self.packed = codec, packed

        def mix_view(self):
            return dataclasses.replace(self.codec.mix_view(), codes=self.packed)

        def __getattr__(self, name):
            return getattr(self.codec, name)

    p = c.vc.mix_view().codes
    for bad in (dataclasses.replace(p, group=4), dataclasses.replace(p, centroids=p.centroids[:-2])):
        with pytest.raises(ValueError, match="at a time"):
            tk.paged_decode(c.q, c.kc, c.kf, Wide(c.vc, bad), c.vf, c.block_table, c.block_size, c.start, c.end)


def test_combine_merges_cycled_partials_with_exact_segments():
    """Five splits of 3 accumulators each (15 partials: the combine reads 4 splits of an accumulator at once),
    exact tokens as two bf16 segments read in place and a vouched max_codes: the reference's result."""
    c = Case("tq4-tq3c3", b=2, h=2, rows=4, n=77, n_exact=5, seed=3)
    xk, xv, xb = c.exact
    xk, xv = xk.bfloat16().float(), xv.bfloat16().float()
    c.exact = (xk, xv, xb)
    ks, vs = segment_views(xk, xv, (2,), torch.bfloat16, DEV)
    g = c.on(DEV)
    got = tk.paged_decode(*g.args(), exact=(tuple(ks), tuple(vs), xb.to(DEV)), code_bias=g.bias, splits=5,
                          max_codes=77)
    close(got.cpu(), c.reference(), TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cuts", [(2,), (0, 2), (1, 3), (0,)])  # 2 segments (one empty), 3 (joined into 2), 1
def test_combine_reads_exact_segments_in_place(dtype, cuts):
    """The combine kernel (split-K merge, unmix, exact tokens, divide in one launch): exact tokens as segments
    in a half dtype, as strided views of larger buffers (sinks and window), over 5 splits: the reference's
    result over the joined float32 tokens; the same with the bias broadcast over sequences, heads or rows."""
    c = Case("tq3-tq2", b=2, h=2, rows=4, n=77, n_exact=5, seed=3)
    xk, xv, xb = c.exact
    xk, xv = xk.to(dtype).float(), xv.to(dtype).float()
    ks, vs = segment_views(xk, xv, cuts, dtype, DEV)
    g = c.on(DEV)
    for bias in (xb, xb[:1], xb[:, :1], xb[:1, :1, :1], None):
        c.exact = (xk, xv, bias)
        got = tk.paged_decode(*g.args(), code_bias=g.bias, splits=5,
                              exact=(tuple(ks), tuple(vs), None if bias is None else bias.to(DEV)))
        close(got.cpu(), c.reference(), TOL)


def test_combine_reads_exact_rows_from_pages_and_keeps_empty_rows_nan():
    """Exact tokens as PagedRows (vLLM's exact slots) give the joined tokens' result; a row that sees no token
    at all (its codes and exact tokens all masked) is NaN, like the reference's fully masked softmax, and the
    other rows stay finite."""
    from qjl.kernels.paged import PagedField, PagedRows

    c = Case("tq4-uni3", b=2, h=2, rows=3, n=40, n_exact=4, seed=5)
    xk, xv, xb = c.exact
    pool_k = torch.zeros(6, 2, 4, 64, dtype=torch.float16)  # [blocks, heads, slots, d]
    pool_v = torch.zeros_like(pool_k)
    blocks = torch.tensor([[5, 5, 1, 1], [0, 2, 2, 3]])
    slots = torch.tensor([[0, 3, 1, 2], [3, 0, 1, 2]])
    for i in range(2):
        for j in range(4):
            pool_k[blocks[i, j], :, slots[i, j]] = xk[i, :, j].half()
            pool_v[blocks[i, j], :, slots[i, j]] = xv[i, :, j].half()
    def field(pool):
        e = pool.element_size()
        return PagedField(pool, 0, pool.stride(0) * e, pool.stride(1) * e, pool.stride(2) * e, pool.dtype, (64,))

    pk, pv = (PagedRows.at(field(p.to(DEV)), blocks[:, :3].to(DEV), slots[:, :3].to(DEV), 2) for p in (pool_k, pool_v))
    ck, cv = xk[:, :, 3:].bfloat16(), xv[:, :, 3:].bfloat16()  # the current token: a bf16 segment
    c.exact = (torch.cat([xk[:, :, :3].half().float(), ck.float()], 2),
               torch.cat([xv[:, :, :3].half().float(), cv.float()], 2), xb)
    g = c.on(DEV)
    got = tk.paged_decode(*g.args(), code_bias=g.bias, exact=((pk, ck.to(DEV)), (pv, cv.to(DEV)), xb.to(DEV)),
                          splits=3)
    close(got.cpu(), c.reference(), TOL)
    c.bias = torch.zeros(2, 40)
    c.bias[1] = float("-inf")  # sequence 1: every code masked ...
    xb2 = xb.clone()
    xb2[1, 0, 2] = float("-inf")  # ... and, for row 2 of head 0, every exact token too
    c.exact = (c.exact[0], c.exact[1], xb2)
    g = c.on(DEV)
    want = c.reference()
    got = tk.paged_decode(*g.args(), code_bias=g.bias, exact=g.exact, splits=3).cpu()
    assert torch.isnan(want[1, 0, 2]).all() and torch.isnan(got[1, 0, 2]).all()
    keep = torch.ones_like(got, dtype=torch.bool)
    keep[1, 0, 2] = False
    assert torch.isfinite(got[keep]).all()
    err = (got[keep] - want[keep]).abs().max().item()
    assert err <= TOL * want[keep].abs().max().item(), err


@pytest.mark.parametrize("codec", ["turboquant_mse", "turboquant_vq"])  # vq: vector codebooks, encoded in torch
def test_cache_with_triton_kernel_matches_torch_path(codec):
    import qjl
    from qjl import CodecSpec, QJLCache, QJLConfig
    from tiny_models import tiny_model

    torch.set_grad_enabled(False)
    model = tiny_model("llama").to(DEV)
    qjl.patch_attention(model)
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(0)).to(DEV)
    outs = {}
    for kernel in ("torch", "triton", "cpu") if DEV.type == "cpu" else ("torch", "triton"):
        cfg = QJLConfig(key=CodecSpec(codec, {"bits": 3}), value=CodecSpec(codec, {"bits": 2}),
                        residual_length=8, flush_block=8, sink_tokens=2, heavy_tokens=4, kernel=kernel,
                        # an fp32 window: fp16 storage rounds the two paths' 1e-7 prefill differences to
                        # different fp16 values now and then, which flips codes in later layers (measured
                        # 4e-3 on the logits; the attention paths agree to 4e-7 on one store)
                        exact_dtype=None)
        cache = QJLCache(model, cfg)
        model(ids[:, :26], **cache_kwargs(cache))
        outs[kernel] = torch.cat([model(ids[:, i:i + 1], **cache_kwargs(cache)).logits for i in range(26, 30)], 1)
        assert cache.layers[0].store.backend == kernel and cache.layers[0].store.key_codes is not None
    assert torch.allclose(outs["triton"], outs["torch"], atol=1e-4)
    if "cpu" in outs:
        assert torch.allclose(outs["cpu"], outs["torch"], atol=1e-4)


def test_quantize_refuses_codecs_it_does_not_cover():
    from qjl.codecs.kivi import KIVIKeys

    with pytest.raises(TypeError, match="codec"):
        kernels.quantize(KIVIKeys(64, 2), torch.randn(1, 32, 64))
    assert not kernels.can_quantize(KIVIKeys(64, 2)) and kernels.can_quantize(TurboQuantMSE(64, 2))
    cycled = TurboQuantMSE(64, 2, cycles=3)  # codes by position: codec.quantize(x, start=...), not the kernel
    assert not kernels.can_quantize(cycled)
    with pytest.raises(TypeError, match="TurboQuantMSE"):
        kernels.quantize(cycled, torch.randn(1, 32, 64))
