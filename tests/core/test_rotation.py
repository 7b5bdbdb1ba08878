import pytest
import torch

from qjl import Rotation
from qjl.core.rotation import haar_matrix


@pytest.mark.parametrize("kind", ["haar", "hadamard", "hadamard-kron"])
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
    assert Rotation(80, "hadamard-kron").out_dim == 80 and Rotation(384, "hadamard-kron").out_dim == 384


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
    for d in (100, 24, 36 * 8):  # 100 = 25 * 4, 24 < 32, 288 = 9 * 32: no Hadamard order of the kind
        with pytest.raises(ValueError, match="dim"):
            Rotation(d, "hadamard-kron")
    with pytest.raises(ValueError, match="power of two"):
        Rotation(96, "hadamard-kron", pad_pow2=True)
    with pytest.raises(ValueError, match="rounds"):
        Rotation(96, "hadamard-kron", rounds=0)


@pytest.mark.parametrize("d", [32, 96, 384, 640, 12 * 256])
def test_kron_hadamard_is_a_hadamard_matrix(d):
    """``kron_hadamard``'s matrix has every entry +-1/sqrt(d) and is orthogonal (a Hadamard matrix of order d:
    Paley's 12 or 20 times Sylvester's 2^k, the dense small-2^k path and the fwht path for 2^k > 128 alike), and
    ``kron_hadamard_t`` is its transpose; Paley's H_12 and H_20 alone too."""
    from qjl.core.hadamard import kron_hadamard, kron_hadamard_t, paley_hadamard

    eye = torch.eye(d, dtype=torch.float32)
    m = kron_hadamard(eye).double()  # rows: images of the basis vectors = the matrix transposed
    assert torch.allclose(m.abs(), torch.full_like(m, d ** -0.5), atol=1e-6)
    assert torch.allclose(m @ m.T, torch.eye(d, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(kron_hadamard_t(eye).double(), m.T, atol=1e-6)
    with pytest.raises(ValueError, match="kron_hadamard_t: the last dimension"):
        kron_hadamard_t(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="m must be one of"):
        paley_hadamard(28)
    for k in (12, 20):
        h = paley_hadamard(k).double()
        assert torch.allclose(h.abs() * k ** 0.5, torch.ones(k, k, dtype=torch.float64), atol=1e-6)
        assert torch.allclose(h @ h.T, torch.eye(k, dtype=torch.float64), atol=1e-6)


def test_kron_hadamard_rotation_is_as_good_as_haar_for_the_codec():
    """Data-oblivious: TurboQuant's relative MSE on random vectors is the same with the unpadded Hadamard rotation
    as with a dense Haar one (3-bit, d = 384: 0.0345 in theory; 4,000 vectors, each coordinate's error nearly
    independent, so the mean is within ~1% of its expectation), and a sparse input (one-hot) is spread as well.  A
    wrong normalization or a repeated sign pattern moves it by far more than the 3% allowed."""
    from qjl.codecs.turboquant import TurboQuantMSE

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 384, generator=g)
    rel = {}
    for kind in ("haar", "hadamard-kron"):
        c = TurboQuantMSE(384, 3, kind, seed=1)
        err = (c.dequantize(c.quantize(x)) - x).square().sum() / x.square().sum()
        rel[kind] = float(err)
    assert rel["hadamard-kron"] == pytest.approx(rel["haar"], rel=0.03)
    onehot = torch.eye(384)[:50]
    c = TurboQuantMSE(384, 3, "hadamard-kron", seed=1)
    assert float((c.dequantize(c.quantize(onehot)) - onehot).square().sum(-1).mean()) < 1.5 * rel["haar"]
