"""How much `qjl eval` numbers move with the torch thread count (float sums split differently).

    python benchmarks/thread_tolerance.py [--context 1536] [--score 512] [--methods tq-k3v2 ...] [--threads 1 2 4]

Runs the same protocol (GPL-3, prefill then chunks of 32) under each thread count in one process and prints,
per method, KL / perplexity change / top-1 under each count and the largest difference.  A measurement, not a
test; `qjl eval --threads N` fixes the count so numbers repeat exactly on machines of one kind.
"""
import argparse
import json
from pathlib import Path

import torch

from qjl.integrations.transformers.attention import patch_attention
from qjl.tools.evaluate import DEFAULT_TEXT, EvalSetup, evaluate_method, load_text_ids
from qjl.tools.methods import make_method
from qjl.tools.models import load_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=1536)
    p.add_argument("--score", type=int, default=512)
    p.add_argument("--methods", nargs="+", default=["tq-k3v2", "tq-k45v3"])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--out", default="runs/thread-tolerance")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    model, tok = load_model()
    patch_attention(model)
    setup = EvalSetup(context=args.context, score=args.score)
    ids = load_text_ids(tok, DEFAULT_TEXT, setup.tokens)[0]
    rows = {}
    for n in args.threads:
        torch.set_num_threads(n)
        ref_m, ref = evaluate_method(model, ids, setup, None)
        for name in args.methods:
            m, _ = evaluate_method(model, ids, setup, make_method(name), ref)
            rows.setdefault(name, {})[n] = {"kl": m["kl"], "dppl": 100 * (m["ppl"] / ref_m["ppl"] - 1),
                                            "top1": m["top1"]}
            print(f"threads {n}  {name:10s} KL {m['kl']:.5f}  dppl {rows[name][n]['dppl']:+.3f}%  "
                  f"top1 {100 * m['top1']:.2f}%", flush=True)
    for name, per in rows.items():
        spread = {k: max(v[k] for v in per.values()) - min(v[k] for v in per.values()) for k in ("kl", "dppl", "top1")}
        print(f"{name}: largest difference over threads {args.threads}: KL {spread['kl']:.5f}, "
              f"dppl {spread['dppl']:.3f} points, top1 {100 * spread['top1']:.2f} points")
        per["spread"] = spread
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(vars(args), indent=2))
    (out / "metrics.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
