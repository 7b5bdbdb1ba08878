"""Attention and quantization kernels over the compressed cache, and how one is picked.

Backends:
    "torch"  -- the reference path of the codecs (dequantize / ``inner_product``, then matmul);
    "cpu"    -- :mod:`qjl.kernels.cpu`, the C build (numba where no compiler), for CPU tensors (decode attention);
    "triton" -- :mod:`qjl.kernels.triton.kernels`, for CUDA tensors (decode attention and
                quantization); it also runs on CPU tensors under ``TRITON_INTERPRET=1``
                (how the tests check it).
``pick_backend(device, "auto")`` gives "triton" on CUDA when Triton imports, "cpu" on the
CPU when its C build compiles or numba imports, else "torch".  The codecs the kernels read are listed by
:func:`qjl.kernels.plan.supports`; the cache falls back to "torch" for the rest.
"""

from __future__ import annotations

import functools
import os

import torch

from qjl.kernels.plan import (KeyPart, ValuePart, check_exact, key_parts, merge_apart, merge_partials, partial_exact, reference_partial, supports,
                   value_part)

__all__ = ["BACKENDS", "pick_backend", "decode_partial", "quantize", "can_quantize", "quantize_cpu", "can_quantize_cpu", "key_parts", "value_part",
           "reference_partial", "merge_partials", "merge_apart", "partial_exact", "supports", "KeyPart", "ValuePart"]

BACKENDS = ("auto", "torch", "cpu", "triton")


@functools.lru_cache(maxsize=None)
def _has(module: str) -> bool:
    try:
        __import__(module)
        return True
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False


def cpu_available() -> bool:
    """The CPU kernel runs: its C build compiles here (once per machine), or numba imports."""
    from qjl.kernels.cpu import build as cpu_build

    return cpu_build.load() is not None or _has("numba")


