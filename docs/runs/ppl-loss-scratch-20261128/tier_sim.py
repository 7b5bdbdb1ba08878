"""scratch: recency-tiered value precision, simulated in a DynamicCache.  After the full-precision prefill and after
every scored chunk of 32, tokens older than the window W (sinks 4 exact) are replaced by TurboQuant reconstructions
(keys `kb` bits, values `vb` bits; smoothing by the prompt's plain mean); with a tier T > W, values of tokens between W
and T back are coded at `tb` bits first and re-coded from the exact values at `vb` bits once older than T.
Arms: name=kb,vb,W[,tb,T]."""
import sys, torch
from transformers import DynamicCache
from qjl import cache_kwargs
from qjl.codecs.turboquant import TurboQuantMSE
from qjl.tools.evaluate import load_text_ids, token_quality
from qjl.tools.models import load_model
from qjl.tools.texts import resolve_texts
torch.set_grad_enabled(False); torch.set_num_threads(2)
CTX, SCORE, CH, SINK = 1536, 512, 32, 4
CODECS = {}
def rec(x, bits, seed):
    key = (x.shape[-1], bits, seed)
    if key not in CODECS: CODECS[key] = TurboQuantMSE(x.shape[-1], bits, seed=seed, correct_norm=True)
    c = CODECS[key]
    return c.dequantize(c.quantize(x.float())).to(x.dtype)
def run(model, ids, arm):
    cache = DynamicCache(config=model.config)
    model(ids[:CTX].unsqueeze(0), **cache_kwargs(cache), use_cache=True)
    if arm is not None:
        kb, vb, W, *tier = arm
        tb, T = tier if tier else (None, None)
        exact = [(l.keys.clone(), l.values.clone()) for l in cache.layers]
        mus = [(k[0, :, SINK:].mean(1, keepdim=True), v[0, :, SINK:].mean(1, keepdim=True)) for k, v in exact]
    def code(n):  # n tokens in the cache now
        if arm is None: return
        for li, layer in enumerate(cache.layers):
            ek, ev = exact[li]
            if ek.shape[2] < n:  # append the new exact tokens
                ek = torch.cat([ek, layer.keys[:, :, ek.shape[2]:n].clone()], 2)
                ev = torch.cat([ev, layer.values[:, :, ev.shape[2]:n].clone()], 2)
                exact[li] = (ek, ev)
            mk, mv = mus[li]
            old = slice(SINK, max(SINK, n - W))
            for h in range(ek.shape[1]):
                layer.keys[0, h, old] = mk[h] + rec(ek[0, h, old] - mk[h], kb, 11 + 1000 * li + h)
                if T:
                    far, near = slice(SINK, max(SINK, n - T)), slice(max(SINK, n - T), max(SINK, n - W))
                    layer.values[0, h, far] = mv[h] + rec(ev[0, h, far] - mv[h], vb, 7 + 1000 * li + h)
                    layer.values[0, h, near] = mv[h] + rec(ev[0, h, near] - mv[h], tb, 9 + 1000 * li + h)
                else:
                    layer.values[0, h, old] = mv[h] + rec(ev[0, h, old] - mv[h], vb, 7 + 1000 * li + h)
    code(CTX)
    out = []
    for s in range(CTX, CTX + SCORE, CH):
        lg = model(ids[s:s + CH].unsqueeze(0), **cache_kwargs(cache), use_cache=True).logits[0]
        out.append(torch.log_softmax(lg.float(), -1))
        code(s + CH)
    return torch.cat(out)[:-1]
model, tok = load_model()
arms = {a.split("=")[0]: tuple(int(x) for x in a.split("=")[1].split(",")) for a in sys.argv[1].split(";")}
for text in sys.argv[2:]:
    ids, _ = load_text_ids(tok, resolve_texts([text])[0], CTX + SCORE)
    ref = run(model, ids, None); tg = ids[CTX + 1: CTX + SCORE]
    for name, a in arms.items():
        lp = run(model, ids, a)
        c = token_quality(lp, tg, ref); d = c["nll"] - c["ref_nll"]
        print(f"{text:14s} {name:10s} {a} KL {c['kl'].mean():.4f} ppl {100*(d.mean().exp()-1):+.2f}% top1 {100*c['top1'].mean():.1f}", flush=True)
