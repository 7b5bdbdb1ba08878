import ctypes, os, sys, time, statistics, torch
sys.path.insert(0, "benchmarks")
import kernel_speed as ks
from qjl.kernels.cpu import launch
from qjl.kernels.paged import PagedField
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
keep = []
def zeros(shape, dtype, huge):
    if not huge: return torch.zeros(shape, dtype=dtype)
    n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(n + (4 << 20), dtype=torch.uint8); keep.append(raw)
    p = raw.data_ptr(); a = (p + (2 << 20) - 1) & ~((2 << 20) - 1)
    libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(n + (2 << 20)), 14)
    t = raw[a - p:a - p + n].view(dtype).view(shape); t.zero_(); return t
h, n, d, r = 8, 65536, 128, 4
g = torch.Generator().manual_seed(0)
k, v, q = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g), torch.randn(1, h, r, d, generator=g)
start, end = torch.zeros(1, dtype=torch.int32), torch.full((1,), n, dtype=torch.int32)
kc, vc = ks.CODECS["tq-k3v2"](d)
kcodes, vcodes = kc.quantize(k), vc.quantize(v)
def pool(t, block, huge):
    _, hh, nn = t.shape[:3]; nb = nn // block; tail = t.shape[3:]
    perm = torch.arange(nb)
    p = zeros((nb, hh, block, *tail), t.dtype, huge)
    p[perm] = t[0].reshape(hh, nb, block, *tail).transpose(0, 1)
    es = t.element_size()
    return PagedField(p, 0, p.stride(0) * es, p.stride(1) * es, p.stride(2) * es, t.dtype, tuple(tail)), perm.to(torch.int32)[None]
lays = {"contig": ({f: PagedField.of(t) for f, t in kcodes.fields.items()}, {f: PagedField.of(t) for f, t in vcodes.fields.items()}, torch.zeros(1, 1, dtype=torch.int32), n)}
for name, huge in [("bh", 0), ("bh-thp", 1)]:
    kp = {f: pool(t, 128, huge) for f, t in kcodes.fields.items()}; vp = {f: pool(t, 128, huge) for f, t in vcodes.fields.items()}
    lays[name] = ({f: x[0] for f, x in kp.items()}, {f: x[0] for f, x in vp.items()}, next(iter(kp.values()))[1], 128)
print([l.strip() for l in open("/proc/self/smaps_rollup") if "AnonHuge" in l])
res = {}
for pf in (0, 1):
    if pf: os.environ["QJL_X_NEXT"] = "1"
    else: os.environ.pop("QJL_X_NEXT", None)
    ts = {x: [] for x in lays}
    for rep in range(14):
        for name, (kf, vf, bt, bs) in lays.items():
            t0 = time.perf_counter(); launch.paged_decode(q, kc, kf, vc, vf, bt, bs, start, end, impl="c-int", threads=2); dt = time.perf_counter() - t0
            if rep >= 2: ts[name].append(dt)
    print("prefetch", pf, {x: round(statistics.median(t) * 1e3, 2) for x, t in ts.items()}, flush=True)
