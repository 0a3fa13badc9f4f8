"""Power-series Toeplitz helpers against materialized matrices."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import linalg as sla
from scipy.special import binom

from corrnoise.errors import CorrnoiseError
from corrnoise.linalg import toeplitz as tp


def test_sqrt_coefficients_match_binomials_and_square_to_prefix():
    n = 200
    c = tp.prefix_sqrt_coefficients(n)
    t = np.arange(n)
    assert np.allclose(c, (-1.0) ** t * binom(-0.5, t), rtol=1e-12)
    cinv = tp.prefix_sqrt_inverse_coefficients(n)
    assert np.allclose(cinv, (-1.0) ** t * binom(0.5, t), rtol=1e-12, atol=1e-300)
    C = tp.toeplitz_matrix(c)
    assert np.allclose(C @ C, np.tril(np.ones((n, n))), atol=1e-13)
    assert np.allclose(C @ tp.toeplitz_matrix(cinv), np.eye(n), atol=1e-13)


def test_sqrt_coefficients_at_ten_million_are_finite_and_asymptotic():
    n = 10**7
    c = tp.prefix_sqrt_coefficients(n)
    cinv = tp.prefix_sqrt_inverse_coefficients(n)
    assert np.all(np.isfinite(c)) and np.all(np.isfinite(cinv))
    t = n - 1  # c_t ~ 1 / sqrt(pi t) (1 - 1/(8t)); c'_t ~ -1 / (2 sqrt(pi) t^1.5)
    assert c[-1] == pytest.approx(1 / np.sqrt(np.pi * t) * (1 - 1 / (8 * t)), rel=1e-9)
    assert cinv[-1] == pytest.approx(-1 / (2 * np.sqrt(np.pi) * t**1.5), rel=1e-6)


@given(st.integers(1, 300), st.integers(1, 300), st.integers(0, 2**32 - 1))
def test_series_inverse_and_products_match_dense(n, length, seed):
    rng = np.random.default_rng(seed)
    c = rng.uniform(-0.3, 0.3, size=min(length, n))
    c[0] = rng.uniform(1.0, 2.0)
    C = tp.toeplitz_matrix(c, n)
    inv = tp.series_inverse(c, n)
    assert np.allclose(tp.toeplitz_matrix(inv, n), sla.solve_triangular(C, np.eye(n), lower=True), atol=1e-9)
    x = rng.normal(size=(n, 2))
    assert np.allclose(tp.toeplitz_matmul(c, x), C @ x, atol=1e-10)
    assert np.allclose(tp.toeplitz_solve(c, x), sla.solve_triangular(C, x, lower=True), atol=1e-8)
    assert np.allclose(tp.column_norms_squared(c, n), np.sum(C**2, axis=0), rtol=1e-12)


def test_singular_and_non_triangular_inputs_are_refused():
    with pytest.raises(CorrnoiseError) as err:
        tp.series_inverse(np.array([0.0, 1.0]), 4)
    assert err.value.param == "strategy"
    with pytest.raises(CorrnoiseError) as err:
        tp.check_lower_triangular("matrix", np.ones((3, 3)))
    assert "lower-triangular" in str(err.value)
    with pytest.raises(CorrnoiseError):
        tp.check_lower_triangular("matrix", np.diag([1.0, 0.0, 1.0]))
    with pytest.raises(CorrnoiseError):
        tp.check_lower_triangular("matrix", np.diag([1.0, np.nan, 1.0]))
