"""scratch: simulated value codecs (TurboQuant 2/3-bit vs a PCA basis with bits water-filled), keys TQ 3-bit,
in a DynamicCache after a full-precision prefill; sinks 4 + window 120 exact; 512 tokens scored in chunks of 32
(scored tokens stay exact). Relative comparison only."""
import sys, math, torch
from transformers import DynamicCache
from qjl import cache_kwargs
from qjl.codecs.turboquant import TurboQuantMSE
from qjl.core.lloyd_max import lloyd_max
from qjl.tools.evaluate import load_text_ids, token_quality
from qjl.tools.models import load_model
from qjl.tools.texts import resolve_texts
torch.set_grad_enabled(False); torch.set_num_threads(2)
CTX, SCORE, CH, SINK, WIN = 1536, 512, 32, 4, 120
import numpy as np
gpdf = lambda x: np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
BOOKS = {b: lloyd_max(gpdf, -8.0, 8.0, b) for b in (1, 2, 3, 4, 5)}
DG = {}
for b, cb in BOOKS.items():  # distortion of unit gaussian
    z = torch.randn(200000, dtype=torch.float64)
    c = torch.as_tensor(cb.centroids, dtype=torch.float64); bd = torch.as_tensor(cb.boundaries, dtype=torch.float64)
    DG[b] = float((z - c[torch.bucketize(z, bd)]).square().mean())
DG[0] = 1.0
print("gaussian LM distortion", {b: round(d, 4) for b, d in DG.items()})
def gq(z, b):
    if b == 0: return torch.zeros_like(z)
    cb = BOOKS[b]; c = torch.as_tensor(cb.centroids, dtype=z.dtype); bd = torch.as_tensor(cb.boundaries, dtype=z.dtype)
    return c[torch.bucketize(z, bd)]
def tq(x, bits, seed):
    c = TurboQuantMSE(x.shape[-1], bits, seed=seed, correct_norm=True)
    return c.dequantize(c.quantize(x.float())).to(x.dtype)
def pca(x, total_bits, center=True):  # x [n, d] centered
    d = x.shape[1]
    cov = x.T.double() @ x.double() / x.shape[0]
    ev, U = torch.linalg.eigh(cov); ev = ev.clamp(min=1e-12)
    b = [0] * d
    for _ in range(total_bits):  # greedy water-filling
        i = max(range(d), key=lambda i: ev[i] * (DG[b[i]] - DG.get(b[i] + 1, DG[b[i]])) if b[i] < 5 else -1)
        b[i] += 1
    z = (x.double() @ U) / ev.sqrt()
    zh = torch.stack([gq(z[:, i], b[i]) for i in range(d)], 1)
    return ((zh * ev.sqrt()) @ U.T).to(x.dtype)
def arm(kind, v, layer, h):
    if kind == "exact": return v
    if kind.startswith("tq"): return tq(v, int(kind[2:]), 7 + 1000 * layer + h)
    if kind.startswith("pcan"):
        r = v.norm(dim=-1, keepdim=True).clamp(min=1e-12); u = v / r
        uh = pca(u, int(float(kind[4:]) * v.shape[1]) - 8, center=False)
        cos = (u * uh).sum(-1, keepdim=True) / uh.square().sum(-1, keepdim=True).clamp(min=1e-12)
        return (r * uh / (u * uh).sum(-1, keepdim=True).clamp(min=1e-6)).to(v.dtype)
    if kind.startswith("pca"): return pca(v, int(float(kind[3:]) * v.shape[1]))
def run(model, ids, varm):
    cache = DynamicCache(config=model.config)
    model(ids[:CTX].unsqueeze(0), **cache_kwargs(cache), use_cache=True)
    if varm is not None:
        for l, layer in enumerate(cache.layers):
            k, v = layer.keys, layer.values
            n = k.shape[2]; sl = slice(SINK, n - WIN)
            for h in range(k.shape[1]):
                kk = k[0, h, sl]; mu = kk.mean(0); k[0, h, sl] = mu + tq(kk - mu, 3, 11 + 1000 * l + h)
                vv = v[0, h, sl]; mv = vv.mean(0); v[0, h, sl] = mv + arm(varm, vv - mv, l, h)
    out = []
    for s in range(CTX, CTX + SCORE, CH):
        lg = model(ids[s:s + CH].unsqueeze(0), **cache_kwargs(cache), use_cache=True).logits[0]
        out.append(torch.log_softmax(lg.float(), -1))
    # predictions for tokens s+1..: logp of position j predicts ids[j+1]
    return torch.cat(out)[:-1]
model, tok = load_model()
for text in sys.argv[2:]:
    ids, _ = load_text_ids(tok, resolve_texts([text])[0], CTX + SCORE)
    ref = run(model, ids, None); tg = ids[CTX + 1: CTX + SCORE]
    for a in sys.argv[1].split(","):
        lp = run(model, ids, a)
        c = token_quality(lp, tg, ref); d = c["nll"] - c["ref_nll"]
        print(f"{text:14s} values {a:8s} KL {c['kl'].mean():.4f} ppl {100*(d.mean().exp()-1):+.2f}% top1 {100*c['top1'].mean():.1f}", flush=True)
