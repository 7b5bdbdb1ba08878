"""Scratch: would widths per KV head (not per layer) lower auto's predicted error at the same bits?"""
import sys, torch, qjl
from qjl.cache import allocation as A
torch.set_num_threads(2)
per_head = {}
orig = A.Allocator.observe
def observe(self, store, query, mask, scaling):
    fresh = store.auto_stats is None
    orig(self, store, query, mask, scaling)
    if not fresh: return
    keys, values = store.keys, store.values
    r = min(self.auto.queries, query.shape[2])
    m = None if mask is None else mask[:, :, -r:] if mask.shape[2] > 1 else mask
    tokens = A._compressible(keys.shape[2], self.config.sink_tokens, self.config.residual_length)
    hkv = keys.shape[1]; g = query.shape[1] // hkv
    out = []
    for h in range(hkv):
        mh = m if m is None or m.shape[1] == 1 else m[:, h*g:(h+1)*g]
        out.append(A.layer_sensitivity(query[:, h*g:(h+1)*g, -r:], keys[:, h:h+1], values[:, h:h+1], mh, scaling, tokens))
    per_head[store.layer_idx] = out
A.Allocator.observe = observe
captured = {}
orig_alloc = A.Allocator.allocate
def allocate(self):
    captured["stats"] = [s.auto_stats for s in self.stores]
    captured["self"] = self
    orig_alloc(self)
A.Allocator.allocate = allocate

model, tok = qjl.load_model()
qjl.patch_attention(model)
from qjl.tools import texts
name = sys.argv[1]; n = int(sys.argv[2]); budget = float(sys.argv[3])
ids = tok(texts.load_text(name)[0], return_tensors="pt").input_ids[:, :n]
cache = qjl.QJLCache(model, qjl.QJLConfig.auto(bits_per_value=budget))
with torch.no_grad():
    model(ids, past_key_values=cache, use_cache=True)
stats = captured["stats"]; al = captured["self"]
live = al.stores
tokens = min(st["tokens"] for st in stats)
b = A.planned_budget(budget, tokens, al.config.flush_block, al.config.smooth_keys, live[0].key_dim, live[0].value_dim,
                     al.config.smooth_values, al.config.heavy_tokens, live[0].heads)
exact_bits = 8 * live[0].exact_dtype.itemsize
for boundary in (0, al.auto.boundary_layers):
    picks = A.choose_widths(stats, b, exact_bits, boundary)
    e_layer = A.predicted_error(stats, picks)
    hs = []
    for st, s in zip(stats, live):
        for sk, sv in per_head[s.layer_idx]:
            hs.append(dict(st, s_k=sk, s_v=sv))
    ph = A.choose_widths(hs, b, exact_bits, 0)
    e_head = A.predicted_error(hs, ph)
    # sanity: the per-layer picks evaluated on per-head stats
    e_layer_h = A.predicted_error(hs, [p for p in picks for _ in range(live[0].heads)])
    print(f"boundary {boundary}: per-layer {e_layer:.4g} (per-head sum {e_layer_h:.4g}), per-head alloc {e_head:.4g}, ratio {e_head/e_layer_h:.3f}")
    kb = [st["keys"][p[0]][0] if p else None for st, p in zip(hs, ph)]
    vb = [st["values"][p[1]][0] if p else None for st, p in zip(hs, ph)]
    print(" per-head key bits", [round(x,2) if x else x for x in kb])
    print(" per-head val bits", [round(x,2) if x else x for x in vb])
# spread of sensitivities across heads
import math
for s in live[:30:5]:
    print(s.layer_idx, [(f"{a:.3g}", f"{v:.3g}") for a, v in per_head[s.layer_idx]])
