import pytest
import torch

from qjl import Rotation
from qjl.core.rotation import haar_matrix


@pytest.mark.parametrize("kind", ["haar", "hadamard"])
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_orthogonal_and_invertible(kind, d):
    rot = Rotation(d, kind, seed=3)
    M = rot.matrix().double()  # [n, d]
    assert M.shape == (rot.out_dim, d)
    assert torch.allclose(M.T @ M, torch.eye(d, dtype=torch.float64), atol=1e-6)
    x = torch.randn(5, d)
    assert torch.allclose(rot.inverse(rot.apply(x)), x, atol=1e-5)
    assert torch.allclose(rot.apply(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


def test_pad_pow2():
    assert Rotation(80, "haar").out_dim == 80
    assert Rotation(80, "haar", pad_pow2=True).out_dim == 128
    assert Rotation(80, "hadamard").out_dim == 128


def test_haar_sign_correction_gives_haar_law():
    """Without the sign fix, QR's diagonal convention biases Q; with it, E[Q] = 0 entrywise."""
    g = torch.Generator().manual_seed(0)
    mean = sum(haar_matrix(g, 4) for _ in range(4000)) / 4000
    assert mean.abs().max() < 0.05  # entries have sd 0.5: 4000 draws give se 0.008


def test_seeded_and_global_rng_free():
    torch.manual_seed(1)
    a = Rotation(64, "haar", seed=5).matrix()
    torch.manual_seed(2)
    assert torch.equal(a, Rotation(64, "haar", seed=5).matrix())
    assert not torch.equal(a, Rotation(64, "haar", seed=6).matrix())


def test_bad_arguments():
    with pytest.raises(ValueError, match="rotation"):
        Rotation(64, "givens")
    with pytest.raises(ValueError, match="dim"):
        Rotation(0)
    with pytest.raises(ValueError, match="seed"):
        Rotation(64, seed=-3)
    with pytest.raises(ValueError, match="hadamard"):
        Rotation(8, "hadamard")
