import pytest
import torch

from qjl.core.packing import pack_bits, pack_signs, packed_size, unpack_bits, unpack_signs


@pytest.mark.parametrize("m", [8, 16, 24, 136, 1000])
def test_signs_round_trip_exact(m):
    x = torch.randn(3, 5, m)
    x[0, 0, :4] = 0.0  # zero counts as positive
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, m // 8)
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(packed), expected)


def test_signs_lsb_first():
    x = -torch.ones(16)
    x[0] = 1.0  # bit 0 of byte 0
    x[9] = 1.0  # bit 1 of byte 1
    assert pack_signs(x).tolist() == [1, 2]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("length", [1, 7, 64, 80, 96, 129])
def test_bits_round_trip_exact(bits, length):
    g = torch.Generator().manual_seed(bits * 1000 + length)
    v = torch.randint(0, 1 << bits, (2, 3, length), generator=g)
    packed = pack_bits(v, bits)
    assert packed.shape == (2, 3, packed_size(length, bits)) == (2, 3, (length * bits + 7) // 8)
    assert torch.equal(unpack_bits(packed, bits, length), v)


def test_bits_dense_layout():
    # two 3-bit values 5 (101) and 3 (011), LSB first: bits 1,0,1,1,1,0 -> 0b00011101 = 29
    assert pack_bits(torch.tensor([5, 3]), 3).tolist() == [29]


def test_bad_input():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.randn(10))
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.tensor([1]), 9)
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        pack_bits(torch.tensor([4]), 2)
    with pytest.raises(TypeError, match="integer"):
        pack_bits(torch.tensor([1.0]), 2)
    with pytest.raises(ValueError, match="need"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 3, 10)
