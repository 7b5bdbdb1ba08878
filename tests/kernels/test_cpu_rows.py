"""The C kernel's decoded rows of paged codes (``rows.c``, :func:`qjl.kernels.cpu.launch.value_rows`): bit for bit
its torch reference, the reference the codecs' own dequantization, and bad arguments refused by name."""

import pytest
import torch

from qjl.codecs.outliers import OutlierQJL
from qjl.codecs.tokenwise import TokenwiseQuantizer
from qjl.codecs.turboquant import TurboQuantMSE
from qjl.codecs.vq import TurboQuantVQ
from qjl.integrations.vllm.paged import PagedField as PoolField
from qjl.integrations.vllm.paged import gather_history
from qjl.kernels.cpu import launch
from qjl.kernels.paged import PagedField

from paged_pool import paged_pool

pytestmark = pytest.mark.skipif(not launch.available(), reason="the C CPU kernels do not build here")

CODECS = {
    "tq1": lambda d: TurboQuantMSE(d, 1, seed=1),
    "tq2-fp8": lambda d: TurboQuantMSE(d, 2, seed=2, norm_dtype="fp8"),
    "tq3-corrected": lambda d: TurboQuantMSE(d, 3, seed=3, correct_norm=True),
    "tq4-bf16": lambda d: TurboQuantMSE(d, 4, seed=4, norm_dtype="bf16"),
    "tq5-fp32": lambda d: TurboQuantMSE(d, 5, seed=5, norm_dtype="fp32"),
    "tq6": lambda d: TurboQuantMSE(d, 6, seed=6),
    "tq7": lambda d: TurboQuantMSE(d, 7, seed=7),
    "tq8": lambda d: TurboQuantMSE(d, 8, seed=8),
    "uni2": lambda d: TokenwiseQuantizer(d, 2, group_size=32),
    "uni3": lambda d: TokenwiseQuantizer(d, 3, group_size=16),
    "uni4-one-group": lambda d: TokenwiseQuantizer(d, 4),
    # vector codebooks (PackedCodes.group > 1): 2 bits in fours, 3 and 4 bits in pairs
    "vq2": lambda d: TurboQuantVQ(d, 2, seed=9),
    "vq3-corrected": lambda d: TurboQuantVQ(d, 3, seed=10, correct_norm=True),
    "vq4-fp8": lambda d: TurboQuantVQ(d, 4, seed=11, norm_dtype="fp8"),
}


def _pool(codec, b=2, h=3, n=75, d=64, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, n, d, generator=g) * (0.5 + torch.rand(d, generator=g) * 2)
    codes = codec.quantize(x)
    fields, table = paged_pool(dict(codes.fields), {}, None, block_size, seed=seed)
    return codes, fields, table


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("d", [64, 80])
def test_rows_equal_reference_bit_for_bit(name, d):
    codec = CODECS[name](d)
    codes, fields, table = _pool(codec, d=d)
    for b, (start, end) in ((0, (0, 75)), (1, (5, 61)), (1, (16, 32)), (0, (74, 75))):
        got = launch.value_rows(codec, fields, table[b], 16, 3, start, end)
        want = launch.value_rows_reference(codec, fields, table[b], 16, 3, start, end)
        assert got.shape == (end - start, 3, d) and got.dtype == torch.float32
        assert torch.equal(got, want), (name, b, start, end, (got - want).abs().max())
    one = launch.value_rows(codec, fields, table[1], 16, 3, 3, 70, threads=1)
    assert torch.equal(one, launch.value_rows(codec, fields, table[1], 16, 3, 3, 70, threads=2))