def triton_usable(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, or anywhere under its interpreter."""
    if not _has("triton"):
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def pick_backend(device: torch.device | str, requested: str = "auto") -> str:
    """The backend for tensors on ``device``; an explicit request that cannot run raises."""
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
            raise ValueError("kernel='cpu' needs a C compiler with cffi, or numba (pip install numba)")
    if requested == "triton" and not triton_usable(device):
        raise ValueError(f"kernel='triton' needs Triton and CUDA tensors (or TRITON_INTERPRET=1), got {device}")
    return requested


def decode_partial(backend: str, parts: list[KeyPart], vp: ValuePart, bias: torch.Tensor | None = None,
                   exact=None):
    """Partial softmax (m, l, o) of the code part; bias [B, N] or None (see :mod:`qjl.kernels.plan`).

    exact: None, or the exact tokens (qx [BH, R, D] query (not rotated), xk/xv [BH, n, D], xbias
    [BH, R, n] additive or None) to merge in: then returns (m, l, o, o_x) as :func:`plan.merge_apart`
    (the CPU kernel does this merge itself).
    """
    if backend not in ("torch", "cpu", "triton"):
        raise ValueError(f"backend must be 'torch', 'cpu' or 'triton' (see pick_backend), got {backend!r}")
    if exact is not None:
        check_exact(exact, parts[0].norm.shape[0], parts[0].q.shape[1])
    if backend == "cpu":
        from qjl.kernels.cpu import launch as cpu

        return cpu.decode_partial(parts, vp, bias, exact=exact)
    if backend == "triton":
        from qjl.kernels.triton import kernels as triton_kernels

        code = triton_kernels.decode_partial(parts, vp, bias)
    else:
        heads = parts[0].norm.shape[0] // (bias.shape[0] if bias is not None else 1)
        code = reference_partial(parts, vp, bias.repeat_interleave(heads, 0) if bias is not None else None)
    return code if exact is None else merge_apart(code, partial_exact(*exact))


def can_quantize(codec) -> bool:
    """Codecs the Triton quantize kernel covers."""
    from qjl.codecs.outliers import OutlierQJL
    from qjl.codecs.sketch import QJLSketch
    from qjl.codecs.turboquant import TurboQuantMSE

    return isinstance(codec, (QJLSketch, OutlierQJL, TurboQuantMSE))


def _seq(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-2], x.shape[-1]) if x.ndim >= 2 else x.reshape(1, 1, -1)


def _dense(obj, device) -> torch.Tensor:
    """``obj.matrix()`` on ``device``, built once per object and device (rotations and sketches are fixed)."""
    cache = obj.__dict__.setdefault("_kernel_dense", {})
    if device not in cache:
        cache[device] = obj.matrix().to(device)
    return cache[device]


def quantize(codec, x: torch.Tensor, outlier_idx: torch.Tensor | None = None):
    """Triton quantization, the same Codes as ``codec.quantize(x[, outlier_idx])``.

    x: [..., n, dim]; QJL/TurboQuant MSE codecs only (:func:`can_quantize`).
    """
    from qjl.codecs.base import Codes
    from qjl.codecs.outliers import OutlierQJL
    from qjl.codecs.sketch import QJLSketch
    from qjl.codecs.turboquant import TurboQuantMSE
    from qjl.core.validation import check_vectors
    from qjl.kernels.triton import kernels as tk

    if not can_quantize(codec):
        raise TypeError(f"codec: the Triton quantize kernel covers QJLSketch, OutlierQJL and TurboQuantMSE, "
                        f"got {type(codec).__name__}")
    check_vectors("x", x, codec.dim, min_ndim=2 if isinstance(codec, OutlierQJL) else 1)
    lead = tuple(x.shape[:-1])
    xs = _seq(x)
    if isinstance(codec, TurboQuantMSE):
        codes, norm = tk.quantize(xs, _dense(codec.rotation, x.device), codec.bits,
                                  boundaries=codec._boundaries.to(x.device), normalize=True,
                                  centroids=codec._centroids.to(x.device), correct_norm=codec.correct_norm)
        _check_norm(codec.norm_dtype, norm)
        return Codes(lead, {"codes": codes.reshape(*lead, -1), "norm": norm.reshape(lead).to(codec.norm_dtype)})
    sketch = codec.inlier if isinstance(codec, OutlierQJL) else codec
    if isinstance(codec, QJLSketch) or codec.outlier is None:
        signs, norm = tk.quantize(xs, _dense(sketch, x.device), 1, sign=True)
        _check_norm(sketch.norm_dtype, norm)
        return Codes(lead, {"signs": signs.reshape(*lead, -1), "norm": norm.reshape(lead).to(sketch.norm_dtype)})
    idx = codec.select_outliers(x) if outlier_idx is None else outlier_idx
    idx = codec._check_idx(idx.to(x.device), lead[:-1])
    idx_s = idx.reshape(-1, idx.shape[-1]).long()
    if idx_s.shape[0] == 1 and xs.shape[0] > 1:
        idx_s = idx_s.expand(xs.shape[0], -1)
    s, d = xs.shape[0], xs.shape[-1]
    inlier_mask = torch.ones(s, d, device=x.device).scatter(-1, idx_s, 0.0)
    s_out = _dense(codec.outlier, x.device)  # [m_o, k]
    scattered = torch.zeros(s, s_out.shape[0], d, device=x.device)
    scattered.scatter_(-1, idx_s.unsqueeze(1).expand(-1, s_out.shape[0], -1), s_out.unsqueeze(0).expand(s, -1, -1))
    signs, norm = tk.quantize(xs, _dense(sketch, x.device), 1, sign=True, channel_mask=inlier_mask, mask_mode=1)
    osigns, onorm = tk.quantize(xs, scattered, 1, sign=True, channel_mask=inlier_mask, mask_mode=2)
    _check_norm(sketch.norm_dtype, norm)
    fields = {"signs": signs.reshape(*lead, -1), "norm": norm.reshape(lead).to(sketch.norm_dtype),
              "outlier_signs": osigns.reshape(*lead, -1), "outlier_norm": onorm.reshape(lead).to(codec.outlier.norm_dtype)}
    return Codes(lead, fields, {"outlier_idx": idx.to(codec._idx_dtype)})


def quantize_cpu(codec, x: torch.Tensor):
    """TurboQuant MSE on the CPU: the reference's norm and rotation (torch), then bucketing, packing
    and the norm correction's cosine in one numba pass.  Codes equal ``codec.quantize(x)``; with
    ``correct_norm`` the cosine is summed in another order (norms may differ by one ulp)."""
    from qjl.core.validation import check_vectors
    from qjl.codecs.base import Codes
    from qjl.codecs.turboquant import TurboQuantMSE
    from qjl.kernels.cpu import launch as cpu

    if not isinstance(codec, TurboQuantMSE):
        raise TypeError(f"codec: the CPU quantize kernel covers TurboQuantMSE, got {type(codec).__name__}")
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.ndim < 1 or x.shape[-1] != codec.dim:
        check_vectors("x", x, codec.dim)  # raises the reference's error
    xf = x.float()
    norm = torch.linalg.vector_norm(xf, dim=-1)
    if not bool(torch.isfinite(norm).all()):  # a NaN/Inf entry makes its norm NaN/Inf: one cheap check
        check_vectors("x", x, codec.dim)
    _check_norm(codec.norm_dtype, norm)
    unit = xf / torch.where(norm > 0, norm, torch.ones_like(norm)).unsqueeze(-1)
    y = codec.rotation.apply(unit)
    codes, cos = cpu.bucket_pack(y, codec._boundaries, codec._centroids, codec.bits)
    if codec.correct_norm:
        norm = norm / torch.where(cos > 0, cos, torch.ones_like(cos))
        _check_norm(codec.norm_dtype, norm)
    return Codes(tuple(x.shape[:-1]), {"codes": codes, "norm": norm.to(codec.norm_dtype)})


def can_quantize_cpu(codec) -> bool:
    from qjl.codecs.turboquant import TurboQuantMSE

    return isinstance(codec, TurboQuantMSE) and _has("numba")


def _check_norm(dtype, norm):
    from qjl.core.validation import check_fits

    check_fits("norm of x", norm, dtype)
