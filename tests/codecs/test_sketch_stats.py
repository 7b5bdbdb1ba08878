"""Statistical tests of Eq. (4): unbiasedness, the exact constant, variance, tails.

Each family is drawn with N = 10,000 independent seeds.  For an estimator with
standard deviation sigma the sample mean has standard error sigma / sqrt(N); a
test passes when |mean - <q,k>| < 3 standard errors (two-sided false alarm rate
0.27% for a correct estimator, fixed seeds make the outcome reproducible).  At
d = 128, m = 256 and q = k the standard error is ~0.012% of <q,k> for the
orthogonal family, so the 0.2% error of using the Gaussian constant there is
~16 standard errors: the test below shows it fails.
"""

import math

import pytest
import torch

from qjl import OutlierQJL, QJLSketch, scale_constant

N_SEEDS = 10_000
D, M = 128, 256


def _keys(d):
    g = torch.Generator().manual_seed(99)
    gauss = torch.randn(d, generator=g)
    outlier = gauss.clone()
    outlier[[3, 17, 40, 77 % d]] *= 12
    other = 0.6 * gauss + 0.8 * torch.randn(d, generator=g)  # correlated query
    one_hot = torch.zeros(d)
    one_hot[5] = 1.0
    # (name, q, k)
    return [("q=k gaussian", gauss, gauss), ("q=k one-hot", one_hot, one_hot),
            ("q=k outliers", outlier, outlier), ("q!=k", other, gauss), ("q!=k outliers", other, outlier)]


def _estimates(kind, d, m, n_seeds):
    pairs = _keys(d)
    q = torch.stack([p[1] for p in pairs]).unsqueeze(1)  # [P, 1, d]
    k = torch.stack([p[2] for p in pairs]).unsqueeze(1)  # [P, 1, d]
    est = torch.empty(n_seeds, len(pairs), dtype=torch.float64)
    for s in range(n_seeds):
        sk = QJLSketch(d, m, kind=kind, seed=s, norm_dtype="fp32")
        est[s] = sk.inner_product(q, sk.quantize(k))[:, 0, 0].double()
    true = (q * k).sum(-1).squeeze(1).double()
    return pairs, est, true


# one pytest-xdist worker per family: its 10,000 seeds are drawn once (tests/conftest.py)
@pytest.fixture(scope="module", params=[pytest.param(k, marks=pytest.mark.xdist_group(f"sketch-{k}"))
                                        for k in ("gaussian", "orthogonal", "hadamard")])
def family(request):
    return request.param, *_estimates(request.param, D, M, N_SEEDS)


def _z(est, true):
    se = est.std(dim=0) / math.sqrt(est.shape[0])
    return (est.mean(dim=0) - true) / se, se


def test_unbiased(family):
    kind, pairs, est, true = family
    z, _ = _z(est, true)
    for (name, _, _), zi in zip(pairs, z):
        assert abs(zi) < 3, f"{kind}, {name}: bias of {zi:.2f} standard errors"


def test_wrong_constant_is_caught(family):
    """The Gaussian constant on orthogonal rows of norm sqrt(d) is 0.2% too large at d=128: it must fail.

    Gaussian rows have a larger spread at q = k (standard error ~0.047% with 10,000
    seeds), so this check runs on the structured families, where the error occurs.
    """
    kind, pairs, est, true = family
    if kind == "gaussian":
        pytest.skip("the 0.2% error concerns rows of fixed norm")
    ratio = scale_constant("gaussian", D, M) / scale_constant(kind, D, M)
    assert ratio - 1 == pytest.approx(0.002, abs=1e-4)
    z, se = _z(est * ratio, true)
    for i, (name, _, _) in enumerate(pairs):
        if name.startswith("q=k"):
            assert se[i] / true[i] < 0.0005  # resolution well below the 0.2% error
            assert z[i] > 3, f"{kind}, {name}: a 0.2% wrong constant went unnoticed (z={z[i]:.2f})"


@pytest.fixture(scope="module")
def gaussian_64():
    """4,000 seeds of the Gaussian family at d = 64, m = 128 (shared by the two tests below, on one worker)."""
    return _estimates("gaussian", 64, 128, 4000)


