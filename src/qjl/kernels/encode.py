"""Codes from keys and values with a kernel: Triton on CUDA (or its interpreter), C bucketing on the CPU.

Both read the codec only through its declared :meth:`quantize_view` (:mod:`qjl.codecs.views`) and give
the same :class:`qjl.Codes` as ``codec.quantize`` (tested bit-exact).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["can_quantize", "quantize", "can_quantize_cpu", "can_store_cpu", "quantize_cpu", "encode_rows_cpu",
           "store_cpu", "encode_store", "raise_store_error", "dense_t", "pass_matrices_t", "cpu_pass", "quantize_with"]


def can_quantize(codec) -> bool:
    """Codecs the Triton quantize kernel covers: those declaring a quantize view of plain passes (one matrix, signs or
    scalar cells; :attr:`qjl.codecs.views.QuantizeView.plain`)."""
    view = codec.quantize_view()
    return view is not None and view.plain


def _seq(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-2], x.shape[-1]) if x.ndim >= 2 else x.reshape(1, 1, -1)


_DENSE = weakref.WeakKeyDictionary()  # rotation / sketch object -> {device: its dense matrix}


def _dense(obj, device) -> torch.Tensor:
    """``obj.matrix()`` on ``device``, built once per object and device (rotations and sketches are fixed)."""
    cache = _DENSE.setdefault(obj, {})
    if device not in cache:
        cache[device] = obj.matrix().to(device)
    return cache[device]


def _check_norm(dtype, norm):
    from qjl.core.validation import check_fits

    check_fits("norm of x", norm, dtype)


def quantize(codec, x: torch.Tensor, outlier_idx: torch.Tensor | None = None):
    """Triton quantization, the same Codes as ``codec.quantize(x[, outlier_idx])``.

    x: [..., n, dim] (any float dtype); outlier_idx: [..., n_outliers] for codecs whose view has a
    per-sequence channel choice (chosen from x when None).
    """
    from qjl.codecs.base import Codes
    from qjl.core.validation import check_vectors
    from qjl.kernels.triton import launch as tl

    view = codec.quantize_view()
    if view is None or not view.plain:
        raise TypeError(f"codec: {codec!r} declares no quantize view the Triton kernel runs (one matrix, signs or "
                        "scalar cells): codec.quantize codes it")
    check_vectors("x", x, codec.dim, min_ndim=2 if view.shared else 1)
    lead = tuple(x.shape[:-1])
    xs = _seq(x)
    s, d = xs.shape[0], xs.shape[-1]
    fields, shared, inlier_mask, idx_s = {}, {}, None, None
    if view.shared:
        idx = codec.select_outliers(x) if outlier_idx is None else outlier_idx
        idx = codec.check_outlier_idx(idx.to(x.device), lead[:-1])
        idx_s = idx.reshape(-1, idx.shape[-1]).long()
        if idx_s.shape[0] == 1 and s > 1:
            idx_s = idx_s.expand(s, -1)
        inlier_mask = torch.ones(s, d, device=x.device).scatter(-1, idx_s, 0.0)
        shared[view.shared] = idx.to(codec.idx_dtype)
    for p in view.passes:
        mat = _dense(p.matrix, x.device)
        kw = {}
        if p.channels == "inliers":
            kw = dict(channel_mask=inlier_mask, mask_mode=1)
        elif p.channels == "outliers":  # the outlier sketch scattered onto each sequence's channels
            scattered = torch.zeros(s, mat.shape[0], d, device=x.device)
            scattered.scatter_(-1, idx_s.unsqueeze(1).expand(-1, mat.shape[0], -1), mat.unsqueeze(0).expand(s, -1, -1))
            mat, kw = scattered, dict(channel_mask=inlier_mask, mask_mode=2)
        if p.boundaries is None:
            codes, norm = tl.quantize(xs, mat, 1, sign=True, **kw)
        else:
            codes, norm = tl.quantize(xs, mat, p.bits, boundaries=p.boundaries.to(x.device), normalize=p.normalize,
                                      centroids=p.centroids.to(x.device), correct_norm=p.correct_norm, **kw)
        _check_norm(p.norm_dtype, norm)
        fields[p.codes] = codes.reshape(*lead, -1)
        fields[p.norm] = norm.reshape(lead).to(p.norm_dtype)
    return Codes(lead, fields, shared)


_PASS = weakref.WeakKeyDictionary()  # codec -> its single CPU bucketing pass, or None (codecs are immutable)


def cpu_pass(codec):
    """The single normalize-rotate-quantize pass (a :class:`qjl.codecs.views.ProjectQuantize`: scalar cells or a
    vector codebook, one rotation or several in turn) the CPU encoder runs for ``codec``, or None (memoized per codec
    object)."""
    try:
        return _PASS[codec]
    except (KeyError, TypeError):
        pass
    view = codec.quantize_view()
    p = None
    if view is not None and not view.shared and len(view.passes) == 1:
        q = view.passes[0]
        p = q if (q.boundaries is not None or q.table is not None) and q.normalize and q.channels == "all" else None
    try:
        _PASS[codec] = p
    except TypeError:  # not weak-referenceable: no memo
        pass
    return p


def can_quantize_cpu(codec) -> bool:
    """Codecs the C bucketing covers (normalize, one rotation, Lloyd-Max cells: TurboQuant MSE) where it builds
    (:func:`quantize_cpu`)."""
    from qjl.kernels.cpu import launch

    p = cpu_pass(codec)
    return p is not None and p.plain and launch.available()


def can_store_cpu(codec) -> bool:
    """Codecs the C encoder stores into paged fields where it builds (:func:`store_cpu`): TurboQuant MSE and its vector
    codebooks (:class:`qjl.codecs.vq.TurboQuantVQ`), over one rotation or several in turn (these given each token's
    position)."""
    from qjl.kernels.cpu import launch

    return cpu_pass(codec) is not None and launch.available()


def _rotated(codec, x: torch.Tensor):
    """The reference's first half in torch, op for op (so the codes are bit-exact): (pass, norm [...],
    y [..., n] = rotation(x / norm)), x checked like the reference checks it."""
    from qjl.core.validation import check_vectors

    p = cpu_pass(codec)
    if p is None or not p.plain:
        raise TypeError(f"codec: the CPU quantize kernel covers rotate-and-bucket codecs with one rotation "
                        f"(TurboQuantMSE), got {codec!r}")
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.ndim < 1 or x.shape[-1] != codec.dim:
        check_vectors("x", x, codec.dim)  # raises the reference's error
    xf = x.float()
    norm = torch.linalg.vector_norm(xf, dim=-1)
    unit = xf / torch.where(norm > 0, norm, torch.ones_like(norm)).unsqueeze(-1)
    return p, norm, p.matrix.apply(unit)


def quantize_cpu(codec, x: torch.Tensor):
    """The reference's norm and rotation (torch), then cells, packing, the norm correction's cosine and the
    norm's range check in one C pass (:func:`encode_rows_cpu`).  Codes equal ``codec.quantize(x)``; with
    ``correct_norm`` the cosine is summed in another order (norms may differ by one ulp of their dtype)."""
    from qjl.codecs.base import Codes

    codes, stored = encode_rows_cpu(codec, x)
    p, lead = cpu_pass(codec), tuple(x.shape[:-1])
    return Codes(lead, {p.codes: codes.reshape(*lead, -1), p.norm: stored.reshape(lead).to(p.norm_dtype)})


def encode_rows_cpu(codec, x: torch.Tensor) -> tuple:
    """``codec.quantize(x)`` as rows ready to store: (codes [rows, nbytes] uint8, stored norms [rows] float32), rows
    in x's order (x [..., dim]).  The torch half of :func:`quantize_cpu`, then one C call that buckets, packs
    and corrects and range-checks the norm (:func:`store_cpu` writes them straight into paged fields instead).
    Equals :func:`quantize_cpu`'s codes (bit-exact with ``codec.quantize``) and norms as float32.  Raises the
    reference's ValueError for NaN/Inf or a norm beyond its dtype."""
    from qjl.kernels.cpu import store

    p, norm, y = _rotated(codec, x)
    rc, codes, stored = store.bucket_norms(y, norm, p)
    _raise_for(rc, codec, x, p)
    return codes, stored


