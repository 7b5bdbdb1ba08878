"""Two design checks of qjl.search on the real embeddings (flat, inner product, recall@10 of 500 queries).

1. RaBitQ-style code search: pick each vector's code to maximise the cosine <u, u_hat> / ||u_hat|| over 31
   rescalings of TurboQuant's Lloyd-Max codebook, instead of the nearest centroid per coordinate.
2. Centering on the mean of the first 1,000 vectors (IndexConfig.center).

Usage: python benchmarks/search_ablation.py [--n 8192]   (needs `qjl search-data` to have embedded n vectors)
"""

import argparse

import torch

from qjl.core.lloyd_max import bucket
from qjl.core.packing import pack_bits
from qjl.search.bench import exact_topk, recall_at
from qjl.search.codecs import SearchCodec
from qjl.search.data import load_dataset
from qjl.search.scan import build_luts, scan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    args = ap.parse_args()
    x, q, _ = load_dataset(n=args.n)
    x, q = torch.from_numpy(x), torch.from_numpy(q[:500])
    truth = exact_topk(x, q, 10).numpy()
    ranges = torch.tensor([[[0, x.shape[0]]]] * q.shape[0])
    print(f"n={x.shape[0]}, 500 queries, recall@10; ||mean of the vectors|| = {x.mean(0).norm():.3f}")
    print("bits  nearest-centroid  code-search(31 scales)  centered")
    for bits in (1, 2, 3, 4):
        sc = SearchCodec("tq-mse-rn", x.shape[1], bits)
        luts = build_luts(sc.layout, sc.tables(q))

        def recall(codes, factors):
            return recall_at(scan(codes, sc.layout, factors.float(), None, luts, ranges, 10)[1].numpy(), truth, 10)

        base = recall(*sc.encode(x))
        norm = x.norm(dim=1)
        y = sc.codec.rotation.apply(x / norm[:, None])
        cents, bounds = sc.codec.codebook.tensors()
        best_cos, best_idx = torch.full((x.shape[0],), -1.0), None
        for t in torch.linspace(0.5, 2.0, 31):
            idx = bucket(y * t, bounds)
            c = cents[idx]
            cos = (y * c).sum(1) / c.norm(dim=1)
            better = cos > best_cos
            best_cos = torch.where(better, cos, best_cos)
            best_idx = idx if best_idx is None else torch.where(better[:, None], idx, best_idx)
        dot = (y * cents[best_idx]).sum(1)
        searched = recall(pack_bits(best_idx, bits), (norm / dot).half()[None])
        centered = recall(*sc.encode(x - x[:1000].mean(0)))  # + <q, c>: the same for every vector
        print(f"{bits:>4}  {base:16.3f}  {searched:22.3f}  {centered:8.3f}")


if __name__ == "__main__":
    main()
