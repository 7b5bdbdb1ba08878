import sys, torch, time
from qjl import QJLConfig, patch_attention, CodecSpec
from qjl.tools.evaluate import EvalSetup, score_method, token_quality, load_text_ids
from qjl.tools.models import load_model
from qjl.tools.texts import resolve_texts
torch.set_grad_enabled(False); torch.set_num_threads(2)
def tq(b, norm="fp16"):
    p = {"bits": b, "correct_norm": True}
    return CodecSpec("turboquant_mse", p if norm == "fp16" else {**p, "norm_dtype": norm})
common = dict(late_key=None, smooth_keys=True, smooth_values=True, heavy_tokens=16, residual_length=120, flush_block=8, exact_dtype="fp16")
cfgs = {
 "k3v2": QJLConfig(key=tq(3), value=tq(2, "fp8"), **common),
 "k8v2": QJLConfig(key=tq(8), value=tq(2, "fp8"), **common),
 "k3v8": QJLConfig(key=tq(3), value=tq(8), **common),
 "auto3": QJLConfig.auto(bits_per_value=3.0),
}
model, tok = load_model(); patch_attention(model)
setup = EvalSetup(context=1536, score=512)
for text in sys.argv[1:]:
    ids, _ = load_text_ids(tok, resolve_texts([text])[0], setup.tokens)
    ref, _, _ = score_method(model, ids, setup, None)
    tg = ids[setup.context:setup.tokens]
    for name, cfg in cfgs.items():
        lp, _, _ = score_method(model, ids, setup, cfg)
        c = token_quality(lp, tg, ref)
        d = c["nll"] - c["ref_nll"]
        top = torch.topk(d, 5)
        print(f"{text:14s} {name:6s} KL {c['kl'].mean():.4f} dnll {d.mean():+.4f} ppl {100*(d.mean().exp()-1):+.2f}% top1 {c['top1'].mean()*100:.1f} top5 dnll {[round(x,2) for x in top.values.tolist()]} at {top.indices.tolist()}", flush=True)
