"""The C decode kernel's fp32 paths (AVX2 where the CPU has it, and portable) against the torch reference (the
integer path, ``impl="c-int"``: test_cpu_int.py)."""


import dataclasses

import pytest
import torch

from kernel_cases import (CYCLED_PAIRS, GROUPED_PAIRS, PAIRS, Case, OneAccumulator, Recoded, close, fields_of,
                          misreads_are_far, segment_views)
from qjl import kernels
from qjl.codecs.turboquant import TurboQuantMSE
from qjl.kernels.cpu import launch

if not launch.available():  # pragma: no cover - no C compiler / cffi here
    pytest.skip("the C kernel does not build here", allow_module_level=True)

TOL = 1e-4  # output scale: fp32 sums over D and over the tokens in another order
IMPLS = ("c", "c-portable")  # fp32 sums: within TOL of the reference


def _run(c, impl, **kw):
    return launch.paged_decode(*c.args(), exact=c.exact, code_bias=c.bias, impl=impl, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", PAIRS)
def test_every_codec_pair(name, impl):
    c = Case(name, b=2, h=2, rows=3, n=301, n_exact=6, ragged=True)
    close(_run(c, impl, split_tokens=128, threads=2), c.reference(), TOL)  # several items per thread


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", CYCLED_PAIRS)
@pytest.mark.parametrize("rows,split", [(6, 128), (3, 0), (9, 100)])
def test_cycled_values(name, rows, split, impl):
    """Values over K rotations in turn (K = 8, and 3: no divisor of a pass of 512 tokens, a split of 128 or 100): each
    token mixed into accumulator t % K of its code position t, with a ragged code start (3: not a multiple of K, so a
    residue counted from an item's or a pass's first token fails), a masked prefix, exact tokens with a per-row mask,
    GQA groups past RW = 4 (6 = 4 + 2, 9 = 4 + 4 + 1) and token splits (128, 100, automatic) merged per unit."""
    c = Case(name, b=2, h=2, rows=rows, n=301, n_exact=6, ragged=True, seed=rows)
    close(_run(c, impl, split_tokens=split, threads=2), c.reference(), TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", CYCLED_PAIRS)
@pytest.mark.parametrize("block_size", [16, 7])
def test_cycled_values_on_paged_pools(name, block_size, impl):
    """Shuffled block pools (vLLM's layout): each pass cut into spans of one block, a residue's tokens K slots apart
    in each (K = 8 in blocks of 16: 2 per span; K = 3: the residue of a block's first slot changing from block to
    block; blocks of 7: spans of odd lengths, shorter than K = 8)."""
    from paged_pool import paged_pool

    c = Case(name, b=2, h=3, rows=5, n=301, n_exact=5, ragged=True, seed=block_size)
    kf, table = paged_pool(dict(c.kcodes.fields), {}, None, block_size, block_size)
    vf, _ = paged_pool(dict(c.vcodes.fields), {}, None, block_size, block_size)
    got = launch.paged_decode(c.q, c.kc, kf, c.vc, vf, table, block_size, c.start, c.end, exact=c.exact,
                              code_bias=c.bias, impl=impl, split_tokens=128, threads=2)
    close(got, c.reference(), TOL)


@pytest.mark.parametrize("name", CYCLED_PAIRS)
def test_cycled_values_are_not_one_accumulator(name):
    """The cycled tests above can fail: the reference with every token in one accumulator (what the K = 1 kernel
    computes on these codes) is far outside their tolerance (> 100 TOL of the output scale) from the output the
    kernel matches."""
    from qjl.kernels.reference import paged_decode_reference

    c = Case(name, b=2, h=2, rows=6, n=301, n_exact=6, ragged=True, seed=6)
    args = list(c.args())
    args[3] = OneAccumulator(c.vc)
    wrong = paged_decode_reference(*args, exact=c.exact, code_bias=c.bias)
    got, want = _run(c, "c", split_tokens=128), c.reference()
    close(got, want, TOL)
    assert (got - wrong).abs().max() > 100 * TOL * want.abs().max()


class Regrouped(Recoded):
    """A codec of scalar b-bit codes (TurboQuantMSE, token-wise values) whose codes are read ``group`` at a time
    through a random table [2^(g b) g] (N(0, 1/n)): the groupings no vector codebook of TurboQuantVQ has (1 bit in
    twos, fours and eights, 2 bits in twos), zero points and scale groups, the same bytes read as joint codes."""

    def __init__(self, codec, group: int, seed: int):
        view = codec.mix_view() if hasattr(codec, "mix_view") else None
        p = view.codes if view is not None else codec.score_view().terms[0].codes
        g = torch.Generator().manual_seed(seed)
        table = torch.randn(group << (group * p.bits), generator=g) / p.length ** 0.5
        super().__init__(codec, lambda q: dataclasses.replace(q, group=group, centroids=table), all_codes=True)
        self.group, self.table = group, table


def _with_codecs(c, kc, vc):
    """Case ``c`` with its tokens coded by these codecs."""
    c.kc, c.vc = kc, vc
    c.kcodes, c.vcodes = kc.quantize(c.k), vc.quantize(c.v)
    c.kf, c.vf = fields_of(c.kcodes), fields_of(c.vcodes)
    return c


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", GROUPED_PAIRS)
@pytest.mark.parametrize("rows,split,d", [(6, 128, 64), (3, 0, 64), (9, 100, 64), (4, 0, 128)])
def test_grouped_codes(name, rows, split, d, impl):
    """Vector-codebook codes (``PackedCodes.group`` g > 1: 2 bits in fours, 3 and 4 bits in pairs, a 3-bit pair's 6-bit
    joint code straddling bytes) as keys, values (over 8 rotations in turn for vq3-vq2c8) or both: coordinate c read
    as ``centroids[e g + c % g]`` from its group's joint code e, the reference's result with a ragged start, a masked
    prefix, exact tokens with a per-row mask, GQA groups past RW = 4 (6, 9) and token splits; reading the groups as
    scalar codes or their fields in reverse order is far off (:func:`_misreads_are_far`)."""
    c = Case(name, b=2, h=2, rows=rows, d=d, n=301, n_exact=6, ragged=True, seed=rows)
    want = misreads_are_far(c)
    close(_run(c, impl, split_tokens=split, threads=2), want, TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", GROUPED_PAIRS)
@pytest.mark.parametrize("block_size", [16, 7])
def test_grouped_codes_on_paged_pools(name, block_size, impl):
    """Grouped codes in shuffled block pools (vLLM's layout): spans of one block each, of odd lengths in blocks of 7
    (cycled values: a residue's tokens K slots apart)."""
    from paged_pool import paged_pool

    c = Case(name, b=2, h=3, rows=5, n=301, n_exact=5, ragged=True, seed=block_size)
    want = misreads_are_far(c)
    kf, table = paged_pool(dict(c.kcodes.fields), {}, None, block_size, block_size)
    vf, _ = paged_pool(dict(c.vcodes.fields), {}, None, block_size, block_size)
    got = launch.paged_decode(c.q, c.kc, kf, c.vc, vf, table, block_size, c.start, c.end, exact=c.exact,
                              code_bias=c.bias, impl=impl, split_tokens=128, threads=2)
    close(got, want, TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits,group", [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (3, 2), (4, 2)])
@pytest.mark.parametrize("d", [8, 24, 64])  # one 8-code run, three (the mix's single last chunk), eight
def test_every_grouping(bits, group, d, impl):
    """Every grouping the kernel reads (g 2, 4 or 8 fields of g b <= 8 bits; the AVX2 loops' run-time widths and the
    vector codebooks' constant ones) as keys and as values over 3 rotations in turn: the reference's result, and
    misreadings far off."""
    c = Case("tq3-tq2", b=2, h=2, rows=5, d=d, n=150, n_exact=3, ragged=True, seed=d + 8 * group + bits)
    _with_codecs(c, Regrouped(TurboQuantMSE(d, bits, seed=1), group, 3),
                 Regrouped(TurboQuantMSE(d, bits, seed=2, cycles=3), group, 4))
    want = misreads_are_far(c)
    close(_run(c, impl, split_tokens=64, threads=2), want, TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("d,rows,block", [(64, 3, 0), (128, 4, 0), (24, 1, 0), (64, 9, 16), (40, 6, 7)])
def test_pair_tables(bits, d, rows, block, impl):
    """Keys in pairs of 2 or 3 bits in items of >= 256 tokens: the AVX2 path scores them through pair tables
    (decode_avx2.c: a pair's joint code as the byte offset of its entry, the 4 rows' products, in a table built per
    item).  The reference's result with a ragged start, masks, exact tokens, GQA chunks past 4 rows, odd numbers of
    8-coordinate groups (d = 24, 40: a row's last group read to its end only) and shuffled block pools; misreadings
    of the pairs far off."""
    from paged_pool import paged_pool

    c = Case("tq3-tq2", b=2, h=2, rows=rows, d=d, n=700, n_exact=3, ragged=True, seed=d + bits + rows)
    _with_codecs(c, Regrouped(TurboQuantMSE(d, bits, seed=1), 2, 3 + bits), TurboQuantMSE(d, 2, seed=2))
    want = misreads_are_far(c)
    if not block:
        close(_run(c, impl, split_tokens=0, threads=2), want, TOL)
        return
    kf, table = paged_pool(dict(c.kcodes.fields), {}, None, block, block)
    vf, _ = paged_pool(dict(c.vcodes.fields), {}, None, block, block)
    close(launch.paged_decode(c.q, c.kc, kf, c.vc, vf, table, block, c.start, c.end, exact=c.exact, code_bias=c.bias,
                              impl=impl, split_tokens=300, threads=2), want, TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["vq3-vq2c8", "vq2-tq3"])
def test_vector_keys_in_long_items(name, impl):
    """The vector codebooks' 3-bit keys (pairs) and 2-bit keys (fours: the unpack8 loops) in items of >= 256 tokens."""
    c = Case(name, b=1, h=3, rows=4, d=128, n=1100, n_exact=4, ragged=True, seed=5)
    close(_run(c, impl, split_tokens=512, threads=2), misreads_are_far(c), TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits,group", [(2, 4), (3, 2), (1, 8)])
@pytest.mark.parametrize("d,group_size", [(64, 16), (24, 8)])
def test_grouped_codes_with_scale_groups(bits, group, d, group_size, impl):
    """Grouped value codes with per-group scales and zero points (token-wise values read g at a time: scale groups of
    8 and 16 coordinates, so a mixed 16-coordinate chunk takes two groups' weights or one): the reference's result."""
    from qjl.codecs.tokenwise import TokenwiseQuantizer

    c = Case("tq3-tq2", b=2, h=2, rows=6, d=d, n=150, n_exact=3, ragged=True, seed=d + bits)
    _with_codecs(c, TurboQuantMSE(d, 4, seed=1), Regrouped(TokenwiseQuantizer(d, bits, group_size=group_size), group, 5))
    want = misreads_are_far(c)
    close(_run(c, impl, split_tokens=64, threads=2), want, TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d", [8, 24, 64, 128, 256])  # 8, 24: a single or odd number of 8-code groups
@pytest.mark.parametrize("rows", [1, 2, 4, 6, 9])  # live rows of a chunk: 1-4 (6 = 4 + 2, 9 = 4 + 4 + 1)
def test_head_dims_and_gqa_rows(d, rows, impl):
    c = Case("tq3-tq2", b=2, h=1, rows=rows, d=d, n=133, seed=d + rows, n_exact=3)
    close(_run(c, impl, split_tokens=64), c.reference(), TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits", [(1, 4), (2, 3), (3, 2), (4, 1), (5, 2), (3, 5)])  # key / value widths 1-5: the
# lane-sliced loops (slabs of 64 codes, 32 at 5 bits)
@pytest.mark.parametrize("d", [64, 192, 72, 96])  # one slab, three, 72 (the other loops), 96 (5 bits: three slabs)
def test_sliced_widths(bits, d, impl):
    c = Case(f"tq{bits[0]}-tq{bits[1]}", b=2, h=2, rows=5, d=d, n=150, seed=d + bits[0], n_exact=2, ragged=True)
    close(_run(c, impl, split_tokens=64, threads=2), c.reference(), TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cuts", [(2,), (0, 2), (1, 3), (0,)])  # segment boundaries: 2 segments (one empty), 3, 1
def test_exact_segments_read_in_place(dtype, cuts, impl):
    """Exact tokens given as segments (sinks, window) in a half dtype, as strided views of larger buffers: the
    same result as the reference over the joined float32 tokens (rounded to the dtype first)."""
    c = Case("tq3-tq2", b=2, h=2, rows=4, n=77, n_exact=5, seed=3)
    xk, xv, xb = c.exact
    xk, xv = xk.to(dtype).float(), xv.to(dtype).float()
    ks, vs = segment_views(xk, xv, cuts, dtype)
    want = launch.paged_decode(*c.args(), code_bias=c.bias, exact=(xk, xv, xb), impl=impl)
    close(launch.paged_decode(*c.args(), code_bias=c.bias, exact=(tuple(ks), tuple(vs), xb), impl=impl), want, TOL)
    c.exact = (xk, xv, xb)
    close(want, c.reference(), TOL)
    mixed = (ks[0].float(), *ks[1:])  # segments of two dtypes: joined as float32
    close(launch.paged_decode(*c.args(), code_bias=c.bias, exact=(mixed, tuple(vs), xb), impl=impl), want, TOL)
    cols = torch.zeros(2, 2, 5, 128, dtype=dtype)[..., ::2]  # rows not contiguous: copied first
    cols.copy_(xk.to(dtype))
    close(launch.paged_decode(*c.args(), code_bias=c.bias, exact=(cols, xv.to(dtype), xb), impl=impl), want, TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_exact_rows_read_from_pages(impl):
    """Exact tokens as PagedRows (fp16 rows of a page pool at per-token block and slot, as vLLM's exact slots) and
    a bf16 segment (the current token): the same result as the joined float32 tokens, on the C kernel and the
    torch reference; offsets reaching past the pool are refused by the kernel before it reads anything."""
    from qjl.kernels.paged import PagedField, PagedRows

    c = Case("tq3-tq2", b=2, h=2, rows=4, n=77, n_exact=5, seed=3)
    xk, xv, xb = c.exact  # [2, 2, 5, 64]
    g = torch.Generator().manual_seed(4)
    cells = torch.randperm(24, generator=g)[:8].reshape(2, 4)
    blocks, slots = cells // 4, cells % 4
    rows = []
    for x in (xk, xv):
        pool = torch.zeros(6, 2, 4, 64, dtype=torch.float16)
        pool[blocks[:, None, :], torch.arange(2)[None, :, None], slots[:, None, :]] = x[:, :, :4].half()
        es = pool.element_size()
        f = PagedField(pool, 0, pool.stride(0) * es, pool.stride(1) * es, pool.stride(2) * es, torch.float16, (64,))
        rows.append(PagedRows.at(f, blocks, slots, 2))
    assert torch.equal(rows[0].gather(), xk[:, :, :4].half())
    cur_k, cur_v = xk[:, :, 4:].bfloat16(), xv[:, :, 4:].bfloat16()
    joined = tuple(torch.cat([x[:, :, :4].half().float(), x[:, :, 4:].bfloat16().float()], 2) for x in (xk, xv))
    want = launch.paged_decode(*c.args(), code_bias=c.bias, exact=(*joined, xb), impl=impl)
    got = launch.paged_decode(*c.args(), code_bias=c.bias, exact=((rows[0], cur_k), (rows[1], cur_v), xb), impl=impl)
    close(got, want, TOL)
    ref = kernels.paged_decode(*c.args(), code_bias=c.bias, exact=((rows[0], cur_k), (rows[1], cur_v), xb),
                               backend="torch")
    close(ref, want, TOL)
    far = PagedRows(rows[0].field, rows[0].offsets + rows[0].field.buffer.numel(), 2)  # built around the check
    with pytest.raises(ValueError, match="refused"):
        launch.paged_decode(*c.args(), exact=((far, cur_k), (rows[1], cur_v), xb), impl=impl)
    with pytest.raises(ValueError, match="reach byte"):
        PagedRows.at(rows[0].field, blocks + 6, slots, 2)
    with pytest.raises(ValueError, match="heads"):
        PagedRows.at(rows[0].field, blocks, slots, 0)

# the C paths this CPU runs (the integer path and its AMX engine where it has them)
IMPLS_HERE = ("c",) + (("c-int",) if launch.has_int_path() else ()) + (("c-amx",) if launch.has_amx_path() else ())


def _paged_exact(c, seed: int = 4):
    """Case ``c``'s first 4 exact tokens as fp16 PagedRows in a page pool (one per role), its last one as a bf16
    segment [B, H, 1, D] (vLLM's current token): (rows, pools' fields, segment)."""
    from qjl.kernels.paged import PagedField, PagedRows

    xk, xv, _ = c.exact
    b, h = xk.shape[:2]
    g = torch.Generator().manual_seed(seed)
    cells = torch.randperm(24, generator=g)[:4 * b].reshape(b, 4)
    blocks, slots = cells // 4, cells % 4
    rows, fields = [], []
    for x in (xk, xv):
        pool = torch.zeros(6, h, 4, x.shape[-1], dtype=torch.float16)
        pool[blocks[:, None, :], torch.arange(h)[None, :, None], slots[:, None, :]] = x[:, :, :4].half()
        es = pool.element_size()
        f = PagedField(pool, 0, pool.stride(0) * es, pool.stride(1) * es, pool.stride(2) * es, torch.float16,
                       (x.shape[-1],))
        rows.append(PagedRows.at(f, blocks, slots, h))
        fields.append(f)
    return tuple(rows), tuple(fields), (xk[:, :, 4:].bfloat16(), xv[:, :, 4:].bfloat16())


@pytest.mark.parametrize("impl", IMPLS_HERE)
@pytest.mark.parametrize("name", ["tq3-tq2", "qjl-outliers-uni2", "tq3-tq2c8", "vq3-vq2c8", "tq5-vq4"])  # the kernel
# maps the queries / the general path / values over rotations in turn / vector codebooks (both roles; values)
def test_decode_step_equals_paged_decode(name, impl):
    """paged_decode_step (a step's ranges, exact offsets and bias converted once, each layer's fields, exact
    fields and current token filled per call) makes the same C call as paged_decode: equal bit for bit, for a
    second layer's pages of the same geometry as well."""
    c = Case(name, b=2, h=2, rows=4, n=77, n_exact=5, seed=3, masked=False)
    rows, fields, cur = _paged_exact(c)
    xb = c.exact[2]
    q, kc, kf, vc, vf, bt, bs, start, end = c.args()
    step = launch.DecodeStep(bt, bs, start, end, rows=rows, segments=1, xbias=xb, impl=impl)
    want = launch.paged_decode(*c.args(), exact=((rows[0], cur[0]), (rows[1], cur[1]), xb), impl=impl)
    got = launch.paged_decode_step(q, kc, kf, vc, vf, step, exact_fields=fields, segments=(cur,))
    assert torch.equal(got, want)
    if impl == "c":  # (the integer path against the reference: test_cpu_int.py)
        ref = kernels.paged_decode(*c.args(), exact=((rows[0], cur[0]), (rows[1], cur[1]), xb), backend="torch")
        close(got, ref, TOL)
    other = Case(name, b=2, h=2, rows=4, n=77, n_exact=5, seed=9, masked=False)  # another layer, same geometry
    rows2, fields2, cur2 = _paged_exact(other)
    got2 = launch.paged_decode_step(q, kc, kf, vc, vf, step, exact_fields=fields2, segments=(cur2,))
    want2 = launch.paged_decode(*c.args(), exact=((rows2[0], cur2[0]), (rows2[1], cur2[1]), xb), impl=impl)
    assert torch.equal(got2, want2) and not torch.equal(got2, got)
    xk, xv, xb = c.exact  # two tensor segments per call (transformers' sinks and window), no rows
    plain = launch.DecodeStep(bt, bs, start, end, segments=2, xbias=xb, impl=impl)
    segs = ((xk[:, :, :2], xv[:, :, :2]), (xk[:, :, 2:].half(), xv[:, :, 2:].half()))
    assert torch.equal(launch.paged_decode_step(q, kc, kf, vc, vf, plain, segments=segs),
                       launch.paged_decode(*c.args(), exact=(tuple(k for k, _ in segs), tuple(v for _, v in segs), xb),
                                           impl=impl))


def test_decode_step_binds_exact_fields_once():
    """With FieldMaps (the vLLM backend's), a layer's exact fields are bound once (their buffers' addresses and
    extents kept in the key fields' memo) and read at each step's own offsets: a later step over the same fields, a
    buffer swapped in place (new storage: the binding is rebuilt) and another layer's fields all equal
    paged_decode bit for bit, and a field of another geometry is still refused."""
    from qjl.kernels.paged import FieldMap, PagedField

    c = Case("tq3-tq2", b=2, h=2, rows=4, n=77, n_exact=5, seed=3, masked=False)
    rows, fields, cur = _paged_exact(c)
    q, kc, kf, vc, vf, bt, bs, start, end = c.args()
    kf, vf = FieldMap(kf), FieldMap(vf)
    xb = c.exact[2]

    def both(step_rows, exact_fields, segment):
        step = launch.DecodeStep(bt, bs, start, end, rows=step_rows, segments=1, xbias=xb)
        got = launch.paged_decode_step(q, kc, kf, vc, vf, step, exact_fields=exact_fields, segments=(segment,))
        want = launch.paged_decode(q, kc, kf, vc, vf, bt, bs, start, end,
                                   exact=((step_rows[0], segment[0]), (step_rows[1], segment[1]), xb))
        assert torch.equal(got, want)
        return got

    first = both(rows, fields, cur)
    bound = [v for key, v in kf.memo.items() if key[0] == "rows"]
    assert len(bound) == 1
    rows_b, _, _ = _paged_exact(c, seed=5)  # the next step: other slots of the same pools
    rows_b = tuple(type(r)(f, r.offsets, r.heads) for r, f in zip(rows_b, fields))
    assert not torch.equal(both(rows_b, fields, cur), first)
    assert [v for key, v in kf.memo.items() if key[0] == "rows"] == bound  # the same binding, read at new offsets
    fields[0].buffer.set_(fields[0].buffer.clone().mul_(2).untyped_storage())  # swapped in place: rebuilt
    assert not torch.equal(both(rows, fields, cur), first)
    other_rows, other_fields, other_cur = _paged_exact(Case("tq3-tq2", b=2, h=2, rows=4, n=77, n_exact=5, seed=9,
                                                            masked=False))
    both(other_rows, other_fields, other_cur)  # another layer's exact fields
    f = fields[0]
    moved = PagedField(f.buffer, f.offset + 2, f.stride_block, f.stride_head, f.stride_token, f.dtype, f.shape)
    step = launch.DecodeStep(bt, bs, start, end, rows=rows, segments=1, xbias=xb)
    with pytest.raises(ValueError, match="offset, strides"):
        launch.paged_decode_step(q, kc, kf, vc, vf, step, exact_fields=(moved, fields[1]), segments=(cur,))


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("odtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_step_raw_query_and_output_dtype(qdtype, odtype):
    """The query given raw with its scale (converted and scaled inside the call) and the output written in place in
    another dtype, with the current token as a [B, H, D] segment: equal bit for bit to scaling in torch, the fp32
    result and ``.to(dtype)``."""
    c = Case("tq3-tq2", b=2, h=2, rows=4, n=77, n_exact=5, seed=3, masked=False)
    rows, fields, cur = _paged_exact(c)
    q, kc, kf, vc, vf, bt, bs, start, end = c.args()
    qr = (q * 3).to(qdtype)
    step = launch.DecodeStep(bt, bs, start, end, rows=rows, segments=1, xbias=c.exact[2])
    want = launch.paged_decode_step(qr.float() * 0.37, kc, kf, vc, vf, step, exact_fields=fields, segments=(cur,))
    out = torch.full((2, 2, 4, 64), 7.0, dtype=odtype)
    one = (cur[0][:, :, 0], cur[1][:, :, 0])  # [B, H, D]
    got = launch.paged_decode_step(qr, kc, kf, vc, vf, step, exact_fields=fields, segments=(one,), q_scale=0.37,
                                   out=out)
    assert got is out and torch.equal(got, want.to(odtype))
    with pytest.raises(ValueError, match="out must be"):
        launch.paged_decode_step(qr, kc, kf, vc, vf, step, exact_fields=fields, segments=(one,), out=out[:1])


def test_half_rounding_matches_torch():
    """The C kernel's rounding of fp32 results into an fp16 / bf16 ``out`` (decode.c's float_to_half and
    float_to_bf16) is torch's ``.to()``, bit for bit: subnormals, the largest fp16, overflow to inf, ties to even,
    NaN, signed zeros and inf, and random values over 15 decades."""
    corners = torch.tensor([0.0, -0.0, 1e-8, 6e-8, 3e-8, 5.96e-8, 6.1e-5, 6.5e-5, 65504.0, 65519.0, 65520.0, 1e6,
                            -1e6, float("inf"), float("-inf"), 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 3.14159,
                            1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 3e38, -3e38, 1e-40, float("nan"), -float("nan")])
    g = torch.Generator().manual_seed(0)
    n = 4096 - len(corners)
    vals = torch.cat([corners, torch.randn(n, generator=g) * torch.logspace(-9, 6, n)])
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(launch.half_rounding(vals, dtype).view(torch.int16), vals.to(dtype).view(torch.int16))
    with pytest.raises(ValueError, match="dtype"):
        launch.half_rounding(vals, torch.float32)
    for bad in ([1.0, 2.0], vals.to(torch.int32)):
        with pytest.raises(TypeError, match="x must be"):
            launch.half_rounding(bad, torch.float16)


def test_decode_step_follows_the_impl_setting(monkeypatch):
    """A kept step with impl="auto" follows $QJL_CPU_IMPL at each call, as paged_decode does (the bench switches it
    between rows; a step kept across calls must not pin the first call's path)."""
    c = Case("tq3-tq2", b=2, h=2, rows=4, n=300, masked=False)
    q, kc, kf, vc, vf, bt, bs, start, end = c.args()
    step = launch.DecodeStep(bt, bs, start, end)
    impls = ("c", "c-portable") + (("c-int",) if launch.has_int_path() else ())
    outs = {}
    for impl in impls + impls:
        monkeypatch.setenv("QJL_CPU_IMPL", impl)
        got = launch.paged_decode_step(q, kc, kf, vc, vf, step)
        assert torch.equal(got, launch.paged_decode(*c.args()))
        outs.setdefault(impl, got)
    if "c-int" in outs:  # the integer path's rounding: a different result, so the switch is seen
        assert not torch.equal(outs["c-int"], outs["c"])


def test_decode_step_bad_input():
    from qjl.kernels.paged import PagedField

    c = Case("tq3-tq2", b=2, h=2, rows=4, n=40, n_exact=5, masked=False)
    rows, fields, cur = _paged_exact(c)
    q, kc, kf, vc, vf, bt, bs, start, end = c.args()
    step = launch.DecodeStep(bt, bs, start, end, rows=rows, segments=1, xbias=c.exact[2])
    run = launch.paged_decode_step
    with pytest.raises(TypeError, match="step"):
        run(q, kc, kf, vc, vf, None, exact_fields=fields, segments=(cur,))
    with pytest.raises(ValueError, match="q must be"):
        run(q[:1], kc, kf, vc, vf, step, exact_fields=fields, segments=(cur,))
    with pytest.raises(ValueError, match="exact_fields must be given"):
        run(q, kc, kf, vc, vf, step, segments=(cur,))
    for bad in (float("nan"), float("inf"), "0.1", True):
        with pytest.raises(ValueError, match="q_scale"):
            run(q, kc, kf, vc, vf, step, exact_fields=fields, segments=(cur,), q_scale=bad)
    with pytest.raises(ValueError, match="segments must be"):
        run(q, kc, kf, vc, vf, step, exact_fields=fields)
    with pytest.raises(ValueError, match=r"segments\[0\] v"):
        run(q, kc, kf, vc, vf, step, exact_fields=fields, segments=((cur[0], cur[1][:, :1]),))
    with pytest.raises(ValueError, match="xbias"):  # two tokens in the segment: the bias covers one
        run(q, kc, kf, vc, vf, step, exact_fields=fields, segments=((torch.cat([cur[0]] * 2, 2),
                                                                    torch.cat([cur[1]] * 2, 2)),))
    f = fields[0]
    moved = PagedField(f.buffer, f.offset + 2, f.stride_block, f.stride_head, f.stride_token, f.dtype, f.shape)
    with pytest.raises(ValueError, match="geometry|offset, strides"):
        run(q, kc, kf, vc, vf, step, exact_fields=(moved, fields[1]), segments=(cur,))
    with pytest.raises(ValueError, match="xbias"):
        launch.DecodeStep(bt, bs, start, end, rows=rows, segments=0, xbias=c.exact[2])
    with pytest.raises(ValueError, match="segments"):
        launch.DecodeStep(bt, bs, start, end, rows=rows, segments=2)
    with pytest.raises(ValueError, match="code_end"):
        launch.DecodeStep(bt, bs, start, end[:1], rows=rows, segments=1)
    with pytest.raises(ValueError, match="rows"):
        launch.DecodeStep(bt, bs, start, end, rows=(rows[0], rows[0].gather()), segments=1)
    far = launch.DecodeStep(bt, bs, start, end + 10**6, rows=rows, segments=1, xbias=c.exact[2])
    with pytest.raises(ValueError, match="code_end"):  # values checked by the kernel, named by the full check
        run(q, kc, kf, vc, vf, far, exact_fields=fields, segments=(cur,))


def test_exact_segments_bad_input():
    c = Case("tq3-tq2", b=1, h=2, rows=4, n=20, n_exact=4)
    xk, xv, xb = c.exact
    with pytest.raises(ValueError, match="as many"):
        launch.paged_decode(*c.args(), exact=((xk[:, :, :2], xk[:, :, 2:]), (xv,), xb))
    with pytest.raises(TypeError, match="floating point"):
        launch.paged_decode(*c.args(), exact=(xk.to(torch.int32), xv.to(torch.int32), xb))
    with pytest.raises(ValueError, match="xbias"):
        launch.paged_decode(*c.args(), exact=((xk[:, :, :2],), (xv[:, :, :2],), xb))
    with pytest.raises(ValueError, match="device"):
        launch.paged_decode(*c.args(), exact=(xk.to("meta"), xv.to("meta"), xb))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("subnormal", [False, True])
def test_fp8_norms_every_byte(impl, subnormal):
    """Key norms and value scales stored as float8 e4m3 taking every finite byte (subnormals, zeros, both signs of
    the values' scales), or only the subnormal ones (then they alone make the output): contiguous, the kernel's
    conversion (8 at a time where it can) reads them as torch does."""
    c = Case("tq3-tq2", b=1, h=2, rows=4, n=254, masked=False)
    every = torch.tensor([x for x in range(256) if x & 0x7F != 0x7F and not (subnormal and x & 0x78)],
                         dtype=torch.uint8)  # 254 bytes (NaNs left out), or the 16 with a zero exponent
    g = torch.Generator().manual_seed(5)
    for codes, fields, name, magnitude in ((c.kcodes, c.kf, "norm", True), (c.vcodes, c.vf, "norm", False)):
        byte = every[torch.randint(len(every), (254,), generator=g)].repeat(1, 2, 1)
        if magnitude:  # key norms are magnitudes: the sign bit cleared
            byte = byte & 0x7F
        f8 = byte.view(torch.float8_e4m3fn)
        codes.fields[name] = f8
        fields[name] = type(fields[name]).of(f8)
    close(_run(c, impl), c.reference(), TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["tq4-uni3", *CYCLED_PAIRS, "vq3-vq2c8", "vq4-vq3"])
def test_long_items_rescale_online(name, impl):
    """Items longer than one pass, with the largest logits late (the running max grows: online rescaling, of every
    accumulator of cycled values; grouped codes of both roles)."""
    c = Case(name, b=1, h=2, rows=4, n=3000, masked=False)
    big = c.kcodes.fields["norm"].clone()
    big[..., 2500:] *= 3
    c.kf["norm"] = type(c.kf["norm"]).of(big)
    c.kcodes.fields["norm"] = big
    close(_run(c, impl, split_tokens=3000), c.reference(), TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_softmax_to_float_rounding(impl):
    """The kernel's exp (a degree-6 polynomial, relative error < 2e-7) and softmax against float64: with every coded
    token masked the output is the exact tokens' attention alone, within fp32 rounding (5.8e-7 of the output
    scale measured; a wrong polynomial constant, 1/24 -> 1/25, gives 7.9e-6)."""
    c = Case("tq3-tq2", b=1, h=2, rows=4, d=64, n=40, n_exact=200, masked=False, seed=5)
    c.bias = torch.full((1, 40), float("-inf"))
    xk, xv, xb = c.exact
    s = torch.einsum("bhrd,bhnd->bhrn", c.q.double(), xk.double()) + xb.double()  # logits of std ~2.4
    want = torch.einsum("bhrn,bhnd->bhrd", torch.softmax(s, -1), xv.double())
    got = _run(c, impl).double()
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_items_and_rows(impl):
    """A sequence whose codes are all masked, items of masked tokens only, a row that sees no exact token."""
    c = Case("qjl-outliers-uni2", b=2, h=3, rows=4, n=200, masked=False, n_exact=4)
    c.bias = torch.zeros(2, 200)
    c.bias[1, :150] = float("-inf")
    c.bias[0] = float("-inf")
    c.exact[2][1, 1, 2, :] = float("-inf")  # sequence 1 sees some codes: this row still sees tokens
    close(_run(c, impl, split_tokens=64), c.reference(), TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_norms_and_scales_read_in_their_dtype(impl, dtype):
    from qjl.codecs.tokenwise import TokenwiseQuantizer
    from qjl.codecs.turboquant import TurboQuantMSE

    for kc, vc in ((TurboQuantMSE(64, 3, norm_dtype=dtype), TokenwiseQuantizer(64, 2, scale_dtype="fp32" if dtype == "fp8" else dtype)),
                   (TurboQuantMSE(64, 4), TurboQuantMSE(64, 2, norm_dtype=dtype))):
        c = Case("tq3-tq2", b=1, h=2, rows=3, n=90, masked=False)
        c.kc, c.vc = kc, vc
        c.kcodes, c.vcodes = kc.quantize(c.k), vc.quantize(c.v)
        c.kf, c.vf = fields_of(c.kcodes), fields_of(c.vcodes)
        close(_run(c, impl), c.reference(), TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_every_half_precision_scalar_is_read_exactly(dtype):
    """Every finite fp16/bf16/fp8 bit pattern (normal, subnormal, zero, negative) reads as torch reads it:
    one sequence per pattern holding one token whose value is ``scale * 1`` (8 one-bit codes, centroid 1),
    so the attention output is the stored scale itself, bit for bit."""
    from qjl.codecs.turboquant import TurboQuantMSE
    from qjl.kernels.paged import PagedField

    if dtype == torch.float8_e4m3fn:
        pattern = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    else:
        pattern = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    scales = pattern[torch.isfinite(pattern.float())].reshape(-1, 1, 1)  # [B, H=1, N=1]

    class Values:  # a value codec view: v = scale * centroid, centroids (1, 1)
        def mix_view(self):
            from qjl.codecs.views import MixView, PackedCodes

            return MixView(PackedCodes("c", 1, 8, torch.ones(2)), 8, "scale")

        def unmix(self, o):
            return o

    b = scales.shape[0]
    kc = TurboQuantMSE(8, 2)
    kf = {n: PagedField.of(t) for n, t in kc.quantize(torch.randn(b, 1, 1, 8)).fields.items()}
    vf = {"c": PagedField.of(torch.zeros(b, 1, 1, 1, dtype=torch.uint8)), "scale": PagedField.of(scales)}
    bt = torch.arange(b, dtype=torch.int32)[:, None]
    out = launch.paged_decode(torch.zeros(b, 1, 1, 8), kc, kf, Values(), vf, bt, 1, torch.zeros(b, dtype=torch.int32),
                              torch.ones(b, dtype=torch.int32), impl="c")
    assert torch.equal(out[:, 0, 0, 0], scales.reshape(-1).float())
    assert torch.equal(out[:, 0, 0, 7], scales.reshape(-1).float())


def test_unreadable_codecs_and_bad_impl_are_refused():
    from qjl.codecs.polarquant import PolarQuant

    c = Case("tq3-tq2", b=1, h=1, rows=2, n=20)
    with pytest.raises(ValueError, match="impl"):
        launch.paged_decode(*c.args(), impl="fast")
    args = list(c.args())
    args[1] = PolarQuant(64)
    with pytest.raises(ValueError, match="does not read"):
        launch.paged_decode(*args)


def test_supports_needs_whole_bytes_of_codes():
    from qjl.codecs.tokenwise import TokenwiseQuantizer
    from qjl.codecs.turboquant import TurboQuantMSE

    assert kernels.supports(TurboQuantMSE(64, 3), TokenwiseQuantizer(64, 2))
    assert not kernels.supports(TurboQuantMSE(100, 3), TurboQuantMSE(100, 2))  # 100 % 8 != 0: reference path
    assert not kernels.supports(TurboQuantMSE(64, 3), TokenwiseQuantizer(64, 2, group_size=12))


def test_pick_backend(monkeypatch):
    from qjl.kernels.cpu import build

    assert kernels.pick_backend("cpu", "auto") == "cpu"
    assert kernels.pick_backend("cpu", "torch") == "torch"
    with pytest.raises(ValueError, match="kernel must be"):
        kernels.pick_backend("cpu", "cuda")
    with pytest.raises(ValueError, match="CPU tensors"):
        kernels.pick_backend("meta", "cpu")
    monkeypatch.setattr(build, "load", lambda: None)  # no C build: the reference
    assert kernels.pick_backend("cpu") == "torch"
    with pytest.raises(ValueError, match="C compiler"):
        kernels.pick_backend("cpu", "cpu")


def test_implementation_names():
    assert launch.implementation() == "c" and launch.simd_path() in ("amx", "int", "avx2", "portable")
    assert set(launch.IMPLS) == {"c", "c-int", "c-amx", "c-portable"}
    assert launch.default_impl() in ("c", "c-int", "c-amx")


def test_int_path_refused_where_the_cpu_lacks_it(monkeypatch):
    """On a CPU without AVX-512 VBMI / VNNI: "auto" runs the fp32 path, "c-int" and "c-amx" are refused by name;
    without AMX, "auto" runs "c-int" and "c-amx" is refused."""
    monkeypatch.delenv("QJL_CPU_IMPL", raising=False)
    monkeypatch.setattr(launch, "has_int_path", lambda: False)
    monkeypatch.setattr(launch, "has_amx_path", lambda: False)
    assert launch.default_impl() == "c"
    c = Case("tq3-tq2", b=1, h=1, rows=2, n=20)
    for impl in ("c-int", "c-amx"):
        with pytest.raises(ValueError, match="AVX-512"):
            launch.paged_decode(*c.args(), impl=impl)
    close(launch.paged_decode(*c.args(), impl="auto"), c.reference(), TOL)
    monkeypatch.setattr(launch, "has_int_path", lambda: True)
    assert launch.default_impl() == "c-int"
    with pytest.raises(ValueError, match="AMX"):
        launch.paged_decode(*c.args(), impl="c-amx")


@pytest.mark.parametrize("impl", IMPLS_HERE)
@pytest.mark.parametrize("odtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_mean", [False, True])
def test_decode_call_equals_decode_step(impl, odtype, with_mean, monkeypatch):
    """A kept DecodeCall (the transformers cache's decode step): equal bit for bit to paged_decode_step, then + the
    value mean in float32 and ``.to(dtype)``, call after call with segments whose address and length change (a
    window reallocated at each append), a segment that empties, a raw bf16 query scaled in the call."""
    from qjl.kernels.paged import FieldMap

    monkeypatch.setenv("QJL_CPU_IMPL", impl)
    c = Case("tq3-tq2", b=2, h=2, rows=4, n=77, n_exact=5, seed=3, masked=False)
    q, kc, kf, vc, vf, bt, bs, start, end = c.args()
    kf, vf = FieldMap(kf), FieldMap(vf)
    xk, xv, _ = c.exact
    g = torch.Generator().manual_seed(9)
    mean = torch.randn(2, 2, 64, generator=g) if with_mean else None
    step = launch.DecodeStep(bt, bs, start, end, segments=2)
    qr = (q * 3).bfloat16()
    call = launch.DecodeCall(qr, kc, kf, vc, vf, step, mean=mean)
    assert call.served
    for n_win in (3, 1, 0, 4):
        sinks = (xk[:, :, :1].half(), xv[:, :, :1].half())
        win = (xk[:, :, 1:1 + n_win].clone().half(), xv[:, :, 1:1 + n_win].clone().half())
        want = launch.paged_decode_step(qr, kc, kf, vc, vf, step, segments=(sinks, win), q_scale=0.37)
        if mean is not None:
            want = want + mean[:, :, None]
        out = torch.full((2, 2, 4, 64), 7.0, dtype=odtype)
        got = call(qr, (sinks, win), q_scale=0.37, out=out)
        assert got is out and torch.equal(got, want.to(odtype)), n_win


def test_decode_call_bad_input():
    """Wrong query, output, segments or scale: a ValueError naming the argument; a buffer moved since the build is
    refused; a step with exact rows, plain dict fields or a mean of the wrong shape/dtype refused at the build."""
    from qjl.kernels.paged import FieldMap

    c = Case("tq3-tq2", b=2, h=2, rows=4, n=40, n_exact=5, masked=False)
    q, kc, kf, vc, vf, bt, bs, start, end = c.args()
    fkf, fvf = FieldMap(kf), FieldMap(vf)
    xk, xv, _ = c.exact
    step = launch.DecodeStep(bt, bs, start, end, segments=1)
    with pytest.raises(TypeError, match="FieldMaps"):
        launch.DecodeCall(q, kc, kf, vc, vf, step)
    for bad in (torch.zeros(2, 2, 64, dtype=torch.float16), torch.zeros(2, 1, 64), torch.zeros(2, 64, 2).mT):
        with pytest.raises(ValueError, match="mean must be"):
            launch.DecodeCall(q, kc, fkf, vc, fvf, step, mean=bad)
    with pytest.raises(ValueError, match="q must be"):
        launch.DecodeCall(q.double(), kc, fkf, vc, fvf, step)
    rows, fields, _ = _paged_exact(c)
    with pytest.raises(ValueError, match="without exact rows"):
        launch.DecodeCall(q, kc, fkf, vc, fvf, launch.DecodeStep(bt, bs, start, end, rows=rows))
    call = launch.DecodeCall(q, kc, fkf, vc, fvf, step)
    out = torch.empty(2, 2, 4, 64)
    seg = ((xk, xv),)
    call(q, seg, q_scale=0.5, out=out)
    for bad_q in (q[:1], q.half(), q.transpose(2, 3).contiguous().transpose(2, 3)):
        with pytest.raises(ValueError, match="q must be"):
            call(bad_q, seg, q_scale=0.5, out=out)
    for bad_out in (out[:1], out.double(), torch.empty(2, 2, 64, 4).mT):
        with pytest.raises(ValueError, match="out must be"):
            call(q, seg, q_scale=0.5, out=bad_out)
    for bad in (float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="q_scale"):
            call(q, seg, q_scale=bad, out=out)
    with pytest.raises(ValueError, match="segments must be"):
        call(q, (seg[0], seg[0]), q_scale=0.5, out=out)
    with pytest.raises(ValueError, match=r"segments\[0\] v"):
        call(q, ((xk, xv[:1]),), q_scale=0.5, out=out)
    buf = next(iter(fkf.values())).buffer
    before = out.clone()
    buf.resize_(buf.numel() * 2)  # a buffer reallocated in place (its address changes)
    with pytest.raises(ValueError, match="moved"):
        call(q, seg, q_scale=0.5, out=out)
    assert torch.equal(out, before)  # nothing written


@pytest.mark.parametrize("name", [*CYCLED_PAIRS, *GROUPED_PAIRS])
def test_cycled_values_through_the_decode_call(name):
    """The transformers cache's call (a kept DecodeCall: a raw bf16 query scaled in the call, sinks and window
    segments, a value mean added in the call) mixes values over rotations in turn and reads vector codebooks' codes
    (GROUPED_PAIRS) as paged_decode_step does, bit for bit, and as the reference does, within TOL."""
    from qjl.kernels.paged import FieldMap
    from qjl.kernels.reference import paged_decode_reference

    c = Case(name, b=2, h=2, rows=6, n=77, n_exact=5, seed=3, masked=False, ragged=True)
    q, kc, kf, vc, vf, bt, bs, start, end = c.args()
    kf, vf = FieldMap(kf), FieldMap(vf)
    xk, xv, _ = c.exact
    mean = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(9))
    step = launch.DecodeStep(bt, bs, start, end, segments=2)
    qr = (q * 3).bfloat16()
    call = launch.DecodeCall(qr, kc, kf, vc, vf, step, mean=mean)
    segs = ((xk[:, :, :1].half(), xv[:, :, :1].half()), (xk[:, :, 1:].half(), xv[:, :, 1:].half()))
    got = call(qr, segs, q_scale=0.37, out=torch.empty(2, 2, 6, 64))
    want = launch.paged_decode_step(qr, kc, kf, vc, vf, step, segments=segs, q_scale=0.37) + mean[:, :, None]
    assert torch.equal(got, want)
    ref = paged_decode_reference(qr.float() * 0.37, kc, kf, vc, vf, bt, bs, start, end,
                                 exact=(xk.half().float(), xv.half().float(), None))
    close(got, ref + mean[:, :, None], TOL)


@pytest.mark.parametrize("name", ["tq3-tq2c8", "vq4-vq3", "vq2-tq3", "tq5-vq4"])
def test_fused_store_step_serves_vector_codebooks_and_rotations_in_turn(name):
    """DecodeStore (vLLM's store-and-decode step in one call, step.c) with a vector codebook's codec of either role or
    values over rotations in turn: pages and output equal bit for bit to the separate calls it replaces (the C store
    given the tokens' positions, then paged_decode_step with the new tokens as the exact segment)."""
    import dataclasses as dc

    from qjl.kernels.cpu.store import store_bounds
    from qjl.kernels.encode import encode_store, store_cpu
    from qjl.kernels.paged import FieldMap

    c = Case(name, b=2, h=2, rows=4, n=40, masked=False)
    q, kc, kf, vc, vf, bt, bs, start, end = c.args()
    twin = [FieldMap({k: dc.replace(f, buffer=f.buffer.clone()) for k, f in fm.items()}) for fm in (kf, vf)]
    kf, vf = FieldMap(kf), FieldMap(vf)
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, 2, 64, generator=g), torch.randn(2, 2, 64, generator=g)
    positions = (end - 1).long()  # each sequence's last code: its new token
    blocks = bt.long()[torch.arange(2), positions // bs]
    bounds = store_bounds(blocks, positions % bs)
    step = launch.DecodeStep(bt, bs, start, end - 1, segments=1)
    store, _ = encode_store([(kc, key, kf["codes"], kf["norm"]), (vc, value, vf["codes"], vf["norm"])])
    fused = launch.DecodeStore(q, kc, kf, vc, vf, step, store)
    assert fused.served and store.positional == (vc.cycles > 1)
    rc, _, got, _, _ = fused(q, key, value, step, bounds, q_scale=0.5, positions=positions)
    assert rc == 0
    tk, tv = twin
    store_cpu([(kc, key, tk["codes"], tk["norm"]), (vc, value, tv["codes"], tv["norm"])], *bounds[:2],
              positions=positions)
    want = launch.paged_decode_step(q, kc, tk, vc, tv, launch.DecodeStep(bt, bs, start, end - 1, segments=1),
                                    segments=((key, value),), q_scale=0.5)
    assert torch.equal(got, want)
    for a, b in ((kf, tk), (vf, tv)):
        assert all(torch.equal(a[n].buffer, b[n].buffer) for n in a)


def test_groups_the_kernel_cannot_read_are_refused():
    """Grouped codes outside what the kernel reads -- g not 2, 4 or 8 (whole joint codes in each run of 8 codes), a
    joint code wider than a byte, a codebook that is not [2^(g b) g] -- are refused by name before the call (keys
    and values), and the C kernel itself refuses such a view (code -1) where a struct carries one."""
    from qjl.kernels.paged import FieldMap

    c = Case("vq4-vq3", b=1, h=1, rows=2, n=40, masked=False)
    assert kernels.supports(c.kc, c.vc, "cpu") and "cpu" in kernels.GROUPED_BACKENDS
    vp, kp = c.vc.mix_view().codes, c.kc.score_view().terms[0].codes
    for packed in (dataclasses.replace(vp, group=4),                        # 4 x 3 bits: 12-bit joint codes
                   dataclasses.replace(vp, centroids=vp.centroids[:-2])):  # a codebook too short
        with pytest.raises(ValueError, match=r"value_codec TurboQuantVQ\(.*g at a time"):
            launch.paged_decode(*_replace_args(c, vc=Recoded(c.vc, lambda p, x=packed: x)))
    threes = _with_codecs(Case("tq3-tq2", b=1, h=1, rows=2, d=48, n=40, masked=False), TurboQuantMSE(48, 3),
                          Regrouped(TurboQuantMSE(48, 2), 3, 0))  # 6-bit joint codes of 3 fields: across 8-code runs
    with pytest.raises(ValueError, match=r"value_codec TurboQuantMSE\(.*g at a time.*got g 3 x 2 bits"):
        launch.paged_decode(*threes.args())
    bad = dataclasses.replace(kp, group=8)  # 8 x 4 bits
    with pytest.raises(ValueError, match=r"key_codec TurboQuantVQ\(.*g at a time"):
        launch.paged_decode(*_replace_args(c, kc=Recoded(c.kc, lambda p: bad)))
    q, kc, kf, vc, vf, bt, bs, start, end = c.args()
    step = launch.DecodeStep(bt, bs, start, end)
    for part in ("value", "key"):
        call = launch.DecodeCall(q, kc, FieldMap(kf), vc, FieldMap(vf), step)
        (call.c.value if part == "value" else call.c.key[0]).group = 3
        with pytest.raises(ValueError, match="refused its arguments"):
            call(q, (), q_scale=1.0, out=torch.empty(q.shape))


def _replace_args(c, **codecs):
    q, kc, kf, vc, vf, bt, bs, start, end = c.args()
    return q, codecs.get("kc", kc), kf, codecs.get("vc", vc), vf, bt, bs, start, end


@pytest.mark.parametrize("part", ["key", "value"])
def test_fused_store_step_refuses_grouped_views_in_c(part):
    """step.c's own check: a fused store step whose decode struct carries a grouped key term or value view that its
    store jobs do not code (scalar cells here) is refused before anything is read or stored (stage 0)."""
    from qjl.kernels.cpu.store import store_bounds
    from qjl.kernels.encode import encode_store
    from qjl.kernels.paged import FieldMap

    c = Case("tq3-tq2", b=2, h=2, rows=4, n=40, masked=False)
    q, kc, kf, vc, vf, bt, bs, start, end = c.args()
    kf, vf = FieldMap(kf), FieldMap(vf)
    g = torch.Generator().manual_seed(2)
    key, value = torch.randn(2, 2, 64, generator=g), torch.randn(2, 2, 64, generator=g)
    store, _ = encode_store([(kc, key, kf["codes"], kf["norm"]), (vc, value, vf["codes"], vf["norm"])])
    step = launch.DecodeStep(bt, bs, start, end - 1, segments=1)
    fused = launch.DecodeStore(q, kc, kf, vc, vf, step, store)
    bounds = store_bounds(torch.tensor([0, 1]), torch.tensor([39, 39]))
    assert fused(q, key, value, step, bounds)[0] == 0
    before = [f.buffer.clone() for f in (*kf.values(), *vf.values())]
    (fused.tpl.decode.key[0] if part == "key" else fused.tpl.decode.value).group = 2
    with pytest.raises(ValueError, match="the C step refused its arguments"):
        fused(q, key * 2, value * 2, step, bounds)
    assert all(torch.equal(b, f.buffer) for b, f in zip(before, (*kf.values(), *vf.values())))
