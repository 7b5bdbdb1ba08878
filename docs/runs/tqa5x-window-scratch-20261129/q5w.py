"""Scratch presets: `tqa-5x` with a shorter exact window and the bytes it frees given to the codes (the same ~5.08x at
4k tokens: `qjl eval`'s memory figure), as `tqa-5x-w32`, `-w48`, `-w64`, `-w96`; then qjl's CLI."""
import sys
sys.path.insert(0, "src")

from qjl import QJLConfig  # noqa: E402
from qjl.cache.presets import PRESETS  # noqa: E402

for window, bits in ((32, 3.016), (48, 2.964), (64, 2.912), (96, 2.807)):
    PRESETS[f"tqa-5x-w{window}"] = QJLConfig.auto(bits_per_value=bits, vector_values=True, residual_length=window,
                                                  flush_block=8, exact_dtype="fp16")

if __name__ == "__main__":
    from qjl.tools.cli import main
    sys.exit(main())
