"""Scratch: exact tokens rounded through float8 e4m3 (stored at fp16, so bytes are fp16's: compute the fp8 bytes by
hand), under scratch preset names; nothing shipped."""
import sys
sys.path.insert(0, "src")  # run from the repository root
import torch
from qjl.cache import presets, buffers
from qjl.cache.config import QJLConfig

def r8(x):
    return x.to(torch.float8_e4m3fn).to(x.dtype)

_append, _replace = buffers.TokenBuffer.append, buffers.TokenBuffer.replace
def append(self, x):
    return _append(self, r8(x.to(self.dtype)))
def replace(self, x):
    return _replace(self, None if x is None else r8(x.to(self.dtype)))
buffers.TokenBuffer.append, buffers.TokenBuffer.replace = append, replace

base = dict(vector_values=True, residual_length=120, flush_block=8, exact_dtype="fp16")
presets.PRESETS["f8-tqa5x"] = QJLConfig.auto(bits_per_value=2.72, **base)
presets.PRESETS["f8-a294"] = QJLConfig.auto(bits_per_value=2.94, **base)
presets.PRESETS["f8-a294s"] = QJLConfig.auto(bits_per_value=2.94, residual_length=120, flush_block=8, exact_dtype="fp16")
from qjl.tools.cli import main
sys.exit(main(sys.argv[1:]))
