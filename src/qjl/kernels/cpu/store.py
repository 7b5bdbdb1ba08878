"""Launchers of the CPU encode (``quantize.c``): TurboQuant's bucketing with the stored norm
(:func:`bucket_norms`), a codebook's cell moments (:func:`cell_moments`), and the one call that quantizes a
layer's new keys and values into paged fields (:class:`EncodeStore`, positions checked by :func:`store_bounds`)."""

from __future__ import annotations

import torch

from .binding import DTYPES, X_DTYPES, Args, f32, require

__all__ = ["vq_nearest", "vq_moments", "bucket_norms", "cell_moments", "store_bounds", "check_positions", "EncodeStore"]


def bucket_norms(y: torch.Tensor, norm: torch.Tensor, qpass) -> tuple:
    """y [..., n] float32 with norms [...] -> the cells (``torch.bucketize(y, boundaries)``) packed LSB-first, and
    the norm to store
    (corrected as ``qpass``, a :class:`qjl.codecs.views.ProjectQuantize`, says; float32, checked against its
    dtype's range).  Returns (status, codes [rows, nbytes] uint8, stored [rows] float32): status 0, or -2 a norm
    not finite, -3 / -4 a norm / corrected norm beyond its dtype, -1 other arguments refused."""
    mod = require()
    n = y.shape[-1]
    y2, nm = f32(y.reshape(-1, n)), f32(norm.reshape(-1))
    rows, nbytes = y2.shape[0], (n * qpass.bits + 7) // 8
    if nm.shape[0] != rows:
        raise ValueError(f"norm must hold one entry per row of y ({rows}), got {tuple(norm.shape)}")
    codes, stored = torch.empty(rows, nbytes, dtype=torch.uint8), torch.empty(rows)
    bnd, cent = f32(qpass.boundaries), f32(qpass.centroids)
    a = Args(mod.ffi)
    rc = mod.lib.qjl_bucket_norms(a.ptr(y2), a.ptr(nm), rows, n, a.ptr(bnd), bnd.numel(), a.ptr(cent), qpass.bits,
                                  int(bool(qpass.correct_norm)), torch.finfo(qpass.norm_dtype).max,
                                  a.ptr(codes, "uint8_t *"), a.ptr(stored), torch.get_num_threads())
    return rc, codes, stored


def cell_moments(y: torch.Tensor, boundaries: torch.Tensor, centroids: torch.Tensor) -> tuple:
    """:func:`qjl.core.lloyd_max.cell_moments` in C: y [..., n] float (CPU) against a codebook of ``2^bits`` cells
    -> (cos [...], cc [...]) float64, ``sum y c`` and ``sum c^2`` over each row's cells (summed in float64 in
    coordinate order).  Raises ValueError for a non-finite y or a codebook that is not ``2^bits`` cells."""
    from qjl.core.lloyd_max import check_codebook

    mod = require()
    bits = check_codebook(boundaries, centroids)
    if not isinstance(y, torch.Tensor) or not y.is_floating_point() or y.ndim < 1 or y.device.type != "cpu":
        raise TypeError(f"y must be a float CPU tensor [..., n], got {getattr(y, 'dtype', type(y).__name__)}")
    bnd, cent = f32(boundaries), f32(centroids)
    n = y.shape[-1]
    y2 = f32(y.reshape(-1, n))
    cos, cc = torch.empty(y2.shape[0], dtype=torch.float64), torch.empty(y2.shape[0], dtype=torch.float64)
    a = Args(mod.ffi)
    rc = mod.lib.qjl_cell_moments(a.ptr(y2), y2.shape[0], n, a.ptr(bnd), bnd.numel(), a.ptr(cent), bits,
                                  a.ptr(cos, "double *"), a.ptr(cc, "double *"), torch.get_num_threads())
    if rc:
        raise ValueError("y must be finite (the C cell moments refused it)")
    return cos.reshape(y.shape[:-1]), cc.reshape(y.shape[:-1])


def _grid(a, grid) -> tuple:
    """The C arguments of a :class:`qjl.core.vq_codebook.SearchGrid` (or none): (lo, inv, cells, off, cand)."""
    if grid is None:
        return 0.0, 1.0, 0, a.ptr(None), a.ptr(None)
    off, cand = grid.off.contiguous(), grid.cand.contiguous()
    if off.dtype != torch.int32 or cand.dtype != torch.int32 or off.shape != (grid.cells ** 2 + 1,):
        raise ValueError(f"grid: off must be int32 [cells^2 + 1] and cand int32, got {off.dtype} {tuple(off.shape)}, "
                         f"{cand.dtype} (qjl.core.vq_codebook.search_grid builds them)")
    return grid.lo, grid.inv, grid.cells, a.ptr(off, "int32_t *"), a.ptr(cand, "int32_t *")


