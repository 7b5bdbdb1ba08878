"""The vector codebooks' codewords read straight from the packed bytes (TurboQuantVQ.stored_codewords) against
the per-coordinate fields joined (the code before), and rotated / dequantize with the new reading; 3 x 1,408 vectors of
d = 64 (one layer's fit at 1.5k)."""
import torch, time
from qjl.cache.config import CodecSpec
from qjl.core.packing import unpack_bits
def t(f, k=200):
    for _ in range(5): f()
    a=time.perf_counter()
    for _ in range(k): f()
    return (time.perf_counter()-a)/k*1e3
for bits in (2, 3, 4):
    c = CodecSpec("turboquant_vq", {"bits": bits, "correct_norm": True}).build(64, 7)
    codes = c.quantize(torch.randn(1,3,1408,64)); p = codes.fields["codes"]
    old = t(lambda: c.joint_codes(unpack_bits(p, bits, 64)))
    new = t(lambda: c.stored_codewords(p))
    print(bits, "codewords old %.3f new %.3f ms; rotated %.3f; dequantize %.3f" % (old, new, t(lambda: c.rotated(codes)), t(lambda: c.dequantize(codes))))
