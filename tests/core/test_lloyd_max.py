"""Codebooks checked against independent computations of the same integrals."""

import math

import numpy as np
import pytest

from qjl.core.lloyd_max import polar_codebook, polar_pdf, sphere_codebook, sphere_pdf


def _independent_mse(pdf, lo, hi, centroids, n=2_000_001):
    """E (X - nearest centroid)^2 by direct quadrature on a different (finer) grid."""
    x = np.linspace(lo, hi, n)
    p = pdf(x)
    p = p / np.trapezoid(p, x)
    c = np.asarray(centroids)
    nearest = c[np.abs(x[:, None] - c[None, :]).argmin(axis=1)] if len(c) <= 16 else c[np.clip(np.searchsorted((c[1:] + c[:-1]) / 2, x), 0, len(c) - 1)]
    return np.trapezoid((x - nearest) ** 2 * p, x), x, p


@pytest.mark.parametrize("d", [3, 16, 64, 128, 256])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_sphere_codebook_against_quadrature(d, bits):
    book = sphere_codebook(d, bits)
    pdf, lo, hi = sphere_pdf(d)
    mse, x, p = _independent_mse(pdf, -1.0, 1.0, book.centroids)
    assert book.mse == pytest.approx(mse, rel=1e-4)
    assert book.second_moment == pytest.approx(1.0 / d, rel=1e-6)  # E u_1^2 = 1/d
    # Lloyd-Max optimality: each centroid is the conditional mean of its cell
    c = np.asarray(book.centroids)
    cells = np.clip(np.searchsorted(np.asarray(book.boundaries), x), 0, len(c) - 1)
    for i in range(len(c)):
        m = cells == i
        cond = np.trapezoid((x * p)[m], x[m]) / np.trapezoid(p[m], x[m])
        assert cond == pytest.approx(c[i], abs=2e-4 / math.sqrt(d))
    assert np.allclose(c, -c[::-1], atol=1e-9)  # symmetric density, symmetric codebook


def test_sphere_codebook_gaussian_limit():
    """d * mse tends to the Lloyd-Max distortions of N(0, 1): 0.3634, 0.1175, 0.03454, 0.009497."""
    for bits, gauss in zip(range(1, 5), (1 - 2 / math.pi, 0.1175, 0.03454, 0.009497)):
        assert 4096 * sphere_codebook(4096, bits).mse == pytest.approx(gauss, rel=3e-3)


@pytest.mark.parametrize("level", [2, 3, 5])
@pytest.mark.parametrize("bits", [1, 2, 3])
def test_polar_codebook_against_quadrature(level, bits):
    book = polar_codebook(level, bits)
    pdf, lo, hi = polar_pdf(level)
    mse, _, _ = _independent_mse(pdf, lo, hi, book.centroids)
    assert book.mse == pytest.approx(mse, rel=1e-4)
    assert all(lo <= c <= hi for c in book.centroids)
    assert np.allclose(np.asarray(book.centroids) + np.asarray(book.centroids)[::-1], math.pi / 2, atol=1e-9)


def test_level2_density_is_sin_2psi():
    pdf, lo, hi = polar_pdf(2)
    x = np.linspace(lo, hi, 10001)
    assert np.trapezoid(pdf(x), x) == pytest.approx(1.0, rel=1e-6)  # sin(2 psi) is already normalized
    assert np.allclose(pdf(x), np.sin(2 * x))


def test_level1_is_uniform_grid():
    book = polar_codebook(1, 3)
    assert np.allclose(np.diff(book.centroids), 2 * math.pi / 8)
    assert book.mse == pytest.approx((2 * math.pi / 8) ** 2 / 12)


def test_disk_cache_round_trip(tmp_path, monkeypatch):
    import qjl.core.lloyd_max as lm

    monkeypatch.setenv("QJL_CACHE_DIR", str(tmp_path))
    book = lm._cached("sphere-d40-b2", lambda: lm.lloyd_max(*sphere_pdf(40), 2))
    assert len(list(tmp_path.glob("*.json"))) == 1
    again = lm._cached("sphere-d40-b2", lambda: pytest.fail("should read the cache"))
    assert again == book


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        sphere_codebook(64, 9)
    with pytest.raises(ValueError, match="d must be"):
        sphere_codebook(2, 2)
    with pytest.raises(ValueError, match="level"):
        polar_codebook(0, 2)


@pytest.mark.parametrize("d", [3, 10, 128])
def test_sphere_density_first_absolute_moment(d):
    """The density used for the codebooks gives the E|u_1| derived independently for the QJL constant."""
    from qjl import sphere_abs_moment

    pdf, _, _ = sphere_pdf(d)
    x = np.linspace(-1, 1, 2_000_001)
    assert np.trapezoid(np.abs(x) * pdf(x), x) == pytest.approx(sphere_abs_moment(d), rel=1e-6)
