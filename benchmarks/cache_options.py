"""Cache options side by side on the embedded model: key smoothing, the exact window's dtype, auto widths.

A measurement, not a test.  The protocol of ``qjl eval`` (prefill ``--context`` tokens, then ``--score``
tokens in chunks of 32 attending to the compressed history; KL, perplexity and top-1 against the
full-precision ``DynamicCache`` on the same tokens), over one or more texts; GPL-3 is the tuning text,
the others are held out.  Writes ``<out>/cache-options-<time>/{config.json,metrics.json}``.

    python benchmarks/cache_options.py --methods tq-k45v3,tq-k3v3 --vary smooth_keys=False,True
    python benchmarks/cache_options.py --methods tq-k45v3 --vary exact_dtype=None,fp16
    python benchmarks/cache_options.py --methods auto:3.0,tq-k3v2 --vary smooth_keys=True

A method is a preset name or ``auto:<bits>`` (``QJLConfig.auto(bits_per_value=<bits>)``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

TEXTS = {
    "gpl3": "/usr/share/common-licenses/GPL-3",  # the tuning text
    "mpl2": "/usr/share/common-licenses/MPL-2.0",  # held out: another license
    "argparse": "/usr/lib/python3.11/argparse.py",  # held out: source code (falls back to this Python's copy)
}


def _text_path(name: str) -> str:
    import argparse as stdlib_argparse

    path = TEXTS.get(name, name)
    if name == "argparse" and not Path(path).exists():
        path = stdlib_argparse.__file__
    return path


def _config(method: str, field: str | None, value):
    from qjl import QJLConfig

    extra = {} if field is None else {field: value}
    if method.startswith("auto:"):
        return QJLConfig.auto(bits_per_value=float(method.split(":", 1)[1]), **extra)
    return QJLConfig.preset(method, **extra)


def _parse_vary(spec: str | None):
    if not spec:
        return None, [None]
    field, values = spec.split("=", 1)
    conv = {"None": None, "True": True, "False": False}
    return field, [conv.get(v, v) for v in values.split(",")]


def main(argv=None) -> int:
    from qjl import patch_attention
    from qjl.tools.evaluate import EvalSetup, evaluate_method, load_text_ids
    from qjl.tools.models import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="tq-k45v3", help="comma-separated presets or auto:<bits>")
    p.add_argument("--vary", default=None, help="FIELD=V1,V2 (a QJLConfig field and its values)")
    p.add_argument("--texts", default="gpl3,mpl2,argparse", help=f"comma-separated: {sorted(TEXTS)} or paths")
    p.add_argument("--context", type=int, default=1536)
    p.add_argument("--score", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    field, values = _parse_vary(a.vary)
    methods = [m for m in a.methods.split(",") if m]
    for m in methods:  # bad names fail before the model loads
        for v in values:
            _config(m, field, v)
    model, tok = load_model()
    patch_attention(model)
    setup = EvalSetup(context=a.context, score=a.score, passkey_trials=0)
    out = Path(a.out) / time.strftime("cache-options-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(vars(a), indent=1))
    rows = []
    for text in a.texts.split(","):
        ids = load_text_ids(tok, _text_path(text), setup.context + setup.score + 1)
        ref_m, ref = evaluate_method(model, tok, ids, setup, None)
        for method in methods:
            for v in values:
                cfg = _config(method, field, v)
                t0 = time.perf_counter()
                m, _ = evaluate_method(model, tok, ids, setup, cfg, ref)
                row = {"text": text, "method": method, "field": field, "value": v, "kl": m["kl"], "top1": m["top1"],
                       "ppl_delta_pct": 100 * (m["ppl"] / ref_m["ppl"] - 1), "key_bits": m["key_bits"],
                       "value_bits": m["value_bits"], "bits_per_value": m["bits_per_value"],
                       "seconds": time.perf_counter() - t0}
                rows.append(row)
                print(f"{text:9s} {method:10s} {field or ''}={v!s:6s} KL {row['kl']:.4f}  ppl {row['ppl_delta_pct']:+.2f}%"
                      f"  top1 {100 * row['top1']:.1f}%  bits K/V {row['key_bits']:.2f}/{row['value_bits']:.2f}",
                      flush=True)
                (out / "metrics.json").write_text(json.dumps(rows, indent=1))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
