"""Kernels over the compressed cache, and how one is picked.

Backends (:data:`BACKENDS`, defined here once):
    "torch"  -- the plain-PyTorch reference (:mod:`qjl.kernels.reference`);
    "cpu"    -- the C kernels for CPU tensors (:mod:`qjl.kernels.cpu`: compiled once per machine with cffi;
                an AVX2 path where the CPU has it, a portable one elsewhere);
    "triton" -- the Triton kernels for CUDA tensors (:mod:`qjl.kernels.triton`); they also run on CPU
                tensors under ``TRITON_INTERPRET=1`` (how the tests check them).
``pick_backend(device, "auto")`` gives "triton" on CUDA when Triton imports, "cpu" on the CPU when the C
build loads, else "torch".  Entry points: :func:`qjl.kernels.paged.paged_decode` (decode attention over
paged codes, one call per layer and step) and :mod:`qjl.kernels.encode` (codes from keys/values:
``quantize``, ``quantize_cpu``, their ``can_*`` tests and ``quantize_with(backend, ...)``, which picks among
them; also importable from here).
Which codecs a kernel reads is declared by the codecs themselves (:mod:`qjl.codecs.views`).
"""

from __future__ import annotations

import functools
import importlib
import os

__all__ = ["BACKENDS", "CYCLED_BACKENDS", "GROUPED_BACKENDS", "pick_backend", "cpu_available", "triton_usable", "supports", "paged_decode", "PagedField",
           "FieldMap", "PagedRows", "quantize", "can_quantize", "quantize_cpu", "can_quantize_cpu", "can_store_cpu",
           "encode_rows_cpu", "store_cpu", "cpu_pass", "quantize_with"]

BACKENDS = ("auto", "torch", "cpu", "triton")
_LAZY = {"paged_decode": "qjl.kernels.paged", "PagedField": "qjl.kernels.paged", "FieldMap": "qjl.kernels.paged",
         "PagedRows": "qjl.kernels.paged", "store_cpu": "qjl.kernels.encode", "quantize": "qjl.kernels.encode",
         "can_quantize": "qjl.kernels.encode", "quantize_cpu": "qjl.kernels.encode",
         "can_quantize_cpu": "qjl.kernels.encode", "can_store_cpu": "qjl.kernels.encode",
         "quantize_with": "qjl.kernels.encode",
         "encode_rows_cpu": "qjl.kernels.encode", "cpu_pass": "qjl.kernels.encode"}


def __getattr__(name):
    if name in _LAZY:  # imported on first use, then a plain attribute (no lookup per call in hot loops)
        value = globals()[name] = getattr(importlib.import_module(_LAZY[name]), name)
        return value
    raise AttributeError(f"module 'qjl.kernels' has no attribute {name!r}")


@functools.lru_cache(maxsize=None)
def _has(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False


def cpu_available() -> bool:
    """The C kernels run here: their build compiles (once per machine) and loads."""
    from qjl.kernels.cpu import build

    return build.load() is not None


def triton_usable(device) -> bool:
    """Triton runs on CUDA tensors, or anywhere under its interpreter."""
    if not _has("triton"):
        return False
    return getattr(device, "type", device) == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def pick_backend(device, requested: str = "auto") -> str:
    """The backend for tensors on ``device`` (a torch.device or its name); an explicit request that cannot run raises."""
    import torch

    if requested not in BACKENDS:
        raise ValueError(f"kernel must be one of {BACKENDS}, got {requested!r}")
    device = torch.device(device)
    if requested == "auto":
        if device.type == "cuda" and triton_usable(device):
            return "triton"
        if device.type == "cpu" and cpu_available():
            return "cpu"
        return "torch"
    if requested == "cpu":
        if device.type != "cpu":
            raise ValueError(f"kernel='cpu' needs CPU tensors, got {device}")
        if not cpu_available():
            raise ValueError("kernel='cpu' needs its C build: cffi and a C compiler with OpenMP")
    if requested == "triton" and not triton_usable(device):
        raise ValueError(f"kernel='triton' needs Triton and CUDA tensors (or TRITON_INTERPRET=1), got {device}")
    return requested


# the backends whose decode kernels mix value codes over rotations in turn (MixView.cycles > 1)
CYCLED_BACKENDS = ("cpu", "triton")
# the backends whose decode kernels read codes g at a time (vector codebooks: PackedCodes.group > 1)
GROUPED_BACKENDS = ("cpu", "triton")


def supports(key_codec, value_codec, backend: str | None = None) -> bool:
    """Whether the decode kernels read this pair of codecs (others use the reference path): both declare
    views (:func:`qjl.codecs.views.kernel_readable`), and, for values over rotations in turn (``cycles > 1``),
    ``backend``'s kernel mixes them (:data:`CYCLED_BACKENDS`; ``backend`` None: every kernel backend must), and
    for codes read g at a time (vector codebooks, ``PackedCodes.group > 1``) it reads them (:data:`GROUPED_BACKENDS`)."""
    from qjl.codecs.views import grouped, kernel_readable

    if not kernel_readable(key_codec, value_codec):
        return False
    wanted = ("cpu", "triton") if backend is None else (backend,)
    if value_codec.mix_view().cycles > 1 and not all(b in CYCLED_BACKENDS for b in wanted):
        return False
    if grouped(key_codec.score_view(), value_codec.mix_view()) and not all(b in GROUPED_BACKENDS for b in wanted):
        return False
    return True
