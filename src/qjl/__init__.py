"""qjl: data-oblivious KV-cache quantizers (QJL, TurboQuant, PolarQuant) and baselines.

Importing the package has no side effects: nothing is patched, no device is touched, and
transformers is imported only when the cache is used.
"""

from .codec import BitBudget, Codec, Codes
from .config import PRESETS, CodecSpec, QJLConfig
from .kivi import KIVIKeys
from .outliers import OutlierQJL
from .polarquant import PolarQuant
from .registry import CODECS, codec_parameters, make_codec
from .rotation import Rotation
from .sketch import QJLSketch, scale_constant, sphere_abs_moment
from .turboquant import TurboQuantMSE, TurboQuantProd
from .values import TokenwiseQuantizer

__all__ = ["BitBudget", "CODECS", "Codec", "CodecSpec", "Codes", "KIVIKeys", "OutlierQJL", "PRESETS", "PolarQuant",
           "QJLCache", "QJLConfig", "QJLSketch", "Rotation", "TokenwiseQuantizer", "TurboQuantMSE",
           "TurboQuantProd", "codec_parameters", "make_codec", "patch_attention", "scale_constant",
           "sphere_abs_moment"]
__version__ = "0.1.0"


def __getattr__(name):  # transformers is heavy: import the integration on first use only
    if name == "QJLCache":
        from .cache import QJLCache

        return QJLCache
    if name == "patch_attention":
        from .attention import patch_attention

        return patch_attention
    raise AttributeError(f"module 'qjl' has no attribute {name!r}")
