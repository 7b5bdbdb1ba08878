"""A/B in one process: env toggle QJL_X_PF alternated per call, medians."""
import os, sys, time, statistics, torch
sys.path.insert(0, "benchmarks")
import kernel_speed as ks
from qjl.codecs import TurboQuantMSE, TurboQuantVQ
from qjl.kernels.cpu import launch
from qjl.kernels.paged import PagedField
ks.CODECS["tqk-tqv8"] = lambda d: (TurboQuantMSE(d, 3, correct_norm=True), TurboQuantMSE(d, 2, correct_norm=True, cycles=8, norm_dtype="fp8"))
ks.CODECS["tq3-vq2"] = lambda d: (TurboQuantMSE(d, 3, correct_norm=True), TurboQuantVQ(d, 2, correct_norm=True, norm_dtype="fp8"))
ks.CODECS["tq3-vq4"] = lambda d: (TurboQuantMSE(d, 3, correct_norm=True), TurboQuantVQ(d, 4, correct_norm=True, norm_dtype="fp8"))
ks.CODECS["tq3-vq4c8"] = lambda d: (TurboQuantMSE(d, 3, correct_norm=True), TurboQuantVQ(d, 4, correct_norm=True, norm_dtype="fp8", cycles=8))
var = sys.argv[1]
names = sys.argv[2].split(",")
threads_list = [int(x) for x in sys.argv[3].split(",")]
impl = sys.argv[4] if len(sys.argv) > 4 else "c-int"
layout = sys.argv[5] if len(sys.argv) > 5 else "contiguous"
h, n, d, r = 8, 65536, 128, 4
g = torch.Generator().manual_seed(0)
k, v, q = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g), torch.randn(1, h, r, d, generator=g)
start, end = torch.zeros(1, dtype=torch.int32), torch.full((1,), n, dtype=torch.int32)
for name in names:
    kc, vc = ks.CODECS[name](d)
    kcodes, vcodes = kc.quantize(k), vc.quantize(v)
    if layout == "contiguous":
        kf = {f: PagedField.of(t) for f, t in kcodes.fields.items()}; vf = {f: PagedField.of(t) for f, t in vcodes.fields.items()}
        bt, bs = torch.zeros(1, 1, dtype=torch.int32), n
    else:
        bs = int(layout.split("-")[1])
        kp = {f: ks._paged(t, bs) for f, t in kcodes.fields.items()}; vp = {f: ks._paged(t, bs) for f, t in vcodes.fields.items()}
        bt = next(iter(kp.values()))[1]; kf = {f: x[0] for f, x in kp.items()}; vf = {f: x[0] for f, x in vp.items()}
    for threads in threads_list:
        call = lambda: launch.paged_decode(q, kc, kf, vc, vf, bt, bs, start, end, impl=impl, threads=threads)
        outs = {}
        times = {"off": [], "on": []}
        for rep in range(24):
            for key in ("off", "on"):
                if key == "on": os.environ[var] = "1"
                else: os.environ.pop(var, None)
                t0 = time.perf_counter(); o = call(); dt = time.perf_counter() - t0
                if rep >= 2: times[key].append(dt)
                outs[key] = o
        same = torch.equal(outs["off"], outs["on"])
        print(f"{name} {impl} {layout} threads {threads}: off {statistics.median(times['off'])*1e3:.2f} ms, on {statistics.median(times['on'])*1e3:.2f} ms, ratio {statistics.median(times['on'])/statistics.median(times['off']):.3f}, outputs equal {same}", flush=True)
