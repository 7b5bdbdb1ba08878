"""Codecs by name, with validated parameters: ``make_codec("turboquant_mse", 128, bits=3)``.

| name | class | for |
| --- | --- | --- |
| ``qjl`` | :class:`OutlierQJL` | keys: 1-bit JL sketch (+ optional outlier sketch) |
| ``turboquant_mse`` | :class:`TurboQuantMSE` | keys or values: rotation + Lloyd-Max |
| ``turboquant_vq`` | :class:`TurboQuantVQ` | keys or values: rotation + a vector codebook per 2-4 coordinates |
| ``turboquant_split`` | :class:`SplitTurboQuant` | keys: chosen channels at more bits, two TurboQuant MSE parts |
| ``turboquant_prod`` | :class:`TurboQuantProd` | keys: MSE stage + QJL residual, unbiased scores |
| ``polarquant`` | :class:`PolarQuant` | keys or values: recursive polar angles |
| ``kivi`` | :class:`KIVIKeys` | keys: per-channel over token groups (baseline) |
| ``uniform`` | :class:`TokenwiseQuantizer` | values (and KIVI's values): per-token min-max |
"""

from __future__ import annotations

import functools
import inspect

from qjl.codecs.base import Codec
from qjl.codecs.kivi import KIVIKeys
from qjl.codecs.outliers import OutlierQJL
from qjl.codecs.polarquant import PolarQuant
from qjl.codecs.split import SplitTurboQuant
from qjl.codecs.turboquant import TurboQuantMSE, TurboQuantProd
from qjl.codecs.tokenwise import TokenwiseQuantizer
from qjl.codecs.vq import TurboQuantVQ

__all__ = ["CODECS", "make_codec", "codec_parameters"]

CODECS = {
    "qjl": OutlierQJL,
    "turboquant_mse": TurboQuantMSE,
    "turboquant_prod": TurboQuantProd,
    "turboquant_split": SplitTurboQuant,
    "turboquant_vq": TurboQuantVQ,
    "polarquant": PolarQuant,
    "kivi": KIVIKeys,
    "uniform": TokenwiseQuantizer,
}


@functools.lru_cache(maxsize=None)
def _signature(cls) -> inspect.Signature:
    """``inspect.signature(cls)``, once per class (a layer's width allocation builds ten codecs per layer)."""
    return inspect.signature(cls)


def codec_parameters(name: str) -> list:
    """The keyword parameters codec ``name`` accepts besides ``dim``."""
    if name not in CODECS:
        raise ValueError(f"codec must be one of {sorted(CODECS)}, got {name!r}")
    return [p for p in _signature(CODECS[name]).parameters if p != "dim"]


def make_codec(name: str, dim: int, **params) -> Codec:
    """Build codec ``name`` for vectors of ``dim``; unknown or missing parameters raise ``TypeError``."""
    allowed = codec_parameters(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise TypeError(f"codec {name!r} got unknown parameter(s) {unknown}; allowed: {allowed}")
    try:
        _signature(CODECS[name]).bind(dim, **params)
    except TypeError as e:
        raise TypeError(f"codec {name!r}: {e}; allowed parameters: {allowed}") from None
    return CODECS[name](dim, **params)
