"""Argument checks shared by every public entry point.

Each check raises ``ValueError``/``TypeError`` naming the argument, what is
allowed and what was received, before anything is computed or stored.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
STORAGE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# norms may also be stored in 8 bits: float8 e4m3 (relative error <= 2^-4 in [2^-6, 448], absolute
# error <= 2^-10 below; larger norms are refused by check_fits).  Not offered for scales and zero points,
# where a relative error of a few percent is larger than a quantization step.
NORM_DTYPES = {**STORAGE_DTYPES, "fp8": torch.float8_e4m3fn}


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_bits(name: str, value, maximum: int = 8) -> int:
    """An int in 1..maximum (bits per coordinate)."""
    check_positive_int(name, value)
    if value > maximum:
        raise ValueError(f"{name} must be in 1..{maximum}, got {value}")
    return value


def check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {sorted(allowed)!r}, got {value!r}")


def storage_dtype(name: str, value, choices=STORAGE_DTYPES) -> torch.dtype:
    """Accept a key of ``choices`` ('fp16'/'bf16'/'fp32', plus 'fp8' for NORM_DTYPES) or the torch dtype itself."""
    if isinstance(value, torch.dtype) and value in choices.values():
        return value
    if isinstance(value, str) and value in choices:
        return choices[value]
    raise ValueError(f"{name} must be one of {sorted(choices)} (or the torch dtype), got {value!r}")


def check_vectors(name: str, x, dim: int, min_ndim: int = 1) -> torch.Tensor:
    """``x`` must be a finite floating tensor of shape [..., dim] with >= min_ndim dims."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {x.dtype}")
    if x.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {tuple(x.shape)}")
    if x.shape[-1] != dim:
        raise ValueError(f"{name} must have last dimension {dim}, got shape {tuple(x.shape)}")
    # a finite sum means every element is finite (NaN and Inf propagate): one pass, no [..] bool tensor;
    # only a non-finite sum (a NaN/Inf, or an overflow of finite values) needs the element-wise check
    if x.numel() and not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or Inf values")
    return x


def check_fits(name: str, values: torch.Tensor, dtype: torch.dtype) -> None:
    """Values beyond ``dtype``'s range are refused, not silently stored as Inf (fp16/bf16) or
    clipped (fp8 saturates)."""
    if values.numel() and bool((values.float().abs() > torch.finfo(dtype).max).any()):
        raise ValueError(
            f"{name} overflows its storage dtype {dtype} (max {torch.finfo(dtype).max:g})"
        )


def check_channels(name: str, idx, count: int, count_name: str, dim: int, lead: tuple) -> torch.Tensor:
    """A per-sequence channel set ``idx`` (QJL's outlier channels, a split codec's chosen channels): an integer tensor
    of ``count`` distinct channels in ``[0, dim)`` per sequence, broadcast to ``lead + (count,)`` -> int64,
    contiguous; else TypeError / ValueError naming ``name`` (and ``count_name``, the parameter that sets ``count``)."""
    if not isinstance(idx, torch.Tensor) or idx.dtype.is_floating_point or idx.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer torch.Tensor, got {getattr(idx, 'dtype', type(idx).__name__)}")
    if idx.ndim < 1 or idx.shape[-1] != count:
        raise ValueError(f"{name} must have last dimension {count_name}={count}, got shape {tuple(idx.shape)}")
    try:
        idx = idx.long().expand(*lead, count)
    except RuntimeError:
        raise ValueError(f"{name} shape {tuple(idx.shape)} does not broadcast to {(*lead, count)}") from None
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= dim):
        raise ValueError(f"{name} values must lie in [0, {dim})")
    if count > 1 and bool((idx.sort(dim=-1).values.diff(dim=-1) == 0).any()):
        raise ValueError(f"{name} must not repeat a channel within a sequence")
    return idx.contiguous()