_DENSE_T = weakref.WeakKeyDictionary()  # rotation -> its dense matrix transposed, [dim, n] float32 (CPU)


def dense_t(rotation) -> torch.Tensor:
    """``rotation.matrix().T`` [dim, n] float32 contiguous on the CPU, built once per rotation object."""
    try:
        return _DENSE_T[rotation]
    except (KeyError, TypeError):
        pass
    m = _dense(rotation, torch.device("cpu")).float().T.contiguous()
    try:
        _DENSE_T[rotation] = m
    except TypeError:  # not weak-referenceable: no memo
        pass
    return m


def pass_matrices_t(p) -> torch.Tensor:
    """The dense matrices the C encoder rotates with for pass ``p``: [dim, n] (one rotation, :func:`dense_t`) or
    [K, dim, n] (its K rotations in turn, ``p.rotations``)."""
    if p.cycles == 1:
        return dense_t(p.matrix)
    return torch.stack([dense_t(r) for r in p.rotations])


def store_cpu(jobs, blocks: torch.Tensor, slots: torch.Tensor, bounds: tuple | None = None,
              memo: dict | None = None, positions: torch.Tensor | None = None) -> None:
    """Quantize every job ``(codec, x [N, H, dim], codes_field, norm_field)`` and store its codes and norms into
    paged fields (CPU buffers) at (blocks [N], slots [N], KV heads 0..H-1), all jobs in one C call
    (:class:`qjl.kernels.cpu.store.EncodeStore`: norm, rotation, cells, packing and the norm's dtype, the rows
    never leaving C).  The arithmetic runs in a fixed order, so what is stored equals
    :func:`qjl.kernels.reference.encode_reference` bit for bit; against ``codec.quantize`` (whose rotation is a
    BLAS product, rounded differently from one batch shape to another) a code may differ where a rotated
    coordinate lies within float32 rounding of a cell boundary (tested: rare, and only there).  Codecs: those of
    :func:`can_store_cpu` (TurboQuant MSE, its vector codebooks, over rotations in turn: these need ``positions``
    [N], each token's position in its sequence).  Nothing is stored unless every job passes: the reference's
    ValueError for NaN/Inf or a norm beyond its dtype; ValueError for positions or fields that do not fit.  ``bounds``:
    :func:`qjl.kernels.cpu.store.store_bounds` of blocks and slots (a caller storing several layers at the same
    positions computes it once); ``memo``: a dict living as long as the fields (e.g.
    :attr:`qjl.kernels.paged.FieldMap.memo`) where the C arguments are kept between calls."""
    store, static = encode_store(jobs, memo)
    xs = [x for _, x, _, _ in jobs]
    rc, k = store(xs, blocks, slots, bounds, positions)
    if rc:
        raise_store_error(rc, jobs[k][0], xs[k], static[k])


