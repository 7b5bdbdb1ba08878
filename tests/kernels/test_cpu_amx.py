"""The integer path on AMX tiles (``impl="c-amx"``, ``decode_amx.c``) against the integer path on vpdpbusd /
vpdpwssd (``impl="c-int"``): the same int32 sums, so the same outputs bit for bit, whatever the codecs, head dims
(partial key blocks, keys past the tiles' 384 coordinates), GQA groups, block layouts, pass lengths, masks and
threads.  ``c-int`` itself is held to a torch model of its arithmetic in test_cpu_int.py.  Skipped where the CPU
has no AMX-TILE / AMX-INT8 (the tests then cannot tell the engines apart)."""

import pytest
import torch

from kernel_cases import CYCLED_PAIRS, PAIRS, Case
from qjl.kernels.cpu import launch

if not launch.available():  # pragma: no cover - no C compiler / cffi here
    pytest.skip("the C kernel does not build here", allow_module_level=True)
if not launch.has_amx_path():  # pragma: no cover - CPUs without AMX
    pytest.skip("this CPU lacks AMX-TILE / AMX-INT8 (impl='c-amx')", allow_module_level=True)


def _both(c, fields=None, **kw):
    """(c-int, c-amx) outputs of one case; `fields`: (key fields, value fields, block table, block size)."""
    args = list(c.args())
    if fields is not None:
        args[2], args[4], args[5], args[6] = fields
    run = [launch.paged_decode(*args, exact=c.exact, code_bias=c.bias, impl=impl, **kw) for impl in ("c-int", "c-amx")]
    assert torch.isfinite(run[0]).all() or not torch.isfinite(c.q).all()
    return run


@pytest.mark.parametrize("name", PAIRS)
@pytest.mark.parametrize("d,rows", [(64, 3), (128, 4), (128, 1), (24, 3), (64, 2), (80, 9), (256, 2), (384, 4),
                                    (448, 2)])
def test_amx_equals_the_int_path(name, d, rows):
    """Every codec pair (wider codes and QJL sign bits go through the fp32 path in both), head dims with a partial
    last key block (24, 80), 3-6 key blocks (256, 384) and past the tiles (448: keys on vpdpbusd, values on tiles),
    GQA groups of 1-9 rows (below 3 rows at head dims under 128 the kernel keeps vpdpbusd: (64, 2), and the
    last row of (80, 9)): equal."""
    if name == "qjl-outliers-uni2" and d == 24:
        pytest.skip("the outlier sketch needs d // 2 to be a multiple of 8")
    c = Case(name, b=2, h=2, rows=rows, d=d, n=301, n_exact=6, ragged=True, seed=d + rows)
    a, b = _both(c, split_tokens=128, threads=2)
    assert torch.equal(a, b)


