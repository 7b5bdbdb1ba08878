"""Scratch: which role makes tqv-k3v2 slow on the integer path (keys or values), via kernel_speed's CLI."""
import sys
sys.path.insert(0, "benchmarks")
import kernel_speed as ks  # noqa: E402
from qjl.codecs import TurboQuantMSE, TurboQuantVQ  # noqa: E402

ks.CODECS["vqk-tqv"] = lambda d: (TurboQuantVQ(d, 3, correct_norm=True), TurboQuantMSE(d, 2, correct_norm=True, norm_dtype="fp8"))
ks.CODECS["tqk-vqv"] = lambda d: (TurboQuantMSE(d, 3, correct_norm=True), TurboQuantVQ(d, 2, correct_norm=True, cycles=8, norm_dtype="fp8"))
ks.CODECS["tqk-tqv8"] = lambda d: (TurboQuantMSE(d, 3, correct_norm=True), TurboQuantMSE(d, 2, correct_norm=True, cycles=8, norm_dtype="fp8"))
sys.argv[0] = "kernel_speed.py"
ks.main()
