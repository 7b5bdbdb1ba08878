"""scratch: auto(3.0) with value_weight variants through run_eval (segments)."""
import sys, argparse
import qjl.tools.evalrun as er
from qjl import QJLConfig
p = argparse.ArgumentParser()
p.add_argument("--texts", nargs="+"); p.add_argument("--weights", nargs="+", type=float)
p.add_argument("--bits", type=float, default=3.0)
p.add_argument("--context", type=int, default=1536); p.add_argument("--segments", type=int, default=1)
p.add_argument("--extra", nargs="*", default=[]); p.add_argument("--out")
a = p.parse_args()
orig = er.make_method
def mk(name):
    if name.startswith("vw"):
        return QJLConfig.auto(bits_per_value=a.bits, value_weight=float(name[2:]))
    return orig(name)
er.make_method = mk
plan = er.EvalPlan(texts=tuple(a.texts), contexts=(a.context,), methods=tuple([er.REFERENCE] + [f"vw{w:g}" for w in a.weights] + a.extra),
                   segments=a.segments, passkey_trials=0, memory_tokens=0)
m = er.run_eval(plan, a.out, show_progress=False)
for name, r in m["results"].items():
    for t, ctxs in r["texts"].items():
        for c, x in ctxs.items():
            print(f"{name:10s} {t:14s} KL {x.get('kl',0):.4f} ppl {x['ppl']:.3f} top1 {100*x.get('top1',1):.1f} bits {x.get('compressed_bits',0):.3f} se {x.get('dnll_se',0):.4f}")
