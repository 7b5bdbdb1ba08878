import sys, torch
from qjl import QJLConfig, patch_attention
from qjl.tools.evaluate import EvalSetup, score_method, token_quality, load_text_ids
from qjl.tools.models import load_model
from qjl.tools.texts import resolve_texts
from qjl.tools.methods import cache_memory
torch.set_grad_enabled(False); torch.set_num_threads(2)
cfgs = {}
for spec in sys.argv[1].split(","):
    b, w = spec.split("w"); cfgs[spec] = QJLConfig.auto(bits_per_value=float(b), residual_length=int(w))
model, tok = load_model(); patch_attention(model)
setup = EvalSetup(context=1536, score=512)
for text in sys.argv[2:]:
    ids, _ = load_text_ids(tok, resolve_texts([text])[0], setup.tokens)
    ref, _, _ = score_method(model, ids, setup, None)
    tg = ids[setup.context:setup.tokens]
    for name, cfg in cfgs.items():
        lp, cache, _ = score_method(model, ids, setup, cfg)
        m = cache_memory(cache)
        c = token_quality(lp, tg, ref); d = c["nll"] - c["ref_nll"]
        print(f"{text:14s} {name:10s} KL {c['kl'].mean():.4f} ppl {100*(d.mean().exp()-1):+.2f}% top1 {c['top1'].mean()*100:.1f} comp {m['compressed_bits']:.3f} total@2048 {m['bits_per_value']:.3f}", flush=True)