def vq_moments(y: torch.Tensor, table: torch.Tensor, sq: torch.Tensor, grid=None) -> tuple:
    """Each row's moments against its nearest codewords, group by group: y [rows, n] float32 CPU (n a multiple of
    g), table [k, g], sq [k], ``grid`` as :func:`vq_nearest` -> (cos, cc) [rows] float64, ``sum y c`` and ``sum
    c^2`` over the row's chosen codewords (:func:`vq_nearest`'s), summed in float64 in coordinate order.
    Raises ValueError for a non-finite y or bad shapes."""
    mod = require()
    if y.ndim != 2 or table.ndim != 2 or y.shape[1] % table.shape[1] or sq.shape != (table.shape[0],):
        raise ValueError(f"y [rows, n] (n a multiple of g), table [k, g], sq [k] expected, got {tuple(y.shape)}, "
                         f"{tuple(table.shape)}, {tuple(sq.shape)}")
    if grid is not None and table.shape[1] != 2:
        raise ValueError(f"grid: the grid search serves pairs (g = 2), got g = {table.shape[1]}")
    y2, t2, s2 = f32(y), f32(table), f32(sq)
    cos, cc = torch.empty(y2.shape[0], dtype=torch.float64), torch.empty(y2.shape[0], dtype=torch.float64)
    a = Args(mod.ffi)
    rc = mod.lib.qjl_vq_moments(a.ptr(y2), y2.shape[0], y2.shape[1], t2.shape[1], a.ptr(t2), t2.shape[0], a.ptr(s2),
                                *_grid(a, grid), a.ptr(cos, "double *"), a.ptr(cc, "double *"),
                                torch.get_num_threads())
    if rc:
        raise ValueError("y must be finite (and grid a search_grid of this table): the C moments refused them")
    return cos, cc


def vq_nearest(y: torch.Tensor, table: torch.Tensor, sq: torch.Tensor, grid=None) -> torch.Tensor:
    """:func:`qjl.core.vq_codebook.nearest_reference` in C: y [groups, g] float32 CPU, table [k, g], sq [k] ->
    [groups] int64, equal to the reference index for index (the same float32 operations in the same order).
    ``grid``: the table's :func:`qjl.core.vq_codebook.search_grid` (pairs only): each pair compared with its
    square's candidates (the same indices; 49,152 pairs at 4 bits, one thread: 3.2 -> 1.4 ms).  Raises ValueError for
    a non-finite y or bad shapes."""
    mod = require()
    if y.ndim != 2 or table.ndim != 2 or y.shape[1] != table.shape[1] or sq.shape != (table.shape[0],):
        raise ValueError(f"y [groups, g], table [k, g], sq [k] expected, got {tuple(y.shape)}, {tuple(table.shape)}, "
                         f"{tuple(sq.shape)}")
    if grid is not None and y.shape[1] != 2:
        raise ValueError(f"grid: the grid search serves pairs (g = 2), got g = {y.shape[1]}")
    y2, t2, s2 = f32(y), f32(table), f32(sq)
    out = torch.empty(y2.shape[0], dtype=torch.int64)
    a = Args(mod.ffi)
    if grid is None:
        rc = mod.lib.qjl_vq_nearest(a.ptr(y2), y2.shape[0], y2.shape[1], a.ptr(t2), t2.shape[0], a.ptr(s2),
                                    a.ptr(out, "int64_t *"), torch.get_num_threads())
    else:
        rc = mod.lib.qjl_vq_nearest_grid(a.ptr(y2), y2.shape[0], a.ptr(t2), t2.shape[0], a.ptr(s2), *_grid(a, grid),
                                         a.ptr(out, "int64_t *"), torch.get_num_threads())
    if rc and grid is not None:
        raise ValueError("y must be finite and grid a search_grid of this table (every square's list non-empty, "
                         "indices below k): the C grid search refused them")
    if rc:
        raise ValueError("y must be finite [groups, g] with 1 <= g <= 8 (the C nearest-codeword search refused it)")
    return out


def store_bounds(blocks: torch.Tensor, slots: torch.Tensor) -> tuple:
    """What :class:`EncodeStore` checks its positions with: (blocks, slots as int64 contiguous, the smallest of
    both, the largest block, the largest slot).  A caller that stores several fields at the same positions (the
    vLLM backend: every layer of a step) computes it once and passes it as ``bounds``."""
    for name, t in (("blocks", blocks), ("slots", slots)):
        if not isinstance(t, torch.Tensor) or t.ndim != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-d int tensor, got {getattr(t, 'shape', t)!r}")
    if blocks.shape[0] == 0 or slots.shape != blocks.shape:
        raise ValueError(f"blocks and slots must hold one entry per token (at least one), got "
                         f"{tuple(blocks.shape)} and {tuple(slots.shape)}")
    blk, slt = blocks.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
    return blk, slt, min(int(blk.min()), int(slt.min())), int(blk.max()), int(slt.max())


