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


def _declaration() -> str:
    """The exported prototype, read from the C source (so the two cannot drift apart)."""
    text = _SRC.read_text()
    start = text.index("int qjl_decode(")
    return text[start:text.index(")", start) + 1] + ";"


DECL = _declaration()


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
