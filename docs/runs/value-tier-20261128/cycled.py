"""scratch: do value-code errors add up coherently over similar tokens?  TurboQuant MSE with K rotations used in turn
by code index (token t of the codes uses rotation t mod K; flushes are whole multiples of K), against one rotation,
in fixed presets through run_eval (SDPA path for both: the cycled codec has no kernel views).
Arms: name=preset[,value K[,key K]]."""
import argparse
import torch
import qjl.tools.evalrun as er
from qjl import QJLConfig
from qjl.cache.config import CodecSpec
from qjl.codecs import registry
from qjl.codecs.base import Codes
from qjl.codecs.params import Param, integer
from qjl.codecs.turboquant import TurboQuantMSE


class Cycled(TurboQuantMSE):
    name = "tq_cycled"
    params = {**TurboQuantMSE.params, "cycles": Param(integer(1, 64))}

    def __init__(self, dim, bits=3, rotation="haar", seed=0, norm_dtype="fp16", correct_norm=False, cycles=4):
        super().__init__(dim, bits, rotation, seed, norm_dtype, correct_norm)
        self.subs = [TurboQuantMSE(dim, bits, rotation, seed + 7919 * j, norm_dtype, correct_norm) for j in range(cycles)]

    def quantize(self, x):
        n, k = x.shape[-2], len(self.subs)
        parts = [self.subs[j].quantize(x[..., j::k, :]) for j in range(k)]
        f = {}
        for name in parts[0].fields:
            t0 = parts[0].fields[name]
            out = torch.empty(*x.shape[:-2], n, *t0.shape[x.ndim - 1:], dtype=t0.dtype)
            for j, p in enumerate(parts):
                if t0.ndim == x.ndim:
                    out[..., j::k, :] = p.fields[name]
                else:
                    out[..., j::k] = p.fields[name]
            f[name] = out
        return Codes(tuple(x.shape[:-1]), f)

    def dequantize(self, codes):
        n, k = codes.lead[-1], len(self.subs)
        out = None
        for j, s in enumerate(self.subs):
            sub = Codes((*codes.lead[:-1], len(range(j, n, k))), {a: t[..., j::k, :] if t.ndim > len(codes.lead) else t[..., j::k]
                                                                 for a, t in codes.fields.items()})
            y = s.dequantize(sub)
            if out is None:
                out = torch.empty(*codes.lead, y.shape[-1])
            out[..., j::k, :] = y
        return out

    def inner_product(self, q, codes):
        return torch.matmul(q.float(), self.dequantize(codes).transpose(-1, -2))

    def score_view(self): return None
    def mix_view(self): return None
    def quantize_view(self): return None


registry.CODECS["tq_cycled"] = Cycled
p = argparse.ArgumentParser()
p.add_argument("--texts", nargs="+"); p.add_argument("--arms", nargs="+")
p.add_argument("--contexts", nargs="+", type=int, default=[1536]); p.add_argument("--segments", type=int, default=1)
p.add_argument("--out", default="/tmp/scratch/cycled")
p.add_argument("--seeds", nargs="+", type=int, default=[0], help="config seeds (arm@s for s > 0)")
a = p.parse_args()


def cyc(spec, k):
    return CodecSpec("tq_cycled", {**spec.params, "cycles": k})


arms = {}
for s in a.arms:
    name, spec = s.split("=")
    xs = spec.split(",")
    if xs[0].startswith("auto-"):  # auto-B[,value K]: the value candidates cycled
        from qjl.cache.allocation import AutoBits
        vc = AutoBits(bits_per_value=3.0).value_candidates
        if len(xs) > 1 and int(xs[1]) > 1:
            vc = tuple(cyc(c, int(xs[1])) for c in vc)
        for sd in a.seeds:
            arms[name if sd == 0 else f"{name}@{sd}"] = QJLConfig.named(xs[0], seed=sd, value_candidates=vc)
        continue
    cfg = QJLConfig.preset(xs[0])
    over = {}
    if len(xs) > 1 and int(xs[1]) > 1:
        over["value"] = cyc(cfg.value, int(xs[1]))
    if len(xs) > 2 and int(xs[2]) > 1:
        over["key"] = cyc(cfg.key, int(xs[2]))
        if cfg.late_key is not None:
            over["late_key"] = cyc(cfg.late_key, int(xs[2]))
    for sd in a.seeds:
        arms[name if sd == 0 else f"{name}@{sd}"] = QJLConfig.preset(xs[0], **over, seed=sd)
orig = er.make_method
er.make_method = lambda name: arms[name] if name in arms else orig(name)
plan = er.EvalPlan(texts=tuple(a.texts), contexts=tuple(a.contexts), methods=tuple([er.REFERENCE] + list(arms)),
                   segments=a.segments, passkey_trials=0, memory_tokens=0)
m = er.run_eval(plan, a.out, show_progress=False)
for name, r in m["results"].items():
    for t, ctxs in r["texts"].items():
        for c, x in ctxs.items():
            print(f"{name:10s} {t:14s} {c} KL {x.get('kl',0):.4f} ppl {x['ppl']:.3f} ({x.get('dppl', 0):+.2f}%) "
                  f"top1 {100*x.get('top1',1):.1f} bits {x.get('compressed_bits',0):.3f}", flush=True)
