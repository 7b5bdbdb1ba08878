import sys, torch
import qjl.codecs.turboquant as tqm
from qjl import QJLConfig, patch_attention, CodecSpec
from qjl.tools.evaluate import EvalSetup, score_method, token_quality, load_text_ids
from qjl.tools.models import load_model
from qjl.tools.texts import resolve_texts
torch.set_grad_enabled(False); torch.set_num_threads(2)
G = {"g": 1.0}
orig = tqm.TurboQuantMSE.stored_norm
def stored_norm(self, norm, cos):
    if self.bits == 2 and self.correct_norm:
        c = torch.where(cos > 0, cos, torch.ones_like(cos))
        return (norm / c ** G["g"]).to(self.norm_dtype)
    return orig(self, norm, cos)
tqm.TurboQuantMSE.stored_norm = stored_norm
def tq(b, norm="fp16", cn=True):
    p = {"bits": b, "correct_norm": cn}
    return CodecSpec("turboquant_mse", p if norm == "fp16" else {**p, "norm_dtype": norm})
common = dict(kernel="torch", late_key=None, smooth_keys=True, smooth_values=True, heavy_tokens=16, residual_length=120, flush_block=8, exact_dtype="fp16")
cfg = QJLConfig(key=tq(3), value=tq(2, "fp8"), **common)
model, tok = load_model(); patch_attention(model)
setup = EvalSetup(context=1536, score=512)
for text in sys.argv[2:]:
    ids, _ = load_text_ids(tok, resolve_texts([text])[0], setup.tokens)
    ref, _, _ = score_method(model, ids, setup, None)
    tg = ids[setup.context:setup.tokens]
    for g in map(float, sys.argv[1].split(",")):
        G["g"] = g
        lp, _, _ = score_method(model, ids, setup, cfg)
        c = token_quality(lp, tg, ref); d = c["nll"] - c["ref_nll"]
        print(f"{text:14s} gamma {g:4.2f} KL {c['kl'].mean():.4f} ppl {100*(d.mean().exp()-1):+.2f}% top1 {c['top1'].mean()*100:.1f}", flush=True)
