"""The C decode kernel's integer path (``impl="c-int"``: AVX-512 VBMI + VNNI) against a torch model of its arithmetic
and against the fp32 reference, at the error bound stated in ``decode_vnni.c``.

The torch model is the reference itself (``paged_decode_reference``) over codecs whose views carry what the integer
path computes: key queries rounded to int8 per row (scale max|q| / 127), key and value centroids rounded to int8
(scale max|c| / 127), for codes of <= 5 bits (wider codes and value groups that do not cover whole 32-coordinate
chunks go through the fp32 path, as in the kernel; so do a vector codebook's grouped codes, ``PackedCodes.group >
1``, except keys in pairs of 3-bit codes and in 8-bit joint codes, whose codewords' coordinates the integer path
rounds to one int8 grid).  What the model leaves out is the rounding of the softmax weights to int16 (|dw| <= W / 65534 per token, W
the pass's largest weight) and float sums in another order."""

from dataclasses import replace

import pytest
import torch

from kernel_cases import CYCLED_PAIRS, GROUPED_PAIRS, PAIRS, Case, close
from qjl.codecs.views import KeyTerm
from qjl.kernels.cpu import launch
from qjl.kernels.reference import paged_decode_reference

if not launch.available():  # pragma: no cover - no C compiler / cffi here
    pytest.skip("the C kernel does not build here", allow_module_level=True)
if not launch.has_int_path():  # pragma: no cover - CPUs without AVX-512 VBMI / VNNI
    pytest.skip("this CPU lacks AVX-512 VBMI / VNNI (impl='c-int')", allow_module_level=True)

MAX_BITS = 5


