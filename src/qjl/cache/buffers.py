"""Growable token buffers that own exactly their storage: the exact window and the code tensors.

A cache appends a few tokens per step and, every ``flush_block`` tokens, a block of codes.  Concatenating
whole tensors at every step copies O(N) bytes per step (O(N^2) over a generation); these buffers keep a
capacity along the token axis instead and grow it geometrically (by 1/64 of the tokens held, at least the
tokens appended), so appending costs O(1) amortized -- a growth copies the buffer once per 1/64 of its
length, about 1.6% of the bytes a decode step reads anyway -- and at most 1/64 (1.6%) of a long buffer is
unused.  The capacity is storage the cache holds: ``nbytes``
reports it, not the tokens in use.

Nothing here aliases a caller's tensor: appended tokens are copied in.  Writes only ever go beyond the
tokens in use (or into a fresh tensor), so a :meth:`state` taken before an operation restores the buffer
exactly (:meth:`restore`): the cache uses that to make ``update`` all-or-nothing.
"""

from __future__ import annotations

import torch

from qjl.codecs.base import Codes

__all__ = ["TokenBuffer", "CodeBuffer", "storage_bytes", "grown_capacity", "GROWTH"]

GROWTH = 64  # a full buffer grows by 1/GROWTH of its tokens (at least the tokens appended)


