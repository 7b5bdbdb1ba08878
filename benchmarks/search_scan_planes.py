"""Does the fast scan's shortlist lose any of the exact top-k?  (qjl.search.fastscan)

For each bits in --bits, one flat index with the fast scan (scan plane ``min(bits, 2)`` bits, a shortlist of
``default_shortlist(k, full_code)`` re-scored exactly: ``max(4k, 64)`` when a 2-bit plane of 3- or 4-bit codes
is scanned, ``max(2k, 16)`` when the plane is the whole code and only the tables' 8-bit rounding separates
the approximate score from the exact one) and one without (``fastscan=False``: the LUT scan scores every vector
with the full codes), same codec and seed, so the same estimator: the fast scan's top-k can differ only
where an exact top-k vector fell out of the shortlist.  Prints the fraction of queries whose top-k ids are
identical, and the recall@k of the fast scan against the full scan.

Usage: python benchmarks/search_scan_planes.py [--n 16384] [--queries 1000] [--k 10]
"""

import argparse

import numpy as np
import torch

from qjl.search import Index
from qjl.search.data import load_dataset


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="minilm-200k")
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--bits", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--codec", default="tq-mse-rn")
    args = ap.parse_args()
    x, q, _ = load_dataset(args.dataset, args.n)
    x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    q = torch.from_numpy(np.ascontiguousarray(q[:args.queries], dtype=np.float32))
    for bits in args.bits:
        found = {}
        for fast in (True, False):
            ix = Index.create(x.shape[1], codec=args.codec, bits=bits, fastscan=fast)
            ix.add(x)
            found[fast] = ix.search(q, args.k)[1]
        same = (found[True] == found[False]).all(1).float().mean().item()
        recall = np.mean([len(set(a.tolist()) & set(b.tolist())) / args.k for a, b in zip(found[True], found[False])])
        print(f"{args.codec} b{bits} n={x.shape[0]} queries={q.shape[0]} k={args.k}: identical top-k {same:.4f}, "
              f"recall@{args.k} of the fast scan vs the full scan {recall:.4f}")


if __name__ == "__main__":
    main()
