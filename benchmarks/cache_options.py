"""Cache options side by side on the embedded model: key smoothing, the exact window's dtype, auto widths.

A measurement, not a test.  The protocol of ``qjl eval`` (prefill ``--context`` tokens, then ``--score``
tokens in chunks of 32 attending to the compressed history; KL, perplexity and top-1 against the
full-precision ``DynamicCache`` on the same tokens), over one or more texts; GPL-3 is the tuning text,
the others are held out.  Writes ``<out>/cache-options-<time>/{config.json,metrics.json}``.

    python benchmarks/cache_options.py --methods tq-k45v3,tq-k3v3 --vary smooth_keys=False,True
    python benchmarks/cache_options.py --methods tq-k45v3 --vary exact_dtype=None,fp16
    python benchmarks/cache_options.py --methods auto:3.0,tq-k3v2 --vary smooth_values=False,True --texts held-out
    python benchmarks/cache_options.py --methods tq-k3v2 --variants none smooth_values=True+smooth_keys=False

Texts are ``qjl eval``'s (:mod:`qjl.tools.texts`: corpus names, ``held-out``, ``all``, or file paths).

A method is a preset name or ``auto:<bits>`` (``QJLConfig.auto(bits_per_value=<bits>)``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

def _config(method: str, extra: dict):
    from qjl import QJLConfig

    if method.startswith("auto:"):
        return QJLConfig.auto(bits_per_value=float(method.split(":", 1)[1]), **extra)
    return QJLConfig.preset(method, **extra)


_CONV = {"None": None, "True": True, "False": False}


def _value(text: str):
    """'None' / 'True' / 'False' / an int / a float / a string, as written."""
    if text in _CONV:
        return _CONV[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _parse_vary(spec: str | None, variants=None) -> list:
    """-> [(label, {field: value})]: ``FIELD=V1,V2`` one field's values, or ``variants`` (each ``none`` or
    ``F1=V1+F2=V2``: several fields at once)."""
    if variants:
        out = []
        for v in variants:
            pairs = [] if v == "none" else [a.split("=", 1) for a in v.split("+")]
            out.append((v, {f: _value(x) for f, x in pairs}))
        return out
    if not spec:
        return [("", {})]
    field, values = spec.split("=", 1)
    return [(f"{field}={v}", {field: _value(v)}) for v in values.split(",")]


def main(argv=None) -> int:
    from qjl import patch_attention
    from qjl.tools.evaluate import EvalSetup, evaluate_method, load_text_ids
    from qjl.tools.models import load_model
    from qjl.tools.texts import resolve_texts

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="tq-k45v3", help="comma-separated presets or auto:<bits>")
    p.add_argument("--vary", default=None, help="FIELD=V1,V2 (a QJLConfig field and its values)")
    p.add_argument("--variants", nargs="+", default=None,
                   help="instead of --vary: each 'none' or F1=V1+F2=V2 (several QJLConfig fields at once)")
    p.add_argument("--texts", default="gpl-3,licenses,python-source",
                   help="comma-separated corpus texts (qjl.tools.texts), 'held-out', 'all' or file paths")
    p.add_argument("--context", type=int, default=1536)
    p.add_argument("--score", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    variants = _parse_vary(a.vary, a.variants)
    methods = [m for m in a.methods.split(",") if m]
    for m in methods:  # bad names fail before the model loads
        for _, extra in variants:
            _config(m, extra)
    texts = resolve_texts(a.texts.split(","))
    model, tok = load_model()
    patch_attention(model)
    setup = EvalSetup(context=a.context, score=a.score)
    out = Path(a.out) / time.strftime("cache-options-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(vars(a), indent=1))
    rows = []
    for text in texts:
        ids, _ = load_text_ids(tok, text, setup.tokens)
        ref_m, ref = evaluate_method(model, ids, setup, None)
        for method in methods:
            for label, extra in variants:
                cfg = _config(method, extra)
                t0 = time.perf_counter()
                m, _ = evaluate_method(model, ids, setup, cfg, ref)
                row = {"text": text, "method": method, "variant": label, "fields": extra, "kl": m["kl"], "top1": m["top1"],
                       "ppl_delta_pct": 100 * (m["ppl"] / ref_m["ppl"] - 1),
                       "compressed_bits": m["compressed_bits"],
                       "seconds": time.perf_counter() - t0}
                rows.append(row)
                print(f"{text:14s} {method:10s} {label:30s} KL {row['kl']:.4f}  ppl {row['ppl_delta_pct']:+.2f}%"
                      f"  top1 {100 * row['top1']:.1f}%  bits {row['compressed_bits']:.2f}", flush=True)
                (out / "metrics.json").write_text(json.dumps(rows, indent=1))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
