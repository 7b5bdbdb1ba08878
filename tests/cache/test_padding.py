"""Per-row sinks under left padding: row starts from the mask, the slot order, the mask that follows it."""

import torch

from qjl.cache import padding
from qjl.cache.padding import remap_mask, row_starts, sink_order


def _left_padded_mask(pads, length, t=None, additive=True):
    """[B, 1, t, L] causal mask over L positions with pads[b] masked columns at the start of row b."""
    t = length if t is None else t
    pos = torch.arange(length)
    q = torch.arange(length - t, length)
    ok = (pos[None, :] <= q[:, None])[None, None] & (pos[None, None, None, :] >= torch.tensor(pads)[:, None, None, None])
    return torch.where(ok, 0.0, torch.finfo(torch.float32).min) if additive else ok


def test_row_starts_from_additive_and_bool_masks():
    for additive in (True, False):
        m = _left_padded_mask([0, 3, 5], 9, additive=additive)
        assert row_starts(m, 3, "cpu").tolist() == [0, 3, 5]
        assert row_starts(m[:, :, -1:], 3, "cpu").tolist() == [0, 3, 5]  # a decode step's mask says the same
    assert row_starts(None, 2, "cpu").tolist() == [0, 0]


def test_row_starts_read_once_per_mask_but_follow_in_place_changes():
    m = _left_padded_mask([0, 3, 5], 9)
    first = row_starts(m, 3, "cpu")
    first[0] = 7  # the caller's copy: the next layer still reads the mask's own starts
    assert row_starts(m, 3, "cpu").tolist() == [0, 3, 5]
    m[1, :, :, 3] = torch.finfo(torch.float32).min  # edited in place: read again
    assert row_starts(m, 3, "cpu").tolist() == [0, 4, 5]
    assert row_starts(_left_padded_mask([2, 0, 1], 9), 3, "cpu").tolist() == [2, 0, 1]  # another mask


def test_sink_order_puts_each_rows_first_real_tokens_first():
    order = sink_order(torch.tensor([0, 2]), 3)
    assert order.tolist() == [[0, 1, 2, 3, 4], [2, 3, 4, 0, 1]]
    assert sink_order(torch.tensor([0, 0]), 3) is None and sink_order(torch.tensor([2, 0]), 0) is None


def test_remapped_mask_follows_the_slots():
    """Keys stored in slot order + the remapped mask give the same attention as position order."""
    g = torch.Generator().manual_seed(0)
    pads, n = [0, 2, 4], 12
    k, v, q = (torch.randn(3, 1, n, 8, generator=g) for _ in range(3))
    mask = _left_padded_mask(pads, n, t=3)
    q = q[:, :, -3:]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    order = sink_order(torch.tensor(pads), 4)
    full = torch.cat([order, torch.arange(order.shape[1], n).expand(3, -1)], dim=1)
    ks, vs = (x.gather(2, full[:, None, :, None].expand(-1, 1, -1, 8)) for x in (k, v))
    got = torch.nn.functional.scaled_dot_product_attention(q, ks, vs, attn_mask=remap_mask(mask, order))
    assert torch.allclose(got, ref, atol=1e-6)


def test_sink_order_with_heavy_tokens():
    """Extra (heavy) positions follow each row's sinks, then its padding, then every other position in order; the
    order is a permutation of the first P positions, and the remapped mask still gives the same attention."""
    order = sink_order(torch.tensor([0, 2]), 2, torch.tensor([[5, 7], [4, 6]]))
    assert order.tolist() == [[0, 1, 5, 7, 2, 3, 4, 6], [2, 3, 4, 6, 0, 1, 5, 7]]
    assert sink_order(torch.tensor([0, 0]), 0, torch.tensor([[3], [1]])).tolist() == [[3, 0, 1, 2], [1, 0, 2, 3]]
    g = torch.Generator().manual_seed(1)
    pads, n = [0, 3], 14
    k, v, q = (torch.randn(2, 1, n, 8, generator=g) for _ in range(3))
    mask = _left_padded_mask(pads, n, t=2)
    q = q[:, :, -2:]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    order = sink_order(torch.tensor(pads), 2, torch.tensor([[6, 9], [7, 8]]))
    assert all(sorted(r) == list(range(order.shape[1])) for r in order.tolist())
    full = torch.cat([order, torch.arange(order.shape[1], n).expand(2, -1)], dim=1)
    ks, vs = (x.gather(2, full[:, None, :, None].expand(-1, 1, -1, 8)) for x in (k, v))
    got = torch.nn.functional.scaled_dot_product_attention(q, ks, vs, attn_mask=remap_mask(mask, order.to(torch.int16)))
    assert torch.allclose(got, ref, atol=1e-6)


def test_store_order_width_follows_replaced_pads_and_heavy_positions():
    """``LayerStore.order_width`` is read on every decode step and memoized per (pads, heavy_pos): replacing either
    (rows selected, sinks formed again after a reset) gives the new width, never the memo's."""
    from qjl import QJLConfig
    from qjl.cache.storage import LayerStore

    store = LayerStore(0, QJLConfig(sink_tokens=4))
    assert store.order_width() == 0
    store.pads, store.heavy_pos = torch.tensor([0, 3]), None
    assert store.order_width() == 7
    store.pads = torch.tensor([0, 1])  # a row selection keeps the rows' own padding
    assert store.order_width() == 5
    store.heavy_pos = torch.tensor([[9], [12]], dtype=torch.int32)
    assert store.order_width() == padding.order_width(store.pads, 4, store.heavy_pos) == 13


def test_plainly_visible_is_asked_once_per_mask_and_sees_in_place_changes():
    """The layers of a step share one mask: the answer is kept per (mask object, version, width); an in-place
    change or another mask is asked again, never answered from the memo; each layer's width is answered from one
    read-back per mask."""
    m = torch.zeros(2, 1, 1, 8)
    assert padding.plainly_visible(m, 3)
    m[1, 0, 0, 2] = float("-inf")  # in place: a padded column now
    assert not padding.plainly_visible(m, 3)
    assert padding.plainly_visible(m, 2)  # another width
    b = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    assert padding.plainly_visible(b, 3)
    b2 = b.clone()
    b2[0, 0, 0, 0] = False
    assert not padding.plainly_visible(b2, 3)
    calls = []
    real = torch.Tensor.tolist
    torch.Tensor.tolist = lambda self: calls.append(1) or real(self)
    try:
        for width in (3, 1, 5, 3, 2):  # 5 layers of one step, each with its own width: one read-back
            assert padding.plainly_visible(b2, width) == (width == 0)
        c = torch.zeros(2, 1, 1, 8)
        assert padding.plainly_visible(c, 8) and padding.plainly_visible(c, 4)
    finally:
        torch.Tensor.tolist = real
    assert len(calls) == 1  # b2 answered from the memo for every width; c read back once
