import pytest
import torch

from qjl import BitBudget, Codes, OutlierQJL, QJLSketch, SplitTurboQuant, TokenwiseQuantizer


def test_budget_arithmetic():
    b = BitBudget(128, {"codes": 256, "norm": 16}, {"idx": 64})
    assert b.bits_per_vector == 272
    assert b.bits_per_coordinate == 272 / 128
    assert b.amortized(4) == (272 + 16) / 128
    with pytest.raises(ValueError, match="n_vectors"):
        b.amortized(0)


CODECS = [
    lambda: QJLSketch(80, 136, kind="orthogonal"),
    lambda: OutlierQJL(80, 136, n_outliers=4, outlier_sketch_dim=32),
    lambda: TokenwiseQuantizer(80, bits=3, group_size=32),
    lambda: SplitTurboQuant(80, bits=2, split_bits=5, n_split=24, norm_dtype="fp8"),
]


@pytest.mark.parametrize("make", CODECS)
def test_nbytes_matches_budget(make):
    """Bytes actually held == vectors * per-vector bits + sequences * shared bits."""
    codec = make()
    x = torch.randn(2, 3, 17, 80)
    codes = codec.quantize(x)
    b = codec.bit_budget()
    assert codes.nbytes() * 8 == 2 * 3 * 17 * b.bits_per_vector + 2 * 3 * b.shared_bits


@pytest.mark.parametrize("make", CODECS)
def test_cat_narrow_select(make):
    codec = make()
    x = torch.randn(2, 3, 10, 80)
    fit = codec.fit(x)  # a per-sequence choice (outlier or split channels) fixed once, as a cache fixes it
    quant = lambda t: codec.quantize(t, *fit)  # noqa: E731
    whole = quant(x)
    parts = Codes.cat([quant(x[:, :, :4]), quant(x[:, :, 4:])], dim=-1)
    for n in whole.fields:
        assert torch.equal(whole.fields[n], parts.fields[n])
    tail = whole.narrow(-1, 6, 4)
    assert tail.lead == (2, 3, 4)
    assert torch.equal(codec.dequantize(tail), codec.dequantize(whole)[:, :, 6:])
    sel = whole.index_select(0, torch.tensor([1, 1, 0]))
    assert sel.lead == (3, 3, 10)
    assert torch.equal(codec.dequantize(sel)[2], codec.dequantize(whole)[0])
    with pytest.raises(ValueError, match="leading axes"):
        whole.narrow(3, 0, 1)
