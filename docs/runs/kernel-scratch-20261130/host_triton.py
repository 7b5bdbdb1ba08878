"""Host-side time of the Triton decode path (the kernels stubbed: nothing launched), on CPU tensors."""
import os, time, statistics, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from qjl.tools.bench import _layer
from qjl.cache.attention import attend
import qjl.kernels.triton.launch as L

class Stub:
    def __getitem__(self, grid):
        return lambda *a, **k: None
if "--stub" in sys.argv:
    L.paged_decode_kernel = Stub(); L.combine_kernel = Stub()
torch.manual_seed(0)
n, hkv, hq, d = int(os.environ.get("N", 4096)), 8, 32, 128
k = torch.randn(1, hkv, n, d); v = torch.randn(1, hkv, n, d); q = torch.randn(1, hq, 1, d)
preset = os.environ.get("PRESET", "tq-k3v2")
store = _layer(preset, k, v, "triton", 0)
f = lambda: attend(store, q, None, d ** -0.5)
for _ in range(5): f()
ts = []
for _ in range(200):
    t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
print(f"{preset} n={n}: host median {statistics.median(ts)*1e6:.0f} us, min {min(ts)*1e6:.0f} us")
if "--prof" in sys.argv:
    with torch.profiler.profile() as p:
        for _ in range(20): f()
    print(p.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    import cProfile, pstats
    cProfile.run("for _ in range(200): f()", "/tmp/scratch/host.prof")
    pstats.Stats("/tmp/scratch/host.prof").sort_stats("cumtime").print_stats(30)
