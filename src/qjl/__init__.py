"""qjl: data-oblivious KV-cache quantizers (QJL, TurboQuant, PolarQuant) and baselines.

The data path, left to right, is the package layout:

* :mod:`qjl.core` -- packing, rotations, the fast Hadamard transform, Lloyd-Max codebooks, argument checks;
* :mod:`qjl.codecs` -- the codec interface and every quantizer (QJL, TurboQuant, PolarQuant, KIVI, token-wise);
* :mod:`qjl.cache` -- cache configuration and presets, a layer's storage, attention over a layer;
* :mod:`qjl.kernels` -- the plain-torch reference, the CPU (C) and Triton kernels, and how one is picked;
* :mod:`qjl.integrations` -- transformers (``QJLCache``, ``patch_attention``), vLLM, lm-eval;
* :mod:`qjl.tools` -- the ``qjl`` command line: eval, bench, stats, reports.

Importing the package has no side effects and imports nothing heavy (not even torch): every public
name below is loaded on first use.  Nothing is patched, no device is touched and no file is written.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (loaded on first attribute access)
_PUBLIC = {
    "BitBudget": "qjl.codecs.base", "Codec": "qjl.codecs.base", "Codes": "qjl.codecs.base",
    "CODECS": "qjl.codecs.registry", "codec_parameters": "qjl.codecs.registry", "make_codec": "qjl.codecs.registry",
    "KIVIKeys": "qjl.codecs.kivi", "OutlierQJL": "qjl.codecs.outliers", "PolarQuant": "qjl.codecs.polarquant",
    "QJLSketch": "qjl.codecs.sketch", "scale_constant": "qjl.codecs.sketch", "sphere_abs_moment": "qjl.codecs.sketch",
    "TurboQuantMSE": "qjl.codecs.turboquant", "TurboQuantProd": "qjl.codecs.turboquant",
    "SplitTurboQuant": "qjl.codecs.split", "TurboQuantVQ": "qjl.codecs.vq",
    "TokenwiseQuantizer": "qjl.codecs.tokenwise", "Rotation": "qjl.core.rotation",
    "CodecSpec": "qjl.cache.config", "QJLConfig": "qjl.cache.config",
    "PRESETS": "qjl.cache.presets", "DEFAULT_PRESET": "qjl.cache.presets",
    "QJLCache": "qjl.integrations.transformers.cache", "patch_attention": "qjl.integrations.transformers.attention",
    "load_model": "qjl.tools.models", "cache_kwargs": "qjl.integrations.transformers.names",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # later accesses skip this hook
        return value
    raise AttributeError(f"module 'qjl' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
