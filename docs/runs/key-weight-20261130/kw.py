"""Scratch presets: key weight on the allocation's S_K."""
import sys
sys.path.insert(0, "src")
from dataclasses import replace
from qjl.cache.presets import PRESETS
from qjl.cache.config import QJLConfig
base = PRESETS["tqa-5x"]
for w in (1.5, 2.0, 3.0):
    PRESETS[f"tqa-5x-k{w:g}"] = replace(base, allocation=replace(base.allocation, key_weight=w))
a3 = QJLConfig.auto(bits_per_value=3.0)
for w in (2.0, 3.0):
    PRESETS[f"auto3-k{w:g}"] = replace(a3, allocation=replace(a3.allocation, key_weight=w))
if __name__ == "__main__":
    from qjl.tools.cli import main
    sys.exit(main())