def grown_capacity(needed: int, current: int, step: int) -> int:
    """Capacity for ``needed`` tokens after an append of ``step``: exact on the first allocation, then
    ``needed + max(needed / 64, step)``."""
    return needed if current == 0 else needed + max(needed // GROWTH, step)


def storage_bytes(tensors) -> dict:
    """{storage data_ptr: bytes} of the storages behind ``tensors`` (views of one storage counted once)."""
    out = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


class TokenBuffer:
    """Tokens ``[B, H, n, D]`` in a ``[B, H, capacity, D]`` tensor; ``view()`` is the ``n`` in use.

    ``spare=False`` (the exact window, which stays short): every append reallocates exactly, O(window) per
    step and no unused storage; ``spare=True`` (a layer kept whole): geometric growth as for codes.
    """

    def __init__(self, dtype: torch.dtype, spare: bool = False):
        self.dtype, self.data, self.n, self.spare = dtype, None, 0, spare

    def view(self) -> torch.Tensor | None:
        if self.data is None or self.n == self.data.shape[2]:  # (the window's tight buffer: no view built per call)
            return self.data
        return self.data[:, :, : self.n]

    @property
    def capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[2]

    def append(self, x: torch.Tensor) -> None:
        """Copy ``x: [B, H, m, D]`` in after the tokens in use (converted to the buffer's dtype)."""
        m = x.shape[2]
        if self.data is None or self.n + m > self.capacity:
            cap = grown_capacity(self.n + m, self.capacity, m) if self.spare else self.n + m
            new = torch.empty(*x.shape[:2], cap, x.shape[3], dtype=self.dtype, device=x.device)
            if self.n:
                new[:, :, : self.n] = self.data[:, :, : self.n]
            self.data = new
        self.data[:, :, self.n: self.n + m] = x
        self.n += m

    def replace(self, x: torch.Tensor | None) -> None:
        """Hold a copy of ``x: [B, H, m, D]`` (or nothing) in a fresh, tight tensor."""
        if x is None or x.shape[2] == 0:
            self.data, self.n = None, 0
            return
        m = x.shape[2]
        new = torch.empty(*x.shape[:2], m, x.shape[3], dtype=self.dtype, device=x.device)
        new[:, :, :m] = x
        self.data, self.n = new, m

    def state(self):
        return self.data, self.n

    def restore(self, state) -> None:
        self.data, self.n = state

    def tensors(self) -> list:
        return [] if self.data is None else [self.data]


def _dropping_fields_map(name: str) -> property:
    """An attribute stored as ``name`` whose assignment also drops the FieldMap kept by ``paged_fields``."""

    def get(self):
        return self.__dict__[name]

    def put(self, value) -> None:
        self.__dict__[name], self.__dict__["_paged"] = value, None

    return property(get, put)


class CodeBuffer:
    """Codes with leading shape ``[B, H, n]`` held in per-field tensors of capacity ``[B, H, cap, ...]``.

    ``view()`` is a :class:`Codes` over the ``n`` codes in use (views, no copy); shared fields
    (e.g. outlier channels, ``[B, H, k]``) are held once.
    """

    def __init__(self):
        self.fields, self.shared, self.n = None, None, 0

    # ``fields`` and ``shared`` are replaced, never changed in place: replacing either drops the kept FieldMap, so
    # it never keeps buffers alive that the store let go
    fields = _dropping_fields_map("_fields")
    shared = _dropping_fields_map("_shared")

    @property
    def capacity(self) -> int:
        return 0 if not self.fields else next(iter(self.fields.values())).shape[2]

    def view(self) -> Codes | None:
        if self.fields is None or self.n == 0:
            return None
        lead = (*next(iter(self.fields.values())).shape[:2], self.n)
        return Codes(lead, {k: t[:, :, : self.n] for k, t in self.fields.items()}, dict(self.shared))

    def paged_fields(self):
        """The fields over the whole capacity as one block per sequence (:class:`qjl.kernels.paged.FieldMap`; a
        kernel reads the codes in use through its ranges, ``[0, n)``), built once per set of buffers (the same
        object until they grow or the shared fields change), or None while empty."""
        if self.fields is None or self.n == 0:
            return None
        if self._paged is None:
            from qjl.kernels.paged import FieldMap, PagedField

            fm = {n: PagedField.of(t) for n, t in self.fields.items()}
            fm.update({n: PagedField.of(t, shared=True) for n, t in self.shared.items()})
            self._paged = FieldMap(fm)
        return self._paged

    def append(self, codes: Codes) -> None:
        """Copy ``codes`` (leading shape ``[B, H, m]``) in after the codes in use."""
        if len(codes.lead) != 3:
            raise ValueError(f"codes must have leading shape [B, H, n], got {codes.lead}")
        m = codes.lead[-1]
        if m == 0:
            return
        if self.fields is not None and self.n:
            if codes.fields.keys() != self.fields.keys() or any(
                    not torch.equal(codes.shared[k], v) for k, v in self.shared.items()):
                raise ValueError("cannot append codes of another codec or other shared parameters")
        if self.fields is None or self.n + m > self.capacity:
            cap = grown_capacity(self.n + m, self.capacity, m)
            new = {}
            for k, t in codes.fields.items():
                buf = torch.empty(*t.shape[:2], cap, *t.shape[3:], dtype=t.dtype, device=t.device)
                if self.n:
                    buf[:, :, : self.n] = self.fields[k][:, :, : self.n]
                new[k] = buf
            self.fields = new
        if self.n == 0:
            self.shared = {k: v.clone() for k, v in codes.shared.items()}
        for k, t in codes.fields.items():
            self.fields[k][:, :, self.n: self.n + m] = t
        self.n += m

    def reserve(self, m: int) -> None:
        """Room for ``m`` more codes after those in use (capacity grown as :meth:`append` grows it: fresh tensors,
        the codes in use copied; nothing in use changes), for a kernel to write them in place through
        :meth:`paged_fields` before :meth:`extend` counts them.  Only once codes are held (their fields' layout)."""
        if self.fields is None or self.n == 0:
            raise RuntimeError("reserve needs codes held (append the first block)")
        if self.n + m > self.capacity:
            cap = grown_capacity(self.n + m, self.capacity, m)
            new = {}
            for k, t in self.fields.items():
                buf = torch.empty(*t.shape[:2], cap, *t.shape[3:], dtype=t.dtype, device=t.device)
                buf[:, :, : self.n] = t[:, :, : self.n]
                new[k] = buf
            self.fields = new

    def extend(self, m: int) -> None:
        """Count ``m`` codes written in place after those in use (:meth:`reserve` made the room)."""
        if m < 0 or self.fields is None or self.n + m > self.capacity:
            raise ValueError(f"extend: {m} codes do not fit after {self.n} in a capacity of {self.capacity}")
        self.n += m

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` codes (capacity kept)."""
        self.n = n

    def select(self, index: torch.Tensor) -> None:
        """Reindex the batch axis (a fresh, tight copy)."""
        if self.fields is None:
            return
        self.fields = {k: t[:, :, : self.n].index_select(0, index).contiguous() for k, t in self.fields.items()}
        self.shared = {k: v.index_select(0, index) for k, v in self.shared.items()}

    def state(self):
        return self.fields, self.shared, self.n

    def restore(self, state) -> None:
        self.fields, self.shared, self.n = state

    def tensors(self) -> list:
        return [*(self.fields or {}).values(), *(self.shared or {}).values()]
