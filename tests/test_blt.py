"""Tests for corrnoise.linalg.blt (tutorial Sec. 2.5, Lemma 2.16, Alg. 2.2, Lemma 2.29)."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.linalg import solve_triangular, toeplitz

from corrnoise.errors import CorrnoiseError
from corrnoise.linalg import blt

# ------------------------------------------------------------------------------------------
# helpers (independent of the module under test)
# ------------------------------------------------------------------------------------------


def coeffs_loop(alpha, lam, n):
    """c_0 = 1, c_t = sum_i alpha_i lam_i^(t-1), by a plain Python loop (Eq. 2.16)."""
    c = [1.0]
    for t in range(1, n):
        c.append(sum(a * l ** (t - 1) for a, l in zip(alpha, lam)))
    return np.array(c)


def dense_c(alpha, lam, n):
    return toeplitz(coeffs_loop(alpha, lam, n), np.zeros(n))


def materialized(alpha, lam, n):
    """(||C||_col^2, max row norm^2 of B, ||B||_F^2 / n) from dense matrices."""
    C = dense_c(alpha, lam, n)
    Cinv = solve_triangular(C, np.eye(n), lower=True, unit_diagonal=True)
    A = np.tril(np.ones((n, n)))
    B = A @ Cinv
    return (
        float(np.max(np.sum(C**2, axis=0))),
        float(np.max(np.sum(B**2, axis=1))),
        float(np.sum(B**2)) / n,
    )


def toeplitz_structured(alpha, lam, n):
    """Same three quantities from coefficient sequences only (O(n^2) forward substitution)."""
    k = np.arange(n - 1, dtype=np.float64)
    c = np.zeros(n)
    c[0] = 1.0
    for a, l in zip(alpha, lam):
        c[1:] += a * np.power(l, k)
    cinv = np.zeros(n)
    cinv[0] = 1.0
    for t in range(1, n):  # (C c')_t = 0 for t >= 1
        cinv[t] = -np.dot(c[1 : t + 1], cinv[t - 1 :: -1])
    b = np.cumsum(cinv)  # B = A C^{-1} is Toeplitz with coefficients b
    rows = np.cumsum(b**2)  # ||B[t, :]||^2
    fro = np.sum((n - np.arange(n)) * b**2)
    return float(np.sum(c**2)), float(np.max(rows)), float(fro) / n, rows


def closed(alpha, lam, n):
    return (
        blt.blt_sensitivity_squared(alpha, lam, n),
        blt.blt_max_error_squared(alpha, lam, n),
        blt.blt_mean_error_squared(alpha, lam, n),
    )


def assert_rel(got, want, rtol, what=""):
    for g, w in zip(got, want):
        assert abs(g - w) <= rtol * abs(w), f"{what}: got {got}, want {want}"


def random_params(rng, d, above_one=False):
    lam = np.sort(rng.uniform(0.0, 1.0, d))
    if rng.random() < 0.5:  # some decays very close to 1
        lam[-1] = 1.0 - 10.0 ** rng.uniform(-4, -1)
    alpha = rng.uniform(0.05, 1.0, d)
    if above_one:
        # sum(alpha) > 1 but sum alpha_i / (1 + lam_i) < 1, so every |lam_hat| < 1.
        alpha *= rng.uniform(0.7, 0.97) / np.sum(alpha / (1.0 + lam))
        assert alpha.sum() > 1.0
    else:
        alpha *= rng.uniform(0.1, 0.95) / alpha.sum()
    return alpha, lam


def _make_cases():
    rng = np.random.default_rng(20240607)
    cases = [
        (np.array([0.2, 0.1, 0.05, 0.02]), np.array([0.3, 0.9, 0.99, 0.999])),
        (np.array([0.5, 0.4]), np.array([0.0, 0.9999])),
    ]
    for d in (1, 2, 3, 4):
        cases.append(random_params(rng, d))
    for d in (1, 2, 3):
        lam = np.sort(rng.uniform(0.3, 0.95, d))
        alpha = rng.uniform(0.2, 1.0, d)
        alpha *= rng.uniform(0.7, 0.97) / np.sum(alpha / (1.0 + lam))
        if alpha.sum() <= 1.0:
            alpha *= 1.01 / alpha.sum()
        cases.append((alpha, lam))
    return cases


CASES = _make_cases()
CASE_IDS = [f"d{a.size}-sum{a.sum():.2f}" for a, _ in CASES]


def valid_blt(max_d=4, max_sum=0.95):
    """Hypothesis strategy: alpha > 0 with sum(alpha) <= max_sum, distinct lam in [0, 1)."""

    @st.composite
    def build(draw):
        d = draw(st.integers(1, max_d))
        lam = draw(
            st.lists(
                st.floats(0.0, 0.999), min_size=d, max_size=d, unique=True
            )
        )
        w = draw(st.lists(st.floats(0.05, 1.0), min_size=d, max_size=d))
        total = draw(st.floats(0.05, max_sum))
        alpha = np.array(w) * total / np.sum(w)
        return alpha, np.array(lam)

    return build()


# ------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------


def test_validate_returns_float_vectors():
    a, l = blt.validate_blt([1, 2], [0, 0.5])
    assert a.dtype == np.float64 and l.dtype == np.float64
    assert a.shape == l.shape == (2,)
    a, l = blt.validate_blt(0.3, 0.2)  # scalars are order-1 BLTs
    assert a.shape == (1,)
    a, l = blt.validate_blt([-0.5, 0.2], [0.1, 0.2])  # alpha sign is not restricted
    assert a[0] == -0.5


@pytest.mark.parametrize(
    "alpha, lam, param",
    [
        ([0.5], [1.0], "lambda"),
        ([0.5], [-0.1], "lambda"),
        ([0.5, 0.1], [0.2, 1.5], "lambda"),
        ([0.5], [float("nan")], "lambda"),
        ([float("nan")], [0.5], "alpha"),
        ([float("inf"), 0.1], [0.5, 0.2], "alpha"),
        ([0.5, 0.2], [0.5], "lambda"),
        ([], [], "alpha"),
        ([[0.5]], [[0.5]], "alpha"),
    ],
)
def test_bad_parameters_raise(alpha, lam, param):
    funcs = [
        lambda: blt.validate_blt(alpha, lam),
        lambda: blt.blt_coefficients(alpha, lam, 5),
        lambda: blt.blt_inverse_parameters(alpha, lam),
        lambda: blt.blt_multiply(alpha, lam, np.ones(3)),
        lambda: blt.blt_inverse_multiply(alpha, lam, np.ones(3)),
        lambda: blt.BLTStream(alpha, lam),
        lambda: blt.blt_sensitivity_squared(alpha, lam, 10),
        lambda: blt.blt_max_error_squared(alpha, lam, 10),
        lambda: blt.blt_mean_error_squared(alpha, lam, 10**9),
        lambda: blt.blt_is_nonnegative_monotone(alpha, lam),
    ]
    for f in funcs:
        with pytest.raises(CorrnoiseError) as err:
            f()
        assert err.value.param == param


@pytest.mark.parametrize(
    "f",
    [blt.blt_coefficients, blt.blt_sensitivity_squared, blt.blt_max_error_squared,
     blt.blt_mean_error_squared],
)
@pytest.mark.parametrize("n", [0, -3, 2.5, "10"])
def test_bad_n_raises(f, n):
    with pytest.raises(CorrnoiseError) as err:
        f([0.5], [0.5], n)
    assert err.value.param == "n"


def test_bad_stream_input_raises():
    with pytest.raises(CorrnoiseError) as err:
        blt.blt_multiply([0.5], [0.5], np.ones((2, 2, 2)))
    assert err.value.param == "x"
    with pytest.raises(CorrnoiseError) as err:
        blt.blt_inverse_multiply([0.5], [0.5], [1.0, float("nan")])
    assert err.value.param == "z"


@pytest.mark.parametrize(
    "alpha, lam, expected",
    [
        ([0.3, 0.2], [0.5, 0.9], True),
        ([0.5, 0.5], [0.0, 0.99], True),
        ([0.0], [0.5], True),
        ([0.6, 0.6], [0.5, 0.9], False),
        ([0.5, -0.1], [0.5, 0.9], False),
    ],
)
def test_nonnegative_monotone(alpha, lam, expected):
    assert blt.blt_is_nonnegative_monotone(alpha, lam) is expected
    c = blt.blt_coefficients(alpha, lam, 200)
    if expected:
        assert np.all(c >= 0) and np.all(np.diff(c) <= 0)
    else:
        assert np.any(c < 0) or np.any(np.diff(c) > 0)


# ------------------------------------------------------------------------------------------
# coefficients
# ------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(valid_blt(max_sum=1.5), st.integers(1, 80))
def test_coefficients_match_loop(params, n):
    alpha, lam = params
    c = blt.blt_coefficients(alpha, lam, n)
    assert c.dtype == np.float64 and c.shape == (n,)
    np.testing.assert_allclose(c, coeffs_loop(alpha, lam, n), rtol=1e-13, atol=1e-300)


def test_coefficients_zero_decay_and_mixed_signs():
    c = blt.blt_coefficients([0.3, -0.2], [0.0, 0.5], 5)
    np.testing.assert_allclose(c, [1.0, 0.1, -0.1, -0.05, -0.025], rtol=1e-15)
    np.testing.assert_array_equal(blt.blt_coefficients([0.3], [0.2], 1), [1.0])


def test_coefficients_large_n():
    n = 10**7
    alpha, lam = [0.1, 0.01], [0.5, 1.0 - 1e-7]
    c = blt.blt_coefficients(alpha, lam, n)
    assert c.shape == (n,) and np.all(np.isfinite(c)) and c[0] == 1.0
    for t in (1, 2, 1000, 123456, n - 1):
        want = 0.1 * math.pow(0.5, t - 1) + 0.01 * math.pow(1.0 - 1e-7, t - 1)
        assert abs(c[t] - want) <= 1e-14 * want
    assert np.all(np.diff(c) <= 0)


# ------------------------------------------------------------------------------------------
# inverse parameters (Lemma 2.16)
# ------------------------------------------------------------------------------------------


def dense_from(alpha_hat, lam_hat, n):
    c = np.zeros(n, dtype=np.result_type(alpha_hat, lam_hat, np.float64))
    c[0] = 1.0
    t = np.arange(n - 1)
    for a, l in zip(alpha_hat, lam_hat):
        c[1:] += a * l**t
    return toeplitz(c, np.zeros(n))


@settings(max_examples=60, deadline=None)
@given(valid_blt(max_sum=0.99))
def test_inverse_parameters_positive_alpha(params):
    alpha, lam = params
    a_hat, l_hat = blt.blt_inverse_parameters(alpha, lam)
    assert a_hat.shape == l_hat.shape == alpha.shape
    assert a_hat.dtype == np.float64 and l_hat.dtype == np.float64  # real for alpha > 0
    assert np.all(a_hat <= 0)  # inverse scales are negative (text after Lemma 2.16)
    assert np.all(np.abs(l_hat) <= 1.0)
    n = 50
    prod = dense_c(alpha, lam, n) @ dense_from(a_hat, l_hat, n)
    np.testing.assert_allclose(prod, np.eye(n), atol=1e-10)


@pytest.mark.parametrize(
    "alpha, lam, complex_expected",
    [
        ([0.2, 0.1, 0.05, 0.02], [0.3, 0.9, 0.99, 0.999], False),
        ([0.6, 0.6], [0.5, 0.95], False),  # sum > 1: one negative inverse decay
        ([2.0], [0.5], False),  # lam_hat = -1.5: outside [-1, 1], still exact
        ([-0.3, 0.8], [0.4, 0.6], True),  # mixed signs: a complex-conjugate pair
        ([0.5, -0.45], [0.2, 0.9], False),
        ([-0.5], [0.5], False),  # lam_hat = 1
    ],
)
def test_inverse_parameters_special(alpha, lam, complex_expected):
    a_hat, l_hat = blt.blt_inverse_parameters(alpha, lam)
    assert np.iscomplexobj(l_hat) == complex_expected
    assert np.iscomplexobj(a_hat) == complex_expected
    n = 40
    prod = dense_c(alpha, lam, n) @ dense_from(a_hat, l_hat, n)
    scale = max(1.0, float(np.max(np.abs(dense_from(a_hat, l_hat, n)))))
    np.testing.assert_allclose(prod, np.eye(n), atol=1e-12 * scale)


def test_inverse_parameters_merge_duplicates_and_zeros():
    alpha, lam = [0.2, 0.1, 0.0], [0.5, 0.5, 0.9]  # == BLT([0.3], [0.5])
    a_hat, l_hat = blt.blt_inverse_parameters(alpha, lam)
    assert a_hat.shape == (3,)
    n = 30
    np.testing.assert_allclose(
        dense_c(alpha, lam, n) @ dense_from(a_hat, l_hat, n), np.eye(n), atol=1e-13
    )
    np.testing.assert_allclose(sorted(l_hat[a_hat != 0]), [0.2])
    a_hat, l_hat = blt.blt_inverse_parameters([0.0, 0.0], [0.1, 0.2])  # C = I
    np.testing.assert_array_equal(a_hat, [0.0, 0.0])


@pytest.mark.parametrize("eps", [0.0, 1e-12])
def test_inverse_parameters_defective_raises(eps):
    # Lam - 1 alpha^T has a double eigenvalue for alpha = (-0.3, 0.9 - sqrt(0.72)).
    alpha, lam = [-0.3, 0.9 - math.sqrt(0.72) + eps], [0.2, 0.8]
    with pytest.raises(CorrnoiseError) as err:
        blt.blt_inverse_parameters(alpha, lam)
    assert err.value.param == "lambda"
    with pytest.raises(CorrnoiseError):
        blt.blt_max_error_squared(alpha, lam, 100)
    # The streaming inverse needs no inverse parameters and still works.
    z = np.arange(1.0, 21.0)
    np.testing.assert_allclose(
        blt.blt_inverse_multiply(alpha, lam, z),
        solve_triangular(dense_c(alpha, lam, 20), z, lower=True, unit_diagonal=True),
        rtol=1e-12,
        atol=1e-12,
    )


# ------------------------------------------------------------------------------------------
# streaming (Eq. 2.18, Alg. 2.2)
# ------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    valid_blt(max_sum=1.0),
    st.integers(1, 64),
    st.integers(0, 3),
    st.integers(0, 2**32 - 1),
)
def test_streaming_matches_dense(params, n, m, seed):
    alpha, lam = params
    rng = np.random.default_rng(seed)
    shape = (n,) if m == 0 else (n, m)
    x = rng.standard_normal(shape)
    C = dense_c(alpha, lam, n)
    y = blt.blt_multiply(alpha, lam, x)
    assert y.shape == shape
    want = C @ x
    np.testing.assert_allclose(y, want, rtol=1e-10, atol=1e-10 * max(1.0, np.abs(want).max()))
    z = blt.blt_inverse_multiply(alpha, lam, x)
    assert z.shape == shape
    want = solve_triangular(C, x, lower=True, unit_diagonal=True)
    np.testing.assert_allclose(z, want, rtol=1e-10, atol=1e-10 * max(1.0, np.abs(want).max()))
    np.testing.assert_allclose(blt.blt_multiply(alpha, lam, z), x, atol=1e-9 * max(1.0, np.abs(z).max()))


def test_stream_step_api():
    alpha, lam = [0.3, 0.2], [0.4, 0.9]
    n, m = 6, 3
    rng = np.random.default_rng(1)
    z = rng.standard_normal((n, m))
    for inverse, want in [
        (False, dense_c(alpha, lam, n) @ z),
        (True, np.linalg.solve(dense_c(alpha, lam, n), z)),
    ]:
        op = blt.BLTStream(alpha, lam, n, inverse=inverse)
        for init_arg in (m, (m,)):
            state = op.init(init_arg)
            first = state
            rows = []
            for t in range(n):
                y, state = op.step(state, z[t])
                rows.append(y)
            np.testing.assert_allclose(np.array(rows), want, atol=1e-12)
            assert np.all(first[1] == 0)  # step does not modify the state it is given
        with pytest.raises(CorrnoiseError) as err:
            op.step(state, z[0])
        assert err.value.param == "steps"
    # scalar rows, no step limit
    op = blt.BLTStream(alpha, lam)
    state = op.init()
    out = []
    for t in range(5):
        y, state = op.step(state, 1.0 if t == 0 else 0.0)
        out.append(float(y))
    np.testing.assert_allclose(out, coeffs_loop(alpha, lam, 5), rtol=1e-14)


# ------------------------------------------------------------------------------------------
# closed forms (Lemma 2.29)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 10, 257])
@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
def test_closed_forms_match_materialized(case, n):
    alpha, lam = CASES[case]
    assert_rel(closed(alpha, lam, n), materialized(alpha, lam, n), 1e-9, f"n={n}")


@pytest.mark.parametrize("case", [0, 1, 5, 7, 8], ids=[CASE_IDS[i] for i in (0, 1, 5, 7, 8)])
def test_closed_forms_match_materialized_n2000(case):
    alpha, lam = CASES[case]
    n = 2000
    assert_rel(closed(alpha, lam, n), materialized(alpha, lam, n), 1e-9, f"n={n}")


@settings(max_examples=40, deadline=None)
@given(valid_blt(max_sum=0.99), st.integers(1, 40))
def test_closed_forms_match_materialized_random(params, n):
    alpha, lam = params
    assert_rel(closed(alpha, lam, n), materialized(alpha, lam, n), 1e-9, f"n={n}")


@pytest.mark.parametrize(
    "alpha, lam",
    [
        ([-0.3, 0.8], [0.4, 0.6]),  # complex inverse parameters
        ([0.5, -0.45], [0.2, 0.9]),  # one inverse decay > 1 (error grows geometrically)
        ([0.3], [0.0]),
        ([0.0, 0.4], [0.3, 0.7]),
    ],
)
def test_closed_forms_general_parameters(alpha, lam):
    for n in (1, 5, 30):
        assert_rel(closed(alpha, lam, n), materialized(alpha, lam, n), 1e-9, f"n={n}")


@pytest.mark.parametrize("case", [0, 1, 2, 6])
def test_closed_forms_match_toeplitz_structured_n10000(case):
    alpha, lam = CASES[case]
    n = 10_000
    sens, row, fro, rows = toeplitz_structured(alpha, lam, n)
    assert np.argmax(rows) == n - 1  # the last row of B has the largest norm
    assert_rel(closed(alpha, lam, n), (sens, row, fro), 1e-9, "n=10000")


def test_closed_forms_large_n_near_one():
    # lam very close to 1, n = 10^6: compare with an O(n) extended-precision sum built from
    # the inverse parameters (exercises the expm1/log1p branch far from the small-n regime).
    alpha, lam = np.array([0.01, 0.005, 0.001]), np.array([1 - 1e-5, 1 - 1e-6, 1 - 1e-7])
    n = 10**6
    a_hat, l_hat = blt.blt_inverse_parameters(alpha, lam)
    u = np.arange(n - 1, dtype=np.float64)
    cinv = np.zeros(n, dtype=np.longdouble)
    cinv[0] = 1
    c = np.zeros(n, dtype=np.longdouble)
    c[0] = 1
    for a, l, ah, lh in zip(alpha, lam, a_hat, l_hat):  # terms in float64, sums in long double
        cinv[1:] += (ah * np.power(lh, u)).astype(np.longdouble)
        c[1:] += (a * np.power(l, u)).astype(np.longdouble)
    b = np.cumsum(cinv)
    want = (
        float(np.sum(c**2)),
        float(np.sum(b**2)),
        float(np.sum((n - np.arange(n, dtype=np.longdouble)) * b**2) / n),
    )
    assert_rel(closed(alpha, lam, n), want, 1e-10, "n=1e6")


def test_closed_forms_n_1e9_need_no_memory_of_size_n_and_are_finite():
    """Lemma 2.29 is O(d^2) whatever n: at n = 10^9 the closed forms allocate a few kB (an O(n) pass
    would need arrays of 8 GB), measured by tracemalloc, which counts numpy's buffers -- the
    same on every machine, unlike a wall-clock limit."""
    n = 10**9
    params = [CASES[0], CASES[1], CASES[-1], (np.array([0.05, 0.01]), np.array([0.999, 0.99999]))]
    closed(*params[0], n)  # warm up (lazy imports, caches)
    for alpha, lam in params:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        try:
            closed(alpha, lam, n)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert peak < 1 << 16, f"closed forms for d = {alpha.size} at n = 1e9 allocated {peak} bytes"
    vals = closed(*params[0], n)
    for alpha, lam in params:
        sens, mx, mean = closed(alpha, lam, n)
        assert all(math.isfinite(v) and v > 0 for v in (sens, mx, mean))
        assert mean <= mx and sens >= 1.0
    # monotone in n
    s_prev = m_prev = 0.0
    for k in range(0, 10):
        sens, mx, _ = closed(*CASES[0], 10**k)
        assert sens >= s_prev and mx >= m_prev
        s_prev, m_prev = sens, mx
    assert vals == closed(*params[0], n)


def test_closed_forms_overflow_is_inf():
    # lam_hat = -1.5: the true error is astronomically large at n = 10^9.
    assert math.isinf(blt.blt_max_error_squared([2.0], [0.5], 10**9))
    assert math.isinf(blt.blt_mean_error_squared([2.0], [0.5], 10**9))


def test_identity_blt():
    # alpha = 0: C = I, B = A: row norm^2 = n, Frobenius^2 / n = (n + 1) / 2.
    assert closed([0.0], [0.5], 7) == (1.0, 7.0, 4.0)


# ------------------------------------------------------------------------------------------
# Lemma 2.29 as printed (documents the correction described in blt.py)
# ------------------------------------------------------------------------------------------


def _gamma(n, x):
    return (1 - x**n) / (1 - x)


def lemma_229_corrected(alpha, lam, n):
    """Lemma 2.29 (b), (c) with its convention C^{-1} = BLT(-alpha~, lambda~), alpha~ >= 0,
    and the sign of the linear terms corrected (printed: +2 ...)."""
    a_hat, lt = blt.blt_inverse_parameters(alpha, lam)
    at = -a_hat
    g, gg = _gamma(n, lt), _gamma(n, np.outer(lt, lt))
    G1 = (n - g) / (1 - lt)
    G2 = (n - g[:, None] - g[None, :] + gg) / np.outer(1 - lt, 1 - lt)
    row = n - 2 * at @ G1 + at @ G2 @ at
    ll = np.outer(lt, lt)
    S1 = 1 - lt + lt / (1 - lt) * (n - g)
    S2 = 1 - ll + ll / (1 - ll) * (n - gg)
    H1 = 1 + (n * (n - 1) / 2 - S1) / (1 - lt)
    H2 = 1 + (n * (n - 1) / 2 - S1[:, None] - S1[None, :] + S2) / np.outer(1 - lt, 1 - lt)
    fro = (n + 1) / 2 - 2 / n * at @ H1 + 1 / n * at @ H2 @ at  # sum over i AND j
    return row, fro


@pytest.mark.parametrize("n", [1, 2, 10, 100])
def test_lemma_229_printed_sign_is_wrong_corrected_is_right(n):
    alpha, lam = CASES[0]
    _, row, fro = materialized(alpha, lam, n)
    row_c, fro_c = lemma_229_corrected(alpha, lam, n)
    assert_rel((row_c, fro_c), (row, fro), 1e-10)
    if n > 1:  # the printed "+2 sum alpha~ Gamma" (with alpha~ >= 0) is off
        a_hat, lt = blt.blt_inverse_parameters(alpha, lam)
        at = -a_hat
        G1 = (n - _gamma(n, lt)) / (1 - lt)
        assert abs((row_c + 4 * at @ G1) - row) > 0.1 * row
