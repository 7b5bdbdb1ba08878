"""Scratch preset: `tqa-5x` with widths per KV head (AutoBits per_head=True), as `tqa-5x-h`; then qjl's CLI."""
import sys
sys.path.insert(0, "src")
from dataclasses import replace  # noqa: E402

from qjl.cache.presets import PRESETS  # noqa: E402

base = PRESETS["tqa-5x"]
PRESETS["tqa-5x-h"] = replace(base, allocation=replace(base.allocation, per_head=True))

if __name__ == "__main__":
    from qjl.tools.cli import main
    sys.exit(main())
