"""Bytes every cache method holds at a given context length, by part (the README's memory figures).

    python benchmarks/memory_table.py [--tokens 4096 16384] [--methods NAME ...] [--all]

One full-precision prefill of the embedded model over the license texts captures every layer's keys and values;
each method's cache then receives them through its own ``update`` (a prefill of n - 1 tokens and one decode step,
as `qjl eval`'s ``x@4096`` does; tested equal to running the model, tests/tools/test_evaluate.py).  Bytes are the
cache's ``memory_report()`` for QJLCache (storage held, once the cache branch counts storage), the tensors'
storage for transformers' caches.  Writes runs/memory-table/{config,metrics}.json.
"""
import argparse
import json
from pathlib import Path

import torch

from qjl.integrations.transformers.attention import patch_attention
from qjl.tools.evaluate import capture_kv, load_text_ids, memory_at
from qjl.tools.evalrun import fix_threads
from qjl.tools.methods import make_method, resolve_methods
from qjl.tools.models import load_model
from qjl.tools.report import format_table


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", nargs="+", type=int, default=[4096])
    p.add_argument("--methods", nargs="+")
    p.add_argument("--all", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/memory-table")
    args = p.parse_args()
    names = resolve_methods(args.methods, everything=args.all)
    fix_threads(args.threads)
    torch.set_grad_enabled(False)
    model, tok = load_model()
    patch_attention(model)
    ids = load_text_ids(tok, "licenses", 8192)[0]
    out, rows = {}, []
    for n in args.tokens:
        kv = capture_kv(model, ids, n)
        for name in names:
            m = memory_at(model, ids, make_method(name), n, kv)
            out.setdefault(name, {})[str(n)] = m
            mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
            rows.append([name, n, mib(m["bytes"]), mib(m["compressed_bytes"]), mib(m["exact_bytes"]),
                         f"{m['bits_per_value']:.2f}", f"{m['x_vs_fp16']:.2f}x"])
        del kv
    print(format_table(["method", "tokens", "MiB held", "codes", "exact", "bits/value", "x vs fp16"], rows))
    d = Path(args.out)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(vars(args), indent=2))
    (d / "metrics.json").write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {d}/config.json, {d}/metrics.json")


if __name__ == "__main__":
    main()
