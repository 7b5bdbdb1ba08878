"""Configurations near the cache issue's 5x point (<= 3.2 bits, >= 5x below fp16 at 4k, perplexity
within 2%, KL <= 0.03) on the embedded model.  A measurement, not a test.

    python benchmarks/five_x_search.py [NAME ...]

Same protocol as `qjl eval` (1,536-token prompt, 512 scored tokens in chunks of 32), no passkey;
x@4k as in `qjl eval --memory-tokens 4096` (fp16 bytes of 4,096 tokens over the bytes held).
"""
import sys

import torch

from qjl.attention import patch_attention
from qjl.config import CodecSpec, QJLConfig
from qjl.evaluate import DEFAULT_TEXT, EvalSetup, evaluate_method, load_text_ids, memory_at
from qjl.models import load_model


def _tq(bits):
    return CodecSpec("turboquant_mse", {"bits": bits, "correct_norm": True})


def _base(**kw):
    return QJLConfig(key=_tq(3), value=_tq(2), exact_dtype="fp16", **kw)


CANDIDATES = {
    # 4-bit keys in the last layers, window shrunk to pay for them
    "late25-w64": _base(late_key=_tq(4), late_fraction=0.25, residual_length=64, flush_block=16),
    "late20-w80": _base(late_key=_tq(4), late_fraction=0.2, residual_length=80, flush_block=16),
    # 3-bit values in the last 7 layers instead
    "v3late-w64": _base(residual_length=64, flush_block=16, layer_overrides={l: {"value": _tq(3)} for l in range(23, 30)}),
    # keep the 128-token window, 4-bit keys or 3-bit values in the last 2 layers only
    "late2-w128": _base(late_key=_tq(4), late_fraction=2 / 30, residual_length=128, flush_block=4),
    "v3last2-w128": _base(residual_length=128, flush_block=4, layer_overrides={l: {"value": _tq(3)} for l in (28, 29)}),
    "late2-w124": _base(late_key=_tq(4), late_fraction=2 / 30, residual_length=124, flush_block=4),
}


def main():
    names = sys.argv[1:] or list(CANDIDATES)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from {list(CANDIDATES)}")
    torch.set_grad_enabled(False)
    model, tok = load_model()
    patch_attention(model)
    setup = EvalSetup(passkey_trials=0)
    ids = load_text_ids(tok, DEFAULT_TEXT, setup.context + setup.score + 1)
    ref_m, ref = evaluate_method(model, tok, ids, setup, None)
    for name in names:
        cfg = CANDIDATES[name]
        m, _ = evaluate_method(model, tok, ids, setup, cfg, ref)
        x = memory_at(model, ids, cfg, 4096)["x_vs_fp16"]
        dppl = 100 * (m["ppl"] / ref_m["ppl"] - 1)
        print(f"{name:14s} bits {m.get('compressed_bits', m['bits_per_value']):.3f}  KL {m['kl']:.4f}  "
              f"ppl {dppl:+.2f}%  top1 {100 * m['top1']:.1f}%  x@4k {x:.3f}", flush=True)


if __name__ == "__main__":
    main()
