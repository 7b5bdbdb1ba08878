"""Scratch presets: tqa-5x with more prompt queries measuring each layer (AutoBits.queries)."""
import sys
sys.path.insert(0, "src")
from dataclasses import replace
from qjl.cache.presets import PRESETS
base = PRESETS["tqa-5x"]
for n in (128, 256):
    PRESETS[f"tqa-5x-q{n}"] = replace(base, allocation=replace(base.allocation, queries=n))
if __name__ == "__main__":
    from qjl.tools.cli import main
    sys.exit(main())
