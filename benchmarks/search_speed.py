"""Flat-scan queries/s side by side: qjl.search.Index against faiss's fast indexes at the same bits per dimension.

Every method answers the same query batch for the same k with the same thread count (1, then 2: torch's
intra-op threads and OpenMP's for us, ``faiss.omp_set_num_threads`` for faiss).  On a shared machine the
load drifts, so the methods are timed in interleaved rounds: in each round every method runs ``--repeats``
timed passes after one warm-up pass and keeps its median; a method's figure is the median over rounds, and
the ratio ours / fastest faiss is taken within each round, then its median reported.  ``--clock cpu`` times
the calling thread's CPU time instead of the wall clock (one thread only): on a loaded machine it leaves out
the time the thread waited for a core, so ratios are stable; on an idle machine the two agree.

faiss configuration (faiss-cpu, `index_factory(d, spec, METRIC_INNER_PRODUCT)`): ``PQ{M}x4fs`` (M = b d / 4
sub-quantizers of 4 bits: b bits per dimension; bbs 32, faiss's default query blocking, k <= 20 uses its
heap handler), ``RaBitQfs{b}`` and ``RaBitQ{b}`` (query bits ``qb = 8``, as in ``qjl search-bench``).  PQ is
trained with 4 k-means iterations on at most 8,192 vectors: the scan's speed does not depend on the codebook
(its recall does, and is measured by ``qjl search-bench``).

``--measure encode`` times ``add`` instead (vectors/s into a fresh index; building, training and the
rotation are outside the timed call, for faiss too): ours against faiss ``SQtqmse{b}`` with ``RR,`` and
``HR,`` rotations, in the same interleaved rounds.

Usage:
    python benchmarks/search_speed.py --n 16384 --queries 200 --bits 1 2 3 4 --out runs
    python benchmarks/search_speed.py --measure encode --n 16384 --bits 1 2 3 4 --out runs
    python benchmarks/search_speed.py --dataset synthetic --n 20000      # no embedding needed
Writes ``<out>/search-{qps,encode}-<time>/results.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def _timed(fn, repeats, clock=time.perf_counter):
    fn()  # warm-up: tables, thread pools
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def _ours(x, bits, codec, scan_bits):
    from qjl.search import Index
    from qjl.search.bench import parse_ours

    name, opts = parse_ours(codec)
    ix = Index.create(x.shape[1], codec=name, bits=bits, scan_bits=scan_bits, **opts)
    ix.add(torch.from_numpy(x))
    return ix


def _faiss(spec, x):
    import faiss

    ix = faiss.index_factory(x.shape[1], spec, faiss.METRIC_INNER_PRODUCT)
    inner = faiss.downcast_index(ix)
    if hasattr(inner, "pq"):
        inner.pq.cp.niter = 4
    if not ix.is_trained:
        ix.train(x[:8192])
    ix.add(x)
    if hasattr(inner, "qb"):
        inner.qb = 8
    return ix


def methods(x, bits, ours):
    out = {}
    d = x.shape[1]
    for codec, scan_bits in ours:
        label = f"qjl {codec} b{bits}" + (f" scan{scan_bits}" if scan_bits else "")
        try:
            ix = _ours(x, bits, codec, scan_bits)
        except ValueError as e:  # a scan_bits that does not fit these bits
            print(f"skip {label}: {e}")
            continue
        out[label] = ("ours", ix)
    specs = [f"RaBitQfs{bits}", f"RaBitQ{bits}"]
    if bits != 3 and d % (bits * d // 4) == 0:
        specs.insert(0, f"PQ{bits * d // 4}x4fs")
    for spec in specs:
        out[f"faiss {spec}"] = ("faiss", _faiss(spec, x))
    return out


def encode_rows(x, args):
    """add() vectors/s into a fresh index, ours against faiss SQtqmse (RR and HR), interleaved rounds."""
    import faiss

    from qjl.search import Index
    from qjl.search.bench import parse_ours

    def ours(bits, codec):
        def make():
            name, opts = parse_ours(codec)
            ix = Index.create(x.shape[1], codec=name, bits=bits, **opts)
            return lambda: ix.add(xt)
        return make

    def peer(spec):
        def make():
            ix = faiss.index_factory(x.shape[1], spec, faiss.METRIC_INNER_PRODUCT)
            if not ix.is_trained:
                ix.train(x[:1024])  # the rotation and the (fixed) codebook: not encoding
            return lambda: ix.add(x)
        return make

    xt = torch.from_numpy(x)
    rows = []
    for bits in args.bits:
        ms = {f"qjl {c} b{bits}": ("ours", ours(bits, c)) for c in args.codecs}
        ms.update({f"faiss {r},SQtqmse{bits}": ("faiss", peer(f"{r},SQtqmse{bits}")) for r in ("RR", "HR")})
        for threads in args.threads:
            torch.set_num_threads(threads)
            faiss.omp_set_num_threads(threads)
            clock = time.thread_time if args.clock == "cpu" else time.perf_counter
            per_round = {name: [] for name in ms}
            ratios = []
            for _ in range(args.rounds):
                rate = {}
                for name, (_, make) in ms.items():
                    make()()  # warm-up: extension, rotation matrices, thread pools
                    times = []
                    for _ in range(args.repeats):
                        fn = make()
                        t0 = clock()
                        fn()
                        times.append(clock() - t0)
                    rate[name] = x.shape[0] / statistics.median(times)
                    per_round[name].append(rate[name])
                ratios.append(max(v for n, v in rate.items() if ms[n][0] == "ours")
                              / max(v for n, v in rate.items() if ms[n][0] == "faiss"))
            for name in ms:
                rows.append({"bits": bits, "threads": threads, "method": name,
                             "encode_vectors_per_s_median": statistics.median(per_round[name]),
                             "rounds": per_round[name]})
            rows.append({"bits": bits, "threads": threads, "method": "ratio ours / faster SQtqmse",
                         "ratio_median": statistics.median(ratios), "ratio_rounds": ratios})
            print(f"encode b={bits} t={threads}: " + "  ".join(f"{n} {statistics.median(per_round[n]):,.0f}" for n in ms)
                  + f"  | ours/faster SQtqmse {statistics.median(ratios):.2f} (rounds {', '.join(f'{r:.2f}' for r in ratios)})",
                  flush=True)
    return rows


def run(args):
    import faiss

    from qjl.search.bench import synthetic
    from qjl.search.data import load_dataset
    from qjl.tools.report import environment, write_json

    if args.dataset == "synthetic":
        x, q, meta = synthetic(args.n, args.queries)
    else:
        x, q, meta = load_dataset(args.dataset, args.n)
    if args.clock == "cpu" and args.threads != [1]:
        raise SystemExit("--clock cpu measures one thread: use --threads 1")
    x = np.ascontiguousarray(x, dtype=np.float32)
    q = np.ascontiguousarray(q[:args.queries], dtype=np.float32)
    qt = torch.from_numpy(q)
    ours = [(c, s) for c in args.codecs for s in args.scan_bits]
    rows = []
    if args.measure == "encode":
        rows = encode_rows(x, args)
    for bits in args.bits if args.measure == "qps" else ():
        ms = methods(x, bits, ours)
        for threads in args.threads:
            def call(kind, ix):
                if kind == "ours":
                    return lambda: ix.search(qt, args.k, threads=threads)
                return lambda: ix.search(q, args.k)

            per_round = {name: [] for name in ms}
            ratios = []
            for _ in range(args.rounds):
                torch.set_num_threads(args.torch_threads or threads)
                faiss.omp_set_num_threads(threads)
                clock = time.thread_time if args.clock == "cpu" else time.perf_counter
                qps = {name: q.shape[0] / _timed(call(*m), args.repeats, clock) for name, m in ms.items()}
                for name, v in qps.items():
                    per_round[name].append(v)
                best_faiss = max(v for name, v in qps.items() if ms[name][0] == "faiss")
                best_ours = max(v for name, v in qps.items() if ms[name][0] == "ours")
                ratios.append(best_ours / best_faiss)
            fastest = max((n for n in ms if ms[n][0] == "faiss"), key=lambda n: statistics.median(per_round[n]))
            for name in ms:
                rows.append({"bits": bits, "threads": threads, "method": name,
                             "qps_median": statistics.median(per_round[name]), "qps_rounds": per_round[name]})
            rows.append({"bits": bits, "threads": threads, "method": "ratio ours / fastest faiss",
                         "ratio_median": statistics.median(ratios), "ratio_rounds": ratios, "fastest_faiss": fastest})
            print(f"b={bits} t={threads}: " + "  ".join(f"{n} {statistics.median(per_round[n]):,.0f}" for n in ms)
                  + f"  | ours/fastest faiss {statistics.median(ratios):.2f} (rounds {', '.join(f'{r:.2f}' for r in ratios)})",
                  flush=True)
    result = {"config": vars(args), "dataset": meta, "n": x.shape[0], "queries": q.shape[0],
              "environment": environment(), "faiss": faiss.__version__, "rows": rows}
    out = Path(args.out) / time.strftime(f"search-{args.measure}-%Y%m%d-%H%M%S")
    write_json(out / "results.json", result)
    print(f"wrote {out}/results.json")
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="minilm-200k")
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--bits", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--codecs", nargs="+", default=["tq-mse-rn"], help="our codecs; '+c': center=True, '+h': the Hadamard rotation (padded), '+ch': both")
    ap.add_argument("--scan-bits", type=int, nargs="+", default=[0], help="0: the default min(bits, 2)")
    ap.add_argument("--measure", choices=["qps", "encode"], default="qps",
                    help="qps: flat-scan queries/s (default); encode: add() vectors/s against faiss SQtqmse")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch's intra-op threads during our search (query tables, rotation); 0: --threads")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: the calling thread's CPU time (1 thread only; robust on a loaded machine)")
    ap.add_argument("--out", default="runs")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
