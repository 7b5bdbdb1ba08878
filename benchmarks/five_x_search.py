"""Configurations near the cache issue's 5x point (<= 3.2 bits, >= 5x below fp16 at 4k, perplexity
within 2%, KL <= 0.03) on the embedded model.  A measurement, not a test.

    python benchmarks/five_x_search.py [NAME ...]

Same protocol as `qjl eval` (1,536-token prompt, 512 scored tokens in chunks of 32), no passkey;
x@4k as in `qjl eval --memory-tokens 4096` (fp16 bytes of 4,096 tokens over the bytes held).
"""
import sys

import torch

from qjl.integrations.transformers.attention import patch_attention
from qjl.cache.config import CodecSpec, QJLConfig
from qjl.tools.evaluate import DEFAULT_TEXT, EvalSetup, evaluate_method, load_text_ids, memory_at
from qjl.tools.models import load_model


def _tq(bits, norm_dtype="fp16"):
    return CodecSpec("turboquant_mse", {"bits": bits, "correct_norm": True, "norm_dtype": norm_dtype})


def _late(n_late, window, flush=4, value_norms="fp16", key_norms="fp16"):
    """3-bit keys (4-bit in the last n_late of 30 layers), 2-bit values, an fp16 window."""
    return QJLConfig(key=_tq(3, key_norms), value=_tq(2, value_norms), late_key=_tq(4, key_norms),
                     late_fraction=n_late / 30, residual_length=window, flush_block=flush, exact_dtype="fp16")


CANDIDATES = {
    # fp16 norms: the window that holds perplexity costs the last few tenths of the 5x
    "late2-w128": _late(2, 128),
    "late2-w124": _late(2, 124),
    # 8-bit (float8 e4m3) norms: on the values, on keys and values
    "late2-w128-v8": _late(2, 128, value_norms="fp8"),
    "late2-w128-kv8": _late(2, 128, value_norms="fp8", key_norms="fp8"),
    # what the values' 8 bits buy: a longer window (the preset "tq-k3v2") or 4-bit keys in one more layer
    "late2-w136-v8": _late(2, 136, flush=8, value_norms="fp8"),
    "late3-w128-v8": _late(3, 128, value_norms="fp8"),
}


def main():
    names = sys.argv[1:] or list(CANDIDATES)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from {list(CANDIDATES)}")
    torch.set_grad_enabled(False)
    model, tok = load_model()
    patch_attention(model)
    setup = EvalSetup()
    ids = load_text_ids(tok, DEFAULT_TEXT, setup.tokens)[0]
    ref_m, ref = evaluate_method(model, ids, setup, None)
    for name in names:
        cfg = CANDIDATES[name]
        m, _ = evaluate_method(model, ids, setup, cfg, ref)
        x = memory_at(model, ids, cfg, 4096)["x_vs_fp16"]
        dppl = 100 * (m["ppl"] / ref_m["ppl"] - 1)
        print(f"{name:14s} bits {m['compressed_bits']:.3f}  KL {m['kl']:.4f}  "
              f"ppl {dppl:+.2f}%  top1 {100 * m['top1']:.1f}%  x@4k {x:.3f}", flush=True)


if __name__ == "__main__":
    main()