@pytest.mark.parametrize("name", ["tq2-fp8", "tq3-corrected", "tq5-fp32", "uni2", "uni3", "vq2", "vq3-corrected"])
def test_reference_is_the_codecs_dequantization(name):
    """The rows, mapped back by the codec's unmix, are the codec's own dequantization of the same codes (TurboQuant
    in its rotated basis bit for bit); the reference reads through a shuffled block table, so a wrong block,
    head or slot would show."""
    codec = CODECS[name](64)
    codes, fields, table = _pool(codec)
    truth = codec.dequantize(codes)  # [B, H, N, D]
    for b in range(2):
        rows = launch.value_rows_reference(codec, fields, table[b], 16, 3, 0, 75)  # [N, H, n]
        if isinstance(codec, TurboQuantMSE):
            assert torch.equal(rows, codec.rotated(codes)[b].transpose(0, 1))
        back = codec.unmix(rows) if codec.mix_view().rotated else rows
        assert torch.allclose(back, truth[b].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_gather_history_token_major_and_codec_agree():
    """gather_history (C rows, then the unmix as a matrix) against each codec's dequantization; keys without a
    mix view (QJL with outlier channels) go through the codec; token_major is the transpose."""
    d, h, n, bs = 64, 3, 75, 16
    kc, vc = OutlierQJL(d, 2 * d, n_outliers=8, outlier_sketch_dim=d // 2, seed=3), TurboQuantMSE(d, 3, seed=2)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g)
    kcodes, vcodes = kc.quantize(k), vc.quantize(v)
    nb = -(-n // bs)
    shared = {"outlier_idx": kcodes.shared["outlier_idx"][:, :, None].expand(1, h, nb, -1)}  # one set, every block
    kf, table = paged_pool(dict(kcodes.fields), shared, None, bs, seed=2)
    vf, _ = paged_pool(dict(vcodes.fields), {}, None, bs, seed=2)  # (the same seed: the same block table)
    fields = {f"{role}.{m}": PoolField(f.buffer, f.offset, f.stride_block, f.stride_head, f.stride_token, f.dtype,
                                       f.shape) for role, fs in (("key", kf), ("value", vf)) for m, f in fs.items()}
    dk, dv = gather_history((kc, vc), fields, table[0].long(), 7, 70, bs, h)
    assert dk.shape == dv.shape == (h, 63, d)
    assert torch.allclose(dv, vc.dequantize(vcodes)[0, :, 7:70], atol=1e-5, rtol=1e-5)
    assert torch.allclose(dk, kc.dequantize(kcodes)[0, :, 7:70], atol=1e-5, rtol=1e-5)
    tk, tv = gather_history((kc, vc), fields, table[0].long(), 7, 70, bs, h, token_major=True)
    assert torch.equal(tk, dk.transpose(0, 1)) and torch.equal(tv, dv.transpose(0, 1))
    with pytest.raises(ValueError, match="mix view"):  # QJL keys have no basis of their own to read rows in
        gather_history((kc, vc), fields, table[0].long(), 7, 70, bs, h, unmix=False)


@pytest.mark.parametrize("c_kernel", [True, False])
def test_gather_history_in_the_codecs_basis(c_kernel, monkeypatch):
    """``unmix=False``: the rows in each codec's own basis, bit for bit the torch reference's (the C kernel, and
    the reference itself where the kernel is not there), which the unmix maps back to the codec's dequantization."""
    from qjl.kernels.paged import unmix_matrix

    d, h, n, bs = 64, 3, 75, 16
    kc, vc = TurboQuantMSE(d, 3, seed=1, correct_norm=True), TurboQuantMSE(d, 2, seed=2)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g)
    kcodes, vcodes = kc.quantize(k), vc.quantize(v)
    kf, table = paged_pool(dict(kcodes.fields), {}, None, bs, seed=2)
    vf, _ = paged_pool(dict(vcodes.fields), {}, None, bs, seed=2)
    fields = {f"{role}.{m}": PoolField(f.raw_bytes(), f.offset, f.stride_block, f.stride_head, f.stride_token,
                                       f.dtype, f.shape)  # (the backend's fields read bytes, as vLLM's pages are)
              for role, fs in (("key", kf), ("value", vf)) for m, f in fs.items()}
    if not c_kernel:
        monkeypatch.setattr(launch, "available", lambda: False)
    rk, rv = gather_history((kc, vc), fields, table[0].long(), 7, 70, bs, h, token_major=True, unmix=False)
    for rows, codec, codes, role in ((rk, kc, kcodes, "key"), (rv, vc, vcodes, "value")):
        ref = launch.value_rows_reference(codec, {m: f for m, f in (kf if role == "key" else vf).items()},
                                          table[0], bs, h, 7, 70)
        assert torch.equal(rows, ref)
        back = (rows @ unmix_matrix(codec)).transpose(0, 1)
        assert torch.allclose(back, codec.dequantize(codes)[0, :, 7:70], atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_refused_by_name():
    codec = CODECS["tq3-corrected"](64)
    codes, fields, table = _pool(codec)
    row = table[0]
    ok = launch.value_rows(codec, fields, row, 16, 3, 0, 0)
    assert ok.shape == (0, 3, 64)
    with pytest.raises(ValueError, match="mix view"):
        launch.value_rows(OutlierQJL(64, 128, n_outliers=8, outlier_sketch_dim=32, seed=3), fields, row, 16, 3, 0, 5)
    with pytest.raises(ValueError, match="block_row"):
        launch.value_rows(codec, fields, row.float(), 16, 3, 0, 5)
    with pytest.raises(ValueError, match="start=5, end=4"):
        launch.value_rows(codec, fields, row, 16, 3, 5, 4)
    with pytest.raises(ValueError, match="end=81"):
        launch.value_rows(codec, fields, row, 16, 3, 0, 81)  # 5 blocks of 16 map 80 tokens
    for name, bad in (("block_size", 0), ("heads", True), ("start", -1), ("end", 2.0)):
        args = dict(block_size=16, heads=3, start=0, end=5)
        args[name] = bad
        with pytest.raises(ValueError, match=name):
            launch.value_rows(codec, fields, row, args["block_size"], args["heads"], args["start"], args["end"])
    with pytest.raises(ValueError, match=r"block_row: block indices must fit int32"):
        launch.value_rows(codec, fields, torch.tensor([0, 2**32 + 1, 2, 3, 4]), 16, 3, 0, 40)
    with pytest.raises(ValueError, match=r"block_row: the blocks"):
        launch.value_rows(codec, fields, torch.tensor([0, -1, 2, 3, 4]), 16, 3, 0, 40)
    with pytest.raises(ValueError, match=r"fields\['codes'\].*blocks up to"):
        launch.value_rows(codec, fields, torch.tensor([0, 10_000, 2, 3, 4]), 16, 3, 0, 40)
    with pytest.raises(ValueError, match=r"fields lacks the field\(s\) \['norm'\]"):
        launch.value_rows(codec, {"codes": fields["codes"]}, row, 16, 3, 0, 5)
    small = dict(fields, codes=PagedField(torch.zeros(100, dtype=torch.uint8), 0, 0, 0, 24, torch.uint8, (24,)))
    with pytest.raises(ValueError, match=r"fields\['codes'\]: offset/strides reach"):
        launch.value_rows(codec, small, row, 16, 3, 0, 5)


@pytest.mark.parametrize("name,d", [("tq3-corrected", 64), ("tq5-fp32", 80), ("tq2-fp8", 128), ("uni3", 64),
                                    ("vq2", 64), ("vq3-corrected", 80), ("vq4-fp8", 128)])
def test_unmixed_rows_and_outputs_in_place(name, d):
    """With ``unmix`` the rows are the reference's times the codec's unmix matrix (float32 sums in another order:
    within 1e-5 of the rows' scale); written into an fp16 / bf16 ``out``, they are the float32 result rounded as
    ``.to()`` rounds, bit for bit, and a slice of a larger buffer is written and nothing around it."""
    from qjl.kernels.paged import unmix_matrix

    codec = CODECS[name](d)
    codes, fields, table = _pool(codec, d=d)
    got = launch.value_rows(codec, fields, table[1], 16, 3, 5, 70, unmix=True)
    ref = launch.value_rows_reference(codec, fields, table[1], 16, 3, 5, 70).double()
    u = unmix_matrix(codec)
    want = ref if u is None else ref @ u.double()
    assert got.shape == (65, 3, d)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.allclose(got, codec.dequantize(codes)[1, :, 5:70].transpose(0, 1), atol=1e-5, rtol=1e-5)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        buf = torch.full((70, 4, d), 7.0, dtype=dtype)
        dst = buf[3:68, 1:]  # [65, 3, d]: token and head strides of the larger buffer
        back = launch.value_rows(codec, fields, table[1], 16, 3, 5, 70, unmix=True, out=dst)
        assert back is dst
        assert torch.equal(dst.view(torch.int16) if dtype != torch.float32 else dst,
                           got.to(dtype).view(torch.int16) if dtype != torch.float32 else got)
        outside = torch.ones_like(buf, dtype=torch.bool)
        outside[3:68, 1:] = False
        assert (buf[outside] == 7.0).all()


def test_bad_out_is_refused_by_name():
    codec = CODECS["tq3-corrected"](64)
    codes, fields, table = _pool(codec)
    for bad in (torch.empty(5, 3, 32), torch.empty(5, 3, 64, dtype=torch.int32), torch.empty(5, 3, 128)[..., ::2],
                "buffer"):
        with pytest.raises(ValueError, match="out must be"):
            launch.value_rows(codec, fields, table[0], 16, 3, 0, 5, unmix=True, out=bad)


def test_the_rotation_matrix_is_refused_for_a_map_that_is_not_orthogonal():
    """:func:`qjl.kernels.paged.rotation_matrix`: TurboQuant's unmix transposed; None where the unmix is the
    identity (token-wise values) or not orthogonal (a codec whose unmix also scales: the rotated basis would change
    the scores)."""
    from qjl.kernels.paged import rotation_matrix, unmix_matrix

    class Scaled(TurboQuantMSE):
        def unmix(self, o):
            return 2.0 * super().unmix(o)

    tq = TurboQuantMSE(64, 3, seed=1)
    assert torch.equal(rotation_matrix(tq), unmix_matrix(tq).T)
    assert rotation_matrix(TokenwiseQuantizer(64, 2, group_size=32)) is None
    assert rotation_matrix(Scaled(64, 3, seed=1)) is None


@pytest.mark.parametrize("cls", [TurboQuantMSE, TurboQuantVQ])
@pytest.mark.parametrize("cycles,d", [(3, 64), (8, 80)])
def test_cycled_rows_are_read_mapped_back(cycles, d, cls):
    """Values over K rotations in turn (TurboQuant ``cycles=K``, scalar or vector codebooks): with ``unmix`` each
    token's row is mapped back by its own rotation (code position t: the unmix matrix's rows [k n, (k + 1) n), k = t %
    K; the runs start mid-block and mid-cycle), the codec's dequantization within float32 rounding, and fp16 / bf16
    ``out`` rounded as ``.to()``; without ``unmix`` (rows in K bases) the kernel and its reference refuse such a codec
    by name."""
    codec = cls(d, 3, seed=3, cycles=cycles)
    codes, fields, table = _pool(codec, d=d)
    truth = codec.dequantize(codes)  # [B, H, N, D]: code position t by rotation t % K
    n = codec.mix_view().codes.length
    from qjl.kernels.paged import unmix_matrix

    u = unmix_matrix(codec).double()  # [K n, D]
    rotated = codec.rotated(codes).double()  # [B, H, N, n]: each token in its own rotation's basis
    for b, (start, end) in ((0, (0, 75)), (1, (5, 61)), (1, (17, 33))):
        got = launch.value_rows(codec, fields, table[b], 16, 3, start, end, unmix=True)
        assert got.shape == (end - start, 3, d)
        assert torch.allclose(got, truth[b, :, start:end].transpose(0, 1), atol=1e-5, rtol=1e-5)
        k = torch.arange(start, end) % cycles
        blocks = u.reshape(cycles, n, d)[k]  # [L, n, D]
        want = torch.einsum("hln,lnd->lhd", rotated[b, :, start:end], blocks)
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
        half = launch.value_rows(codec, fields, table[b], 16, 3, start, end, unmix=True,
                                 out=torch.empty(end - start, 3, d, dtype=torch.bfloat16))
        assert torch.equal(half.view(torch.int16), got.to(torch.bfloat16).view(torch.int16))
    for read in (launch.value_rows, launch.value_rows_reference):
        with pytest.raises(ValueError, match=rf"codec {cls.__name__}\(.*cycles=.*rotations in turn.*unmix=True"):
            read(codec, fields, table[0], 16, 3, 0, 5)


@pytest.mark.parametrize("name,d", [("vq2", 64), ("vq3-corrected", 80), ("vq4-fp8", 64)])
def test_grouped_rows_are_not_scalar_rows(name, d):
    """A vector codebook's rows (each group's g fields one joint code e, coordinate c ``centroids[e g + c % g]``): the C
    rows equal the reference bit for bit, and differ from what reading the fields as scalar codes (the group
    ignored) or combining them in reverse order gives -- so the bit-for-bit tests above fail for either misreading.
    Grouped codes the kernel cannot read (g not 2, 4 or 8, joint codes past a byte, a short codebook) are refused
    by name."""
    import dataclasses

    from qjl.core.packing import unpack_bits

    codec = CODECS[name](d)
    codes, fields, table = _pool(codec, d=d)
    got = launch.value_rows(codec, fields, table[1], 16, 3, 3, 70)
    assert torch.equal(got, launch.value_rows_reference(codec, fields, table[1], 16, 3, 3, 70))
    view = codec.mix_view()
    p, g = view.codes, view.codes.group
    idx = unpack_bits(codes.fields["codes"][1, :, 3:70], p.bits, p.length)  # [H, L, n]
    scale = codes.fields["norm"][1, :, 3:70].float().unsqueeze(-1)
    flipped = idx.reshape(*idx.shape[:-1], -1, g).flip(-1).reshape(idx.shape)
    for wrong in (dataclasses.replace(p, group=1).values(idx), p.values(flipped)):
        assert (scale * wrong).transpose(0, 1).sub(got).abs().max() > 0.1 * got.abs().max()

    class Misgrouped:  # the codec with its view's codes replaced
        def __init__(self, packed):
            self.packed = packed

        def mix_view(self):
            return dataclasses.replace(view, codes=self.packed)

        def __repr__(self):
            return "Misgrouped"

    for bad in (dataclasses.replace(p, group=3), dataclasses.replace(p, group=8),
                dataclasses.replace(p, centroids=p.centroids[:-1])):
        with pytest.raises(ValueError, match="Misgrouped.*g at a time"):
            launch.value_rows(Misgrouped(bad), fields, table[1], 16, 3, 3, 70)
