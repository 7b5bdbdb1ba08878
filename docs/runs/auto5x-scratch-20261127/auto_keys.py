"""Scratch: auto(b) with its default key candidates against auto(b) without 2-bit keys, and tq-k3v2, on texts."""
import sys
import torch
from qjl.integrations.transformers.attention import patch_attention
from qjl.cache.config import CodecSpec, QJLConfig
from qjl.tools.evaluate import EvalSetup, evaluate_method, load_text_ids, memory_at
from qjl.tools.models import load_model

def tq(b):
    return CodecSpec("turboquant_mse", {"bits": b, "correct_norm": True, "norm_dtype": "fp16"})

budget = float(sys.argv[1]); texts = sys.argv[2:]
torch.set_num_threads(2); torch.set_grad_enabled(False)
model, tok = load_model(); patch_attention(model)
setup = EvalSetup()
cands = {"tq-k3v2": QJLConfig.preset("tq-k3v2"), f"auto-{budget}": QJLConfig.auto(budget),
         f"auto-{budget}-k3up": QJLConfig.auto(budget, key_candidates=tuple(tq(b) for b in (3, 4, 5, 6)))}
for text in texts:
    ids = load_text_ids(tok, text, setup.tokens)[0]
    ref_m, ref = evaluate_method(model, ids, setup, None)
    for name, cfg in cands.items():
        m, _ = evaluate_method(model, ids, setup, cfg, ref)
        x = memory_at(model, ids, cfg, 4096)["x_vs_fp16"]
        print(f"{text:14s} {name:16s} bits {m['compressed_bits']:.3f}  KL {m['kl']:.4f}  "
              f"ppl {100 * (m['ppl'] / ref_m['ppl'] - 1):+.2f}%  top1 {100 * m['top1']:.1f}%  x@4k {x:.3f}", flush=True)
