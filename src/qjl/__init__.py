"""qjl: data-oblivious KV-cache quantizers (QJL, TurboQuant, PolarQuant) and baselines.

Importing the package has no side effects: nothing is patched, no device is touched.
"""

from .codec import BitBudget, Codec, Codes
from .sketch import QJLSketch

__all__ = ["BitBudget", "Codec", "Codes", "QJLSketch"]
__version__ = "0.1.0"