def check_positions(positions, n: int) -> torch.Tensor:
    """``positions`` as the C encoder reads them: a contiguous int64 CPU tensor [n] of non-negative positions (each
    token's in its sequence), or ValueError naming it."""
    if (not isinstance(positions, torch.Tensor) or positions.shape != (n,) or positions.dtype.is_floating_point
            or positions.dtype == torch.bool):
        raise ValueError(f"positions must be a 1-d int tensor of the {n} tokens' positions in their sequences (values "
                         f"coded over rotations in turn), got {getattr(positions, 'shape', positions)!r}")
    pos = positions.to("cpu", torch.int64).contiguous()
    if n and int(pos.min()) < 0:
        raise ValueError("positions must be non-negative")
    return pos


def _vq_job(a, j, qpass, n: int) -> None:
    """A vector-codebook pass's C arguments into encode job ``j``: the table, its squared norms
    (:func:`qjl.core.vq_codebook.codeword_norms`), the table transposed and the pairs' search grid (checked once
    here by a search through it)."""
    table = f32(qpass.table)
    words, g = table.shape
    if n % g or words != 1 << (g * qpass.bits):
        raise ValueError(f"a vector codebook of {words} words of {g} coordinates at {qpass.bits} bits does not code "
                         f"{n} coordinates")
    from qjl.core.vq_codebook import codeword_norms

    sq = codeword_norms(table)
    j.group, j.words, j.table, j.sq, j.tt = g, words, a.ptr(table), a.ptr(sq), a.ptr(table.t().contiguous())
    grid = qpass.search
    if grid is not None:
        vq_nearest(torch.zeros(1, g), table, sq, grid)  # (ValueError unless it is a grid of this table)
        j.grid_lo, j.grid_inv, j.grid_cells, j.grid_off, j.grid_cand = _grid(a, grid)


