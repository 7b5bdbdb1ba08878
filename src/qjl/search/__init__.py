"""Vector search over qjl's codecs: a flat / IVF index, a LUT scan kernel, the data set and the benchmark.

``Index`` and ``IndexConfig`` are the public entry points; the rest (data set builder, benchmark)
is imported from its module on use, so ``import qjl.search`` stays light.
"""

from .index import METRICS, Index, IndexConfig
from .codecs import CODEC_NAMES

__all__ = ["CODEC_NAMES", "METRICS", "Index", "IndexConfig"]
