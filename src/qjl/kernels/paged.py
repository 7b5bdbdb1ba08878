"""The paged decode contract: where a layer's fields live, and the public launcher every backend serves.

PAGED ADDRESSING (shared with the vLLM backend): field ``f`` of coded token ``t`` of sequence ``b``,
KV head ``h``, is the ``f.dtype`` array of shape ``f.shape`` at byte address

    f.buffer.data_ptr() + f.offset + block_table[b, t // block_size] * f.stride_block
                        + h * f.stride_head + (t % block_size) * f.stride_token

(``stride_token = 0``: one entry per block and head, e.g. QJL's ``outlier_idx``).  vLLM's pages and
transformers' contiguous codes (one block per sequence, ``block_table = arange(B)[:, None]``,
``block_size`` = the code length; :meth:`PagedField.of`) are both this addressing.  Fields are named
as in the codecs' :class:`qjl.Codes`; the codecs' views (:mod:`qjl.codecs.views`) say which fields a
kernel reads and how.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace

import torch

__all__ = ["PagedField", "FieldMap", "PagedRows", "role_fields", "paged_decode", "check_paged", "views",
           "kernel_readable", "view_fields", "term_queries", "query_maps", "unmix_matrix", "check_exact",
           "joined_exact", "check_static", "mix_room", "mix_view", "rotation_matrix", "check_args", "check_table", "fields_signature",
           "extent_bytes", "field_geometry", "fit_field"]

_VIEWS = weakref.WeakKeyDictionary()  # codec -> its views, centroids as contiguous float32 (codecs are immutable)


def _view(codec, kind: str):
    try:
        memo = _VIEWS.setdefault(codec, {})
    except TypeError:  # not weak-referenceable: no memo
        memo = {}
    if kind not in memo:
        v = getattr(codec, kind, lambda: None)()
        if v is not None and kind == "score_view":
            v = replace(v, terms=tuple(replace(t, codes=replace(t.codes, centroids=t.codes.centroids.float().contiguous()))
                                       for t in v.terms))
        elif v is not None:
            v = replace(v, codes=replace(v.codes, centroids=v.codes.centroids.float().contiguous()))
        memo[kind] = v
    return memo[kind]


def query_maps(key_codec) -> list | None:
    """The key terms' query maps as matrices [n_i, dim] float32 (``score_queries(q)[i] = q @ M_i.T``, the maps
    being linear), built once per codec; None when the maps read per-sequence shared fields."""
    view = _view(key_codec, "score_view")
    if view.shared:
        return None
    memo = _VIEWS.get(key_codec, {})
    if "qmaps" not in memo:
        eye = torch.eye(key_codec.dim)
        memo["qmaps"] = [m.T.float().contiguous() for m in key_codec.score_queries(eye)]
    return memo["qmaps"]


def unmix_matrix(value_codec) -> torch.Tensor | None:
    """``unmix`` as a matrix [K n, dim] float32 (``unmix(o) = o @ U``; K the view's ``cycles``, accumulator k in
    rows ``[k n, (k + 1) n)``), once per codec; None for the identity."""
    view = _view(value_codec, "mix_view")
    if not view.rotated:
        return None
    memo = _VIEWS.get(value_codec, {})
    if "unmix" not in memo:
        memo["unmix"] = value_codec.unmix(torch.eye(view.mixed_length)).float().contiguous()
    return memo["unmix"]


def rotation_matrix(codec) -> torch.Tensor | None:
    """The map into ``codec``'s mix basis as a matrix [dim, dim] float32 (``rotated = x @ R``), once per codec: the
    transpose of :func:`unmix_matrix` where that is square and orthogonal (TurboQuant's rotation; checked to 1e-5);
    None for a codec without a mix view, the identity unmix, or any other map."""
    if _view(codec, "mix_view") is None:
        return None
    memo = _VIEWS.get(codec, {})
    if "rotation" not in memo:
        u = unmix_matrix(codec)
        ok = u is not None and u.shape[0] == u.shape[1] and bool(
            (u @ u.T - torch.eye(u.shape[0])).abs().max() <= 1e-5)
        memo["rotation"] = u.T.contiguous() if ok else None
    return memo["rotation"]


def mix_view(codec):
    """``codec.mix_view()`` (None where it declares none), centroids contiguous float32, built once per codec."""
    return _view(codec, "mix_view")


def fit_field(key_codec) -> str | None:
    """The per-sequence (per-block, in pages) shared field a key codec's query maps read -- its ``fit``, e.g. QJL's
    ``outlier_idx`` or a split codec's ``split_idx`` -- or None (one view built once per codec)."""
    view = _view(key_codec, "score_view")
    if view is None or not view.shared:
        return None
    if len(view.shared) != 1:
        raise ValueError(f"{type(key_codec).__name__}: a score view reading {len(view.shared)} shared fields is not "
                         "paged (one per-sequence fit at most)")
    return view.shared[0]


def views(key_codec, value_codec) -> tuple:
    """(key_codec.score_view(), value_codec.mix_view()), built once per codec object."""
    return _view(key_codec, "score_view"), _view(value_codec, "mix_view")


def kernel_readable(key_codec, value_codec) -> bool:
    """:func:`qjl.codecs.views.kernel_readable`, memoized per pair of codec objects."""
    memo = _VIEWS.get(key_codec)
    hit = memo.get(("readable", id(value_codec))) if memo is not None else None
    if hit is not None and hit[0]() is value_codec:
        return hit[1]
    from qjl.codecs.views import readable

    ok = readable(*views(key_codec, value_codec))
    try:
        _VIEWS.setdefault(key_codec, {})[("readable", id(value_codec))] = (weakref.ref(value_codec), ok)
    except TypeError:  # not weak-referenceable: no memo
        pass
    return ok


@dataclass(frozen=True)
class PagedField:
    """One stored field of every token of a paged pool (see the module docstring for the addressing).

    buffer: the tensor holding it (addresses are relative to ``buffer.data_ptr()``); offset and
    strides in bytes; dtype and shape of one entry (``shape=(nbytes,)`` uint8 for packed codes,
    ``()`` for a norm, ``(groups,)`` for token-wise scales).
    """

    buffer: torch.Tensor
    offset: int
    stride_block: int
    stride_head: int
    stride_token: int
    dtype: torch.dtype
    shape: tuple

    @staticmethod
    def of(t: torch.Tensor, shared: bool = False) -> "PagedField":
        """A field of contiguous codes: ``t`` [B, H, N, *shape] (``shared``: [B, H, *shape], one entry per
        sequence and head) as one block per sequence."""
        entry_dims = t.ndim - (2 if shared else 3)
        if entry_dims and not t[(0,) * (t.ndim - entry_dims)].is_contiguous():
            t = t.contiguous()  # an entry's elements must be consecutive
        es = t.element_size()
        token = 0 if shared else t.stride(2) * es
        shape = tuple(t.shape[2:] if shared else t.shape[3:])
        return PagedField(t, 0, t.stride(0) * es, t.stride(1) * es, token, t.dtype, shape)

    @property
    def entry_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def raw_bytes(self) -> torch.Tensor:
        """The bytes from ``buffer.data_ptr()`` on, as a 1-d uint8 tensor (no copy)."""
        t = self.buffer
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        return raw[t.storage_offset() * t.element_size():]

    def gather(self, blocks: torch.Tensor, heads: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Broadcastable int tensors of a common shape S -> the entries [*S, *shape] (a copy)."""
        blocks, heads, slots = torch.broadcast_tensors(blocks.long(), heads.long(), slots.long())
        addr = self.offset + blocks * self.stride_block + heads * self.stride_head + slots * self.stride_token
        idx = addr.unsqueeze(-1) + torch.arange(self.entry_bytes, device=addr.device)
        raw = self.raw_bytes()[idx]
        return raw.view(self.dtype).reshape(*idx.shape[:-1], *self.shape)


class FieldMap(dict):
    """{field name: :class:`PagedField`} that cannot change once built.  Launchers memoize the checks and the C
    arguments of a FieldMap's fields in its :attr:`memo` (a PagedField is frozen),
    so a caller that passes the same FieldMap call after call (the vLLM backend: one per layer and role, for the
    life of the KV cache) pays them once.  Any other mapping works too, checked on every call."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("a FieldMap cannot change once built: build a new one")

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = clear = setdefault = _refuse

    @property
    def memo(self) -> dict:
        """A dict that lives as long as this map, where launchers keep what they derive from its fields."""
        return self.__dict__.setdefault("launch_memo", {})

    def part(self, prefix: str) -> "FieldMap":
        """The entries whose names start with ``prefix``, the prefix dropped (e.g. ``"key."``), as a FieldMap
        built once per prefix (the same object on every call)."""
        parts = self.__dict__.setdefault("parts", {})
        if prefix not in parts:
            parts[prefix] = FieldMap({n[len(prefix):]: f for n, f in self.items() if n.startswith(prefix)})
        return parts[prefix]


def role_fields(fields, role: str) -> dict:
    """The fields of ``role`` ("key", "value", "exact") in a map named ``role.field`` (vLLM's page fields):
    ``fields.part(role + ".")`` for a :class:`FieldMap`, else a new dict."""
    if isinstance(fields, FieldMap):
        return fields.part(role + ".")
    p = role + "."
    return {n[len(p):]: f for n, f in fields.items() if n.startswith(p)}


@dataclass(frozen=True)
class PagedRows:
    """Exact tokens read in place from a paged field (an exact segment of :func:`paged_decode` that is no tensor):
    token ``j`` of sequence ``b``, KV head ``h``, is ``field``'s entry at byte ``offsets[b, j] + h *
    field.stride_head`` of ``field.buffer``.  Build with :meth:`at`; ``shape`` [B, H, n, D] as a tensor segment's.
    The CPU kernel reads the rows where they are; the other backends :meth:`gather` them."""

    field: PagedField
    offsets: torch.Tensor  # [B, n] int64 byte offsets (the field's offset included)
    heads: int

    @staticmethod
    def at(field: PagedField, blocks: torch.Tensor, slots: torch.Tensor, heads: int) -> "PagedRows":
        """Rows at blocks, slots [B, n] int (broadcastable) for ``heads`` KV heads; ValueError unless every
        entry lies inside the field's buffer."""
        if len(field.shape) != 1 or not field.dtype.is_floating_point:
            raise ValueError(f"PagedRows: the field must hold float rows [D], got {field.dtype} {field.shape}")
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"PagedRows: heads must be a positive int, got {heads!r}")
        blocks, slots = torch.broadcast_tensors(blocks.long(), slots.long())
        if blocks.ndim != 2:
            raise ValueError(f"PagedRows: blocks and slots must be [B, n], got {tuple(blocks.shape)}")
        offsets = (field.offset + blocks * field.stride_block + slots * field.stride_token).contiguous()
        if offsets.numel():
            lo, hi = int(offsets.min()), int(offsets.max())
            last = hi + (heads - 1) * field.stride_head + field.entry_bytes
            if lo < 0 or field.stride_head < 0 or last > extent_bytes(field.buffer):
                raise ValueError(f"PagedRows: the rows reach byte {last} of a buffer of {extent_bytes(field.buffer)} "
                                 "(or an offset is negative)")
        return PagedRows(field, offsets, int(heads))

    @property
    def shape(self) -> tuple:
        return (self.offsets.shape[0], self.heads, self.offsets.shape[1], self.field.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.field.dtype

    @property
    def device(self) -> torch.device:
        return self.field.buffer.device

    def gather(self) -> torch.Tensor:
        """The rows as a tensor [B, H, n, D] (a copy)."""
        f = self.field
        heads = torch.arange(self.heads, device=self.offsets.device)[None, :, None] * f.stride_head
        idx = (self.offsets[:, None, :] + heads).unsqueeze(-1) + torch.arange(f.entry_bytes, device=heads.device)
        raw = f.raw_bytes().index_select(0, idx.reshape(-1))
        return raw.view(f.dtype).reshape(*self.shape)


def field_geometry(f: PagedField) -> tuple:
    """What fixes where a PagedField's entries are, apart from its buffer's address: offset, strides, entry size,
    dtype and shape (rows read at the same byte offsets in two fields of equal geometry are alike)."""
    return (f.offset, f.stride_block, f.stride_head, f.stride_token, f.entry_bytes, f.dtype, tuple(f.shape))


def view_fields(key_codec, value_codec) -> tuple:
    """(key field names, value field names) the codecs' views read (per-token and per-block shared)."""
    kview, vview = views(key_codec, value_codec)
    if kview is None or vview is None:
        raise ValueError(f"codecs {type(key_codec).__name__}/{type(value_codec).__name__} declare no kernel views")
    knames = [n for t in kview.terms for n in (t.codes.field, t.norm)] + list(kview.shared)
    vnames = [vview.codes.field, vview.scale] + ([vview.zero] if vview.zero else [])
    return knames, vnames


def _entry_shapes(key_codec, value_codec) -> dict:
    """{(role, field): bytes per entry} of the packed-code fields the views declare."""
    kview, vview = views(key_codec, value_codec)
    out = {("key_fields", t.codes.field): t.codes.nbytes for t in kview.terms}
    out[("value_fields", vview.codes.field)] = vview.codes.nbytes
    return out


def check_paged(q, key_codec, key_fields: dict, value_codec, value_fields: dict, block_table, block_size: int,
                code_start, code_end) -> tuple:
    """ValueError naming the argument unless the arguments fit the contract (:func:`paged_decode`), including
    that every address a kernel may read lies inside its field's buffer.  Returns the fields' signature
    (:func:`fields_signature`), for launchers that memoize on it."""
    sig, room = check_static(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size,
                             code_start, code_end)
    starts, ends = code_start.tolist(), code_end.tolist()
    if any(e < s or s < 0 for s, e in zip(starts, ends)):
        raise ValueError("code_start/code_end must satisfy 0 <= code_start <= code_end")
    end = max(ends, default=0)
    if end > block_table.shape[1] * block_size:
        raise ValueError(f"code_end reaches token {end} but block_table maps only "
                         f"{block_table.shape[1]} blocks of {block_size}")
    if block_table.shape[1] == 1:  # one block per sequence (the transformers cache): plain ints
        col = block_table[:, 0].tolist()
        lo, top = min(col, default=0), max(col, default=0)
    else:
        used = block_table[:, : max(1, -(-end // block_size))]
        lo, top = (int(used.min()), int(used.max())) if used.numel() else (0, 0)
    if lo < 0:
        raise ValueError("block_table: the blocks holding coded tokens must be >= 0")
    if top > room[0]:
        raise ValueError(f"{room[1]}: offset/strides reach past the end of its buffer at block {top} "
                         f"(blocks up to {room[0]} fit)")
    return sig


def check_static(q, key_codec, key_fields: dict, value_codec, value_fields: dict, block_table, block_size: int,
                 code_start, code_end) -> tuple:
    """:func:`check_paged` without reading the ranges' and the block table's values (for a kernel that checks
    those itself, as the CPU kernel does): the arguments' types and shapes (:func:`check_args`), and the fields
    (present, their sizes, inside their buffers).  Returns (the fields' signature, (the largest block index every
    field's buffer holds, the name of the field that bounds it))."""
    check_args(q, block_table, block_size, code_start, code_end)
    sig = fields_signature(key_fields, value_fields)
    return sig, _field_room(key_codec, key_fields, value_codec, value_fields, q.shape[1], block_size, q.device, sig)


def check_args(q, block_table, block_size: int, code_start, code_end) -> None:
    """ValueError naming the argument unless q is a float [B, H_kv, R, D] tensor, block_table [B, max_blocks],
    block_size a positive int and code_start / code_end [B] int tensors (types and shapes only)."""
    if not isinstance(q, torch.Tensor) or q.ndim != 4 or not q.dtype.is_floating_point:
        raise ValueError(f"q must be a float tensor [B, H_kv, R, D], got {getattr(q, 'shape', q)!r}")
    check_table(q.shape[0], block_table, block_size, code_start, code_end)


def check_table(b: int, block_table, block_size: int, code_start, code_end) -> None:
    """:func:`check_args` without the query: block_table [B, max_blocks], block_size a positive int, code_start /
    code_end [B] int tensors, for a batch of ``b`` sequences (types and shapes only)."""
    if not isinstance(block_table, torch.Tensor) or block_table.ndim != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must be [B={b}, max_blocks], got {getattr(block_table, 'shape', block_table)!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    for name, t in (("code_start", code_start), ("code_end", code_end)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (b,) or t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a [B={b}] int tensor, got {getattr(t, 'shape', t)!r}")


_ROOM: dict = {}  # the static checks' result per key of plain values (no object kept alive)


def extent_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to the end of ``t``'s last element (a view reaches no further: other views of
    the same storage, e.g. another layer's pages, are out of bounds)."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _field_signature(f) -> tuple:
    t = getattr(f, "buffer", None)
    if not isinstance(t, torch.Tensor):
        return (None, id(f))
    return (t.data_ptr(), extent_bytes(t), str(t.device),
            f.offset, f.stride_block, f.stride_head, f.stride_token, f.dtype, tuple(f.shape))


def fields_signature(key_fields: dict, value_fields: dict) -> tuple:
    """Plain values that fix what a kernel reads through the fields: per field, its name, its buffer's address,
    size and device, its offset, strides, dtype and shape (memo keys that keep no object alive)."""
    return (tuple((n, _field_signature(f)) for n, f in key_fields.items()),
            tuple((n, _field_signature(f)) for n, f in value_fields.items()))


def _field_room(key_codec, key_fields: dict, value_codec, value_fields: dict, h: int, block_size: int, device,
                sig: tuple):
    """The static half of :func:`check_paged` (the fields a view reads are present, on ``device``, with the
    declared entry sizes, inside their buffers for block 0): returns (the largest block index every field's
    buffer holds for ``h`` heads and ``block_size`` slots, the name of the field that bounds it).  Memoized on
    plain values (the views' field names and sizes, and ``sig``, the fields' :func:`fields_signature`)."""
    knames, vnames = view_fields(key_codec, value_codec)
    sizes = _entry_shapes(key_codec, value_codec)
    key = (tuple(knames), tuple(vnames), tuple(sorted(sizes.items())), h, block_size, str(device), sig)
    hit = _ROOM.get(key)
    if hit is not None:
        return hit
    best = (float("inf"), "")
    for role, given, wanted in (("key_fields", key_fields, knames), ("value_fields", value_fields, vnames)):
        best = min(best, _room(role, given, wanted, sizes, h, block_size, device))
    if len(_ROOM) > 4096:  # bounded (the transformers cache's buffers grow: new keys as they do)
        _ROOM.clear()
    _ROOM[key] = best
    return best


def _room(role: str, given: dict, wanted: list, sizes: dict, h: int, block_size: int, device) -> tuple:
    """(the largest block index every field ``wanted`` of ``given`` holds, the name of the one that bounds it);
    ValueError naming ``role`` and the field where one is missing, off ``device``, of the wrong entry size
    (``sizes``: {(role, name): bytes} of packed codes) or outside its buffer for block 0."""
    best = (float("inf"), "")
    missing = [n for n in wanted if n not in given]
    if missing:
        raise ValueError(f"{role} lacks the field(s) {missing} its codec's view reads (has {sorted(given)})")
    for n in wanted:
        f = given[n]
        if not isinstance(getattr(f, "buffer", None), torch.Tensor) or f.buffer.device != device:
            raise ValueError(f"{role}[{n!r}] must be a PagedField whose buffer is on {device}")
        if (role, n) in sizes and (f.dtype != torch.uint8 or f.entry_bytes != sizes[(role, n)]):
            raise ValueError(f"{role}[{n!r}]: packed codes of {sizes[(role, n)]} uint8 bytes per token expected, "
                             f"got {f.dtype} {tuple(f.shape)}")
        last = f.offset + (h - 1) * f.stride_head + (block_size - 1) * f.stride_token + f.entry_bytes
        room = extent_bytes(f.buffer)
        if min(f.offset, f.stride_block, f.stride_head, f.stride_token) < 0 or last > room:
            raise ValueError(f"{role}[{n!r}]: offset/strides reach byte {last} of a buffer of {room}")
        top = (room - last) // f.stride_block if f.stride_block else float("inf")
        best = min(best, (top, f"{role}[{n!r}]"))
    return best


def mix_room(codec, fields: dict, h: int, block_size: int, device) -> tuple:
    """:func:`_field_room` for one codec's :class:`qjl.codecs.views.MixView` alone (its codes read as vectors,
    :func:`qjl.kernels.cpu.rows.value_rows`): (the largest block index its fields hold, the bounding field's
    name), memoized on plain values like it.  ValueError where the codec declares no mix view."""
    view = mix_view(codec)
    if view is None:
        raise ValueError(f"{type(codec).__name__} declares no mix view (its codes are not read as vectors)")
    names = [view.codes.field, view.scale] + ([view.zero] if view.zero else [])
    sig = fields_signature({}, {n: fields[n] for n in names if n in fields})
    key = ("mix", tuple(names), view.codes.nbytes, h, block_size, str(device), sig)
    hit = _ROOM.get(key)
    if hit is None:
        hit = _room("fields", fields, names, {("fields", view.codes.field): view.codes.nbytes}, h, block_size, device)
        if len(_ROOM) > 4096:
            _ROOM.clear()
        _ROOM[key] = hit
    return hit


def term_queries(q: torch.Tensor, key_codec, key_fields: dict, block_table: torch.Tensor) -> list:
    """Each key term's query rows: [B, H, R, n], or [B, max_blocks, H, R, n] when the codec's query map reads
    per-block shared fields (QJL outlier channels chosen per block: one map per block-table column)."""
    kview = _view(key_codec, "score_view")
    qf = q.float()
    if not kview.shared:
        return key_codec.score_queries(qf)
    h = q.shape[1]
    blocks = block_table.long().clamp(min=0).unsqueeze(-1)  # [B, max_blocks, 1]; unused columns may be -1
    heads = torch.arange(h, device=q.device).view(1, 1, h)
    shared = {n: key_fields[n].gather(blocks, heads, torch.zeros_like(blocks)) for n in kview.shared}
    return key_codec.score_queries(qf.unsqueeze(1), shared)


def check_exact(exact, q) -> tuple | None:
    """The exact tokens checked and as segments: None, or ``(xk_segments, xv_segments, xbias)``.

    ``exact`` is None or ``(xk, xv, xbias)``; xk and xv are each one segment [B, H_kv, n, D] or a tuple of them
    (e.g. sinks and window, read in place by the CPU kernel: no copy), taken in order as one [B, H_kv, n_x, D];
    a segment is a tensor or a :class:`PagedRows` (rows in pages)."""
    if exact is None:
        return None
    if not isinstance(exact, (tuple, list)) or len(exact) != 3:
        raise ValueError("exact must be None or a tuple (xk, xv, xbias)")
    xk, xv, xbias = exact
    ks = tuple(xk) if isinstance(xk, (tuple, list)) else (xk,)
    vs = tuple(xv) if isinstance(xv, (tuple, list)) else (xv,)
    b, h, r, d = q.shape
    if not ks or len(vs) != len(ks):
        raise ValueError(f"exact: xk and xv must be tensors or tuples of as many tensors, got {len(ks)} and {len(vs)}")
    seg = (torch.Tensor, PagedRows)
    for k, v in zip(ks, vs):
        if not isinstance(k, seg) or len(k.shape) != 4 or tuple(k.shape[:2]) != (b, h) or k.shape[-1] != d:
            raise ValueError(f"exact: xk must be [{b}, {h}, n, {d}], got {getattr(k, 'shape', k)!r}")
        if not isinstance(v, seg) or tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"exact: xv must have xk's shape {tuple(k.shape)}, got {getattr(v, 'shape', v)!r}")
        if not (k.dtype.is_floating_point and v.dtype.is_floating_point):
            raise TypeError(f"exact: xk and xv must be floating point, got {k.dtype} and {v.dtype}")
        if k.device != q.device or v.device != q.device:
            raise ValueError(f"exact: xk and xv must be on q's device {q.device}, got {k.device} and {v.device}")
    n = sum(k.shape[2] for k in ks)
    if xbias is not None and (xbias.ndim != 4 or xbias.shape[-1] != n
                              or any(xbias.shape[i] not in (1, (b, h, r)[i]) for i in range(3))):
        raise ValueError(f"exact: xbias must be [{b}|1, {h}|1, {r}|1, {n}], got {tuple(xbias.shape)}")
    return ks, vs, xbias


def joined_exact(segments: tuple | None) -> tuple | None:
    """:func:`check_exact`'s segments as one ``(xk, xv, xbias)`` (concatenated only where there are several)."""
    if segments is None:
        return None
    ks, vs, xbias = segments
    ks, vs = [_tensor(k) for k in ks], [_tensor(v) for v in vs]
    if len(ks) == 1:
        return ks[0], vs[0], xbias
    return torch.cat([k.float() for k in ks], -2), torch.cat([v.float() for v in vs], -2), xbias


def _tensor(segment) -> torch.Tensor:
    return segment.gather() if isinstance(segment, PagedRows) else segment


def paged_decode(q: torch.Tensor, key_codec, key_fields: dict, value_codec, value_fields: dict,
                 block_table: torch.Tensor, block_size: int, code_start: torch.Tensor, code_end: torch.Tensor, *,
                 exact=None, code_bias: torch.Tensor | None = None, backend: str = "auto",
                 max_codes: int | None = None) -> torch.Tensor:
    """Decode attention over paged codes (+ exact tokens), one call per layer and step.

    Args:
        q: [B, H_kv, R, D] float32, the query rows of KV head ``h`` (its GQA group x new tokens),
            already multiplied by the softmax scale.
        key_codec, value_codec: the layer's codecs; they must declare kernel views
            (:func:`qjl.codecs.views.kernel_readable`).
        key_fields, value_fields: {codec field name: :class:`PagedField`}.
        block_table: [B, max_blocks] int; block_size: tokens per block.
        code_start, code_end: [B] int, the coded tokens ``[start, end)`` of each sequence (token indices
            of the addressing; vLLM: ``[sinks, n - window)``, transformers: ``[0, N)``).
        exact: None or ``(xk, xv, xbias)``: exact tokens (sinks, window, the current token) merged into
            the same softmax; xk/xv [B, H_kv, n_x, D] (any float dtype), or tuples of such segments taken in
            order (the CPU kernel reads up to two fp32/fp16/bf16 segments in place), xbias [B, H_kv, R, n_x]
            additive (0 / -inf, e.g. a causal mask or ragged lengths; axes of size 1 broadcast) or None.
        code_bias: [B, >= max(code_end)] additive over coded token indices (e.g. left padding) or None.
        backend: "auto" (by device), "cpu", "triton" or "torch" (:func:`qjl.kernels.reference.paged_decode_reference`).
        max_codes: for callers that build the ranges and the block table from their own state (the transformers
            cache): they vouch that the arguments are valid and that ``max(code_end - code_start) == max_codes``.
            The Triton path then skips the checks that read those tensors back from the GPU (each a
            synchronization, several per layer and step); the other backends check as always.

    Returns:
        [B, H_kv, R, D] float32: ``softmax(q . k) v`` over the sequence's coded and exact tokens, keys scored
        with the key codec's estimator and values mixed from the value codec's reconstruction.  Error against
        the float64-accurate result: float32 rounding of sums over ``D`` and over the tokens (the CPU and
        Triton kernels sum in another order than the reference: outputs agree within 1e-4 of their scale).  The
        CPU kernel's integer path (the default where the CPU has AVX-512 VBMI + VNNI; ``QJL_CPU_IMPL=c`` for fp32)
        rounds queries and centroids to int8 and softmax weights to int16, within the bound stated in
        ``kernels/cpu/decode_vnni.c`` (0.3-0.75% of the values' scale at logits of std 2).
        A row that sees no token at all gets NaN (0 / 0), like a fully masked softmax.
    """
    from qjl import kernels

    backend = kernels.pick_backend(q.device, backend)
    if max_codes is not None and (isinstance(max_codes, bool) or not isinstance(max_codes, int) or max_codes < 0):
        raise ValueError(f"max_codes must be None or a non-negative int, got {max_codes!r}")
    if backend == "cpu":  # every backend checks ``exact`` (check_exact) itself
        from qjl.kernels.cpu import launch

        return launch.paged_decode(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size,
                                   code_start, code_end, exact=exact, code_bias=code_bias)
    if backend == "triton":
        from qjl.kernels.triton import launch

        return launch.paged_decode(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size,
                                   code_start, code_end, exact=exact, code_bias=code_bias, max_codes=max_codes)
    from qjl.kernels.reference import paged_decode_reference

    return paged_decode_reference(q, key_codec, key_fields, value_codec, value_fields, block_table, block_size,
                                  code_start, code_end, exact=exact, code_bias=code_bias)
