import time, statistics, torch, cProfile, pstats, sys
from qjl import QJLCache, QJLConfig
from qjl.tools.models import load_model
from qjl.tools.methods import make_cache
from qjl import cache_kwargs
from qjl.tools.evaluate import load_text_ids
torch.set_grad_enabled(False)
model, tok = load_model()
import qjl; qjl.patch_attention(model)
ids = load_text_ids(tok, "gpl-3", 1536)[0].unsqueeze(0)
cfgs = {"fixed": QJLConfig.preset("tq-k3v3"), "auto": QJLConfig.auto(bits_per_value=3.0),
        "auto-nofit": QJLConfig.auto(bits_per_value=3.0, fit_key_scale=False)}
ts = {k: [] for k in cfgs}
for _ in range(3):
    for k, c in cfgs.items():
        t = time.perf_counter()
        cache = QJLCache(model, c)
        model(ids, **cache_kwargs(cache))
        model(ids[:, -1:], **cache_kwargs(cache))  # the next step: a pending allocation flushes here
        ts[k].append(time.perf_counter() - t)
print({k: round(statistics.median(v), 3) for k, v in ts.items()})
if len(sys.argv) > 2:
    cache = QJLCache(model, cfgs["auto"])
    pr = cProfile.Profile(); pr.enable()
    model(ids, **cache_kwargs(cache)); model(ids[:, -1:], **cache_kwargs(cache))
    pr.disable(); pstats.Stats(pr).sort_stats("cumulative").print_stats("key_scale|storage|allocation", 30)
from qjl.cache import storage as S
import functools
spent = [0.0]
orig = S.LayerStore._fit_scale
def timed(self, *a):
    t = time.perf_counter(); r = orig(self, *a); spent[0] += time.perf_counter() - t; return r
S.LayerStore._fit_scale = timed
for _ in range(3):
    spent[0] = 0.0
    t = time.perf_counter()
    cache = QJLCache(model, cfgs["auto"]); model(ids, **cache_kwargs(cache)); model(ids[:, -1:], **cache_kwargs(cache))
    print("fit", round(spent[0], 3), "of", round(time.perf_counter() - t, 3))
