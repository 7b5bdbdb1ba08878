"""Scratch (not shipped): QJLConfig.auto with widths chosen per KV head instead of per layer.

Every method named auto-* in this process allocates per KV head: each layer's per-head sensitivities (S_K, S_V of
qjl.cache.allocation.layer_sensitivity on that head's keys, values and its query group), the layer's candidate
distortions, greedy over (layers x heads) units within the same budget.  A layer's heads are then coded by a
wrapper codec that quantizes and immediately dequantizes each head with its own candidate (float32 held: bits
reported by the cache are NOT the codes'; the bits of the choice are printed from the candidates').  Decode runs
through the SDPA path (kernels do not read the wrapper), as qjl eval's 32-token chunks do anyway."""
import sys, json
sys.path.insert(0, "src")
import torch
from qjl.cache import allocation as A
from qjl.codecs.base import Codec, Codes

LOG = []


class PerHead(Codec):
    positional = True

    def __init__(self, codecs):
        self.codecs, self.dim = codecs, codecs[0].dim

    def __repr__(self):
        return "PerHead(" + ", ".join(repr(c) for c in self.codecs) + ")"

    def quantize(self, x, *fit, start=0):
        parts = [c.dequantize(c.quantize(x[:, h:h + 1].contiguous(), start=start), start=start) if getattr(c, "positional", False)
                 else c.dequantize(c.quantize(x[:, h:h + 1].contiguous())) for h, c in enumerate(self.codecs)]
        return Codes(lead=tuple(x.shape[:-1]), fields={"x": torch.cat(parts, dim=1).float()})

    def dequantize(self, codes, start=0):
        return codes.fields["x"]

    def bit_budget(self):
        return self.codecs[0].bit_budget()

    def norm_limit(self):
        lims = [c.norm_limit() for c in self.codecs]
        return None if any(l is None for l in lims) else min(lims)

    def check_storable(self, x, name="x", *fit):
        for h, c in enumerate(self.codecs):
            c.check_storable(x[:, h:h + 1], name)


orig_observe = A.Allocator.observe


def observe(self, store, query, mask, scaling):
    fresh = store.auto_stats is None
    orig_observe(self, store, query, mask, scaling)
    if not fresh:
        return
    keys, values = store.keys, store.values
    r = min(self.auto.queries, query.shape[2])
    m = None if mask is None else mask[:, :, -r:] if mask.shape[2] > 1 else mask
    tokens = A._compressible(keys.shape[2], self.config.sink_tokens, self.config.residual_length)
    hkv = keys.shape[1]
    g = query.shape[1] // hkv
    store.head_stats = [A.layer_sensitivity(query[:, h * g:(h + 1) * g, -r:], keys[:, h:h + 1], values[:, h:h + 1],
                                            m if m is None or m.shape[1] == 1 else m[:, h * g:(h + 1) * g], scaling, tokens)
                        for h in range(hkv)]


def allocate(self):
    live = self.stores
    exact_bits = 8 * live[0].exact_dtype.itemsize
    stats = [s.auto_stats for s in live]
    tokens = min(st["tokens"] for st in stats)
    budget = A.planned_budget(self.auto.bits_per_value, tokens, self.config.flush_block, self.config.smooth_keys,
                              live[0].key_dim, live[0].value_dim, self.config.smooth_values, self.config.heavy_tokens,
                              live[0].heads)
    units = [dict(st, s_k=sk, s_v=sv) for st, s in zip(stats, live) for sk, sv in s.head_stats]
    picks = A.choose_widths(units, budget, exact_bits, 0)
    layer_picks = A.choose_widths(stats, budget, exact_bits, 0)
    hkv = live[0].heads
    rec = {"budget": budget, "pred_head": A.predicted_error(units, picks),
           "pred_layer": A.predicted_error(units, [p for p in layer_picks for _ in range(hkv)]),
           "bits": sum(u["keys"][p[0]][0] + u["values"][p[1]][0] for u, p in zip(units, picks)) / (2 * len(units)),
           "picks": [list(p) for p in picks]}
    LOG.append(rec)
    print(f"per-head allocation: predicted {rec['pred_head']:.4g} vs per-layer {rec['pred_layer']:.4g}, "
          f"mean bits {rec['bits']:.3f} (budget {budget:.3f})", flush=True)
    self.choices = {}
    for li, store in enumerate(live):
        kc, vc = store.candidates
        ps = picks[li * hkv:(li + 1) * hkv]
        store.assign(self.auto.key_candidates[ps[0][0]], self.auto.value_candidates[ps[0][1]],
                     codecs=(PerHead([kc[p[0]] for p in ps]), PerHead([vc[p[1]] for p in ps])))
        store.candidates = None
        self.choices[store.layer_idx] = ps[0]


A.Allocator.observe = observe
A.Allocator.allocate = allocate

if __name__ == "__main__":
    from qjl.tools.cli import main
    try:
        main()
    finally:
        out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "."
        json.dump(LOG, open(f"{out}/perhead_log.json", "w"))
