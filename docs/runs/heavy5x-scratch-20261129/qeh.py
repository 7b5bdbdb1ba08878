"""Scratch: the 5x point with more heavy tokens (or fewer window tokens), bytes held at 4k kept near tqa-5x's;
scratch preset names; nothing shipped."""
import sys
sys.path.insert(0, "src")  # run from the repository root
from qjl.cache import presets
from qjl.cache.config import QJLConfig

base = dict(vector_values=True, flush_block=8, exact_dtype="fp16")
presets.PRESETS["h32"] = QJLConfig.auto(bits_per_value=2.66, residual_length=120, heavy_tokens=32, **base)
presets.PRESETS["h48"] = QJLConfig.auto(bits_per_value=2.60, residual_length=120, heavy_tokens=48, **base)
presets.PRESETS["h80w56"] = QJLConfig.auto(bits_per_value=2.72, residual_length=56, heavy_tokens=80, **base)
from qjl.tools.cli import main
sys.exit(main(sys.argv[1:]))