def encode_store(jobs, memo: dict | None = None) -> tuple:
    """(:class:`qjl.kernels.cpu.store.EncodeStore`, its static parts) of :func:`store_cpu`'s ``jobs``, built once
    per jobs' objects (codecs and fields) and kept in ``memo`` (see :func:`store_cpu`); TypeError for a codec the
    CPU quantize kernel does not cover."""
    from qjl.kernels.cpu.store import EncodeStore

    xs = [x for _, x, _, _ in jobs]
    heads = xs[0].shape[-2] if xs and isinstance(xs[0], torch.Tensor) and xs[0].ndim == 3 else 0
    objs = tuple(o for codec, _, cf, nf in jobs for o in (codec, cf, nf))  # (codecs are immutable: what a job
    key = ("store", heads) + tuple(id(o) for o in objs)                     # stores follows from these objects)
    hit = memo.get(key) if memo is not None else None
    if hit is not None and len(hit[0]) == len(objs) and all(x is y for x, y in zip(hit[0], objs)):
        return hit[2], hit[1]
    static = []
    for codec, x, cf, nf in jobs:
        p = cpu_pass(codec)
        if p is None:
            raise TypeError(f"codec: the C encoder stores rotate-and-quantize codecs (TurboQuantMSE, TurboQuantVQ), "
                            f"got {type(codec).__name__}")
        static.append((p, pass_matrices_t(p), cf, nf))
    store = EncodeStore(static, heads)
    if memo is not None:
        memo[key] = (objs, static, store)  # (the objects kept: their ids stay theirs)
    return store, static


def raise_store_error(rc: int, codec, x: torch.Tensor, static) -> None:
    """Raise the reference's error for a failed job of an :class:`qjl.kernels.cpu.store.EncodeStore` (status
    ``rc``, the job's codec, input ``x`` and its entry of :func:`encode_store`'s static parts)."""
    _raise_for(rc, codec, x, static[0])


def _raise_for(rc: int, codec, x: torch.Tensor, p) -> None:
    """The reference's error for a C bucketing status (0: none)."""
    from qjl.core.validation import check_vectors

    if rc == -2:  # a NaN/Inf entry (the reference's error), else finite entries whose norm overflows float32
        check_vectors("x", x, codec.dim)
        rc = -3
    if rc in (-3, -4):  # the reference's message (qjl.core.validation.check_fits)
        top = torch.finfo(p.norm_dtype).max
        raise ValueError(f"{'norm of x' if rc == -3 else 'corrected norm of x'} overflows its storage dtype "
                         f"{p.norm_dtype} (max {top:g})")
    if rc:
        raise ValueError("the C bucketing refused its arguments (code width or boundaries)")


def quantize_with(backend: str, codec, x: torch.Tensor, *fit, start: int = 0):
    """The codes of x with the fastest quantizer ``backend`` has for ``codec`` ("triton": the Triton kernel for
    codecs with a quantize view; "cpu": the C bucketing for TurboQuant MSE when there is no per-sequence fit;
    otherwise, and for "torch", ``codec.quantize``).  Every path gives ``codec.quantize(x, *fit)``'s codes
    (tested bit-exact).  ``fit``: the codec's per-sequence choice (outlier channels), if any.  ``start``: the code
    position of x's first vector (axis -2), for codecs whose codes depend on it (``codec.positional``: TurboQuant
    over rotations in turn, quantized by ``codec.quantize(x, start=start)``)."""
    from qjl.kernels import BACKENDS

    if backend not in BACKENDS[1:]:
        raise ValueError(f"backend must be one of {BACKENDS[1:]} (pick one with qjl.kernels.pick_backend), "
                         f"got {backend!r}")
    if getattr(codec, "positional", False):
        return codec.quantize(x, *fit, start=start)
    if backend == "triton" and can_quantize(codec):
        return quantize(codec, x, *fit)
    if backend == "cpu" and not fit and can_quantize_cpu(codec):
        return quantize_cpu(codec, x)
    return codec.quantize(x, *fit)
