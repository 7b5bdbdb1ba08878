r"""Lloyd-Max scalar codebooks for the densities the data-oblivious codecs produce.

* ``sphere``: one coordinate of a uniform point on S^{d-1} (seed 003, TurboQuant):
  ``f(x) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) (1 - x^2)^((d-3)/2)`` on [-1, 1],
  which tends to N(0, 1/d).
* ``polar``: a level-l angle of PolarQuant's recursive polar transform of a
  Gaussian vector (l >= 2): the angle ``atan2(b, a)`` of two independent chi_k
  radii, k = 2^(l-1), with density proportional to ``sin^(k-1)(2 psi)`` on
  [0, pi/2].  Level 1 angles are uniform on [0, 2 pi), whose Lloyd-Max codebook is
  the uniform grid of cell midpoints.

The Lloyd-Max iteration (boundaries at centroid midpoints, centroids at the
conditional means) runs on cumulative integrals of the density over a fine grid
(float64) until the centroids move by less than 1e-13 of the interval.  For these
log-concave densities the fixed point is the global optimum.  Results are cached
in memory and on disk (``$QJL_CACHE_DIR`` or ``~/.cache/qjl``), keyed by density,
parameter and bits.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["Codebook", "sphere_codebook", "polar_codebook", "lloyd_max", "sphere_pdf", "polar_pdf", "cell_moments", "check_codebook"]

_VERSION = 1
_GRID = 400_001


@dataclass(frozen=True)
class Codebook:
    """centroids: [2**bits] increasing; boundaries: [2**bits - 1] interior cell edges; mse: E(X - Q(X))^2."""

    centroids: tuple
    boundaries: tuple
    mse: float
    second_moment: float

    def tensors(self, device=None):
        return (torch.tensor(self.centroids, dtype=torch.float32, device=device),
                torch.tensor(self.boundaries, dtype=torch.float32, device=device))


def sphere_pdf(d: int):
    """Density of one coordinate of a uniform point on S^{d-1} (d >= 3), and its effective support."""
    log_c = math.lgamma(d / 2) - math.lgamma((d - 1) / 2) - 0.5 * math.log(math.pi)
    half = min(1.0, 16.0 / math.sqrt(d))  # beyond 16 standard deviations the mass is < 1e-50

    def pdf(x):
        if d == 3:  # uniform on [-1, 1] (Archimedes)
            return np.full_like(x, math.exp(log_c))
        with np.errstate(divide="ignore"):  # log(0) at x = +-1 gives density 0, as it should
            return np.exp(log_c + (d - 3) / 2 * np.log1p(-np.minimum(x * x, 1.0)))
    return pdf, -half, half


def polar_pdf(level: int):
    """Density of a PolarQuant angle at ``level`` >= 2 on [0, pi/2] (unnormalized is fine)."""
    k = 2 ** (level - 1)

    def pdf(x):
        return np.power(np.clip(np.sin(2 * x), 0.0, None), k - 1)
    return pdf, 0.0, math.pi / 2


def lloyd_max(pdf, lo: float, hi: float, bits: int, max_iter: int = 200_000, tol: float = 1e-13) -> Codebook:
    """Optimal 2**bits-level scalar quantizer of the density ``pdf`` on [lo, hi]."""
    x = np.linspace(lo, hi, _GRID)
    p = pdf(x)
    dx = np.diff(x)

    def cumulative(v):
        return np.concatenate([[0.0], np.cumsum((v[1:] + v[:-1]) / 2 * dx)])

    F, M1, M2 = cumulative(p), cumulative(x * p), cumulative(x * x * p)
    total = F[-1]
    F, M1, M2 = F / total, M1 / total, M2 / total
    levels = 1 << bits
    c = np.interp((np.arange(levels) + 0.5) / levels, F, x)  # start at quantiles
    for _ in range(max_iter):
        t = np.concatenate([[lo], (c[1:] + c[:-1]) / 2, [hi]])
        Ft, M1t = np.interp(t, x, F), np.interp(t, x, M1)
        mass = np.diff(Ft)
        new = np.where(mass > 0, np.diff(M1t) / np.maximum(mass, 1e-300), c)
        done = np.max(np.abs(new - c)) < tol * (hi - lo)
        c = new
        if done:
            break
    t = np.concatenate([[lo], (c[1:] + c[:-1]) / 2, [hi]])
    mass = np.diff(np.interp(t, x, F))
    m1, m2 = np.diff(np.interp(t, x, M1)), np.diff(np.interp(t, x, M2))
    mse = float(np.sum(m2 - 2 * c * m1 + c * c * mass))
    return Codebook(tuple(c.tolist()), tuple(t[1:-1].tolist()), mse, float(M2[-1]))


def _cache_dir() -> Path:
    return Path(os.environ.get("QJL_CACHE_DIR") or Path.home() / ".cache" / "qjl")


def _cached(key: str, compute) -> Codebook:
    path = _cache_dir() / f"codebook-v{_VERSION}-{key}.json"
    try:
        data = json.loads(path.read_text())
        return Codebook(tuple(data["centroids"]), tuple(data["boundaries"]), data["mse"], data["second_moment"])
    except (OSError, ValueError, KeyError):
        pass
    book = compute()
    if not all(math.isfinite(v) for v in (*book.centroids, book.mse)):
        raise RuntimeError(f"Lloyd-Max did not produce a finite codebook for {key}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(book.__dict__))
        tmp.replace(path)  # atomic: concurrent processes never read half a file
    except OSError:
        pass  # a read-only home is not an error: the codebook is just recomputed next time
    return book


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")


@functools.lru_cache(maxsize=None)
def sphere_codebook(d: int, bits: int) -> Codebook:
    """Lloyd-Max codebook for a coordinate of a uniform point on S^{d-1}. Distortion of a unit vector: d * mse."""
    if isinstance(d, bool) or not isinstance(d, int) or d < 3:
        raise ValueError(f"d must be an int >= 3, got {d!r}")
    _check_bits(bits)
    return _cached(f"sphere-d{d}-b{bits}", lambda: lloyd_max(*sphere_pdf(d), bits))


@functools.lru_cache(maxsize=None)
def polar_codebook(level: int, bits: int) -> Codebook:
    """Lloyd-Max codebook for PolarQuant angles at ``level`` (1: uniform on [0, 2 pi))."""
    if isinstance(level, bool) or not isinstance(level, int) or level < 1:
        raise ValueError(f"level must be an int >= 1, got {level!r}")
    _check_bits(bits)
    if level == 1:
        k = 1 << bits
        step = 2 * math.pi / k
        c = tuple((i + 0.5) * step for i in range(k))
        return Codebook(c, tuple((i + 1) * step for i in range(k - 1)), step * step / 12, 4 * math.pi ** 2 / 3)
    return _cached(f"polar-l{level}-b{bits}", lambda: lloyd_max(*polar_pdf(level), bits))


def bucket(y: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """Index of the codebook cell of each entry: the number of (sorted) boundaries below it.

    Equal to ``torch.bucketize(y, boundaries)``; for the few boundaries of a <= 4-bit codebook a
    comparison per boundary is several times faster on the CPU.  Returns int64.
    """
    if boundaries.numel() > 15:
        return torch.bucketize(y, boundaries)
    idx = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for b in boundaries.tolist():
        idx += y > b
    return idx.long()


def check_codebook(boundaries: torch.Tensor, centroids: torch.Tensor) -> int:
    """The bits of a Lloyd-Max codebook given as tensors (``2^bits`` centroids, ``2^bits - 1`` boundaries,
    bits 1-8); ValueError/TypeError naming the argument otherwise."""
    for name, t in (("boundaries", boundaries), ("centroids", centroids)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.ndim != 1:
            raise TypeError(f"{name} must be a 1-d float tensor, got {getattr(t, 'dtype', type(t).__name__)} "
                            f"{tuple(getattr(t, 'shape', ()))}")
    bits = centroids.numel().bit_length() - 1
    if centroids.numel() < 2 or centroids.numel() != 1 << bits or bits > 8 or boundaries.numel() != centroids.numel() - 1:
        raise ValueError(f"centroids/boundaries must be a codebook of 2^bits cells (bits 1-8), got "
                         f"{centroids.numel()} centroids and {boundaries.numel()} boundaries")
    return bits


def cell_moments(y: torch.Tensor, boundaries: torch.Tensor, centroids: torch.Tensor) -> tuple:
    """Per-row moments of the cells of y: [..., n] -> (cos [...], cc [...]) float64 with ``cos = sum_i y_i c_i``
    and ``cc = sum_i c_i^2``, ``c_i = centroids[bucket(y_i)]``.  With the norm ``s`` a codec stores for a row
    of norm ``r`` (``y`` the unit vector rotated), ``||r y - s c||^2 = r^2 - 2 r s cos + s^2 cc``: what the
    width allocation reads a candidate's distortion from (its C twin: ``qjl.kernels.cpu.store.cell_moments``).
    Raises TypeError/ValueError for a y that is not a finite float tensor or a codebook of the wrong size."""
    from qjl.core.validation import check_vectors

    check_codebook(boundaries, centroids)
    if not isinstance(y, torch.Tensor) or y.ndim < 1:
        raise TypeError(f"y must be a float tensor [..., n], got {type(y).__name__}")
    check_vectors("y", y, y.shape[-1])
    c = centroids.to(y.device)[bucket(y, boundaries.to(y.device))].double()
    return (y.double() * c).sum(-1), c.square().sum(-1)
