import pytest
import torch

from qjl import KIVIKeys


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("d", [64, 80, 128])
def test_per_channel_error_bound(bits, d):
    kq = KIVIKeys(d, bits=bits, group_size=16)
    k = torch.randn(2, 3, 48, d) * torch.linspace(0.1, 20, d)  # channels of very different scale
    codes = kq.quantize(k)
    assert codes.lead == (2, 3, 3)
    assert codes.fields["scale"].shape == (2, 3, 3, d)
    k_hat = kq.dequantize(codes)
    assert k_hat.shape == k.shape
    step = codes.fields["scale"].float().repeat_interleave(16, dim=-2)
    assert torch.all((k - k_hat).abs() <= step / 2 * (1 + 1e-5) + 1e-6)


def test_scales_are_per_channel():
    """A channel-wise outlier only coarsens its own channel (the reason KIVI quantizes keys per channel)."""
    kq = KIVIKeys(64, bits=2, group_size=32)
    k = torch.randn(32, 64)
    k[:, 5] *= 100
    scale = kq.quantize(k).fields["scale"].float()[0]
    assert scale[5] > 50 * scale[torch.arange(64) != 5].max()


def test_budget_and_nbytes():
    kq = KIVIKeys(128, bits=2, group_size=32)
    b = kq.bit_budget()
    assert b.bits_per_coordinate == 2 + 2 * 16 / 32
    codes = kq.quantize(torch.randn(4, 64, 128))
    assert codes.nbytes() * 8 == 4 * 64 * b.bits_per_vector


def test_cat_of_groups():
    kq = KIVIKeys(64, bits=3, group_size=8)
    from qjl import Codes
    k = torch.randn(3, 24, 64)
    whole = kq.quantize(k)
    parts = Codes.cat([kq.quantize(k[:, :8]), kq.quantize(k[:, 8:])])
    assert torch.equal(kq.dequantize(whole), kq.dequantize(parts))
    scores = kq.inner_product(torch.randn(3, 2, 64), whole)
    assert scores.shape == (3, 2, 24)


def test_bad_arguments():
    with pytest.raises(ValueError, match="complete groups of group_size=32"):
        KIVIKeys(64, group_size=32).quantize(torch.randn(40, 64))
    with pytest.raises(ValueError, match="bits"):
        KIVIKeys(64, bits=12)
    with pytest.raises(ValueError, match="group_size"):
        KIVIKeys(64, group_size=0)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        KIVIKeys(64).quantize(torch.randn(64))
