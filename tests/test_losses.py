"""Losses and the sensitivity dispatcher against materialized matrices and brute force."""


import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from corrnoise.errors import CorrnoiseError
from corrnoise.losses import error_summary, loss_report, mechanism_sensitivity, per_query_squared_error
from corrnoise.participation import Cyclic, MinSep, Single
from corrnoise.sensitivity import brute_force_sensitivity
from corrnoise.strategies import BLT, ColumnNormalized, Dense, OnlineTree, Toeplitz, Tree, parse_strategy
from corrnoise.workloads import momentum, parse_workload, prefix
from conftest import random_strategies
from tree_reference import noising_reference


def _dense_errors(strategy, workload):
    C = strategy.matrix()
    A = workload.matrix(strategy.n)
    B = A @ np.linalg.pinv(C)  # = A C^{-1} for square invertible C (least squares for tree:full)
    if isinstance(strategy, OnlineTree):  # the online tree's own left inverse (tests/tree_reference.py)
        B = A @ noising_reference(strategy.n, strategy.decoding)
    return np.sum(B**2, axis=1)


@pytest.mark.parametrize("workload", [prefix(), momentum(0.9), momentum(0.5, 0.1)], ids=lambda w: w.spec)
@pytest.mark.parametrize("n", [1, 5, 24])
def test_per_query_errors_match_dense_for_every_kind(n, workload):
    for s in random_strategies(n, seed=n):
        expected = _dense_errors(s, workload)
        assert np.allclose(per_query_squared_error(s, workload), expected, rtol=1e-8, atol=1e-10), s.label
        mean, mx = error_summary(s, workload)
        assert mean == pytest.approx(np.sqrt(expected.mean()), rel=1e-8), s.label
        assert mx == pytest.approx(np.sqrt(expected.max()), rel=1e-8), s.label


def test_momentum_workload_matches_the_sgd_recursion():
    """Unroll tutorial Eq. 3.4 on unit impulses and compare with A_mom (Eq. 3.5-3.6)."""
    beta, wd, n = 0.8, 0.05, 7
    A = momentum(beta, wd).matrix(n)
    for s in range(n):
        v = theta = 0.0
        for t in range(n):
            v = beta * v + (1.0 if t == s else 0.0)
            theta = (1 - wd) * theta - v
            assert -theta == pytest.approx(A[t, s]), (t, s)


