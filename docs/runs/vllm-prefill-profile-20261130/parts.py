import sys, time, functools, collections, torch
sys.argv = ["x", "--preset", sys.argv[1], "--threads", "2", "--context", sys.argv[2], "--chunk", sys.argv[3], "--repeats", "40"]
import qjl.integrations.vllm.prefill as P
import qjl.integrations.vllm.paged as PG
T = collections.defaultdict(list)
def wrap(mod, name, label=None):
    f = getattr(mod, name)
    @functools.wraps(f)
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); T[label or name].append(time.perf_counter() - t0); return r
    setattr(mod, name, g)
wrap(P, "sequence_kv")
ops = P._cpu_ops()
class W:
    def __getattr__(self, n):
        f = getattr(ops, n)
        def g(*a, **k):
            t0 = time.perf_counter(); r = f(*a, **k); T[n].append(time.perf_counter() - t0); return r
        return g
orig_ready = P.VLLMPrefill._ready
def ready(self):
    r = orig_ready(self); self.ops = W(); return r
P.VLLMPrefill._ready = ready
orig_att = P.VLLMPrefill._attend
def att(self, *a, **k):
    t0 = time.perf_counter(); r = orig_att(self, *a, **k); T["_attend"].append(time.perf_counter() - t0); return r
P.VLLMPrefill._attend = att
sys.path.insert(0, "benchmarks")
import vllm_layer_profile as V
res = V.main()
print({k: round(v, 3) for k, v in res["ms"].items() if "prefill" in k})
for k, v in T.items():
    v = sorted(v)[len(v)//2] * 1e3
    print(f"{k:40s} {v:.3f} ms")
