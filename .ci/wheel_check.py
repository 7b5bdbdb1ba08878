"""Run from a fresh virtual environment where qjl was installed from its wheel (see .ci/run):
the package imports from that environment, its C source shipped, and a decode picks the C kernel
and agrees with the reference path."""

import os
import sys
from pathlib import Path

import torch

import qjl
from qjl.cache.attention import attend
from qjl.cache.storage import LayerStore
from qjl.kernels.cpu import build, launch

here = Path(qjl.__file__).resolve()
assert "site-packages" in str(here) and "/src/qjl" not in str(here), f"qjl imported from {here}, not the wheel"
missing = [s.name for s in build.SOURCES if not s.exists()]
assert not missing, f"the wheel lacks {missing}"
assert launch.implementation() == "c", "the C kernel did not build from the wheel"

torch.manual_seed(0)
k, v, q = torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64), torch.randn(1, 6, 1, 64)
outs = {}
for kernel in ("auto", "torch"):
    store = LayerStore(0, qjl.QJLConfig.preset("tq-k45v3", kernel=kernel), num_layers=2)
    store.append(k, v)
    store.flush()
    print(kernel, "->", store.backend, "| default CPU path:", launch.default_impl())
    if kernel == "torch":
        want = attend(store, q, None, 64 ** -0.5)
        continue
    assert store.backend == "cpu", f"the wheel's cache picked {store.backend!r}, not the C kernel"
    for impl in ("c", launch.default_impl()):  # the CPU kernel's fp32 path and its default (c-int where it can)
        os.environ["QJL_CPU_IMPL"] = impl
        outs[impl] = attend(store, q, None, 64 ** -0.5)
# fp32 sums: 1e-4; the integer path: its int8 / int16 rounding (decode_vnni.c), 2e-3 of the values' scale
for impl, out in outs.items():
    tol = 1e-4 if impl == "c" else 2e-3 * v.abs().max().item()
    err = (out - want).abs().max().item()
    assert err <= tol, (impl, err)
# the vector-search extension (scan + encoder) builds from the wheel's sources and matches its torch reference
from qjl.core.lloyd_max import sphere_codebook  # noqa: E402
from qjl.search.encode import encode_lloyd_max, encode_lloyd_max_torch  # noqa: E402
from qjl.search.scan import c_available  # noqa: E402

assert c_available(), "the search C extension did not build from the wheel"
y, book = torch.nn.functional.normalize(torch.randn(33, 384), dim=1), sphere_codebook(384, 3)
assert torch.equal(encode_lloyd_max(y, book, 3, rbits=1)[0], encode_lloyd_max_torch(y, book, 3, rbits=1)[0])
print("wheel check ok:", here.parent, "| python", sys.version.split()[0])
