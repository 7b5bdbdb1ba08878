import ctypes, sys, time, statistics, torch, os
sys.path.insert(0, "benchmarks")
import kernel_speed as ks
from qjl.kernels.cpu import launch
from qjl.kernels.paged import PagedField
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
def huge_empty(shape, dtype):
    n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(n + (4 << 20), dtype=torch.uint8)  # untouched pages
    p = raw.data_ptr(); a = (p + (2 << 20) - 1) & ~((2 << 20) - 1)
    r = libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(n + (2 << 20) - (a - p) + (2<<20) - (2<<20)), 14)
    off = a - p
    t = raw[off:off + n].view(dtype).view(shape)
    t._raw = raw
    return t, r
def paged(t, block, huge):
    _, h, n = t.shape[:3]; nb = n // block
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(0))
    shape = (nb, h, block, *t.shape[3:])
    pool = huge_empty(shape, t.dtype)[0] if huge else torch.empty(shape, dtype=t.dtype)
    pool[perm] = t[0].reshape(h, nb, block, *t.shape[3:]).transpose(0, 1)
    es = t.element_size()
    return PagedField(pool, 0, pool.stride(0) * es, pool.stride(1) * es, pool.stride(2) * es, t.dtype, tuple(t.shape[3:])), perm.to(torch.int32)[None], pool
h, n, d, r = 8, 65536, 128, 4
g = torch.Generator().manual_seed(0)
k, v, q = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g), torch.randn(1, h, r, d, generator=g)
start, end = torch.zeros(1, dtype=torch.int32), torch.full((1,), n, dtype=torch.int32)
kc, vc = ks.CODECS["tq-k3v2"](d)
kcodes, vcodes = kc.quantize(k), vc.quantize(v)
calls = {}
keep = []
for huge in (False, True):
    kp = {f: paged(t, 128, huge) for f, t in kcodes.fields.items()}; vp = {f: paged(t, 128, huge) for f, t in vcodes.fields.items()}
    keep.append((kp, vp))
    bt = next(iter(kp.values()))[1]; kf = {f: x[0] for f, x in kp.items()}; vf = {f: x[0] for f, x in vp.items()}
    calls[huge] = (lambda kf=kf, vf=vf, bt=bt: launch.paged_decode(q, kc, kf, vc, vf, bt, 128, start, end, impl="c-int", threads=2))
print([l for l in open("/proc/self/smaps_rollup") if "AnonHuge" in l])
ts = {False: [], True: []}
for rep in range(24):
    for hg in (False, True):
        t0 = time.perf_counter(); calls[hg](); dt = time.perf_counter() - t0
        if rep >= 2: ts[hg].append(dt)
print("4K pages", statistics.median(ts[False]) * 1e3, "huge", statistics.median(ts[True]) * 1e3)
