"""Banded-Toeplitz and BLT optimizers (issue #3): gradients, objectives, published tables, errors.

Independent references: finite differences for gradients, corrnoise.losses.loss_report
(materialized / closed-form losses from issue #2) for objectives and sensitivities, the numpy
inverse-BLT parameters (Lemma 2.16) for the secular roots, and tutorial Tables 2.2 / 2.3.
The slow table entries (Toeplitz n = 8192, BLT n >= 2048) live in
benchmarks/bench_optimize_vs_jax.py --tables.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from corrnoise.errors import CorrnoiseError
from corrnoise.linalg import blt as bltmath
from corrnoise.linalg import toeplitz as tp
from corrnoise.losses import loss_report, mechanism_sensitivity
from corrnoise.optimize import blt as B
from corrnoise.optimize import toeplitz as T
from corrnoise.participation import Cyclic, MinSep
from corrnoise.strategies import BLT, BandedSqrt, ColumnNormalized, Toeplitz
from corrnoise.workloads import momentum, prefix

TABLE_23_TOEPLITZ = {8: 1.544, 16: 1.75, 32: 1.963, 64: 2.179, 128: 2.397, 256: 2.616, 512: 2.836,
                     1024: 3.057, 2048: 3.277, 4096: 3.498}
TABLE_22_BLT = {8: 1.723, 64: 2.391, 512: 3.054}
TABLE_23_BLT = {16: 1.751, 128: 2.398, 1024: 3.057}


def _fd(fun, x, h=1e-6):
    return np.array([(fun(x + h * e) - fun(x - h * e)) / (2 * h) for e in np.eye(x.size)])


# ------------------------------------------------------------------------ banded Toeplitz
@pytest.mark.parametrize(
    "n,p,objective,workload,approximate",
    [(60, 5, "rms", prefix(), False), (300, 200, "max", momentum(0.9), False),
     (257, 257, "rms", prefix(), False), (40, 40, "max", prefix(), False)],
)
def test_toeplitz_error_gradient_matches_finite_differences(n, p, objective, workload, approximate):
    rng = np.random.default_rng(n + p)
    c = np.r_[1.0, 0.5 * rng.random(p - 1) / np.arange(1, p)]
    spec = T._error_spec(n, objective, workload, approximate)
    err, grad = T.toeplitz_error_and_grad(c, spec)
    fd = _fd(lambda x: T.toeplitz_error_and_grad(x, spec)[0], c)
    assert np.max(np.abs(fd - grad)) <= 1e-6 * np.max(np.abs(grad))
    # err itself against the materialized decoder B = A C^{-1} (Eq. 4.11)
    b = workload.matrix(n) @ np.linalg.inv(tp.toeplitz_matrix(c, n))
    ref = np.sum(b**2) / n if objective == "rms" else np.max(np.sum(b**2, axis=1))
    assert err == pytest.approx(ref, rel=1e-9)


def test_fixed_point_tail_gradient_and_accuracy():
    """Seed 002 App. I: beta_t -> 1 / sum(c); the tail term and its gradient are exact for it."""
    n, head = 5000, 600
    c = tp.prefix_sqrt_coefficients(8)
    full = T._error_spec(n, "rms", prefix(), False)
    t = np.arange(head, dtype=float)
    r = float(n - head)
    approx = T._ErrorSpec(n, "rms", np.ones(head), (n - t) / n, r * (r + 1) / (2 * n), 1.0)
    e_full = T.toeplitz_error_and_grad(c, full)[0]
    e_apx, g_apx = T.toeplitz_error_and_grad(c, approx)
    assert e_apx == pytest.approx(e_full, rel=1e-6)
    fd = _fd(lambda x: T.toeplitz_error_and_grad(x, approx)[0], c)
    assert np.max(np.abs(fd - g_apx)) <= 1e-6 * np.max(np.abs(g_apx))


@pytest.mark.parametrize("schema", [Cyclic(5, 24), MinSep(3, 30), MinSep(4, 7), Cyclic(18, 7)])
def test_toeplitz_sensitivity_matches_loss_code_and_gradient(schema):
    n = 120
    rng = np.random.default_rng(3)
    for p in (5, 40):
        c = np.sort(rng.random(p))[::-1]  # non-negative, non-increasing (Eq. 3.25 class)
        s2, g = T.toeplitz_sensitivity_squared_and_grad(c, n, schema)
        ref = mechanism_sensitivity(Toeplitz(c, n), schema)
        assert ref.exact
        assert s2 == pytest.approx(ref.value**2, rel=1e-12)
        fd = _fd(lambda x: T.toeplitz_sensitivity_squared_and_grad(x, n, schema)[0], c)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("n", sorted(TABLE_23_TOEPLITZ))
def test_table_2_3_optimized_toeplitz(n):
    s = T.optimize_banded_toeplitz(n, n, objective="rms")
    r = loss_report(s)
    assert r.rms_loss <= TABLE_23_TOEPLITZ[n] + 0.002
    assert isinstance(s, Toeplitz) and s.coefficients[0] == 1.0


@pytest.mark.parametrize("participation,bands", [("single", 16), ("cyclic:4:25", 5), ("cyclic:4:25", 40),
                                                 ("minsep:3:10", 40)])
def test_optimized_banded_toeplitz_never_worse_than_banded_sqrt(participation, bands):
    """Seed 002 App. E: the optimizer started from the A^{1/2} coefficients never loses to them."""
    n = 100
    s = T.optimize_banded_toeplitz(n, bands, participation=participation, objective="rms")
    r = loss_report(s, participation)
    assert r.sensitivity_exact
    assert r.rms_loss <= loss_report(BandedSqrt(n, bands), participation).rms_loss * (1 - 0.005)
    assert s.bands <= bands
    if bands > 25:  # Eq. 3.25 class kept
        assert s.is_nonnegative_monotone()


def test_full_toeplitz_cyclic_line_search_through_zero_is_backtracked():
    """Regression (the planner's 2,048 x 256 x 10 epochs setup: n = 80, b = 8, bands = n): with
    bands > b the decrements delta >= 0 are optimized under L-BFGS-B bounds, and the scale-invariant
    objective let a projected step land on delta = 0, i.e. c = 0 -- a singular C that scipy's
    lfilter rejected ("a[0] == 0") instead of the line search backtracking. The optimizer must
    return a valid C (c_0 = 1, finite, Eq. 3.25 class) that beats its A^{1/2} start point."""
    n, part = 80, "cyclic:10:8"
    s = T.optimize_banded_toeplitz(n, n, participation=part)
    c = np.asarray(s.coefficients)
    assert c[0] == 1.0 and np.all(np.isfinite(c))
    assert s.is_nonnegative_monotone()
    assert loss_report(s, part).rms_loss < loss_report(BandedSqrt(n, n), part).rms_loss


def test_toeplitz_error_of_a_singular_c_is_infeasible_not_an_exception():
    """c_0 = 0 makes T_c singular: the objective reports it as infeasible (no filter call)."""
    spec = T._error_spec(8, "rms", prefix(), False)
    err, grad = T.toeplitz_error_and_grad(np.zeros(8), spec)
    assert err == math.inf and np.all(grad == 0.0)


def test_banded_toeplitz_max_objective_momentum_and_column_normalization():
    n, wl = 200, momentum(0.9)
    s = T.optimize_banded_toeplitz(n, 8, objective="max", workload=wl)
    base = loss_report(BandedSqrt(n, 8), None, wl).max_loss
    assert loss_report(s, None, wl).max_loss < base
    cn = T.optimize_banded_toeplitz(n, 8, column_normalize=True)
    assert isinstance(cn, ColumnNormalized) and isinstance(cn.base, Toeplitz)
    np.testing.assert_allclose(cn.column_norms_squared(), 1.0)
    # normalizing afterwards (seed 002 Sec. 3.2) does not hurt for single participation
    assert loss_report(cn).rms_loss <= loss_report(cn.base).rms_loss + 1e-12


def test_banded_toeplitz_large_n_uses_fixed_point_and_progress():
    calls = []
    s = T.optimize_banded_toeplitz(2_000_000, 4, objective="max", progress=lambda i, l: calls.append((i, l)))
    assert calls and [i for i, _ in calls] == list(range(1, len(calls) + 1))
    assert loss_report(s).max_loss < loss_report(BandedSqrt(2_000_000, 4)).max_loss


@pytest.mark.parametrize(
    "kwargs,param",
    [(dict(n=10, bands=11), "bands"), (dict(n=10, bands=0), "bands"), (dict(n=0, bands=1), "n"),
     (dict(n=10, bands=2, objective="mean"), "objective"), (dict(n=10, bands=2, workload="zzz"), "workload"),
     (dict(n=10, bands=2, participation="cyclic:2:3"), "participation"),
     (dict(n=10, bands=2, column_normalize="yes"), "column_normalize"),
     (dict(n=10, bands=2, progress=3), "progress")],
)
def test_banded_toeplitz_bad_input(kwargs, param):
    with pytest.raises(CorrnoiseError) as err:
        T.optimize_banded_toeplitz(**kwargs)
    assert err.value.param == param and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------ BLT
def test_secular_roots_match_numpy_inverse_parameters():
    rng = np.random.default_rng(7)
    for _ in range(20):
        d = int(rng.integers(1, 7))
        lam = np.sort(1 - 10 ** rng.uniform(-8, 0, d))
        alpha = rng.uniform(0.01, 1.0, d) / d
        om = np.sort(B._secular_roots_complement(alpha, 1 - lam))
        _, mu = bltmath.blt_inverse_parameters(alpha, lam)
        np.testing.assert_allclose(np.sort(1 - mu.real), om, rtol=1e-6, atol=1e-15)


@pytest.mark.parametrize("n", [7, 1000, 10**6])
def test_blt_objective_matches_loss_report(n):
    rng = np.random.default_rng(n)
    for _ in range(6):
        d = int(rng.integers(1, 5))
        lam = np.sort(1 - 10 ** rng.uniform(-7, 0, d))
        alpha = rng.uniform(0.01, 1.5, d) / d  # large scales give negative inverse decays
        schemas = ["single"] + ([f"cyclic:{-(-n // 3)}:3", "minsep:2:3"] if n <= 1000 else [])
        if np.sum(alpha) > 1:
            schemas = ["single"]  # Eq. 3.25 needs sum(alpha) <= 1
        for part in schemas:
            r = loss_report(BLT(alpha, lam, n), part)
            assert B.blt_objective(alpha, lam, n, part, "rms") == pytest.approx(r.rms_loss, rel=1e-10)
            assert B.blt_objective(alpha, lam, n, part, "max") == pytest.approx(r.max_loss, rel=1e-10)
    if n <= 1000:
        alpha, lam = np.array([0.3, 0.1]), np.array([0.95, 0.5])
        wl = momentum(0.8)
        r = loss_report(BLT(alpha, lam, n), None, wl)
        assert B.blt_objective(alpha, lam, n, "single", "rms", wl) == pytest.approx(r.rms_loss, rel=1e-10)


@pytest.mark.parametrize("objective,participation,workload", [("max", "single", None), ("rms", "single", None),
                                                              ("rms", "cyclic:10:10", None),
                                                              ("max", "single", momentum(0.9))])
def test_blt_gradient_matches_finite_differences(objective, participation, workload):
    prob = B._Problem(100, B.parse_participation(participation), objective, workload or prefix())
    x0 = B._pack(np.array([0.2, 0.05, 0.3]), np.array([0.99, 0.9, 0.3]), prob.multi)

    def f(xn):
        return float(B._objective_torch(torch.tensor(xn, dtype=torch.float64), 3, prob, 0.0)[1])

    x = torch.tensor(x0, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(B._objective_torch(x, 3, prob, 0.0)[1], x)
    np.testing.assert_allclose(g.numpy(), _fd(f, x0), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("n", sorted(TABLE_22_BLT))
def test_table_2_2_blt_max(n):
    s = B.optimize_blt(n, objective="max")
    assert loss_report(s).max_loss <= TABLE_22_BLT[n] + 0.003


@pytest.mark.parametrize("n", sorted(TABLE_23_BLT))
def test_table_2_3_blt_rms(n):
    s = B.optimize_blt(n, objective="rms")
    assert loss_report(s).rms_loss <= TABLE_23_BLT[n] + 0.003


def test_blt_multi_participation_is_valid_and_beats_toeplitz_sqrt():
    part = "minsep:3:10"
    s = B.optimize_blt(100, buffers=2, participation=part)
    assert isinstance(s, BLT) and s.alpha.size == 2
    assert np.all(s.alpha > 0) and np.all((s.lam > 0) & (s.lam < 1)) and s.alpha.sum() <= 1
    r = loss_report(s, part)
    assert r.sensitivity_exact and r.sensitivity_method == "toeplitz-eq-3.25"
    assert r.rms_loss < loss_report(BandedSqrt(100, 100), part).rms_loss


def test_blt_progress_and_auto_buffers():
    calls = []
    s = B.optimize_blt(256, objective="max", progress=lambda i, l: calls.append((i, l)))
    assert calls and calls[-1][0] == len(calls)
    assert 2 <= s.alpha.size <= B.MAX_BUFFERS
    assert all(math.isfinite(l) for _, l in calls)


@pytest.mark.parametrize(
    "kwargs,param",
    [(dict(n=1), "n"), (dict(n=10, buffers=0), "buffers"), (dict(n=10, buffers=11), "buffers"),
     (dict(n=10, objective="x"), "objective"), (dict(n=10, workload="momentum:2"), "beta"),
     (dict(n=10, participation="minsep:5:5"), "participation"), (dict(n=10, progress="p"), "progress")],
)
def test_blt_bad_input(kwargs, param):
    with pytest.raises(CorrnoiseError) as err:
        B.optimize_blt(**kwargs)
    assert err.value.param == param and "\n" not in str(err.value)


def test_blt_each_is_optimize_blt_per_number_of_buffers():
    """One run of the d = 1, 2, ... path gives each d's optimize_blt result (the planner builds
    blt:1, blt:2, blt:4 from it instead of three runs that each recompute the smaller d)."""
    each = B.optimize_blt_each(60, (4, 1, 2), participation="cyclic:5:12")
    assert sorted(each) == [1, 2, 4]
    for d, strat in each.items():
        alone = B.optimize_blt(60, buffers=d, participation="cyclic:5:12")
        np.testing.assert_array_equal(strat.alpha, alone.alpha)
        np.testing.assert_array_equal(strat.lam, alone.lam)
    with pytest.raises(CorrnoiseError) as err:
        B.optimize_blt_each(60, ())
    assert err.value.param == "buffers"
