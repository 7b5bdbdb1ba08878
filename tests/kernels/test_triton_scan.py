"""The vector-search Triton scan (qjl.kernels.triton.scan) against the torch reference, through Triton's interpreter
(conftest sets TRITON_INTERPRET), or natively on a GPU with ``TRITON_INTERPRET=0`` (see kernel_cases.TRITON_DEVICE)."""

import pytest
import torch
from kernel_cases import TRITON_DEVICE as DEV

from qjl.search.scan import Layout, Segment, build_luts, scan_torch
from qjl.kernels.triton.scan import scan_triton, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@pytest.mark.parametrize("bits_list", [[1], [3], [4], [2, 1], [3, 1]])
def test_triton_scan_matches_reference(bits_list):
    coords, n, nq, k = 21, 150, 2, 7  # 21 * 3 bits = 8 bytes: a partial 3-byte word
    segs, off = [], 0
    for b in bits_list:
        nb = (coords * b + 7) // 8
        segs.append(Segment(off, nb, b, coords))
        off += nb
    lay = Layout(tuple(segs), off)
    codes = torch.randint(0, 256, (n, off), dtype=torch.uint8)
    luts = build_luts(lay, [torch.randn(nq, coords, 1 << b) for b in bits_list])
    factors, add = torch.rand(len(bits_list), n), torch.randn(n)
    ranges = torch.tensor([[[0, 60], [100, 150]], [[3, 9], [0, 0]]])
    s1, i1 = (t.cpu() for t in scan_triton(codes.to(DEV), lay, factors.to(DEV), add.to(DEV), luts.to(DEV),
                                             ranges.to(DEV), k, block=64))
    s2, i2 = scan_torch(codes, lay, factors, add, luts, ranges, k)
    fin = torch.isfinite(s2)
    assert torch.equal(fin, torch.isfinite(s1))
    assert torch.allclose(s1[fin], s2[fin], atol=1e-5 * float(luts.abs().max()) * off, rtol=0)
    assert torch.equal(i1, i2)


@pytest.mark.skipif(DEV.type != "cpu", reason="an Index keeps its codes on the CPU; its 'triton' backend is the interpreter's")
def test_index_triton_backend_matches_c():
    from qjl.search import Index

    x = torch.randn(200, 32)
    ix = Index.create(32, codec="tq-prod", bits=4)
    ix.add(x)
    q = torch.randn(2, 32)
    a, b = ix.search(q, 5, backend="triton"), ix.search(q, 5)
    assert torch.equal(a[1], b[1]) and torch.allclose(a[0], b[0], atol=1e-5)


def test_index_triton_backend_on_cpu_codes_is_refused_clearly(monkeypatch):
    """Natively (no interpreter) Triton cannot read the CPU codes an Index holds: a ValueError says so."""
    from qjl.search import Index

    ix = Index.create(32, codec="tq-prod", bits=4)
    ix.add(torch.randn(50, 32))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="triton"):
        ix.search(torch.randn(1, 32), 3, backend="triton")