def _schemas(n):
    out = [Single()]
    for b in range(1, n + 1):
        k = -(-n // b)
        out.append(Cyclic(k, b))
        for kk in range(1, k + 1):
            out.append(MinSep(kk, b))
    return out


@given(st.integers(2, 9), st.integers(0, 1000))
def test_dispatched_sensitivity_matches_brute_force_when_gram_is_nonnegative(n, seed):
    rng = np.random.default_rng(seed)
    nonneg = [
        parse_strategy("toeplitz-sqrt", n), parse_strategy("bsr:2", n), BLT(rng.uniform(0, 0.5, 2), rng.uniform(0, 1, 2), n),
        Dense(np.tril(rng.uniform(0.1, 1.0, (n, n)))), ColumnNormalized(parse_strategy("toeplitz-sqrt", n)),
        parse_strategy("dpcgd:0.4", n), Tree(n), OnlineTree(n), OnlineTree(n, "ls"),
    ]
    for s in nonneg:
        C = s.matrix()
        for schema in _schemas(n):
            got = mechanism_sensitivity(s, schema)
            want = brute_force_sensitivity(C, schema, n)
            if got.exact:
                assert got.value == pytest.approx(want, rel=1e-9), (s.label, schema.spec, got.method)
            else:
                assert got.value >= want * (1 - 1e-12), (s.label, schema.spec, got.method)


@given(st.integers(2, 8), st.integers(0, 1000))
def test_banded_sensitivity_is_exact_for_any_sign(n, seed):
    """Lemma 3.16(b): with bands <= b the cross terms vanish whatever the signs of C."""
    rng = np.random.default_rng(seed)
    coeffs = np.concatenate([[1.0], rng.normal(size=1)])
    s = Toeplitz(coeffs, n)
    C = s.matrix()
    for b in range(2, n + 1):
        for k in range(1, -(-n // b) + 1):
            got = mechanism_sensitivity(s, MinSep(k, b))
            assert got.exact
            best = max(np.sum(C[:, list(p)] ** 2) for p in MinSep(k, b).patterns(n))
            assert got.value == pytest.approx(np.sqrt(best), rel=1e-12)


def test_negative_gram_is_reported_as_an_upper_bound():
    n = 6
    C = np.tril(np.ones((n, n)))
    C[3:, 0] = -1.0
    s = Dense(C)
    got = mechanism_sensitivity(s, Cyclic(2, 3))
    assert not got.exact
    # Any unit vectors u_t give a lower bound ||sum_t C[:, t] u_t^T||_F (Def. 3.13).
    rng = np.random.default_rng(0)
    lower = 0.0
    for _ in range(2000):
        for pattern in Cyclic(2, 3).patterns(n):
            u = rng.normal(size=(len(pattern), 3))
            u /= np.linalg.norm(u, axis=1, keepdims=True)
            lower = max(lower, np.linalg.norm(C[:, list(pattern)] @ u))
    assert got.value >= lower


def test_blt_closed_forms_are_used_for_huge_n():
    s = BLT([0.3, 0.1], [0.99, 0.5], 10**9)
    r = loss_report(s)
    assert r.sensitivity_method == "blt-closed-form"
    assert np.isfinite(r.rms_loss) and r.rms_loss <= r.max_loss
    small = loss_report(BLT([0.3, 0.1], [0.99, 0.5], 300))
    dense = loss_report(Dense(BLT([0.3, 0.1], [0.99, 0.5], 300).matrix()))
    assert small.rms_loss == pytest.approx(dense.rms_loss, rel=1e-9)
    assert small.max_loss == pytest.approx(dense.max_loss, rel=1e-9)


def test_loss_is_error_times_sensitivity():
    for name in ("identity", "toeplitz-sqrt", "bsr:3"):
        r = loss_report(parse_strategy(name, 12), "minsep:3:4", parse_workload("momentum:0.9"))
        assert r.rms_loss == pytest.approx(r.sensitivity * r.mean_error)
        assert r.max_loss == pytest.approx(r.sensitivity * r.max_error)


def test_identity_sensitivity_counts_participations():
    s = parse_strategy("identity", 12)
    assert mechanism_sensitivity(s, "cyclic:3:4").value == pytest.approx(np.sqrt(3))
    assert mechanism_sensitivity(s, "minsep:2:5").value == pytest.approx(np.sqrt(2))


def test_infeasible_participation_is_refused():
    with pytest.raises(CorrnoiseError) as err:
        loss_report(parse_strategy("identity", 10), "minsep:4:4")
    assert err.value.param == "participation"


@pytest.mark.parametrize("workload", [prefix(), momentum(0.7, 0.2)], ids=lambda w: w.spec)
def test_streamed_errors_match_dense_for_every_square_kind(workload):
    from corrnoise.losses import streamed_squared_error

    for s in random_strategies(17, seed=5):
        if s.rows != s.n:
            continue
        assert np.allclose(streamed_squared_error(s, workload), _dense_errors(s, workload), rtol=1e-8), s.label


@pytest.mark.parametrize("workload", [prefix(), momentum(0.9), momentum(0.6, 0.3)], ids=lambda w: w.spec)
@pytest.mark.parametrize("n,bands", [(1, 1), (7, 3), (40, 5), (101, 20), (64, 63)])
def test_block_recurrence_errors_match_streamed_rows(n, bands, workload):
    """O(n b^2) block recurrence (linalg.banded) vs the O(n^2 b) row stream and dense B."""
    from corrnoise.linalg.banded import banded_errors_squared
    from corrnoise.losses import band_storage, streamed_squared_error
    from corrnoise.strategies import Banded

    rng = np.random.default_rng(n + bands)
    band = rng.normal(size=(n, bands)) / bands  # well-conditioned: C^{-1} must not blow up
    band[:, 0] = rng.uniform(1.0, 2.0, size=n)
    for s in (Banded(band), ColumnNormalized(Banded(band)), ColumnNormalized(parse_strategy(f"bsr:{bands}", n))):
        got = banded_errors_squared(band_storage(s), np.asarray(workload.inverse_coefficients)) if s.bands < n else None
        if got is None:
            continue
        assert np.allclose(got, streamed_squared_error(s, workload), rtol=1e-8), s.label
        assert np.allclose(got, _dense_errors(s, workload), rtol=1e-7), s.label


def test_closed_forms_are_chosen_by_method_not_class_name():
    """BLT and DP-CGD (and any BLT subclass) use Lemma 2.29; a column-normalized BLT, a Toeplitz
    and a dense strategy have no closed form and take the general paths."""
    from corrnoise.strategies import DPCGD

    class MyBLT(BLT):
        kind = "my-blt"

    n = 40
    for s in (BLT([0.3, 0.1], [0.9, 0.4], n), DPCGD(0.6, n), MyBLT([0.3], [0.7], n)):
        assert s.closed_form_sensitivity_squared()[1] == "blt-closed-form"
        assert mechanism_sensitivity(s).method == "blt-closed-form"
        mean_sq, max_sq = s.closed_form_prefix_errors_squared()
        e = _dense_errors(s, prefix())
        assert np.isclose(mean_sq, e.mean(), rtol=1e-9) and np.isclose(max_sq, e.max(), rtol=1e-9)
        assert np.allclose(error_summary(s), np.sqrt([e.mean(), e.max()]), rtol=1e-9)
    for s in (ColumnNormalized(BLT([0.3], [0.7], n)), Toeplitz(np.array([1.0, 0.5]), n), Dense(np.eye(n))):
        assert s.closed_form_sensitivity_squared() is None and s.closed_form_prefix_errors_squared() is None
        assert mechanism_sensitivity(s).method != "blt-closed-form"
