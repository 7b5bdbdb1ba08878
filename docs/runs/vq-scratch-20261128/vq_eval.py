"""scratch: auto(B) with VQ value (and key) candidates vs scalar, SDPA path for all arms.
Arms: name=auto-B[,v][,k] (v: VQ values, k: VQ keys)."""
import argparse, sys
sys.path.insert(0, "/tmp/scratch/vq")
import qjl.tools.evalrun as er
from qjl import QJLConfig
from qjl.cache.config import CodecSpec
from qjl.cache.allocation import AutoBits
from qjl.codecs import registry
from vqcodec import TurboQuantVQ

registry.CODECS["tq_vq"] = TurboQuantVQ
p = argparse.ArgumentParser()
p.add_argument("--texts", nargs="+"); p.add_argument("--arms", nargs="+")
p.add_argument("--contexts", nargs="+", type=int, default=[1536]); p.add_argument("--segments", type=int, default=1)
p.add_argument("--out", default="/tmp/scratch/vq/run")
p.add_argument("--seeds", nargs="+", type=int, default=[0])
p.add_argument("--kernel", default="torch")
a = p.parse_args()

def vq(spec):
    return CodecSpec("tq_vq", dict(spec.params), per_dim=spec.per_dim) if spec.name == "turboquant_mse" and spec.params["bits"] <= 4 else spec

arms = {}
for s in a.arms:
    name, spec = s.split("=")
    xs = spec.split(",")
    if not xs[0].startswith("auto-"):
        cfg = QJLConfig.preset(xs[0])
        over = {}
        if "v" in xs[1:]: over["value"] = vq(cfg.value)
        if "k" in xs[1:]:
            over["key"] = vq(cfg.key)
            if cfg.late_key is not None: over["late_key"] = vq(cfg.late_key)
        for sd in a.seeds:
            arms[name if sd == 0 else f"{name}@{sd}"] = QJLConfig.preset(xs[0], seed=sd, kernel=a.kernel, **over)
        continue
    b = float(xs[0][5:])
    base = AutoBits(bits_per_value=b)
    kw = {}
    if "v" in xs[1:]:
        kw["value_candidates"] = tuple(vq(c) for c in base.value_candidates)
    if "k" in xs[1:]:
        kw["key_candidates"] = tuple(vq(c) for c in base.key_candidates)
    for sd in a.seeds:
        arms[name if sd == 0 else f"{name}@{sd}"] = QJLConfig.named(xs[0], seed=sd, kernel=a.kernel, **kw)
orig = er.make_method
er.make_method = lambda name: arms[name] if name in arms else orig(name)
plan = er.EvalPlan(texts=tuple(a.texts), contexts=tuple(a.contexts), methods=tuple([er.REFERENCE] + list(arms)),
                   segments=a.segments, passkey_trials=0, memory_tokens=0)
m = er.run_eval(plan, a.out, show_progress=False)
for name, r in m["results"].items():
    for t, ctxs in r["texts"].items():
        for c, x in ctxs.items():
            print(f"{name:10s} {t:14s} {c} KL {x.get('kl',0):.4f} ppl {x['ppl']:.3f} ({x.get('dppl', 0):+.2f}%"
                  f" ±{x.get('dppl_se', 0):.2f}) top1 {100*x.get('top1',1):.1f} bits {x.get('compressed_bits',0):.3f}", flush=True)
