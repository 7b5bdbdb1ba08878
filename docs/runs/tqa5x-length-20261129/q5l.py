"""Scratch preset: `tqa-5x` as it was before its budget was stated at 4,096 tokens (budget_tokens=None), as
`tqa-5x-fixed`; then qjl's CLI."""
import sys
sys.path.insert(0, "src")
from dataclasses import replace  # noqa: E402

from qjl.cache.presets import PRESETS  # noqa: E402

base = PRESETS["tqa-5x"]
PRESETS["tqa-5x-fixed"] = replace(base, allocation=replace(base.allocation, budget_tokens=None))

if __name__ == "__main__":
    from qjl.tools.cli import main
    sys.exit(main())
