"""Recall@10 of our flat index over rotation seeds, with and without centering (``center=True``), per rotation.

The rotation seed moves 1-bit recall by about a point on n = 24,576 MiniLM passages, as much as the gaps
between methods, so the README quotes the bench's seed 0 and the mean over seeds side by side.

    python benchmarks/search_seeds.py --n 24576 --queries 300 --seeds 0 1 2 --bits 1 2 3 4
    python benchmarks/search_seeds.py --rotations haar hadamard-kron --centers 1     # the two unpadded rotations
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main(argv=None) -> None:
    from qjl.search import Index
    from qjl.search.bench import exact_topk, recall_at
    from qjl.search.data import load_dataset

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=24576)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--bits", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--codec", default="tq-mse-rn")
    ap.add_argument("--rotations", nargs="+", default=["haar"], help="IndexConfig rotations to compare")
    ap.add_argument("--centers", type=int, nargs="+", default=[0, 1], help="0: plain, 1: centered")
    args = ap.parse_args(argv)
    x, q, _ = load_dataset(n=args.n)
    x, q = torch.from_numpy(x), torch.from_numpy(q[: args.queries])
    truth = exact_topk(x, q, 10).numpy()
    print("| bits | rotation | center | bits/dim | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean |")
    print("|---|---|---|---|" + "---|" * (len(args.seeds) + 1))
    for bits in args.bits:
        for rotation in args.rotations:
            for center in (bool(c) for c in args.centers):
                rec = []
                for seed in args.seeds:
                    ix = Index.create(x.shape[1], codec=args.codec, bits=bits, seed=seed, center=center,
                                      rotation=rotation)
                    ix.add(x)
                    rec.append(recall_at(ix.search(q, 10)[1].numpy(), truth, 10))
                print(f"| {bits} | {rotation} | {center} | {ix.bits_per_dim():.3f} | "
                      + " | ".join(f"{r:.3f}" for r in rec) + f" | {statistics.mean(rec):.3f} |", flush=True)


if __name__ == "__main__":
    main()
