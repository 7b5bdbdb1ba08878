"""Scratch A/B (not a test, not a benchmark of the repo): decode steps of the embedded model with one preset, two
caches prefilled alike, their decode steps in turn (a flush every 8 steps: the mean step counts it, the median not); cache "C" flushes as the code now does (the C encoder straight
into the code buffers), cache "torch" with that path turned off on each of its layer stores (codec.quantize, as
before).  Run from the repo root:  python docs/runs/flush-c-scratch-20261129/flush_ab.py tqa-5x 8192 24"""
import json
import statistics
import sys
import time

sys.path.insert(0, "src")
import torch  # noqa: E402

import qjl  # noqa: E402
from qjl.cache import storage  # noqa: E402
from qjl.cache.presets import PRESETS  # noqa: E402
from qjl.tools.bench import long_text_ids  # noqa: E402
from qjl.tools.models import load_model  # noqa: E402

preset, ctx, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_grad_enabled(False)
model, tok = load_model()
qjl.patch_attention(model)
ids = long_text_ids(tok, ctx)[None]
flush_time = {"C": 0.0, "torch": 0.0}
real_flush = storage.LayerStore.flush
caches, nxt, times = {}, {}, {"C": [], "torch": []}
which = [None]


def timed_flush(self):
    t = time.perf_counter()
    real_flush(self)
    flush_time[which[0]] += time.perf_counter() - t


storage.LayerStore.flush = timed_flush
for name in ("C", "torch"):
    cache = caches[name] = qjl.QJLCache(model, PRESETS[preset])
    which[0] = name
    out = None
    for s in range(0, ctx, 512):
        out = model(ids[:, s:s + 512], **qjl.cache_kwargs(cache), use_cache=True)
    nxt[name] = out.logits[:, -1:].argmax(-1)
    if name == "torch":  # every layer store of this cache: the C flush off (scratch only)
        for layer in cache.layers:
            if hasattr(layer, "store"):
                layer.store._flush_stored = lambda *a: False
for i in range(steps + 2):
    for name in ("C", "torch"):
        which[0] = name
        if i == 2:
            flush_time[name] = 0.0
        t = time.perf_counter()
        o = model(nxt[name], **qjl.cache_kwargs(caches[name]), use_cache=True)
        nxt[name] = o.logits[:, -1:].argmax(-1)
        if i >= 2:
            times[name].append(time.perf_counter() - t)
row = {name: {"decode_ms_median": 1e3 * statistics.median(ts), "decode_ms_mean": 1e3 * statistics.mean(ts),
              "flush_ms_per_step": 1e3 * flush_time[name] / steps} for name, ts in times.items()}
row.update(preset=preset, context=ctx, steps=steps, threads=torch.get_num_threads(),
           same_tokens=bool(torch.equal(nxt["C"], nxt["torch"])))
print(json.dumps(row))