class EncodeStore:
    """One C call (``qjl_encode_store``, ``quantize.c``) that quantizes a layer's new keys and values and stores
    them into paged fields, with the jobs' fixed parts (the pass: Lloyd-Max cells or a vector codebook; rotation,
    codes field, norm field) checked and turned into C arguments once: callers that store into the same fields step
    after step keep one (the vLLM backend: in its :attr:`qjl.kernels.paged.FieldMap.memo`).  ``static``: [(qpass, a
    :class:`qjl.codecs.views.ProjectQuantize`; matrix_t [dim, n] float32, the rotation's dense matrix transposed, or
    [K, dim, n] for the pass's K rotations in turn; codes_field, norm_field)], 1 to 4 jobs; ``heads``: KV heads per
    token.
    The row order of the arithmetic is fixed (``quantize.c``'s ``encode_row``; the torch mirror is
    :func:`qjl.kernels.reference.encode_reference`).  Each call checks the positions against the fields' buffers
    (whose address and geometry must not have changed: checked too).  One caller at a time: a call fills the C
    arguments it keeps (the vLLM backend runs a step's layers one after another)."""

    def __init__(self, static, heads: int):
        from qjl.kernels.paged import extent_bytes

        if not 1 <= len(static) <= 4:
            raise ValueError(f"EncodeStore takes 1 to 4 jobs, got {len(static)}")
        self.mod, self.heads, self.static = require(), int(heads), tuple(static)
        self.a = a = Args(self.mod.ffi)
        self.cj = a.ffi.new("qjl_encode_job[]", len(static))
        self.limits = []  # per field: (name, offset + the last head's and the entry's bytes, strides, extent, buffer)
        self.positional = False  # some job codes tokens by their positions (rotations in turn)
        for j, (qpass, matrix_t, codes_field, norm_field) in zip(self.cj, static):
            mt = f32(matrix_t)
            cycles = mt.shape[0] if mt.ndim == 3 else 1
            if mt.ndim not in (2, 3) or cycles != qpass.cycles:
                raise ValueError(f"matrix_t must be [dim, n] (one rotation) or [K, dim, n] (K = the pass's "
                                 f"{qpass.cycles} rotations in turn), got {tuple(matrix_t.shape)}")
            dim, n = mt.shape[-2:]
            self.positional |= cycles > 1
            j.cycles, j.cos_floor = cycles, float(qpass.cos_floor)
            if qpass.table is None:
                bnd, cent = f32(qpass.boundaries), f32(qpass.centroids)
                j.bnd, j.cent, j.nbnd, j.group = a.ptr(bnd), a.ptr(cent), bnd.numel(), 1
            else:
                _vq_job(a, j, qpass, n)
            for name, f, entry in (("codes_field", codes_field, (n * qpass.bits + 7) // 8),
                                   ("norm_field", norm_field, None)):
                if f.buffer.device.type != "cpu":
                    raise ValueError(f"{name} must live in CPU memory, got {f.buffer.device}")
                if entry is not None and f.entry_bytes != entry:
                    raise ValueError(f"{name}: entries of {f.entry_bytes} bytes cannot hold {entry}-byte codes")
                if entry is None and f.dtype not in DTYPES:
                    raise ValueError(f"{name}: a norm stored as {f.dtype} is not written by the CPU kernel")
                if min(f.offset, f.stride_block, f.stride_head, f.stride_token) < 0:
                    raise ValueError(f"{name}: negative offset or strides")
                t = f.buffer
                self.limits.append((name, f.offset + (self.heads - 1) * f.stride_head + f.entry_bytes, f.stride_block,
                                    f.stride_token, extent_bytes(t), t, t.data_ptr(), tuple(t.shape), t.stride()))
            j.dim, j.n, j.matrix_t, j.bits = dim, n, a.ptr(mt), qpass.bits
            j.correct, j.norm_max = int(bool(qpass.correct_norm)), torch.finfo(qpass.norm_dtype).max
            a.field(j.codes, codes_field, False)
            a.field(j.norm_field, norm_field, True)
        self.failed = a.ffi.new("int32_t *")

    def check_positions(self, bounds: tuple) -> None:
        """ValueError (naming the field) unless every position of ``bounds`` (:func:`store_bounds`) lies inside every
        field's buffer."""
        _, _, lo, top_block, top_slot = bounds
        for name, fixed, sb, st, extent, *_ in self.limits:
            last = fixed + top_block * sb + top_slot * st
            if lo < 0 or last > extent:
                raise ValueError(f"{name}: the blocks/slots bounds reach byte {last} of a buffer of {extent} "
                                 f"(or an index is negative): nothing stored")

    def matches(self, static) -> bool:
        """These jobs are the ones this store was built for (the same objects)."""
        return len(static) == len(self.static) and all(
            x is y for s, t in zip(static, self.static) for x, y in zip(s, t))

    def __call__(self, xs, blocks: torch.Tensor, slots: torch.Tensor, bounds: tuple | None = None,
                 positions: torch.Tensor | None = None) -> tuple:
        """xs: one tensor [N, H, dim] per job (fp32, fp16 or bf16; other floats are converted) of the tokens at
        blocks, slots [N] (``bounds``: their :func:`store_bounds`); ``positions`` [N] int (>= 0): each token's
        position in its sequence, which jobs over rotations in turn need (:attr:`positional`).  Returns (status,
        job): 0, or for the first job that failed -2 (a NaN/Inf entry), -3 (a norm beyond its dtype), -4 (a
        corrected norm beyond it), -1 (arguments refused); nothing is stored unless the status is 0.  ValueError
        (nothing stored) for inputs or positions that do not fit."""
        blk, slt, lo, top_block, top_slot = bounds = store_bounds(blocks, slots) if bounds is None else bounds
        n_tok, h = blk.shape[0], self.heads
        pos = check_positions(positions, n_tok) if self.positional or positions is not None else None
        for name, fixed, sb, st, extent, t, ptr, shape, stride in self.limits:
            if t.data_ptr() != ptr or t.shape != shape or t.stride() != stride:
                raise ValueError(f"{name}: its buffer moved or changed shape since this EncodeStore was built")
        self.check_positions(bounds)
        if len(xs) != len(self.static):
            raise ValueError(f"EncodeStore: {len(self.static)} inputs expected, got {len(xs)}")
        keep = []
        for j, x in zip(self.cj, xs):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != (n_tok, h, j.dim):
                raise ValueError(f"x must be [{n_tok}, {h}, {j.dim}] (tokens, KV heads, dim), got "
                                 f"{getattr(x, 'shape', type(x).__name__)}")
            if x.dtype not in X_DTYPES or x.stride(2) != 1 or x.device.type != "cpu":
                x = x.detach().to("cpu", torch.float32).contiguous()
            keep.append(x)
            es = x.element_size()
            j.x, j.x_dtype = self.a.ffi.cast("const uint8_t *", x.data_ptr()), X_DTYPES[x.dtype]
            j.x_st, j.x_sh = x.stride(0) * es, x.stride(1) * es
            j.pos = self.a.ffi.NULL if pos is None else self.a.ffi.cast("const int64_t *", pos.data_ptr())
        rc = self.mod.lib.qjl_encode_store(self.cj, len(self.static), n_tok, h,
                                           self.a.ffi.cast("int64_t *", blk.data_ptr()),
                                           self.a.ffi.cast("int64_t *", slt.data_ptr()), torch.get_num_threads(),
                                           self.failed)
        del keep, pos  # (the inputs stayed alive through the call)
        return rc, int(self.failed[0])