@pytest.mark.parametrize("block_size", [7, 16, 61, 128])
@pytest.mark.parametrize("name", ["tq3-tq2", "tq4-uni3", "qjl-outliers-uni2"])
def test_amx_on_paged_pools(name, block_size):
    """Shuffled block pools whose blocks cut a pass into spans of odd lengths (the tiles take 16 keys and 64 values
    at a time, across spans): equal."""
    from paged_pool import paged_pool

    c = Case(name, b=2, h=3, rows=4, d=128, n=301, n_exact=5, ragged=True, seed=block_size)
    shared = {}
    if c.kcodes.shared:
        nb = -(-c.k.shape[2] // block_size)
        shared = {n: t.unsqueeze(2).expand(*t.shape[:2], nb, *t.shape[2:]) for n, t in c.kcodes.shared.items()}
    kf, table = paged_pool(dict(c.kcodes.fields), shared, None, block_size, block_size)
    vf, _ = paged_pool(dict(c.vcodes.fields), {}, None, block_size, block_size)
    a, b = _both(c, (kf, vf, table, block_size), split_tokens=128, threads=2)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", CYCLED_PAIRS)
@pytest.mark.parametrize("block_size", [0, 16])  # 0: contiguous codes
def test_amx_cycled_values(name, block_size):
    """Values over rotations in turn: "c-amx" mixes them on vpdpwssd as "c-int" does (keys on tiles where they
    qualify), from 3 rows (where tiles take the values at K = 1), contiguous and in blocks of 16: equal."""
    from paged_pool import paged_pool

    c = Case(name, b=2, h=2, rows=6, d=128, n=301, n_exact=5, ragged=True, seed=11)
    fields = None
    if block_size:
        kf, table = paged_pool(dict(c.kcodes.fields), {}, None, block_size, block_size)
        vf, _ = paged_pool(dict(c.vcodes.fields), {}, None, block_size, block_size)
        fields = (kf, vf, table, block_size)
    a, b = _both(c, fields, split_tokens=100, threads=2)
    assert torch.equal(a, b)


@pytest.mark.parametrize("n,split", [(1, 0), (15, 0), (17, 0), (63, 0), (65, 0), (511, 0), (513, 0), (3000, 3000),
                                     (3000, 700)])
def test_amx_pass_lengths(n, split):
    """Runs of 1 token to several passes, lengths around the tiles' 16 keys and 64 values and the 512-token pass,
    one item or several per head: equal."""
    c = Case("tq3-tq2", b=1, h=2, rows=4, d=128, n=n, masked=False, seed=n)
    a, b = _both(c, split_tokens=split, threads=2)
    assert torch.equal(a, b)


def test_amx_masks_and_late_maxima():
    """Fully masked sequences and rows, a running max growing late (the accumulators rescaled): equal."""
    c = Case("tq4-uni3", b=1, h=2, rows=4, n=3000, masked=False)
    big = c.kcodes.fields["norm"].clone()
    big[..., 2500:] *= 3
    c.kf["norm"] = type(c.kf["norm"]).of(big)
    a, b = _both(c, split_tokens=3000)
    assert torch.equal(a, b)
    c = Case("tq3-tq2", b=2, h=3, rows=4, n=200, masked=False, n_exact=4)
    c.bias = torch.zeros(2, 200)
    c.bias[1, :150] = float("-inf")
    c.bias[0] = float("-inf")
    a, b = _both(c, split_tokens=64)
    assert torch.equal(a, b)


def test_amx_value_sums_at_their_largest():
    """Every weight the pass's largest (int16 32767: high byte 127, low byte 255) and every value code the largest
    centroid (int8 127) over full passes: 256 C_hi + C_lo at the int32 bound, equal to vpdpwssd's sums (a high
    byte taken signed, a missing shift or the halves swapped fail)."""
    c = Case("tq3-tq2", b=1, h=1, rows=4, d=128, n=2048, masked=False)
    c.kcodes.fields["codes"].fill_(0x5A)
    c.kcodes.fields["norm"].fill_(1.0)
    c.vcodes.fields["codes"].fill_(0xFF)
    a, b = _both(c, split_tokens=2048)
    assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_amx_non_finite_queries(bad):
    """A non-finite query row sends that key term through the fp32 path in both engines: equal (NaN where NaN)."""
    c = Case("tq3-tq2", b=1, h=1, rows=3, n=40, masked=False)
    c.q[0, 0, 1, 3] = bad
    a, b = _both(c)
    assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_amx_beside_torchs_own_tiles():
    """torch's oneDNN runs bf16 matmuls on the same threads' tiles: both keep their own configuration (ours is
    loaded per item and released after), so interleaved calls give what each gives alone."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=g).bfloat16(), torch.randn(256, 128, generator=g).bfloat16()
    mm_alone = x @ w
    c = Case("tq3-tq2", b=2, h=2, rows=4, d=128, n=700, masked=False)
    alone = launch.paged_decode(*c.args(), impl="c-amx", threads=2)
    for _ in range(3):
        assert torch.equal(x @ w, mm_alone)
        assert torch.equal(launch.paged_decode(*c.args(), impl="c-amx", threads=2), alone)


def test_amx_is_the_default_here(monkeypatch):
    monkeypatch.delenv("QJL_CPU_IMPL")  # the test suite runs the fp32 path by default (conftest)
    assert launch.simd_path() == "amx" and launch.default_impl() == "c-amx"
    c = Case("tq3-tq2", b=1, h=1, rows=2, n=20)
    assert torch.equal(launch.paged_decode(*c.args(), impl="auto"), launch.paged_decode(*c.args(), impl="c-amx"))