@pytest.mark.xdist_group("sketch-gaussian-64")
def test_gaussian_variance_matches_theory(gaussian_64):
    _, est, true = gaussian_64
    for i, (name, q, k) in enumerate(_keys(64)):
        theory = (math.pi / 2 * q.double().norm() ** 2 * k.double().norm() ** 2 - true[i] ** 2) / 128
        # relative standard error of a sample variance of 4000 draws is ~2.2-3%: allow 4 of them
        assert est[:, i].var().item() == pytest.approx(theory.item(), rel=0.12), name


def test_structured_variance_not_above_gaussian(family):
    kind, pairs, est, true = family
    if kind == "gaussian":
        pytest.skip("reference family")
    _, g_est, _ = _estimates("gaussian", D, M, 4000)
    for i, (name, _, _) in enumerate(pairs):
        assert est[:, i].var() <= g_est[:, i].var() * 1.12, f"{kind}, {name}"


def corrected_tail_bound(m, eps):
    """Bernstein (Boucheron et al., Cor. 2.11) with the paper's moment bound (Eq. 5): v = pi/2, c = 2/3."""
    return 2 * math.exp(-m * eps ** 2 / (math.pi + 4 * eps / 3))


@pytest.mark.xdist_group("sketch-gaussian-64")
def test_gaussian_tail_below_corrected_lemma_3_5(gaussian_64):
    """Lemma 3.5 as printed (2 exp(-3/4 m eps^2 / (1 + eps))) drops the pi/2 of E z^2 and is too
    optimistic; the corrected bound holds.  See README, "Where the paper is off"."""
    _, est, true = gaussian_64
    for i, (name, q, k) in enumerate(_keys(64)):
        scale = (q.norm() * k.norm()).item()
        for eps in (0.1, 0.2, 0.3, 0.4):
            tail = ((est[:, i] - true[i]).abs() > eps * scale).double().mean().item()
            bound = corrected_tail_bound(128, eps)
            assert tail <= min(1.0, bound), (name, eps, tail, bound)


def test_printed_lemma_3_5_is_violated():
    """For q orthogonal to k the estimator is ~N(0, pi/2 ||q||^2 ||k||^2 / m): its tail exceeds the printed bound."""
    d, m, eps = 64, 128, 0.3
    q, k = torch.zeros(d), torch.zeros(d)
    q[0], k[1] = 1.0, 1.0
    est = torch.empty(4000, dtype=torch.float64)
    for s in range(4000):
        sk = QJLSketch(d, m, kind="gaussian", seed=s, norm_dtype="fp32")
        est[s] = sk.inner_product(q[None], sk.quantize(k[None]))[0, 0]
    tail = (est.abs() > eps).double().mean().item()
    printed = 2 * math.exp(-0.75 * m * eps ** 2 / (1 + eps))
    assert tail > printed + 3 * math.sqrt(printed / 4000)


@pytest.mark.parametrize("kind", ["orthogonal", "hadamard"])
@pytest.mark.parametrize("d", [64, 80, 96, 256])
def test_unbiased_awkward_dims(kind, d):
    m = 8 * ((3 * d) // 16)  # 1.5 d rounded to bytes: not a multiple of d
    pairs, est, true = _estimates(kind, d, m, 3000)
    z, _ = _z(est, true)
    for (name, _, _), zi in zip(pairs, z):
        assert abs(zi) < 3.5, f"{kind} d={d} m={m}, {name}: {zi:.2f} se"


@pytest.mark.parametrize("kind", ["gaussian", "orthogonal", "hadamard"])
def test_outlier_split_unbiased(kind):
    d = 128
    _, q, k = _keys(d)[2]  # q = k with four 12x outlier channels
    q2 = _keys(d)[3][1]
    idx = torch.tensor([3, 17, 40, 77])
    qs = torch.stack([q, q2]).unsqueeze(1)
    est = torch.empty(N_SEEDS, 2, dtype=torch.float64)
    for s in range(N_SEEDS):
        codec = OutlierQJL(d, 128, n_outliers=4, outlier_sketch_dim=32, kind=kind, seed=s, norm_dtype="fp32")
        codes = codec.quantize(k.expand(2, 1, d), idx)
        est[s] = codec.inner_product(qs, codes)[:, 0, 0].double()
    true = torch.stack([q @ k, q2 @ k]).double()
    z, _ = _z(est, true)
    assert z.abs().max() < 3, z
