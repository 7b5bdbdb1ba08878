"""A vector index over qjl's codecs: flat (no training) or IVF, top-k by inner product, cosine or L2.

Storage, every byte counted by :meth:`Index.nbytes`: codes ``[n, stride]`` uint8 (for the fast scan:
the same bits as scan and refine planes in blocks of 32 vectors, :mod:`qjl.search.fastscan`, padded
to 32), one float16 factor per segment (norms), a float16 norm for ``metric='l2'``, a float16 ``<c, x>``
for a centered ``'ip'``/``'cosine'`` index (``center=True``, below), int64 ids, the
IVF centroids and list offsets, and, with ``rerank > 0``, the float32 vectors used to re-score a
shortlist of ``rerank * k`` candidates exactly.  Rows are kept sorted by IVF list, so a probe is a
range.  An IVF index encodes each vector's residual to its list's centroid (``by_residual``, as
faiss and RaBitQ do): ``<q, x> = <q, c_list> + <q, x - c_list>``, the first term added per probed list.

Scores: ``'ip'`` returns estimated ``<q, x>``; ``'cosine'`` normalises vectors and queries
first; ``'l2'`` ranks by ``2 <q, x> - ||x||^2`` and returns estimated squared distances
``||q||^2 - 2 <q, x> + ||x||^2``.  Every method validates all its input before it changes
anything, so a failed call leaves the index as it was.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..core.validation import check_fits, check_vectors
from . import scan as _scan
from .codecs import CODEC_NAMES, FAST_CODECS, SearchCodec, check_rotation, default_rotation
from .fastscan import default_shortlist, fast_layout, fastscan, from_blocks, planes_to_rows, rows_to_planes, to_blocks
from .ivf import assign, kmeans, probe

__all__ = ["IndexConfig", "Index", "METRICS"]

METRICS = ("ip", "cosine", "l2")
_QBATCH = 256  # queries scored per kernel call (tables of one batch: <= 256 x lut_size floats)


@dataclass(frozen=True)
class IndexConfig:
    """dim; codec (see :mod:`qjl.search.codecs`); bits per coordinate 1..4; metric; nlist (0: flat);
    rerank (0: off; else shortlist rerank * k candidates re-scored with stored float32 vectors); seed;
    center: encode ``x - c`` with ``c`` the mean of the first batch added (one pass, no iterations):
    embeddings share a large common component (all-MiniLM-L6-v2:
    ``||mean|| ~ 0.31`` for unit vectors) that otherwise takes bits from what tells vectors apart.
    Queries are centered too: ``<q, x> = <q - c, x - c> + <c, x> + <q - c, c>``, the first term estimated
    from the codes, ``<c, x>`` stored per vector (float16, counted), the last a per-query constant, so the
    codes' error scales with ``||q - c||`` instead of ``||q||`` (1-bit recall@10 on MiniLM passages, mean of
    three seeds: 0.641 -> 0.664 for 16 more bits per vector, ``benchmarks/search_seeds.py``).  With ``metric='l2'`` the norms are those of
    ``x - c`` (distances need no ``<c, x>``).  fastscan: store the
    codes for the fast scan (tq-mse, tq-mse-rn, qjl); scan_bits: bits per coordinate the fast scan ranks
    by before re-scoring a shortlist exactly (0: min(bits, 2)); by_residual (IVF): encode ``x - c_list``;
    rotation: 'auto' (the default: 'hadamard-kron' where the codec and ``dim`` allow it, else 'haar'; the config
    holds the one chosen), 'haar' (dense, ``dim`` coordinates), 'hadamard' (tq-mse, tq-mse-rn, tq-prod: zero-padded
    to the next power of two, e.g. 384 -> 512 coordinates, so 4/3 more code bits per vector: faiss's ``HR,``) or
    'hadamard-kron' (the same codecs: random signs and a Hadamard transform of order ``dim`` itself, for ``dim = m 2^k``
    with m in 1, 12, 20 and dim >= 32, such as 64, 384 or 768: no padding, several times cheaper to apply than the
    dense rotation, the same recall within the seed spread: docs/search.md, "An unpadded Hadamard rotation")."""

    dim: int
    codec: str = "tq-mse-rn"
    bits: int = 4
    metric: str = "ip"
    nlist: int = 0
    rerank: int = 0
    seed: int = 0
    center: bool = False
    fastscan: bool = True
    scan_bits: int = 0
    by_residual: bool = True
    rotation: str = "auto"

    def __post_init__(self):
        for name in ("dim", "nlist", "rerank", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "dim" else 0):
                raise ValueError(f"{name} must be an int >= {1 if name == 'dim' else 0}, got {v!r}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 4:
            raise ValueError(f"bits must be an int in 1..4, got {self.bits!r}")
        if self.codec not in CODEC_NAMES:
            raise ValueError(f"codec must be one of {list(CODEC_NAMES)}, got {self.codec!r}")
        if self.rotation == "auto":
            object.__setattr__(self, "rotation", default_rotation(self.codec, self.dim))
        check_rotation(self.codec, self.rotation)
        for name in ("center", "fastscan", "by_residual"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {list(METRICS)}, got {self.metric!r}")
        if isinstance(self.scan_bits, bool) or self.scan_bits not in (0, 1, 2, 4):
            raise ValueError(f"scan_bits must be 0 (auto), 1, 2 or 4, got {self.scan_bits!r}")
        if self.center and self.nlist and self.by_residual:
            raise ValueError("center=True is for a flat index or by_residual=False: an IVF index that encodes "
                             "residuals is already centered on its lists")


class Index:
    """See the module docstring.  ``Index(IndexConfig(...))`` or ``Index.create(dim, **fields)``."""

    #: per-vector fields that only some configurations hold (None otherwise), kept in row order with the codes
    OPTIONAL_ROWS = ("norms", "cdots", "vectors")

    def __init__(self, config: IndexConfig):
        if not isinstance(config, IndexConfig):
            raise TypeError(f"config must be an IndexConfig, got {type(config).__name__}")
        self.config = config
        self.codec = SearchCodec(config.codec, config.dim, config.bits, config.seed, config.rotation)
        # fast scan: single-factor codes stored as scan / refine planes in blocks of 32 vectors (fastscan.py)
        self.fast = None
        if config.fastscan and config.codec in FAST_CODECS:
            bits = self.codec.code_bits
            if config.scan_bits and not (config.scan_bits <= bits and bits - config.scan_bits <= 2
                                         and (config.scan_bits != 4 or bits == 4)):
                raise ValueError(f"scan_bits={config.scan_bits} does not fit {bits}-bit codes: use 0 (auto), "
                                 f"{', '.join(str(s) for s in (1, 2, 4) if s <= bits and bits - s <= 2)}")
            self.fast = fast_layout(self.codec.n_coords, bits, config.scan_bits)
            self._cs = self.codec.centroids(self.fast.scan_bits)
            self._c = self.codec.centroids()
        self.codes = self._store(torch.empty(0, self.codec.stride, dtype=torch.uint8))
        self.factors = torch.empty(self.codec.nseg, 0, dtype=torch.float16)
        self.norms = torch.empty(0, dtype=torch.float16) if config.metric == "l2" else None
        # <c, x> per vector: a centered inner-product index scores <q - c, x - c> from the codes
        self.cdots = torch.empty(0, dtype=torch.float16) if config.center and config.metric != "l2" else None
        self.ids = torch.empty(0, dtype=torch.int64)
        self.vectors = torch.empty(0, config.dim) if config.rerank else None
        self.centroids = None
        self.center_vec = None  # [dim] float32 with config.center, set by the first add
        self.offsets = torch.zeros(max(config.nlist, 1) + 1, dtype=torch.int64)
        self.train_seconds = 0.0
        self.next_id = 0

    @classmethod
    def create(cls, dim: int, **fields) -> "Index":
        return cls(IndexConfig(dim, **fields))

    def __len__(self) -> int:
        return self.ids.numel()

    @property
    def is_trained(self) -> bool:
        return self.config.nlist == 0 or self.centroids is not None

    def _prep(self, name: str, x) -> torch.Tensor:
        check_vectors(name, x, self.config.dim, min_ndim=2)
        if x.ndim != 2:
            raise ValueError(f"{name} must be [n, {self.config.dim}], got shape {tuple(x.shape)}")
        x = x.float()
        if self.config.metric == "cosine":
            x = torch.nn.functional.normalize(x, dim=1)
        return x

    # -- building ---------------------------------------------------------------------
    def train(self, x: torch.Tensor, iters: int = 10) -> float:
        """IVF only: k-means on ``x: [n, dim]``; returns (and keeps in ``train_seconds``) its time."""
        if self.config.nlist == 0:
            raise ValueError("a flat index (nlist=0) needs no training")
        if len(self):
            raise ValueError("train before adding vectors")
        x = self._prep("x", x)
        t0 = time.perf_counter()
        self.centroids = kmeans(x, self.config.nlist, iters, self.config.seed)
        self.train_seconds = time.perf_counter() - t0
        return self.train_seconds

    def add(self, x: torch.Tensor, ids=None) -> torch.Tensor:
        """x: [n, dim] float; ids: [n] int64 (default: consecutive from the largest seen) -> the ids."""
        if not self.is_trained:
            raise ValueError("this IVF index is not trained: call train(x) first")
        x = self._prep("x", x)
        n = x.shape[0]
        if ids is None:
            ids = torch.arange(self.next_id, self.next_id + n, dtype=torch.int64)
        else:
            if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64) or ids.shape != (n,):
                raise TypeError(f"ids must be an int64 tensor of shape [{n}], got "
                                f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
            ids = ids.long()
            if ids.unique().numel() != n:
                raise ValueError("ids holds duplicate values")
            if bool(torch.isin(ids, self.ids).any()):
                raise ValueError(f"ids already in the index: {ids[torch.isin(ids, self.ids)][:5].tolist()}")
        center = self.center_vec
        if self.config.center and center is None and n:
            center = x.mean(0)
        cdots = None
        if self.cdots is not None:
            cdots = x @ center if n else torch.empty(0)
            check_fits("<center, x> (x times the index's center)", cdots, torch.float16)
        lists = assign(x, self.centroids) if self.config.nlist else torch.zeros(n, dtype=torch.int64)
        residual = self.config.nlist and self.config.by_residual
        if residual:
            codes, factors = self.codec.encode(x - self.centroids[lists], planes=self.fast)
        else:  # x - center is formed a chunk at a time inside encode
            codes, factors = self.codec.encode(x, planes=self.fast, shift=center)
        new = {"codes": codes, "factors": factors, "ids": ids, "center_vec": center,
               "norms": None if self.norms is None else torch.linalg.vector_norm(
                   x if center is None else x - center, dim=1).half(),
               "cdots": None if cdots is None else cdots.half(),
               "vectors": None if self.vectors is None else x}
        self._merge(new, lists)
        self.next_id = max(self.next_id, int(ids.max()) + 1) if n else self.next_id
        return ids

    def _store(self, rows: torch.Tensor) -> torch.Tensor:
        return self._block(rows_to_planes(rows, self.fast) if self.fast else rows)

    def _planes(self) -> torch.Tensor:
        """The codes in add's format: rows, or the fast scan's planes ``[n, row_bytes]``."""
        return from_blocks(self.codes, len(self)) if self.fast else self.codes

    def _block(self, planes: torch.Tensor) -> torch.Tensor:
        return to_blocks(planes) if self.fast else planes

    def row_codes(self) -> torch.Tensor:
        """The codes as rows ``[n, stride]`` uint8, whatever the storage layout."""
        return planes_to_rows(self._planes(), self.fast) if self.fast else self.codes

    def set_row_codes(self, rows: torch.Tensor) -> None:
        """Replace the codes (rows ``[n, stride]`` uint8, one per stored id; used by persistence)."""
        if rows.dtype != torch.uint8 or rows.shape != (len(self), self.codec.stride):
            raise ValueError(f"rows must be uint8 [{len(self)}, {self.codec.stride}], got {rows.dtype} {tuple(rows.shape)}")
        self.codes = self._store(rows)

    def _lists(self) -> torch.Tensor:
        counts = self.offsets.diff()
        return torch.repeat_interleave(torch.arange(counts.numel()), counts)

    def _merge(self, new: dict, lists: torch.Tensor) -> None:
        """Append rows, keep them sorted by list; all fields are computed before any is assigned."""
        all_lists = torch.cat([self._lists(), lists])
        # a flat index (one list) appends in place of order; an IVF index keeps its rows sorted by list
        order = torch.sort(all_lists, stable=True).indices if self.config.nlist else None

        def merged(old, add, dim=0):
            both = torch.cat([old, add], dim)
            return both if order is None else both.index_select(dim, order)

        out = {"codes": self._block(merged(self._planes(), new["codes"])),
               "factors": merged(self.factors, new["factors"], 1),
               "ids": merged(self.ids, new["ids"]), "center_vec": new["center_vec"]}
        for name in self.OPTIONAL_ROWS:
            if getattr(self, name) is not None:
                out[name] = merged(getattr(self, name), new[name])
        counts = torch.bincount(all_lists, minlength=self.offsets.numel() - 1)
        out["offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        for name, value in out.items():
            setattr(self, name, value)

    def remove(self, ids) -> int:
        """Remove the vectors with these ids (unknown ids are ignored); returns how many went."""
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"ids must be an integer tensor, got {type(ids).__name__}")
        keep = ~torch.isin(self.ids, ids.long().reshape(-1))
        removed = int((~keep).sum())
        if removed:
            lists = self._lists()[keep]
            counts = torch.bincount(lists, minlength=self.offsets.numel() - 1)
            out = {"codes": self._block(self._planes()[keep]), "factors": self.factors[:, keep], "ids": self.ids[keep],
                   "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])}
            for name in self.OPTIONAL_ROWS:
                if getattr(self, name) is not None:
                    out[name] = getattr(self, name)[keep]
            for name, value in out.items():
                setattr(self, name, value)
        return removed

    # -- searching --------------------------------------------------------------------
    def search(self, q: torch.Tensor, k: int, nprobe: int = 8, threads: int = 0, backend: str = "auto"):
        """q: [nq, dim] -> (scores [nq, k] float32, ids [nq, k] int64), best first.

        ``scores`` are inner products ('ip'/'cosine') or squared distances ('l2', ascending).
        ``nprobe`` lists are scanned in an IVF index; ``backend``: 'auto' (C kernel where built),
        'c', 'torch' (the reference scan; also what 'polar' always uses), 'triton' (the Triton scan on
        the index's device: a GPU, or the CPU under ``TRITON_INTERPRET=1``)."""
        q = self._prep("q", q)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        if k > len(self):
            raise ValueError(f"k={k} is larger than the index ({len(self)} vectors)")
        if isinstance(nprobe, bool) or not isinstance(nprobe, int) or nprobe < 1:
            raise ValueError(f"nprobe must be a positive int, got {nprobe!r}")
        if backend not in ("auto", "c", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'c', 'torch' or 'triton', got {backend!r}")
        kk = min(len(self), k * self.config.rerank) if self.config.rerank else k
        l2, c = self.config.metric == "l2", self.center_vec
        qs = q if c is None else q - c  # scan in centered space (see IndexConfig.center)
        ranges, lists = self._ranges(q, nprobe)
        bias = None
        if self.config.nlist and self.config.by_residual:  # <q, c_list> per probed list (x 2 for l2)
            bias = (2.0 if l2 else 1.0) * torch.gather(qs @ self.centroids.T, 1, lists)
        scores, rows = [], []
        for s in range(0, q.shape[0], _QBATCH):
            sc, rw = self._scan(qs[s:s + _QBATCH], ranges[s:s + _QBATCH], kk, threads, backend,
                                None if bias is None else bias[s:s + _QBATCH])
            scores.append(sc)
            rows.append(rw)
        scores, rows = torch.cat(scores), torch.cat(rows)
        if c is not None and not l2:  # the scan estimated <q - c, x - c> + <c, x>
            scores = scores + (qs @ c).unsqueeze(1)
        if self.config.rerank:
            scores, rows = self._rerank(q, rows, k)
            qs = q
        ids = torch.where(rows >= 0, self.ids[rows.clamp(min=0)], torch.full_like(rows, -1))
        if l2:
            scores = (qs * qs).sum(1, keepdim=True) - scores
        return scores, ids

    def _ranges(self, q: torch.Tensor, nprobe: int):
        """-> (ranges [nq, nr, 2] int64, lists [nq, nr] int64): the rows of each probed list."""
        if self.config.nlist == 0:
            zero = torch.zeros(q.shape[0], 1, dtype=torch.int64)
            return torch.tensor([[[0, len(self)]]], dtype=torch.int64).expand(q.shape[0], 1, 2).contiguous(), zero
        lists = probe(q, self.centroids, nprobe, self.config.metric)  # [nq, nprobe]
        return torch.stack([self.offsets[lists], self.offsets[lists + 1]], dim=-1).contiguous(), lists

    def _add_term(self):
        """Per-vector term added to the codes' estimate: ``-||x||^2`` (l2), ``<c, x>`` (centered ip)."""
        if self.norms is not None:
            return -(self.norms.float() ** 2)
        return None if self.cdots is None else self.cdots.float()

    def _scan(self, q, ranges, k, threads, backend, bias):
        factors = self.factors.float()
        scale = 2.0 if self.config.metric == "l2" else 1.0  # rank by 2<q,x> - ||x||^2
        if self.codec.layout is None:
            return self._scan_dense(q, ranges, k, factors, scale, bias)
        if backend == "torch":  # the reference LUT scan, chunked over the vectors
            return self._scan_dense(q, ranges, k, factors, scale, bias) if len(self) > 65536 else _scan.scan_torch(
                self.row_codes(), self.codec.layout, factors, self._add_term(),
                _scan.build_luts(self.codec.layout, [scale * t for t in self.codec.tables(q)]), ranges, k, bias)
        if backend == "triton":
            from .. import kernels
            from ..kernels.triton.scan import scan_triton

            if not kernels.triton_usable(self.codes.device):
                raise ValueError(f"backend='triton' scans CUDA tensors (or the CPU under TRITON_INTERPRET=1); this "
                                 f"index holds its codes on {self.codes.device}: use backend='auto' or 'c'")
            luts = _scan.build_luts(self.codec.layout, [scale * t for t in self.codec.tables(q)])
            return scan_triton(self.row_codes(), self.codec.layout, factors, self._add_term(), luts, ranges, k,
                               bias=bias)
        if backend == "c" and not _scan.c_available():
            raise RuntimeError("backend='c' asked but the C scan could not be built")
        if self.fast:
            y = self.codec.query_coords(q)
            y = y * scale if scale != 1.0 else y
            shared = self.config.nlist == 0
            return fastscan(self.codes, len(self), self.fast, factors[0], self._add_term(), y, self._cs, self._c,
                            ranges, bias, k, default_shortlist(k, self.fast.rbits == 0), threads, shared=shared)
        luts = _scan.build_luts(self.codec.layout, [scale * t for t in self.codec.tables(q)])
        return _scan.scan(self.codes, self.codec.layout, factors, self._add_term(), luts, ranges, k, threads, bias)

    def _scan_dense(self, q, ranges, k, factors, scale, bias):
        """Reference path: the codec's own estimate for every vector in range (chunked), then top-k."""
        best_s = torch.full((q.shape[0], k), -float("inf"))
        best_i = torch.full((q.shape[0], k), -1, dtype=torch.int64)
        add = self._add_term()
        rows_all = self.row_codes()
        for s in range(0, len(self), 16384):
            e = min(len(self), s + 16384)
            sc = scale * self.codec.score(q, rows_all[s:e], self.factors[:, s:e])
            if add is not None:
                sc = sc + add[s:e]
            rows = torch.arange(s, e)
            member = (rows >= ranges[..., :1]) & (rows < ranges[..., 1:])  # [nq, nr, chunk]
            if bias is not None:
                sc = sc + (member.float() * bias.unsqueeze(-1)).sum(1)
            sc = torch.where(member.any(1), sc, torch.tensor(-float("inf")))
            cat_s, cat_i = torch.cat([best_s, sc], 1), torch.cat([best_i, rows.expand(q.shape[0], -1)], 1)
            top = torch.topk(cat_s, k, dim=1)
            best_s, best_i = top.values, cat_i.gather(1, top.indices)
        return best_s, torch.where(torch.isfinite(best_s), best_i, torch.full_like(best_i, -1))

    def _rerank(self, q, rows, k):
        vec = self.vectors[rows.clamp(min=0)]  # [nq, kk, dim]
        exact = torch.einsum("qd,qkd->qk", q, vec)
        if self.config.metric == "l2":
            exact = 2 * exact - (vec * vec).sum(-1)
        exact = torch.where(rows >= 0, exact, torch.tensor(-float("inf")))
        top = torch.topk(exact, k, dim=1)
        return top.values, rows.gather(1, top.indices)

    # -- accounting -------------------------------------------------------------------
    def nbytes(self) -> dict:
        """Bytes held, by component (ids and IVF structures included)."""
        out = {"codes": self.codes.numel(), "factors": 2 * self.factors.numel(), "ids": 8 * self.ids.numel()}
        if self.norms is not None:
            out["norms"] = 2 * self.norms.numel()
        if self.cdots is not None:
            out["center_dots"] = 2 * self.cdots.numel()
        if self.vectors is not None:
            out["rerank_vectors"] = 4 * self.vectors.numel()
        if self.center_vec is not None:
            out["center"] = 4 * self.center_vec.numel()
        if self.centroids is not None:
            out["centroids"] = 4 * self.centroids.numel()
            out["list_offsets"] = 8 * self.offsets.numel()
        return out

    def bytes_per_vector(self) -> int:
        """Code bytes as stored (the fast scan's planes may round up each plane to a byte) + factors (+ norm,
        + ``<c, x>``)."""
        code = self.fast.row_bytes if self.fast else self.codec.stride
        return code + 2 * self.codec.nseg + (2 if self.norms is not None else 0) + (2 if self.cdots is not None else 0)

    def bits_per_dim(self, with_ids: bool = False) -> float:
        """Per-vector bits / dim: codes + factors (+ norms or ``<c, x>``, + rerank vectors)(+ ids)."""
        per = self.bytes_per_vector()
        per += 4 * self.config.dim if self.vectors is not None else 0
        per += 8 if with_ids else 0
        return 8 * per / self.config.dim

    # -- persistence (qjl.search.persist) ------------------------------------------------
    def save(self, path) -> None:
        from .persist import save_index

        save_index(self, path)

    @classmethod
    def load(cls, path) -> "Index":
        from .persist import load_index

        return load_index(path)
