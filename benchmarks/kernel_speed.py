"""The CPU decode kernel alone: ns per (token, KV head) for the presets' codecs, both C paths, 1 and all
threads, contiguous and paged (16-token blocks).  A measurement, not a test.

    python benchmarks/kernel_speed.py [--tokens 16384] [--repeats 15] [--out runs]
    python benchmarks/kernel_speed.py --tokens 65536 --codecs tq-k3v2 --rows 1 2 4 --dims 64 128 256 --threads 1 \
        --layouts contiguous --impls c     # where the time goes: per query row, per coordinate

One Llama-3-8B layer shape (8 KV heads, 4 query rows per head, d = 128; ``--rows`` and ``--dims`` vary them),
random codes, no exact tokens;
minimum and median of ``repeats`` calls after 2 warm-up calls, wall time.  Writes
``<out>/kernel-speed-<time>/kernel_speed.json``.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from qjl.codecs import QJLSketch, TokenwiseQuantizer, TurboQuantMSE, TurboQuantVQ
from qjl.kernels.cpu import launch
from qjl.kernels.paged import PagedField

CODECS = {  # (keys, values) as the presets build them at d = 128 (their first-half layers)
    "tq-k3v2": lambda d: (TurboQuantMSE(d, 3, correct_norm=True), TurboQuantMSE(d, 2, correct_norm=True, norm_dtype="fp8")),
    "tq-k45v3": lambda d: (TurboQuantMSE(d, 4, correct_norm=True), TurboQuantMSE(d, 3, correct_norm=True)),
    # the default preset's layers 15-29 (5-bit keys); "tq-k45v3" above is its layers 0-14
    "tq-k5v3": lambda d: (TurboQuantMSE(d, 5, correct_norm=True), TurboQuantMSE(d, 3, correct_norm=True)),
    "qjl-m256-u2": lambda d: (QJLSketch(d, 2 * d), TokenwiseQuantizer(d, 2)),
    # the vector-codebook 5x preset's first layers (keys 3 bits in pairs, values 2 bits in fours over 8 rotations)
    "tqv-k3v2": lambda d: (TurboQuantVQ(d, 3, correct_norm=True),
                           TurboQuantVQ(d, 2, correct_norm=True, cycles=8, norm_dtype="fp8")),
}


def _paged(t: torch.Tensor, block: int):
    """[1, H, N, ...] codes -> a pool [N / block, H, block, ...] in shuffled block order, and its block table."""
    _, h, n = t.shape[:3]
    nb = n // block
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(0))
    pool = torch.empty(nb, h, block, *t.shape[3:], dtype=t.dtype)
    pool[perm] = t[0].reshape(h, nb, block, *t.shape[3:]).transpose(0, 1)
    es = t.element_size()
    return PagedField(pool, 0, pool.stride(0) * es, pool.stride(1) * es, pool.stride(2) * es, t.dtype,
                      tuple(t.shape[3:])), perm.to(torch.int32)[None]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default="runs")
    p.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    p.add_argument("--rows", type=int, nargs="+", default=[4], help="query rows per KV head (GQA group)")
    p.add_argument("--dims", type=int, nargs="+", default=[128], help="head dimensions")
    p.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1 and all")
    p.add_argument("--layouts", nargs="+", default=["contiguous", "paged-16"],
                   choices=["contiguous", "paged-16", "paged-128"], help="paged-N: blocks of N tokens in shuffled "
                   "order (vLLM's CPU default is 128)")
    p.add_argument("--impls", nargs="+", default=list(launch.IMPLS), choices=list(launch.IMPLS))
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    rows = []
    for d in args.dims:
        for r in args.rows:
            rows += _measure(args, d, r)
    out = Path(args.out) / time.strftime("kernel-speed-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    config = {"tokens": args.tokens, "kv_heads": 8, "rows": args.rows, "head_dims": args.dims, "repeats": args.repeats,
              "simd_path": launch.simd_path(), "torch_threads": torch.get_num_threads(), "argv": sys.argv[1:]}
    (out / "kernel_speed.json").write_text(json.dumps({"config": config, "rows": rows}, indent=2))
    print(f"wrote {out / 'kernel_speed.json'}")


def _measure(args, d: int, r: int) -> list:
    h, n = 8, args.tokens
    g = torch.Generator().manual_seed(0)
    k, v, q = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g), torch.randn(1, h, r, d, generator=g)
    start, end = torch.zeros(1, dtype=torch.int32), torch.full((1,), n, dtype=torch.int32)
    rows = []
    for name in args.codecs:
        kc, vc = CODECS[name](d)
        kcodes, vcodes = kc.quantize(k), vc.quantize(v)
        contiguous = ({f: PagedField.of(t) for f, t in kcodes.fields.items()},
                      {f: PagedField.of(t) for f, t in vcodes.fields.items()}, torch.zeros(1, 1, dtype=torch.int32), n)
        layouts = {"contiguous": contiguous}
        for layout in args.layouts:
            if layout.startswith("paged-"):
                bs = int(layout.split("-")[1])
                kp = {f: _paged(t, bs) for f, t in kcodes.fields.items()}
                vp = {f: _paged(t, bs) for f, t in vcodes.fields.items()}
                table = next(iter(kp.values()))[1]
                layouts[layout] = ({f: x[0] for f, x in kp.items()}, {f: x[0] for f, x in vp.items()}, table, bs)
        for layout in args.layouts:
            kf, vf, bt, bs = layouts[layout]
            for impl in args.impls:
                for threads in args.threads or sorted({1, torch.get_num_threads()}):
                    def call():
                        return launch.paged_decode(q, kc, kf, vc, vf, bt, bs, start, end, impl=impl, threads=threads)
                    for _ in range(2):
                        call()
                    times = []
                    for _ in range(args.repeats if impl != "c-portable" else 3):
                        t0 = time.perf_counter()
                        call()
                        times.append(time.perf_counter() - t0)
                    row = {"codecs": name, "layout": layout, "impl": impl, "threads": threads, "head_dim": d, "rows": r,
                           "min_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3,
                           "ns_per_token_head_min": min(times) * 1e9 / (h * n) * threads}
                    rows.append(row)
                    print(f"{name:12s} d={d} R={r} {layout:10s} {impl:10s} threads {threads}: min {row['min_ms']:.2f} ms, "
                          f"median {row['median_ms']:.2f} ms, {row['ns_per_token_head_min']:.1f} ns per token-head "
                          f"(x threads)", flush=True)
    return rows


if __name__ == "__main__":
    main()
