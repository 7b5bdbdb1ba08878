"""The peers of ``qjl search-bench``: faiss indexes (by factory string) and rabitqlib's IVF index.

Each peer is wrapped with the same four calls as ours: ``build(x) -> (train_s, add_s)``,
``search(q, k, threads) -> ids [nq, k]``, ``code_bits()`` (per-vector code bits, faiss's
``code_size`` or rabitqlib's stored bits, ids excluded) and ``nbytes()`` (the serialized index).
faiss's RaBitQ indexes are searched with ``qb = 8`` query bits (the default is 4 for the
non-fastscan one; 8 gives it its best recall).
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

__all__ = ["FaissPeer", "RabitqlibPeer", "faiss_available", "rabitqlib_available"]


def faiss_available() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def rabitqlib_available() -> bool:
    try:
        import rabitqlib  # noqa: F401
    except ImportError:
        return False
    return True


class FaissPeer:
    def __init__(self, factory: str, dim: int, nprobe: int = 1):
        import faiss

        self.faiss, self.factory, self.dim, self.nprobe = faiss, factory, dim, nprobe
        self.index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)

    def build(self, x: np.ndarray, train: np.ndarray):
        t0 = time.perf_counter()
        if not self.index.is_trained:
            self.index.train(train)
        t1 = time.perf_counter()
        self.index.add(x)
        return t1 - t0, time.perf_counter() - t1

    def _inner(self):
        idx = self.faiss.downcast_index(self.index)
        while isinstance(idx, self.faiss.IndexPreTransform):
            idx = self.faiss.downcast_index(idx.index)
        return idx

    def search(self, q: np.ndarray, k: int, threads: int) -> np.ndarray:
        self.faiss.omp_set_num_threads(threads)
        inner = self._inner()
        if hasattr(inner, "nprobe"):
            inner.nprobe = self.nprobe
        if hasattr(inner, "qb"):
            inner.qb = 8
        return self.index.search(q, k)[1]

    def code_bits(self) -> int:
        return 8 * self._inner().code_size

    def nbytes(self) -> int:
        return int(self.faiss.serialize_index(self.index).size)


class RabitqlibPeer:
    """rabitqlib.IvfIndex (one cluster for the flat regime), metric 'ip', ``nbits`` total bits per dimension."""

    def __init__(self, nbits: int, dim: int, nlist: int = 1, nprobe: int = 1):
        import rabitqlib

        self.rabitqlib, self.nbits, self.dim, self.nlist, self.nprobe = rabitqlib, nbits, dim, nlist, nprobe
        self.index = None

    def build(self, x: np.ndarray, train: np.ndarray):
        import torch

        from .ivf import assign, kmeans

        t0 = time.perf_counter()
        cent = kmeans(torch.from_numpy(train), self.nlist) if self.nlist > 1 else torch.from_numpy(x.mean(0, keepdims=True))
        t1 = time.perf_counter()
        cid = assign(torch.from_numpy(x), cent).numpy().astype(np.uint32)
        self.index = self.rabitqlib.IvfIndex(self.dim, x.shape[0], self.nlist, self.nbits, metric="ip")
        self.index.build(x, cent.numpy().astype(np.float32), cid, num_threads=2)
        return t1 - t0, time.perf_counter() - t1

    def search(self, q: np.ndarray, k: int, threads: int) -> np.ndarray:
        out = self.index.search(q, k, self.nprobe, num_threads=threads)
        return np.asarray(out[0]).astype(np.int64)  # (ids, distances)

    def code_bits(self):
        return None  # not exposed: see nbytes

    def nbytes(self) -> int:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ix")
            self.index.save(path)
            return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(tmp) for f in fs)
