"""Coarse partition for the inverted-file (IVF) index: k-means in torch, list assignment, probing.

``kmeans(x, nlist)`` runs Lloyd's algorithm from a seeded random sample of the points
(``iters`` rounds, empty clusters re-seeded from the points farthest from their centroid).
Points go to the centroid of largest ``<x, c> - ||c||^2 / 2`` (the nearest in L2); queries
probe the ``nprobe`` centroids of largest inner product (``metric='ip'``/``'cosine'``) or
smallest distance (``'l2'``), as faiss's IndexIVF does with an inner-product or L2 quantizer.
"""

from __future__ import annotations

import torch

__all__ = ["kmeans", "assign", "probe"]

_CHUNK = 65536


def assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """x: [n, d], centroids: [nlist, d] -> [n] int64, the nearest centroid in L2."""
    half = 0.5 * (centroids * centroids).sum(1)
    out = [torch.argmax(x[s:s + _CHUNK].float() @ centroids.T - half, dim=1) for s in range(0, x.shape[0], _CHUNK)]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)


def kmeans(x: torch.Tensor, nlist: int, iters: int = 10, seed: int = 0, max_points: int = 256) -> torch.Tensor:
    """x: [n, d] float32 -> centroids [nlist, d]; trains on at most ``max_points * nlist`` points."""
    if isinstance(nlist, bool) or not isinstance(nlist, int) or nlist < 1:
        raise ValueError(f"nlist must be a positive int, got {nlist!r}")
    n = x.shape[0]
    if n < nlist:
        raise ValueError(f"k-means with nlist={nlist} needs at least {nlist} training vectors, got {n}")
    gen = torch.Generator().manual_seed(seed)
    if n > max_points * nlist:
        x = x[torch.randperm(n, generator=gen)[: max_points * nlist]]
    x = x.float()
    cent = x[torch.randperm(x.shape[0], generator=gen)[:nlist]].clone()
    for _ in range(iters):
        a = assign(x, cent)
        sums = torch.zeros_like(cent).index_add_(0, a, x)
        counts = torch.bincount(a, minlength=nlist).float()
        empty = counts == 0
        cent = torch.where(empty.unsqueeze(1), cent, sums / counts.clamp(min=1).unsqueeze(1))
        if bool(empty.any()):  # re-seed from the worst-served points
            err = ((x - cent[a]) ** 2).sum(1)
            cent[empty] = x[torch.topk(err, int(empty.sum())).indices]
    return cent


def probe(q: torch.Tensor, centroids: torch.Tensor, nprobe: int, metric: str) -> torch.Tensor:
    """q: [nq, d] -> [nq, nprobe] int64 list numbers, best first."""
    if metric == "l2":
        score = 2 * q.float() @ centroids.T - (centroids * centroids).sum(1)
    else:
        score = q.float() @ centroids.T
    return torch.topk(score, min(nprobe, centroids.shape[0]), dim=1).indices
