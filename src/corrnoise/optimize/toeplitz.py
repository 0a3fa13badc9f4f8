"""Banded Toeplitz strategy optimization (tutorial Sec. 4.3.1, seed 002 Sec. 3.2 and App. I).

The strategy is C = Toeplitz(c_0, ..., c_{p-1}, 0, ..., 0) with p = ``bands`` coefficients.
For a Toeplitz workload A (first column a) the decoder B = A C^{-1} is Toeplitz with first
column ``beta = T_c^{-1} a`` (seed 002 Prop. 3.1, tutorial Eq. 4.11), so

    rms:  ||B||_F^2 / n  = sum_t (n - t) / n * beta_t^2,      max:  ||B||_row^2 = sum_t beta_t^2,

and beta costs O(n p) (an IIR filter with the p taps of C, seed 002 Alg. 1) or O(n log n)
(FFT Newton inverse) for long coefficient vectors. The gradient is exact and written by hand
(adjoint method): with g = d err / d beta and u = T_c^{-T} g,

    d err / d c_j = - sum_t u_t beta_{t-j}                       (one more filter + a correlation).

Objective (Problem 4.12): log sens(C, Pi)^2 + log err(B), minimized with L-BFGS from the
A^{1/2} coefficients (tutorial Thm 2.5). The sensitivity used for optimization is

* single participation: ||c||^2 (the first column has the largest norm);
* cyclic / min-sep with bands <= b: sum_{j<k} ||C[:, j b]||^2 (Lemma 3.16(b); the column norms
  of a lower-triangular Toeplitz matrix do not increase, so the pattern 0, b, 2b, ... is worst);
* cyclic / min-sep with bands > b: ||sum_{j<k} C[:, j b]||^2 (Eq. 3.25), which needs
  non-negative, non-increasing coefficients; we keep c in that class by optimizing the
  non-negative decrements delta_s = c_s - c_{s+1} with L-BFGS-B bounds.

For n >= 10^6 (prefix-like workloads) the fixed-point approximation of seed 002 App. I is used
during optimization: beta_t is computed exactly for t < K and replaced by its limit
beta_* = a_* / sum_j c_j afterwards. The returned losses are always recomputed exactly with
:func:`corrnoise.losses.loss_report`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from scipy import optimize as sopt

from ..errors import CorrnoiseError, check_int
from ..linalg import toeplitz as tp
from ..participation import Participation, Single, parse_participation
from ..strategies import ColumnNormalized, Strategy, Toeplitz
from ..workloads import Workload
from .common import check_objective, check_progress, check_workload, series_sqrt


def _signal():
    """scipy.signal, imported on first use: the import takes ~1 s (scipy's array-API backends pull in
    scipy.stats), which every ``import corrnoise`` paid before."""
    from scipy import signal

    return signal

__all__ = [
    "optimize_banded_toeplitz",
    "toeplitz_error_and_grad",
    "toeplitz_sensitivity_squared_and_grad",
    "series_sqrt",
    "FIXED_POINT_MIN_N",
]

#: From this n on, the optimizer uses the fixed-point approximation of seed 002 App. I.
FIXED_POINT_MIN_N = 1_000_000
# Number of exactly computed decoder coefficients in the fixed-point approximation.
_FIXED_POINT_HEAD = 100_000
# Up to this many bands the decoder is an IIR filter (O(n p)); beyond, FFT Newton (O(n log n)).
_FILTER_MAX_BANDS = 128
_INFEASIBLE = 1e6


# ------------------------------------------------------------------------------ inputs
def _initial_coefficients(workload: Workload, bands: int) -> np.ndarray:
    """A^{1/2} coefficients (tutorial Thm 2.5 / Sec. 4.3.1 "Practical Considerations")."""
    if workload.is_prefix:
        return tp.prefix_sqrt_coefficients(bands)
    return series_sqrt(workload.coefficients(bands), bands)


# ---------------------------------------------------------------------- sensitivity
def _participation_weights(schema: Participation, n: int, bands: int) -> np.ndarray:
    """m_s with sens^2 = sum_s m_s c_s^2 when bands <= b (Lemma 3.16(b)).

    Column t of the Toeplitz C has squared norm sum_{s < min(bands, n - t)} c_s^2, so the
    worst pattern is 0, b, ..., (k-1) b (cyclic; min-sep: the earliest picks dominate any
    b-separated set) and m_s = #{j < k : j b + s < n}. Single participation: m_s = 1.
    """
    s = np.arange(bands, dtype=np.float64)
    if isinstance(schema, Single):
        return np.ones(bands)
    k, b = schema.max_participations(n), schema.b
    # j b < n - s  <=>  j <= (n - s - 1) // b
    return np.minimum(float(k), np.floor((n - s - 1.0) / b) + 1.0)


def toeplitz_sensitivity_squared_and_grad(
    c: np.ndarray, n: int, participation: Participation | str = "single"
) -> tuple[float, np.ndarray]:
    """sens(C, Pi)^2 for the banded Toeplitz C with coefficients c, and its gradient in c.

    Single / bands <= b: sum_s m_s c_s^2 (Lemma 3.16(b), see :func:`_participation_weights`).
    bands > b: ||v||^2 with v = sum_{j<k} S^{jb} c (Eq. 3.25; the caller must keep c
    non-negative and non-increasing), gradient 2 sum_j v_{s + j b}.
    """
    schema = parse_participation(participation)
    n = schema.validate(n)
    c = np.asarray(c, dtype=np.float64)
    p = c.size
    if isinstance(schema, Single) or p <= schema.b:
        m = _participation_weights(schema, n, p)
        return float(np.dot(m, c * c)), 2.0 * m * c
    k, b = schema.max_participations(n), schema.b
    full = np.zeros(k * b + p)
    for j in range(k):
        full[j * b : j * b + p] += c
    v = full[:n]
    grad = np.zeros(p)
    vpad = np.zeros(k * b + p)
    vpad[:n] = v
    for j in range(k):
        grad += vpad[j * b : j * b + p]
    return float(np.dot(v, v)), 2.0 * grad


# ---------------------------------------------------------------------------- error
def _inverse_apply(c: np.ndarray, x: np.ndarray, fir: bool) -> np.ndarray:
    """T_c^{-1} x (lower-triangular Toeplitz solve)."""
    if fir:
        return _signal().lfilter([1.0], c, x)
    inv = tp.series_inverse(c, x.size)
    return tp.series_multiply(inv, x, x.size)


def _inverse_transpose_apply(c: np.ndarray, g: np.ndarray, fir: bool) -> np.ndarray:
    """T_c^{-T} g: the upper-triangular solve, i.e. the lower solve in reversed time."""
    return _inverse_apply(c, g[::-1].copy(), fir)[::-1]


def _lag_correlation(u: np.ndarray, beta: np.ndarray, p: int) -> np.ndarray:
    """r_j = sum_t u_t beta_{t-j} for j = 0..p-1."""
    n = u.size
    if p <= 32:
        return np.array([float(np.dot(u[j:], beta[: n - j])) for j in range(p)])
    full = _signal().fftconvolve(u[::-1], beta)  # index n-1-j holds r_j
    return full[n - 1 - np.arange(p)]


@dataclass(frozen=True)
class _ErrorSpec:
    n: int
    objective: str
    a: np.ndarray  # workload coefficients of the exactly computed head (length K)
    head_weights: np.ndarray  # w_t for t < K
    tail_weight: float  # sum_{t >= K} w_t (0 when exact)
    a_limit: float  # a_* for the fixed-point tail


def _error_spec(n: int, objective: str, workload: Workload, approximate: bool | None) -> _ErrorSpec:
    if approximate is None:
        approximate = n >= FIXED_POINT_MIN_N
    head = min(n, _FIXED_POINT_HEAD) if approximate else n
    t = np.arange(head, dtype=np.float64)
    if objective == "rms":
        w = (n - t) / n
        r = float(n - head)
        tail = r * (r + 1.0) / (2.0 * n)
    else:
        w = np.ones(head)
        tail = float(n - head)
    a = workload.coefficients(head)
    return _ErrorSpec(n, objective, a, w, tail, float(a[-1]))


def toeplitz_error_and_grad(c: np.ndarray, spec: _ErrorSpec) -> tuple[float, np.ndarray]:
    """err(B) and d err / d c for B = A T_c^{-1} (tutorial Eq. 4.11 / seed 002 Prop. 3.1).

    err = sum_t w_t beta_t^2 with beta = T_c^{-1} a, w_t = (n - t)/n (rms) or 1 (max). With the
    fixed-point tail (seed 002 App. I) beta_t = beta_* = a_* / sum_j c_j for t >= K adds
    beta_*^2 W_tail (W_tail = sum_{t >= K} w_t), whose gradient is -2 W_tail beta_*^2 / sum_j c_j.

    A singular T_c (c_0 = 0, or a non-finite c) has no decoder: err = inf with a zero gradient,
    which the optimizer treats as infeasible (its line search backtracks). L-BFGS-B reaches
    c = 0 in the monotone parameterization: the objective is scale-invariant, and a projected
    step onto the bounds delta >= 0 can zero every decrement (n = 80, bands = n, cyclic:10:8).
    """
    c = np.asarray(c, dtype=np.float64)
    p = c.size
    if p == 0 or c[0] == 0.0 or not np.all(np.isfinite(c)):
        return math.inf, np.zeros(p)
    fir = p <= _FILTER_MAX_BANDS
    beta = _inverse_apply(c, spec.a, fir)
    wb = spec.head_weights * beta
    err = float(np.dot(wb, beta))
    u = _inverse_transpose_apply(c, 2.0 * wb, fir)
    grad = -_lag_correlation(u, beta, p)
    if spec.tail_weight > 0.0:
        total = float(np.sum(c))
        b_star = spec.a_limit / total
        err += b_star * b_star * spec.tail_weight
        # d b_* / d c_j = -a_* / (sum c)^2 = -b_* / sum c
        grad = grad - 2.0 * spec.tail_weight * b_star * b_star / total
    return err, grad


# ------------------------------------------------------------------------ optimizer
def _monotone_map(delta: np.ndarray) -> np.ndarray:
    """c_s = sum_{r >= s} delta_r: non-negative non-increasing c from delta >= 0."""
    return np.cumsum(delta[::-1])[::-1]


def _monotone_unmap(c: np.ndarray) -> np.ndarray:
    c = np.minimum.accumulate(np.maximum(c, 0.0))
    delta = c.copy()
    delta[:-1] -= c[1:]
    return np.maximum(delta, 0.0)


def optimize_banded_toeplitz(
    n: int,
    bands: int,
    participation="single",
    objective: str = "rms",
    workload=None,
    column_normalize: bool = False,
    progress: Callable[[int, float], None] | None = None,
    *,
    max_iterations: int = 2000,
    approximate: bool | None = None,
) -> Strategy:
    """Optimize a ``bands``-banded Toeplitz strategy for n steps (tutorial Problem 4.12).

    Returns ``Toeplitz(coefficients, n)`` with c_0 = 1, or its ``ColumnNormalized`` version
    when ``column_normalize`` (seed 002 Sec. 3.2: normalization as post-processing).
    ``approximate`` forces the App. I fixed-point objective on/off (default: n >= 10^6).
    ``progress(iteration, loss)`` is called once per L-BFGS iteration with the current
    (normalized, objective-specific) loss of the optimization objective.
    """
    n = check_int("n", n, minimum=1)
    bands = check_int("bands", bands, minimum=1)
    if bands > n:
        raise CorrnoiseError("bands", f"must be <= n = {n}, got {bands}")
    schema = parse_participation(participation)
    schema.validate(n)
    objective = check_objective(objective)
    workload = check_workload(workload)
    if not isinstance(column_normalize, (bool, np.bool_)):
        raise CorrnoiseError("column_normalize", f"must be True or False, got {column_normalize!r}")
    progress = check_progress(progress)
    max_iterations = check_int("max_iterations", max_iterations, minimum=0)

    spec = _error_spec(n, objective, workload, approximate)
    monotone = not isinstance(schema, Single) and bands > schema.b
    c0 = _initial_coefficients(workload, bands)

    def loss_grad_c(c):
        with np.errstate(all="ignore"):
            s2, gs = toeplitz_sensitivity_squared_and_grad(c, n, schema)
            err, ge = toeplitz_error_and_grad(c, spec)
            ok = s2 > 0.0 and err > 0.0 and math.isfinite(s2) and math.isfinite(err)
            if ok:
                f = math.log(s2) + math.log(err)
                g = gs / s2 + ge / err
                ok = bool(np.all(np.isfinite(g)))
        if not ok:
            # C^{-1} unstable (beta overflows) or degenerate: large but finite, so the line
            # search backtracks instead of aborting.
            return _INFEASIBLE, np.zeros_like(c)
        return f, g

    if monotone:
        x0 = _monotone_unmap(c0)
        to_c = _monotone_map

        def fun(x):
            f, g = loss_grad_c(_monotone_map(x))
            return f, np.cumsum(g)  # d f / d delta_r = sum_{s <= r} d f / d c_s

        bounds = [(0.0, None)] * bands
    else:
        x0 = c0.copy()

        def to_c(x):
            return x

        fun = loss_grad_c
        bounds = None

    state = {"it": 0}

    def callback(intermediate_result):
        state["it"] += 1
        if progress is not None:
            progress(state["it"], math.exp(0.5 * float(intermediate_result.fun)))

    if max_iterations > 0 and bands > 1:
        res = sopt.minimize(
            fun, x0, jac=True, method="L-BFGS-B", bounds=bounds, callback=callback,
            options={"maxiter": max_iterations, "maxcor": 30, "ftol": 1e-15, "gtol": 1e-12,
                     "maxls": 40},
        )
        f0 = fun(x0)[0]
        x = res.x if (np.all(np.isfinite(res.x)) and res.fun <= f0) else x0
    else:
        x = x0
    c = np.asarray(to_c(x), dtype=np.float64)
    if not np.all(np.isfinite(c)) or c[0] == 0.0:
        raise CorrnoiseError("bands", "optimization produced an invalid strategy (c_0 = 0 or non-finite); try fewer bands")
    c = c / c[0]  # the objective is scale-invariant; c_0 = 1 keeps the diagonal positive
    if monotone:
        c = np.minimum.accumulate(np.maximum(c, 0.0))  # remove round-off outside the class
    strategy: Strategy = Toeplitz(c, n)
    if column_normalize:
        strategy = ColumnNormalized(strategy)
    return strategy
