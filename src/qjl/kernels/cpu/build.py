"""Build (once per machine) and load C extensions with cffi: the decode kernel and any other C source.

``load_extension(name, sources, cdef)`` compiles the C ``sources`` (concatenated, in order, as one
translation unit) with the system C compiler (``-O3 -march=native -fopenmp``) into
``$QJL_CACHE_DIR/ext/<hash>/`` (default ``~/.cache/qjl``) on first use, keyed by the sources, the flags,
the Python version, the machine and the CPU's feature flags, then imports it from there; later
processes load it without compiling.  When cffi, a compiler, OpenMP or a source file is missing,
it returns None and warns once, so callers fall back to their next backend instead of raising.

:func:`load` is the CPU kernels' module: the decode (``decode.h`` shared declarations and helpers,
``decode_portable.c``, ``decode_avx2.c``, ``decode_vnni.c``, ``decode_amx.c``, ``decode.c`` the entry) and TurboQuant's bucketing
(``quantize.c``), the decoded rows of paged codes (``rows.c``) and a layer's whole decode step in one call
(``step.c``); ``QJL_CPU_KERNEL=off`` disables it (the cache then uses the torch reference).
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

__all__ = ["load", "load_extension", "declaration", "kernels_cdef", "DECODE_SOURCE", "SOURCES"]

_HERE = Path(__file__).parent
DECODE_SOURCE = _HERE / "decode.c"
SOURCES = tuple(_HERE / f for f in ("decode.h", "decode_portable.c", "decode_avx2.c", "decode_vnni.c", "decode_amx.c", "decode.c",
                                     "quantize.c", "rows.c", "step.c"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c99", "-fno-math-errno", "-fno-trapping-math")


def declaration(source: Path, function: str) -> str:
    """The prototype of ``function`` read from a C source (so the cdef and the C code cannot drift apart)."""
    text = Path(source).read_text()
    start = text.index(f"int {function}(")
    return text[start:text.index(")", start) + 1] + ";"


def cache_root() -> Path:
    return Path(os.environ.get("QJL_CACHE_DIR", Path.home() / ".cache" / "qjl"))


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> str:
    """The CPU's model and feature flags (``-march=native`` builds differ between CPUs)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor()


def _key(texts: list[str], flags: tuple) -> str:
    blob = "\0".join(texts) + " ".join(flags) + sys.version + platform.machine() + _cpu_flags()
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _built(target: Path, name: str) -> Path | None:
    found = sorted(target.glob(f"{name}*.so")) + sorted(target.glob(f"{name}*.pyd"))
    return found[0] if found else None


def _build(target: Path, name: str, code: str, cdef: str, flags: tuple) -> Path:
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(cdef)
    ffi.set_source(name, code, extra_compile_args=list(flags), extra_link_args=["-fopenmp"])
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target) as tmp:  # build aside, then move in atomically
        built = Path(ffi.compile(tmpdir=tmp, verbose=False))
        final = target / built.name
        os.replace(built, final)
    return final


@functools.lru_cache(maxsize=None)
def _load_cached(name: str, sources: tuple, cdef: str | None, flags: tuple):
    try:
        texts = [Path(s).read_text() for s in sources]
        cdef = cdef if cdef is not None else "\n".join(
            declaration(s, fn) for s in sources for fn in _exported(Path(s).read_text()))
        code = "\n".join(texts)
        target = cache_root() / "ext" / _key(texts + [cdef], flags)
        path = _built(target, name)
        if path is None:
            from qjl.core.locks import cache_lock

            with cache_lock(target):  # processes started together compile once; the others wait and load it
                path = _built(target, name) or _build(target, name, code, cdef, flags)
        return _import(path, name)
    except Exception as e:  # noqa: BLE001 - no source / cffi / compiler / OpenMP: the caller falls back
        warnings.warn(f"qjl: the C extension {name!r} could not be built or loaded ({type(e).__name__}: {e}); "
                      "falling back to the next kernel backend", RuntimeWarning, stacklevel=3)
        return None


def _exported(text: str) -> list[str]:
    """Functions marked ``QJL_EXPORT int name(`` in a C source."""
    out, pos = [], 0
    while (i := text.find("QJL_EXPORT int ", pos)) >= 0:
        j = text.index("(", i)
        out.append(text[i + len("QJL_EXPORT int "):j].strip())
        pos = j
    return out


def load_extension(name: str, sources, cdef: str | None = None, flags=FLAGS):
    """The compiled cffi module (``.lib``, ``.ffi``) of C ``sources`` (paths), or None (with one warning).

    ``cdef``: the declarations to export; by default the prototypes of every function marked
    ``QJL_EXPORT int f(...)`` in the sources (``#define QJL_EXPORT`` empty in C).
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be a Python identifier, got {name!r}")
    return _load_cached(name, tuple(str(s) for s in sources), cdef, tuple(flags))


def load():
    """The CPU kernels' module (``.lib.qjl_paged_decode``, ``.lib.qjl_bucket_norms``, ``.ffi``), or None
    where it cannot be built (one warning)."""
    return _load(os.environ.get("QJL_CPU_KERNEL", "").lower() == "off", os.environ.get("QJL_CACHE_DIR"))


@functools.lru_cache(maxsize=None)
def _load(off: bool, cache_dir):
    del cache_dir  # part of the key: another cache directory loads (or builds) its own copy
    return None if off else load_extension("_qjl_cpu_kernels", SOURCES, kernels_cdef())


@functools.lru_cache(maxsize=None)
def kernels_cdef() -> str | None:
    """The structs between ``cdef begin`` / ``cdef end`` in decode.h, and every exported prototype."""
    try:
        header = SOURCES[0].read_text()
        i, j = header.index("/* cdef begin"), header.index("/* cdef end */")
        structs = header[header.index("*/", i) + 2:j]
        protos = [declaration(s, fn) for s in SOURCES for fn in _exported(s.read_text())]
        return structs + "\n" + "\n".join(protos)
    except (OSError, ValueError):
        return None  # load_extension then warns about the missing source
