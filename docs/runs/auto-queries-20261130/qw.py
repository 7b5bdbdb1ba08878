"""Scratch presets: tqa-5x with each prompt query's own window held exact in the proxy (AutoBits.query_windows)."""
import sys
sys.path.insert(0, "src")
from dataclasses import replace
from qjl.cache.presets import PRESETS
base = PRESETS["tqa-5x"]
for n in (64, 128, 256):
    PRESETS[f"tqa-5x-w{n}"] = replace(base, allocation=replace(base.allocation, queries=n, query_windows=True))
if __name__ == "__main__":
    from qjl.tools.cli import main
    sys.exit(main())
