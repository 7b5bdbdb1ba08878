import sys, torch
import qjl.cache.allocation as al
from qjl import QJLConfig, patch_attention
from qjl.tools.evaluate import EvalSetup, score_method, token_quality, load_text_ids
from qjl.tools.models import load_model
from qjl.tools.texts import resolve_texts
torch.set_grad_enabled(False); torch.set_num_threads(2)
orig = al.choose_widths
GROUP = set()
ROLE = "values"
def patched(stats, budget, exact_bits, boundary):
    picks = orig(stats, budget, exact_bits, boundary)
    out = []
    for l, p in enumerate(picks):
        if l in GROUP and p is not None:
            p = (p[0], len(stats[l]["values"]) - 1) if ROLE == "values" else (len(stats[l]["keys"]) - 1, p[1])
        out.append(p)
    return out
al.choose_widths = patched
model, tok = load_model(); patch_attention(model)
setup = EvalSetup(context=1536, score=512)
groups = [()] + [tuple(range(a, a + 5)) for a in range(0, 30, 5)]
ROLE = sys.argv[1]
for text in sys.argv[2:]:
    ids, _ = load_text_ids(tok, resolve_texts([text])[0], setup.tokens)
    ref, _, _ = score_method(model, ids, setup, None)
    tg = ids[setup.context:setup.tokens]
    base = None
    for g in groups:
        GROUP = set(g)
        lp, _, _ = score_method(model, ids, setup, QJLConfig.auto(bits_per_value=3.0))
        c = token_quality(lp, tg, ref)
        d = c["nll"] - c["ref_nll"]
        if base is None: base = c["nll"]
        print(f"{ROLE} {text:14s} {str(g):20s} KL {c['kl'].mean():.4f} ppl {100*(d.mean().exp()-1):+.2f}% top1 {c['top1'].mean()*100:.1f} vs base dnll {(c['nll']-base).mean():+.4f}", flush=True)
