"""Build (once per machine) and load the C decode kernel ``cpu_kernel.c`` with cffi.

The shared object is compiled with the system C compiler (``-O3 -march=native -fopenmp``)
into ``$QJL_CACHE_DIR/ext/<hash>/`` (default ``~/.cache/qjl``) on first use, keyed by the
source, the flags, the Python version and the machine, then imported from there; later
processes load it without compiling.  When cffi or a compiler is missing, :func:`load`
returns None and :mod:`qjl.kernels.cpu` uses its numba kernel (same algorithm, scalar).
Set ``QJL_CPU_KERNEL=numba`` to force the numba kernel.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import sys
import tempfile
from pathlib import Path

__all__ = ["load", "DECL"]

_SRC = Path(__file__).with_name("cpu_kernel.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c99", "-fno-math-errno", "-fno-trapping-math"]
DECL = """
int qjl_decode(int kbits1, const uint8_t *c1, int64_t nb1, int64_t n1, const float *cent1, const void *norm1,
               int nkind1, const float *q1, int has2, int kbits2, const uint8_t *c2, int64_t nb2, int64_t n2,
               const float *cent2, const void *norm2, int nkind2, const float *q2, int vbits, const uint8_t *vc,
               int64_t nbv, int64_t nvn, const float *vcent, int64_t gs, int64_t ngroups, const void *vscale,
               const void *vzero, int skind, int has_zero, const float *bias, int has_bias, int64_t heads,
               int64_t bh_count, int64_t rchunks, int64_t n_tok, int64_t block, int64_t splits, float *out_m,
               float *out_l, float *out_o, int threads);
"""


def _cache_dir() -> Path:
    root = Path(os.environ.get("QJL_CACHE_DIR", Path.home() / ".cache" / "qjl"))
    source = _SRC.read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + sys.version.encode() + platform.machine().encode()
                         + platform.processor().encode()).hexdigest()[:16]
    return root / "ext" / key


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(target: Path, name: str) -> Path:
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(DECL)
    ffi.set_source(name, _SRC.read_text(), extra_compile_args=_FLAGS, extra_link_args=["-fopenmp"])
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target) as tmp:  # build aside, then move in atomically
        built = Path(ffi.compile(tmpdir=tmp, verbose=False))
        final = target / built.name
        os.replace(built, final)
    return final


@functools.lru_cache(maxsize=None)
def load():
    """The compiled module (``.lib.qjl_decode``, ``.ffi``), or None where it cannot be built."""
    if os.environ.get("QJL_CPU_KERNEL", "").lower() == "numba":
        return None
    name = "_qjl_cpu_kernel"
    target = _cache_dir()
    try:
        found = sorted(target.glob(f"{name}*.so")) + sorted(target.glob(f"{name}*.pyd"))
        path = found[0] if found else _build(target, name)
        return _import(path, name)
    except Exception:  # noqa: BLE001 - no cffi / compiler / OpenMP: the numba kernel takes over
        return None
