"""FieldMap: field maps whose checks and C arguments the CPU launchers keep between calls (the vLLM backend's
fields), and what keeps that safe: a frozen map, identity checks, buffers that moved."""

import pytest
import torch

from kernel_cases import Case, close
from qjl import kernels
from qjl.codecs import TurboQuantMSE
from qjl.kernels.cpu import launch
from qjl.kernels.paged import FieldMap, PagedField, role_fields

if not launch.available():  # pragma: no cover - no C compiler / cffi here
    pytest.skip("the C kernel does not build here", allow_module_level=True)


def test_a_fieldmap_cannot_change():
    fm = FieldMap({"key.codes": 1, "key.norm": 2, "value.codes": 3})
    for op in (lambda: fm.__setitem__("x", 1), lambda: fm.update(x=1), lambda: fm.pop("key.codes"),
               lambda: fm.clear(), lambda: fm.setdefault("x", 1), lambda: fm.popitem(),
               lambda: fm.__delitem__("key.codes")):
        with pytest.raises(TypeError, match="cannot change"):
            op()
    assert dict(fm) == {"key.codes": 1, "key.norm": 2, "value.codes": 3}
    part = role_fields(fm, "key")
    assert part == {"codes": 1, "norm": 2} and role_fields(fm, "key") is part  # built once, the same object
    assert role_fields(dict(fm), "value") == {"codes": 3}


def test_kept_arguments_follow_the_buffers():
    """Decoding through FieldMaps gives the plain maps' result; when a buffer is swapped for other codes in place
    (same tensor object, another storage) the kept C arguments are rebuilt, not reused with stale addresses."""
    c = Case("tq3-tq2", b=1, h=2, rows=3, n=64, seed=1)
    kf, vf = FieldMap(c.kf), FieldMap(c.vf)
    args = (c.q, c.kc, kf, c.vc, vf, c.block_table, c.block_size, c.start, c.end)
    want = launch.paged_decode(*c.args())
    close(launch.paged_decode(*args), want, 1e-6)
    close(launch.paged_decode(*args), want, 1e-6)  # from the kept arguments
    other = Case("tq3-tq2", b=1, h=2, rows=3, n=64, seed=2)  # the same codecs' shapes, other codes
    for name, f in c.kf.items():
        f.buffer.set_(other.kf[name].buffer.clone())  # the buffer moves: a new address
    c.kcodes = other.kcodes
    fresh = launch.paged_decode(c.q, c.kc, other.kf, c.vc, c.vf, c.block_table, c.block_size, c.start, c.end)
    close(launch.paged_decode(*args), fresh, 1e-6)


def test_kept_store_refuses_a_moved_buffer():
    """store_cpu with a memo keeps its C arguments; a buffer that moved since is refused, nothing stored."""
    codec = TurboQuantMSE(64, 3, seed=0)
    p = kernels.cpu_pass(codec)
    pool = torch.zeros(4, 2, 8, 24 + 2, dtype=torch.uint8)
    es = 1
    strides = (pool.stride(0) * es, pool.stride(1) * es, pool.stride(2) * es)
    codes_f = PagedField(pool, 0, *strides, torch.uint8, (24,))
    norm_f = PagedField(pool, 24, *strides, p.norm_dtype, ())
    memo = {}
    x = torch.randn(3, 2, 64)
    blocks, slots = torch.tensor([0, 1, 3]), torch.tensor([2, 7, 0])
    kernels.store_cpu([(codec, x, codes_f, norm_f)], blocks, slots, memo=memo)
    first = pool.clone()
    store = next(iter(memo.values()))
    kernels.store_cpu([(codec, x, codes_f, norm_f)], blocks, slots, memo=memo)
    assert next(iter(memo.values())) is store and torch.equal(pool, first)  # reused, the same bytes
    pool.set_(torch.zeros_like(pool))
    with pytest.raises(ValueError, match="moved"):
        kernels.store_cpu([(codec, x, codes_f, norm_f)], blocks, slots, memo=memo)
    assert not pool.any()
