"""qjl: data-oblivious KV-cache quantizers (QJL, TurboQuant, PolarQuant) and baselines.

Importing the package has no side effects: nothing is patched, no device is touched.
"""

from .codec import BitBudget, Codec, Codes
from .kivi import KIVIKeys
from .outliers import OutlierQJL
from .polarquant import PolarQuant
from .registry import CODECS, codec_parameters, make_codec
from .rotation import Rotation
from .sketch import QJLSketch, scale_constant, sphere_abs_moment
from .turboquant import TurboQuantMSE, TurboQuantProd
from .values import TokenwiseQuantizer

__all__ = ["BitBudget", "CODECS", "Codec", "Codes", "KIVIKeys", "OutlierQJL", "PolarQuant", "QJLSketch",
           "Rotation", "TokenwiseQuantizer", "TurboQuantMSE", "TurboQuantProd", "codec_parameters",
           "make_codec", "scale_constant", "sphere_abs_moment"]
__version__ = "0.1.0"
