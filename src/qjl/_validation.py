"""Argument checks shared by every public entry point.

Each check raises ``ValueError``/``TypeError`` naming the argument, what is
allowed and what was received, before anything is computed or stored.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
STORAGE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


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


def storage_dtype(name: str, value) -> torch.dtype:
    """Accept 'fp16'/'bf16'/'fp32' or the torch dtype itself."""
    if isinstance(value, torch.dtype) and value in STORAGE_DTYPES.values():
        return value
    if isinstance(value, str) and value in STORAGE_DTYPES:
        return STORAGE_DTYPES[value]
    raise ValueError(f"{name} must be one of {sorted(STORAGE_DTYPES)} (or the torch dtype), got {value!r}")


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
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or Inf values")
    return x


def check_fits(name: str, values: torch.Tensor, dtype: torch.dtype) -> None:
    """Values that become Inf when stored in ``dtype`` are refused, not silently stored."""
    if values.numel() and not bool(torch.isfinite(values.to(dtype)).all()):
        raise ValueError(
            f"{name} overflows its storage dtype {dtype} (max {torch.finfo(dtype).max:g}); "
            "choose a wider dtype"
        )
