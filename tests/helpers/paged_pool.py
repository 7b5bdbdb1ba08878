"""A vLLM-like paged pool for the kernel tests: every field of a layer in one byte buffer.

Pages are ``[num_blocks, H, region]`` bytes; inside a (block, head) region each field is an array of
``block_size`` entries (structure of arrays, each array 8-byte aligned), per-block shared fields one entry.
Sequences get distinct blocks in a shuffled order, so the block table is not monotone.
"""

import math

import torch

from qjl.kernels.paged import PagedField


def paged_pool(per_token: dict, shared: dict, lengths, block_size: int, seed: int = 0, device="cpu"):
    """per_token {name: [B, H, N, *shape]}, shared {name: [B, H, n_blocks_max, *shape]} (one entry per block)
    -> (fields {name: PagedField}, block_table [B, max_blocks] int32)."""
    b, h, n = next(iter(per_token.values())).shape[:3]
    max_blocks = math.ceil(n / block_size)
    names = list(per_token) + list(shared)
    layout, off = {}, 0
    for name in names:
        t = per_token.get(name, shared.get(name))
        entry = math.prod(t.shape[3:]) * t.element_size()
        off = -(-off // 8) * 8
        layout[name] = (off, entry)
        off += entry * (block_size if name in per_token else 1)
    region = -(-off // 8) * 8 + 8  # a little padding between regions
    num_blocks = b * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    table = perm[: b * max_blocks].reshape(b, max_blocks).to(torch.int32)
    pool = torch.full((num_blocks, h, region), 0xA5, dtype=torch.uint8)  # junk where nothing is written
    for name in names:
        o, entry = layout[name]
        t = per_token.get(name, shared.get(name))
        raw = t.contiguous().view(torch.uint8).reshape(b, h, t.shape[2], entry)
        for i in range(b):
            for j in range(max_blocks):
                blk = int(table[i, j])
                if name in per_token:
                    t0, t1 = j * block_size, min(n, (j + 1) * block_size)
                    if t1 > t0:
                        dst = pool[blk, :, o:o + (t1 - t0) * entry].view(h, t1 - t0, entry)
                        dst.copy_(raw[i, :, t0:t1])
                else:
                    pool[blk, :, o:o + entry] = raw[i, :, j]
    pool, table = pool.to(device), table.to(device)
    fields = {}
    for name in names:
        o, entry = layout[name]
        t = per_token.get(name, shared.get(name))
        token = entry if name in per_token else 0
        fields[name] = PagedField(pool, o, h * region, region, token, t.dtype, tuple(t.shape[3:]))
    del lengths
    return fields, table


def code_layout(kcodes, vcodes, layout: str, n: int) -> tuple:
    """One sequence's key and value codes as the decode kernels read them (the benchmarks' two layouts):
    ``"contiguous"`` (the transformers cache: one block of ``n`` slots) or ``"paged-16"`` (shuffled blocks of 16
    slots, vLLM's layout) -> (key FieldMap, value FieldMap, block table, block size)."""
    from qjl.kernels.paged import FieldMap

    if layout == "contiguous":
        kf = {m: PagedField.of(t) for m, t in kcodes.fields.items()}
        vf = {m: PagedField.of(t) for m, t in vcodes.fields.items()}
        return FieldMap(kf), FieldMap(vf), torch.zeros(1, 1, dtype=torch.int32), n
    kf, bt = paged_pool(dict(kcodes.fields), {}, None, 16, 1)
    vf, _ = paged_pool(dict(vcodes.fields), {}, None, 16, 1)
    return FieldMap(kf), FieldMap(vf), bt, 16
