"""Ablation on the embedded model: exact sink tokens, TurboQuant's norm correction, and which
half of the layers gets 5-bit keys.

    python benchmarks/cache_ablation.py [--part sinks|layers|all]

Same protocol as `qjl eval` (1,536-token prompt, 512 scored tokens in chunks of 32), no passkey.
"""
from dataclasses import replace

import torch

from qjl.integrations.transformers.attention import patch_attention
from qjl.cache.config import CodecSpec
from qjl.cache.presets import PRESETS
from qjl.tools.evaluate import DEFAULT_TEXT, EvalSetup, evaluate_method, load_text_ids
from qjl.tools.models import load_model


def main():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["sinks", "layers", "all"], default="all")
    part = parser.parse_args().part
    torch.set_grad_enabled(False)
    model, tok = load_model()
    patch_attention(model)
    setup = EvalSetup()
    ids = load_text_ids(tok, DEFAULT_TEXT, setup.tokens)[0]
    ref_m, ref = evaluate_method(model, ids, setup, None)
    base = PRESETS["tq-paper-k4v3"]  # the paper's TurboQuant_mse keys, 3-bit uniform values, no sinks
    corrected = CodecSpec("turboquant_mse", {"bits": 4, "correct_norm": True})
    five = CodecSpec("turboquant_mse", {"bits": 5, "correct_norm": True})
    runs = []
    if part in ("sinks", "all"):
        runs += [("paper TQ keys, no sinks", base),
                 ("paper TQ keys, 4 sinks", replace(base, sink_tokens=4)),
                 ("corrected TQ keys, no sinks", replace(base, key=corrected)),
                 ("corrected TQ keys, 4 sinks", replace(base, key=corrected, sink_tokens=4))]
    if part in ("layers", "all"):
        n = model.config.num_hidden_layers
        first = {i: {"key": five} for i in range(n // 2)}
        runs += [("5-bit keys, first half", replace(PRESETS["tq-k4v3"], layer_overrides=first)),
                 ("5-bit keys, deeper half", PRESETS["tq-k45v3"])]
    for label, cfg in runs:
        r, _ = evaluate_method(model, ids, setup, cfg, ref)
        print(f"{label:30s} bits {r['compressed_bits']:.3f}  KL {r['kl']:.4f}  "
              f"ppl {100 * (r['ppl'] / ref_m['ppl'] - 1):+.2f}%  top1 {100 * r['top1']:.1f}%", flush=True)


if __name__ == "__main__":
    main()
