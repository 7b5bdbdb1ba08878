"""Stand-in for ``qjl.kernels.cpu.build.load_extension`` until the restructure lands (same signature).

Compiles ``sources`` with cffi once per machine into ``$QJL_CACHE_DIR/ext/<hash>/`` (keyed by
the sources, the flags, the Python version and the machine) and imports it from there; returns
None, with one warning, where cffi or a C compiler is missing.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import sys
import tempfile
import warnings
from pathlib import Path

__all__ = ["load_extension"]

_FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c99", "-fno-math-errno", "-fno-trapping-math")


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def _load(name: str, sources: tuple, cdef: str, flags: tuple):
    text = "\n".join(Path(s).read_text() for s in sources)
    root = Path(os.environ.get("QJL_CACHE_DIR") or Path.home() / ".cache" / "qjl")
    key = hashlib.sha256("\0".join([text, cdef, " ".join(flags), sys.version, platform.machine(),
                                    platform.processor()]).encode()).hexdigest()[:16]
    target = root / "ext" / key
    found = sorted(target.glob(f"{name}*.so")) + sorted(target.glob(f"{name}*.pyd"))
    if found:
        return _import(found[0], name)
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(cdef)
    ffi.set_source(name, text, extra_compile_args=list(flags), extra_link_args=["-fopenmp"])
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target) as tmp:  # build aside, move in atomically
        built = Path(ffi.compile(tmpdir=tmp, verbose=False))
        final = target / built.name
        os.replace(built, final)
    return _import(final, name)


def load_extension(name: str, sources: list, cdef: str, extra_compile_args=_FLAGS):
    """The compiled cffi module (``.lib``, ``.ffi``) or None (warned once) where it cannot be built."""
    try:
        return _load(name, tuple(str(s) for s in sources), cdef, tuple(extra_compile_args))
    except Exception as e:  # noqa: BLE001 - no cffi / compiler / OpenMP: callers fall back to torch
        warnings.warn(f"qjl: could not build the C extension {name} ({type(e).__name__}: {e}); "
                      "using the torch reference instead", RuntimeWarning, stacklevel=2)
        return None
