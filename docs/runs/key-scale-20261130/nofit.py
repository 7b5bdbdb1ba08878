"""Scratch presets: tqa-5x / auto-3.0 without the fitted key scale (as before), beside the library's default."""
import sys
from dataclasses import replace
sys.path.insert(0, "src")
from qjl.cache.presets import PRESETS
from qjl.cache.config import QJLConfig
PRESETS["tqa-5x-nofit"] = replace(PRESETS["tqa-5x"], fit_key_scale=False)
PRESETS["auto3-nofit"] = replace(QJLConfig.auto(bits_per_value=3.0), fit_key_scale=False)
if __name__ == "__main__":
    from qjl.tools.cli import main
    sys.exit(main())
