"""qjl: data-oblivious KV-cache quantizers (QJL, TurboQuant, PolarQuant) and baselines.

Importing the package has no side effects: nothing is patched, no device is touched.
"""

from .codec import BitBudget, Codec, Codes
from .outliers import OutlierQJL
from .sketch import QJLSketch, scale_constant, sphere_abs_moment
from .values import TokenwiseQuantizer

__all__ = ["BitBudget", "Codec", "Codes", "OutlierQJL", "QJLSketch", "TokenwiseQuantizer",
           "scale_constant", "sphere_abs_moment"]
__version__ = "0.1.0"