def _int8_grid(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the int8 grid of its last dim's max |x| / 127 (half to even, as lrintf)."""
    s = x.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(x * (1 / s)).clamp(-127, 127) * s


def _int(packed) -> bool:
    """Value codes the integer path mixes: scalar ones (group 1) of <= MAX_BITS bits (grouped codes: the fp32 loops)."""
    return packed.bits <= MAX_BITS and packed.group == 1


def _int_key(packed) -> bool:
    """Key codes the integer path scores: as values, and a vector codebook's pairs of 3-bit codes (6-bit joint codes)
    and 8-bit joint codes (pairs of 4-bit codes, fours of 2-bit codes), through int8 tables on the grid of all the
    codewords' coordinates; other grouped keys: fp32."""
    return _int(packed) or (packed.group, packed.bits) in ((2, 3), (2, 4), (4, 2))


class IntKeys:
    """A key codec as the integer path scores it (queries and centroids on int8 grids)."""

    def __init__(self, codec):
        self.codec = codec

    def score_view(self):
        v = self.codec.score_view()
        terms = tuple(KeyTerm(replace(t.codes, centroids=_int8_grid(t.codes.centroids)), t.norm)
                      if _int_key(t.codes) else t for t in v.terms)
        return replace(v, terms=terms)

    def score_queries(self, q, shared=None):
        qts = self.codec.score_queries(q) if shared is None else self.codec.score_queries(q, shared)
        terms = self.codec.score_view().terms
        return [_int8_grid(qt) if _int_key(t.codes) else qt for qt, t in zip(qts, terms)]

    def __getattr__(self, name):
        return getattr(self.codec, name)


class IntValues:
    """A value codec as the integer path mixes it (centroids on the int8 grid)."""

    def __init__(self, codec):
        self.codec = codec

    def mix_view(self):
        v = self.codec.mix_view()
        whole = v.groups == 1 or v.group_size % 32 == 0
        if not _int(v.codes) or not whole:
            return v
        return replace(v, codes=replace(v.codes, centroids=_int8_grid(v.codes.centroids)))

    def __getattr__(self, name):
        return getattr(self.codec, name)


def _model(c):
    args = list(c.args())
    args[1], args[3] = IntKeys(c.kc), IntValues(c.vc)
    return paged_decode_reference(*args, exact=c.exact, code_bias=c.bias)


def _run(c, **kw):
    return launch.paged_decode(*c.args(), exact=c.exact, code_bias=c.bias, impl="c-int", **kw)


def _within(got, want, tol, scale):
    err = (got - want).abs().max().item()
    assert torch.isfinite(got).all() and err <= tol * scale, (err, tol * scale)


@pytest.mark.parametrize("name", PAIRS + ["vq3-tq2", "vq4-tq2", "vq2-tq2"])
@pytest.mark.parametrize("d,rows", [(64, 3), (128, 4), (24, 1), (80, 9), (256, 2)])
def test_int_path_is_its_torch_model(name, d, rows):
    """Every codec pair (and keys in pairs of 3-bit codes), head dims with a partial last chunk (24, 80) and GQA
    groups of 1-9 rows: the kernel equals
    the model within the int16 weights' rounding (1e-3 of the values' scale; the int8 rounding itself is ~20-60x
    that on these peaked logits, so a wrong constant, table or unpacking fails)."""
    if name == "qjl-outliers-uni2" and d == 24:
        pytest.skip("the outlier sketch needs d // 2 to be a multiple of 8")
    c = Case(name, b=2, h=2, rows=rows, d=d, n=301, n_exact=6, ragged=True, seed=d + rows)
    _within(_run(c, split_tokens=128, threads=2), _model(c), 1e-3, c.v.abs().max().item())


@pytest.mark.parametrize("block_size", [7, 16, 61])
@pytest.mark.parametrize("name", ["tq3-tq2", "tq4-uni3", "qjl-outliers-uni2"])
def test_int_path_on_paged_pools(name, block_size):
    """Shuffled block pools (vLLM's layout) whose blocks cut passes into spans of odd lengths: the same model."""
    from paged_pool import paged_pool

    c = Case(name, b=2, h=3, rows=4, n=301, n_exact=5, ragged=True, seed=block_size)
    want = _model(c)
    shared = {}
    if c.kcodes.shared:  # one entry per block: the sequence's channels repeated
        nb = -(-c.k.shape[2] // block_size)
        shared = {n: t.unsqueeze(2).expand(*t.shape[:2], nb, *t.shape[2:]) for n, t in c.kcodes.shared.items()}
    kf, table = paged_pool(dict(c.kcodes.fields), shared, None, block_size, block_size)
    vf, _ = paged_pool(dict(c.vcodes.fields), {}, None, block_size, block_size)
    got = launch.paged_decode(c.q, c.kc, kf, c.vc, vf, table, block_size, c.start, c.end, exact=c.exact,
                              code_bias=c.bias, impl="c-int", split_tokens=128, threads=2)
    _within(got, want, 1e-3, c.v.abs().max().item())


@pytest.mark.parametrize("name", CYCLED_PAIRS)
@pytest.mark.parametrize("block_size", [0, 16])  # 0: contiguous codes
def test_int_path_cycled_values(name, block_size):
    """Values over rotations in turn (K = 8, 3) on the integer path: each residue's weights rounded to int16 on their
    own scale (a residue's largest weight, at most the pass's: the model's bound holds) and mixed on vpdpwssd into its
    accumulator, contiguous and in shuffled blocks of 16, with a ragged start, masks, GQA rows past RW and splits;
    and a running max growing late over passes of one item: the same model."""
    from paged_pool import paged_pool

    c = Case(name, b=2, h=2, rows=6, n=301, n_exact=6, ragged=True, seed=7)
    want = _model(c)
    if block_size:
        kf, table = paged_pool(dict(c.kcodes.fields), {}, None, block_size, block_size)
        vf, _ = paged_pool(dict(c.vcodes.fields), {}, None, block_size, block_size)
        got = launch.paged_decode(c.q, c.kc, kf, c.vc, vf, table, block_size, c.start, c.end, exact=c.exact,
                                  code_bias=c.bias, impl="c-int", split_tokens=100, threads=2)
    else:
        got = _run(c, split_tokens=100, threads=2)
    _within(got, want, 1e-3, c.v.abs().max().item())
    c = Case(name, b=1, h=2, rows=4, n=1500, masked=False)
    big = c.kcodes.fields["norm"].clone()
    big[..., 1200:] *= 3
    c.kf["norm"] = type(c.kf["norm"]).of(big)
    c.kcodes.fields["norm"] = big
    _within(_run(c, split_tokens=1500), _model(c), 1e-3, c.v.abs().max().item())


@pytest.mark.parametrize("name", GROUPED_PAIRS)
@pytest.mark.parametrize("block_size", [0, 7])  # 0: contiguous codes
def test_int_path_grouped_codes(name, block_size):
    """A vector codebook's grouped codes (``PackedCodes.group > 1``): keys in pairs of 3-bit codes and in 8-bit joint
    codes take the integer products through their int8 tables (the keys of vq3-vq2c8, vq4-vq3 and vq2-tq3); grouped
    values are mixed by the fp32 AVX2 loops while the other role's scalar codes keep the integer path (vq2-tq3: int16
    value weights; tq5-vq4: int8 keys), contiguous and in shuffled blocks of 7, GQA rows past RW, splits: the model
    (int8 grids where the integer path reads, else unrounded); with nothing on the integer path the result is "c"'s
    bit for bit; "c-amx" (where the CPU has tiles) gives "c-int"'s outputs bit for bit (grouped keys stay on
    vpdpbusd)."""
    from paged_pool import paged_pool

    c = Case(name, b=2, h=2, rows=6, n=301, n_exact=6, ragged=True, seed=11)
    want = _model(c)
    kf, vf, table, bs = c.kf, c.vf, c.block_table, c.block_size
    if block_size:
        kf, table = paged_pool(dict(c.kcodes.fields), {}, None, block_size, block_size)
        vf, _ = paged_pool(dict(c.vcodes.fields), {}, None, block_size, block_size)
        bs = block_size
    got = {impl: launch.paged_decode(c.q, c.kc, kf, c.vc, vf, table, bs, c.start, c.end, exact=c.exact,
                                     code_bias=c.bias, impl=impl, split_tokens=100, threads=2)
           for impl in ("c-int", "c-amx")[:1 + launch.has_amx_path()]}
    _within(got["c-int"], want, 1e-3, c.v.abs().max().item())
    if "c-amx" in got:
        assert torch.equal(got["c-amx"], got["c-int"])
    keys_int = any(_int_key(t.codes) for t in c.kc.score_view().terms)
    if not keys_int and not _int(c.vc.mix_view().codes):  # nothing for the integer path: the fp32 result
        assert torch.equal(got["c-int"], launch.paged_decode(c.q, c.kc, kf, c.vc, vf, table, bs, c.start, c.end,
                                                             exact=c.exact, code_bias=c.bias, impl="c",
                                                             split_tokens=100, threads=2))


def test_int_path_long_items_and_masks():
    """Items longer than a pass with the running max growing late, and fully masked items and rows."""
    c = Case("tq4-uni3", b=1, h=2, rows=4, n=3000, masked=False)
    big = c.kcodes.fields["norm"].clone()
    big[..., 2500:] *= 3
    c.kf["norm"] = type(c.kf["norm"]).of(big)
    c.kcodes.fields["norm"] = big
    _within(_run(c, split_tokens=3000), _model(c), 1e-3, c.v.abs().max().item())
    c = Case("tq3-tq2", b=2, h=3, rows=4, n=200, masked=False, n_exact=4)
    c.bias = torch.zeros(2, 200)
    c.bias[1, :150] = float("-inf")
    c.bias[0] = float("-inf")
    _within(_run(c, split_tokens=64), _model(c), 1e-3, c.v.abs().max().item())


def test_int_path_error_against_fp32():
    """Against the fp32 reference, logits of std 2 (a real model's range; the embedded model's KL did not move:
    docs/kernels.md): within 1.5% of the values' scale, the stated bound's order."""
    for name in ("tq3-tq2", "tq4-uni3", "qjl-uni2"):
        c = Case(name, b=2, h=2, rows=4, d=128, n=301, n_exact=6, ragged=True)
        c.q = c.q / (c.q @ c.k.transpose(-1, -2)).std() * 2
        _within(_run(c), c.reference(), 1.5e-2, c.v.abs().max().item())


def test_value_groups_not_covering_chunks_use_fp32():
    """Token-wise values in groups of 16 coordinates (not whole 32-code chunks) are mixed by the fp32 path."""
    from qjl.codecs.tokenwise import TokenwiseQuantizer

    c = Case("tq3-tq2", b=1, h=2, rows=3, n=90, masked=False)
    c.vc = TokenwiseQuantizer(64, 2, group_size=16)
    c.vcodes = c.vc.quantize(c.v)
    from kernel_cases import fields_of

    c.vf = fields_of(c.vcodes)
    want = paged_decode_reference(c.q, IntKeys(c.kc), c.kf, c.vc, c.vf, c.block_table, c.block_size, c.start, c.end)
    close(_run(c), want, 1e-4)  # the keys' int8 rounding is modelled; the values are fp32 sums


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_queries_take_the_fp32_path(bad):
    """A query row with a NaN or an inf: the term is scored in fp32 (they propagate as in the reference), not
    through an int8 conversion (which would give a finite, wrong row)."""
    c = Case("tq3-tq2", b=1, h=1, rows=2, n=40, masked=False)
    c.q[0, 0, 1, 3] = bad
    got = _run(c)
    want = paged_decode_reference(c.q, c.kc, c.kf, IntValues(c.vc), c.vf, c.block_table, c.block_size, c.start, c.end)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(want[..., 1, :]).all()
    _within(got[..., 0, :], want[..., 0, :], 1e-3, c.v.abs().max().item())  # fp32 keys, the values' int path


def test_impl_choice(monkeypatch):
    monkeypatch.delenv("QJL_CPU_IMPL")  # the test suite runs the fp32 path by default (conftest)
    amx = launch.has_amx_path()  # the same integers on AMX tiles (test_cpu_amx.py)
    assert launch.simd_path() == ("amx" if amx else "int") and launch.default_impl() == ("c-amx" if amx else "c-int")
    c = Case("tq3-tq2", b=1, h=1, rows=2, n=20)
    assert torch.equal(launch.paged_decode(*c.args(), impl="auto"), launch.paged_decode(*c.args(), impl="c-int"))


def test_impl_from_environment(monkeypatch):
    monkeypatch.setenv("QJL_CPU_IMPL", "c")
    assert launch.default_impl() == "c"
    monkeypatch.setenv("QJL_CPU_IMPL", "fast")
    with pytest.raises(ValueError, match="QJL_CPU_IMPL"):
        launch.default_impl()


def test_value_sums_at_their_largest_do_not_wrap():
    """The int32 value sums at their bound: every weight the pass's largest (equal scores: int16 32767), every value
    code the largest centroid (int8 127), one item over several full passes -- 32767 * 127 per token and lane, which
    a pass longer than 512 tokens would wrap past 2^31 (decode_vnni.c; tested to fail at 1024): as the reference."""
    c = Case("tq3-tq2", b=1, h=1, rows=4, d=128, n=2048, masked=False)
    c.kcodes.fields["codes"].fill_(0x5A)  # every key the same code and norm: equal scores
    c.kcodes.fields["norm"].fill_(1.0)
    c.vcodes.fields["codes"].fill_(0xFF)  # every value code 3: the largest 2-bit centroid
    got = launch.paged_decode(*c.args(), impl="c-int", split_tokens=2048)
    want = paged_decode_reference(*c.args())
    close(got, want, 1e-3)
