"""Scratch preset: `tqa-5x` with its layers' errors unweighted (AutoBits residual_weights=False, the preset as it
was before 2026-11-29's ninth session), as `tqa-5x-u`; then qjl's CLI (`auto-3.0u` is a method name of its own)."""
import sys
sys.path.insert(0, "src")
from dataclasses import replace  # noqa: E402

from qjl.cache.presets import PRESETS  # noqa: E402

base = PRESETS["tqa-5x"]
PRESETS["tqa-5x-u"] = replace(base, allocation=replace(base.allocation, residual_weights=False))

if __name__ == "__main__":
    from qjl.tools.cli import main
    sys.exit(main())
