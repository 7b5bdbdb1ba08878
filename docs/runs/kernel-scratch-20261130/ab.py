"""Interleaved A/B of kernel variants chosen by env vars read per call."""
import os, sys, time, statistics, torch
sys.argv = sys.argv[:1]
from qjl.codecs import TurboQuantMSE
from qjl.kernels.cpu import launch
from qjl.kernels.paged import PagedField
torch.set_grad_enabled(False)
n, h, d, r = int(os.environ.get("N", 65536)), 8, 128, 4
g = torch.Generator().manual_seed(0)
k, v, q = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g), torch.randn(1, h, r, d, generator=g)
kc, vc = TurboQuantMSE(d, 3, correct_norm=True), TurboQuantMSE(d, 2, correct_norm=True, norm_dtype="fp8")
kf = {f: PagedField.of(t) for f, t in kc.quantize(k).fields.items()}
vf = {f: PagedField.of(t) for f, t in vc.quantize(v).fields.items()}
start, end = torch.zeros(1, dtype=torch.int32), torch.full((1,), n, dtype=torch.int32)
bt = torch.zeros(1, 1, dtype=torch.int32)
variants = [dict(x.split("=") for x in spec.split(",") if x) for spec in os.environ["VARIANTS"].split(";")]
threads = int(os.environ.get("THREADS", 1))
def call(env):
    for key in ("QJL_EXP", "QJL_NOMIX", "QJL_NOSCORE"):
        os.environ.pop(key, None)
    os.environ.update(env)
    return launch.paged_decode(q, kc, kf, vc, vf, bt, n, start, end, impl="c-int", threads=threads)
outs = [call(e) for e in variants]
for o in outs[1:]:
    print("max |diff| vs first:", (o - outs[0]).abs().max().item())
times = [[] for _ in variants]
for rep in range(int(os.environ.get("REPS", 30))):
    for i, e in enumerate(variants):
        t = time.perf_counter(); call(e); times[i].append(time.perf_counter() - t)
for e, ts in zip(variants, times):
    print(f"{e}: min {min(ts)*1e3:.3f} ms  median {statistics.median(ts)*1e3:.3f} ms")
