"""Vector search over qjl's codecs: a flat / IVF index, a LUT scan kernel, the data set and the benchmark.

``Index`` and ``IndexConfig`` are the public entry points.  Names load on first use, so
``import qjl.search`` (and the CLI's argument parsing) imports nothing heavy.
"""

__all__ = ["CODEC_NAMES", "METRICS", "Index", "IndexConfig"]


def __getattr__(name):
    if name in ("Index", "IndexConfig", "METRICS"):
        from . import index

        return getattr(index, name)
    if name == "CODEC_NAMES":
        from .codecs import CODEC_NAMES

        return CODEC_NAMES
    raise AttributeError(f"module 'qjl.search' has no attribute {name!r}")
