import os, sys, time, statistics, torch
sys.path.insert(0, "benchmarks")
import kernel_speed as ks
from qjl.kernels.cpu import launch
from qjl.kernels.paged import PagedField
h, n, d, r = 8, 65536, 128, 4
g = torch.Generator().manual_seed(0)
k, v, q = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g), torch.randn(1, h, r, d, generator=g)
start, end = torch.zeros(1, dtype=torch.int32), torch.full((1,), n, dtype=torch.int32)
kc, vc = ks.CODECS["tq-k3v2"](d)
kcodes, vcodes = kc.quantize(k), vc.quantize(v)
def pool(t, block, shuffle, headmajor, pad=0):
    _, hh, nn = t.shape[:3]; nb = nn // block
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(0)) if shuffle else torch.arange(nb)
    tail = t.shape[3:]
    src = t[0].reshape(hh, nb, block, *tail)  # [H, nb, block, ...]
    es = t.element_size()
    if headmajor:  # [H, nb, block(+pad), ...]: block stride within a head
        p = torch.zeros(hh, nb, block + pad, *tail, dtype=t.dtype)
        p[:, perm, :block] = src
        return PagedField(p, 0, p.stride(1) * es, p.stride(0) * es, p.stride(2) * es, t.dtype, tuple(tail)), perm.to(torch.int32)[None]
    p = torch.zeros(nb, hh, block + pad, *tail, dtype=t.dtype)
    p[perm, :, :block] = src.transpose(0, 1)
    return PagedField(p, 0, p.stride(0) * es, p.stride(1) * es, p.stride(2) * es, t.dtype, tuple(tail)), perm.to(torch.int32)[None]
lays = {"contig": ({f: PagedField.of(t) for f, t in kcodes.fields.items()}, {f: PagedField.of(t) for f, t in vcodes.fields.items()}, torch.zeros(1, 1, dtype=torch.int32), n)}
for name, sh, hm, pad in [("bh-shuf", 1, 0, 0), ("bh-ident", 0, 0, 0), ("hb-ident", 0, 1, 0), ("hb-shuf", 1, 1, 0), ("bh-shuf-pad1", 1, 0, 1)]:
    kp = {f: pool(t, 128, sh, hm, pad) for f, t in kcodes.fields.items()}; vp = {f: pool(t, 128, sh, hm, pad) for f, t in vcodes.fields.items()}
    lays[name] = ({f: x[0] for f, x in kp.items()}, {f: x[0] for f, x in vp.items()}, next(iter(kp.values()))[1], 128)
ts = {x: [] for x in lays}
outs = {}
for rep in range(16):
    for name, (kf, vf, bt, bs) in lays.items():
        t0 = time.perf_counter(); o = launch.paged_decode(q, kc, kf, vc, vf, bt, bs, start, end, impl="c-int", threads=2); dt = time.perf_counter() - t0
        if rep >= 2: ts[name].append(dt)
        outs[name] = o
print({x: round(statistics.median(t) * 1e3, 2) for x, t in ts.items()})
print({x: bool(torch.equal(o, outs["contig"])) for x, o in outs.items()})
