"""Scratch pairs of benchmarks/kernel_speed.py: vector-codebook keys of 2, 3 and 4 bits against scalar 4-bit keys."""
import sys
sys.path.insert(0, "benchmarks")  # run from the repository root
import kernel_speed as ks
from qjl.codecs import TurboQuantMSE, TurboQuantVQ
ks.CODECS["vq4-tq2"] = lambda d: (TurboQuantVQ(d, 4, correct_norm=True), TurboQuantMSE(d, 2, correct_norm=True, norm_dtype="fp8"))
ks.CODECS["tq4-tq2"] = lambda d: (TurboQuantMSE(d, 4, correct_norm=True), TurboQuantMSE(d, 2, correct_norm=True, norm_dtype="fp8"))
ks.CODECS["vq3-tq2"] = lambda d: (TurboQuantVQ(d, 3, correct_norm=True), TurboQuantMSE(d, 2, correct_norm=True, norm_dtype="fp8"))
ks.CODECS["vq2-tq2"] = lambda d: (TurboQuantVQ(d, 2, correct_norm=True), TurboQuantMSE(d, 2, correct_norm=True, norm_dtype="fp8"))
sys.argv[0] = "kernel_speed.py"
ks.main()
