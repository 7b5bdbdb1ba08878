"""scratch: auto(B) with a recency value tier, through run_eval.  Arms: name=B[,tier_bits,tier_tokens]."""
import argparse
import qjl.tools.evalrun as er
from qjl import QJLConfig
from qjl.cache.config import CodecSpec
p = argparse.ArgumentParser()
p.add_argument("--texts", nargs="+"); p.add_argument("--arms", nargs="+")
p.add_argument("--contexts", nargs="+", type=int, default=[1536]); p.add_argument("--segments", type=int, default=1)
p.add_argument("--out", default="/tmp/scratch/tier")
a = p.parse_args()
arms = {}
for s in a.arms:
    name, spec = s.split("=")
    xs = spec.split(",")
    kw = {}
    if len(xs) > 1:
        kw = dict(value_tier=CodecSpec("turboquant_mse", {"bits": int(xs[1]), "correct_norm": True, "norm_dtype": "fp8"}),
                  value_tier_tokens=int(xs[2]))
    arms[name] = QJLConfig.auto(bits_per_value=float(xs[0]), **kw)
orig = er.make_method
er.make_method = lambda name: arms[name] if name in arms else orig(name)
plan = er.EvalPlan(texts=tuple(a.texts), contexts=tuple(a.contexts), methods=tuple([er.REFERENCE] + list(arms)),
                   segments=a.segments, passkey_trials=0, memory_tokens=0)
m = er.run_eval(plan, a.out, show_progress=False)
for name, r in m["results"].items():
    for t, ctxs in r["texts"].items():
        for c, x in ctxs.items():
            print(f"{name:10s} {t:14s} {c} KL {x.get('kl',0):.4f} ppl {x['ppl']:.3f} ({x.get('dppl', 0):+.2f}%) top1 {100*x.get('top1',1):.1f} "
                  f"bits {x.get('compressed_bits',0):.3f} se {x.get('dnll_se',0):.4f}", flush=True)
