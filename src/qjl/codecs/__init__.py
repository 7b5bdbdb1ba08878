"""The codec interface (:mod:`qjl.codecs.base`) and every quantizer, by name in :mod:`qjl.codecs.registry`."""

from qjl.codecs.base import BitBudget, Codec, Codes
from qjl.codecs.kivi import KIVIKeys
from qjl.codecs.outliers import OutlierQJL
from qjl.codecs.polarquant import PolarQuant
from qjl.codecs.registry import CODECS, codec_parameters, make_codec
from qjl.codecs.sketch import QJLSketch
from qjl.codecs.split import SplitTurboQuant
from qjl.codecs.tokenwise import TokenwiseQuantizer
from qjl.codecs.turboquant import TurboQuantMSE, TurboQuantProd
from qjl.codecs.vq import TurboQuantVQ

__all__ = ["BitBudget", "CODECS", "Codec", "Codes", "KIVIKeys", "OutlierQJL", "PolarQuant", "QJLSketch",
           "SplitTurboQuant", "TokenwiseQuantizer", "TurboQuantMSE", "TurboQuantProd", "TurboQuantVQ", "codec_parameters", "make_codec"]
