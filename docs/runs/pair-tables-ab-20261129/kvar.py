"""Interleaved timing of decode-kernel variants (a scratch script kept with its run):
    BS=<block size> python kvar.py <d> <rows> <tokens> <kv heads> [variants,comma-separated] [rounds]"""
import sys, time, statistics, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import kernel_speed as ks
from qjl.codecs import TurboQuantMSE as M, TurboQuantVQ as V
from qjl.kernels.cpu import launch
from qjl.kernels.paged import PagedField
d, R, n, h = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
import os
bs = int(os.environ.get("BS", "128"))
V8 = dict(correct_norm=True, cycles=8, norm_dtype="fp8")
var = {
 "tq-k3v2": (M(d, 3, correct_norm=True), M(d, 2, correct_norm=True, norm_dtype="fp8")),
 "tqv-k3v2": (V(d, 3, correct_norm=True), V(d, 2, **V8)),
 "vqK": (V(d, 3, correct_norm=True), M(d, 2, correct_norm=True, norm_dtype="fp8")),
 "vqV1": (M(d, 3, correct_norm=True), V(d, 2, correct_norm=True, norm_dtype="fp8")),
 "vqV8": (M(d, 3, correct_norm=True), V(d, 2, **V8)),
 "tqV8": (M(d, 3, correct_norm=True), M(d, 2, **V8)),
}
if len(sys.argv) > 5: var = {k: var[k] for k in sys.argv[5].split(",")}
torch.set_grad_enabled(False)
g = torch.Generator().manual_seed(0)
k, v, q = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g), torch.randn(1, h, R, d, generator=g)
start, end = torch.zeros(1, dtype=torch.int32), torch.full((1,), n, dtype=torch.int32)
calls = {}
for name, (kc, vc) in var.items():
    kcodes, vcodes = kc.quantize(k), vc.quantize(v)
    kp = {f: ks._paged(t, bs) for f, t in kcodes.fields.items()}
    vp = {f: ks._paged(t, bs) for f, t in vcodes.fields.items()}
    table = next(iter(kp.values()))[1]
    kf = {f: x[0] for f, x in kp.items()}; vf = {f: x[0] for f, x in vp.items()}
    calls[name] = (lambda kc=kc, kf=kf, vc=vc, vf=vf, table=table:
                   launch.paged_decode(q, kc, kf, vc, vf, table, bs, start, end, impl="c", threads=1))
times = {x: [] for x in calls}
for r in range(int(sys.argv[6]) if len(sys.argv) > 6 else 15):
    for name, f in calls.items():
        t0 = time.perf_counter(); f(); dt = time.perf_counter() - t0
        if r >= 2: times[name].append(dt)
base = statistics.median(times["tq-k3v2"]) if "tq-k3v2" in times else None
for name, ts in times.items():
    m = statistics.median(ts)
    print(f"{name:10s} median {m*1e3:7.2f} ms  {m*1e9/(h*n):6.1f} ns/token-head" + (f"  x{m/base:.2f}" if base else ""))
