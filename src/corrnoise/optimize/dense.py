"""The dense mechanism: optimize the Gram matrix M = C^T C (tutorial Sec. 4.2).

Objective (tutorial Lemma 4.2): ||A C^{-1}||_F^2 = tr(A M^{-1} A^T), convex in M, with exact
gradient -M^{-1} A^T A M^{-1}. Constraints:

* single participation -- diag(M) = 1 (Problem 4.3);
* cyclic (k, b) -- M[t, tau] = 0 for t != tau in one pattern and sum_{t in pi} M[t, t] = 1,
  with the diagonal moved only along the projected gradient (Problem 4.6, Eq. 4.7);
* b-min-sep (k >= 2) -- diag(M) = 1 and M[t, tau] = 0 for |t - tau| >= b, i.e. M and C are
  b-banded (Problem 4.8).

Fixed entries are simply not variables (tutorial footnote 2). The iterates stay positive definite
because the line search rejects any step that is not (tutorial Fig. 4.2).

Convergence is certified by a dual bound: for any Lambda > 0 supported on the constrained
entries (diagonal, pattern-constant for cyclic, plus the entries fixed at zero),
  min_M tr(W M^{-1}) + <Lambda, M> = 2 ||A F||_*   (W = A^T A, Lambda = F F^T, nuclear norm),
so scaling Lambda gives  f* >= ||A F||_*^2 / <Lambda, M_feasible>  (Lagrange duality of
Problem 4.3/4.6/4.8; Remark 4.11). We take Lambda = M^{-1} W M^{-1} restricted to those entries,
which is the optimal multiplier at the optimum (stationarity: M^{-1} W M^{-1} = Lambda), and
stop when the relative gap is below ``tol``. For the max objective the same bound holds for
W_w = A^T diag(w) A with any probability weights w (a lower bound on max_t (A M^{-1} A^T)[t, t]).

The max objective min_M max_t (A M^{-1} A^T)[t, t] is convex too; it is smoothed by
tau log sum exp(./tau) with tau decreasing until the certified gap is below ``tol``.
"""

from __future__ import annotations

import math
import time

import numpy as np
from scipy import linalg as sla
from scipy.linalg import blas, lapack
from scipy.special import logsumexp, softmax

from ..errors import CorrnoiseError
from ..linalg.toeplitz import prefix_sqrt_coefficients, toeplitz_matrix
from ..participation import Cyclic, MinSep, Participation
from ..strategies import Banded, Dense, Strategy
from ..workloads import Workload
from .common import (
    Progress,
    check_problem,
    check_strategy_matrix,
    lbfgs,
    report_progress,
    blas_threads,
    reverse_cholesky,
    series_sqrt,
)

#: Largest n the dense optimizer accepts (O(n^2) memory, O(n^3) per iteration).
MAX_DENSE_N = 4096


def sqrt_coefficients(workload: Workload, m: int) -> np.ndarray:
    """First m coefficients of A^{1/2} (tutorial Thm 2.5 for prefix sums)."""
    if workload.is_prefix:
        return prefix_sqrt_coefficients(m)
    return series_sqrt(workload.coefficients(m), m)


class _Structure:
    """Which entries of M are free, which are fixed at zero, and how the diagonal moves."""

    def __init__(self, n: int, schema: Participation):
        self.n = n
        i, j = np.triu_indices(n, 1)
        gap = j - i
        k_multi = isinstance(schema, (Cyclic, MinSep)) and schema.k > 1
        self.cyclic = isinstance(schema, Cyclic) and schema.k > 1
        self.band = schema.b if isinstance(schema, MinSep) and schema.k > 1 else None
        if self.cyclic:
            free = gap % schema.b != 0
        elif self.band is not None:
            free = gap < self.band
        else:
            free = np.ones(gap.shape, dtype=bool)
        self.iu, self.ju = i[free], j[free]
        self.fixed_zero = (i[~free], j[~free]) if k_multi else None
        if self.cyclic:
            self.group = np.arange(n) % schema.b
            counts = np.bincount(self.group, minlength=schema.b).astype(np.float64)
            self.group_size = counts[self.group]
            self.diag0 = 1.0 / self.group_size
        else:
            self.diag0 = np.ones(n)

    @property
    def n_free(self) -> int:
        return self.iu.size + (self.n if self.cyclic else 0)

    def project_diag(self, v: np.ndarray) -> np.ndarray:
        """Orthogonal projection onto {sum_{t in pi} v_t = 0 for every pattern} (Eq. 4.7)."""
        means = np.bincount(self.group, weights=v) / np.bincount(self.group)
        return v - means[self.group]

    def gram(self, x: np.ndarray) -> np.ndarray:
        n = self.n
        m = np.zeros((n, n))
        m[self.iu, self.ju] = x[: self.iu.size]
        m += m.T
        diag = self.diag0 + (self.project_diag(x[self.iu.size :]) if self.cyclic else 0.0)
        m[np.diag_indices(n)] = diag
        return m

    def pack(self, m: np.ndarray) -> np.ndarray:
        x = m[self.iu, self.ju]
        if self.cyclic:
            x = np.concatenate([x, np.zeros(self.n)])
        return x

    def multiplier(self, h: np.ndarray) -> np.ndarray:
        """Lambda: h = M^{-1} W M^{-1} restricted to the constrained entries."""
        lam = np.zeros_like(h)
        d = np.diagonal(h).copy()
        if self.cyclic:
            d = np.bincount(self.group, weights=d)[self.group] / self.group_size
        lam[np.diag_indices(self.n)] = d
        if self.fixed_zero is not None:
            i, j = self.fixed_zero
            lam[i, j] = h[i, j]
            lam[j, i] = h[i, j]
        return lam


def warm_start(n: int, schema: Participation, workload: Workload) -> np.ndarray:
    """Feasible starting Gram matrix: column-scaled A^{1/2} (tutorial Thm 2.5), truncated to b
    bands (Thm 2.13) for cyclic / min-sep so the zero constraints hold."""
    bands = n
    if isinstance(schema, (Cyclic, MinSep)) and schema.k > 1:
        bands = min(schema.b, n)
    coef = np.zeros(n)
    coef[:bands] = sqrt_coefficients(workload, bands)
    c = toeplitz_matrix(coef)
    m = c.T @ c
    target = np.ones(n)
    if isinstance(schema, Cyclic) and schema.k > 1:
        counts = np.bincount(np.arange(n) % schema.b).astype(np.float64)
        target = 1.0 / counts[np.arange(n) % schema.b]
    s = np.sqrt(target / np.diagonal(m))
    return m * s[:, None] * s[None, :]


def dual_lower_bound(a_w: np.ndarray, lam: np.ndarray, m: np.ndarray) -> float | None:
    """||A_w F||_*^2 / <Lambda, M> with Lambda = F F^T (see the module docstring); None when
    Lambda is not positive definite."""
    try:
        f = sla.cholesky(lam, lower=True, check_finite=False)
    except sla.LinAlgError:
        return None
    if not np.all(np.isfinite(f)):
        return None
    k = a_w @ f
    eig = sla.eigvalsh(k.T @ k, check_finite=False, driver="evd")
    nuc = float(np.sum(np.sqrt(np.clip(eig, 0.0, None))))
    t = float(np.sum(lam * m))
    if t <= 0:
        return None
    return nuc * nuc / t


def dual_fixed_point(a: np.ndarray, m0: np.ndarray, tol: float, max_iter: int = 50,
                     progress: Progress | None = None):
    """Problem 4.3 through its dual (Remark 4.11): for multipliers v > 0 the minimizer of
    tr(W M^{-1}) + <diag(v), M> is M(v) = V^{-1/2} (V^{1/2} W V^{1/2})^{1/2} V^{-1/2} (stationarity
    M V M = W), and the optimum has diag(M(v)) = 1. Iterate v <- v * diag(M(v))^2 (a balancing
    step: diag M(s v) = s^{-1/2} diag M(v)); each iterate gives the feasible point
    D^{-1/2} M(v) D^{-1/2} (D = diag M(v)) and the lower bound ||A V^{1/2}||_*^2 / sum(v).
    Returns (best feasible M, best lower bound, iterations); M is None if nothing was feasible.
    The loop is a heuristic; the caller only trusts the certified gap."""
    w = a.T @ a
    x0 = np.linalg.inv(m0)
    v = np.einsum("ij,ji->i", x0 @ w, x0)  # diag(M0^{-1} W M0^{-1})
    best_m, best_f, best_bound = None, math.inf, -math.inf
    it = 0
    for it in range(1, max_iter + 1):
        if not np.all(np.isfinite(v)) or np.any(v <= 0):
            break
        s = np.sqrt(v)
        k = s[:, None] * w * s[None, :]
        try:
            lam, u = sla.eigh(k, driver="evd", check_finite=False)
        except (sla.LinAlgError, ValueError):
            break
        if lam[0] <= 0:
            break
        root = np.sqrt(lam)
        best_bound = max(best_bound, float(root.sum()) ** 2 / float(v.sum()))
        m = ((u * root) @ u.T) / s[:, None] / s[None, :]
        m = 0.5 * (m + m.T)
        d = np.diagonal(m).copy()
        # f(D^{-1/2} M D^{-1/2}) = tr(W D^{1/2} M^{-1} D^{1/2}), M^{-1} = S K^{-1/2} S
        minv = ((u / root) @ u.T) * s[:, None] * s[None, :]
        sd = np.sqrt(d)
        f = float(np.sum(w * (minv * sd[:, None] * sd[None, :])))
        if f < best_f:
            best_f, best_m = f, m / sd[:, None] / sd[None, :]
        gap = (best_f - best_bound) / best_f
        report_progress(progress, min(1.0, math.log(max(gap, 1e-12)) / math.log(tol)) if gap < 1 else 0.0,
                        f"dense (dual fixed point): gap {gap:.1e}")
        if gap <= tol:
            break
        v = v * d * d
    if best_m is not None:
        best_m[np.diag_indices(best_m.shape[0])] = 1.0
    return best_m, (best_bound if math.isfinite(best_bound) else None), it


def optimize_dense(
    n: int,
    participation="single",
    objective: str = "rms",
    workload=None,
    tol: float = 5e-5,
    max_iter: int = 3000,
    progress: Progress | None = None,
    info: dict | None = None,
    threads: int | None = 1,
) -> Strategy:
    """Optimal dense strategy for ``n`` steps (tutorial Problems 4.3, 4.6, 4.8).

    Returns a lower-triangular C (``Dense``; ``Banded`` for min-sep) with C^T C = M*. ``tol``
    is the certified relative gap on the squared objective (5e-5 gives the loss to better
    than 4 significant digits). Single participation with the RMS objective starts with the
    dual fixed point (:func:`dual_fixed_point`), which usually certifies the optimum in a few
    eigendecompositions; everything else (and anything the fixed point leaves) is L-BFGS.
    ``info`` (optional dict) receives ``iterations`` (L-BFGS), ``fixed_point_iterations``,
    ``evaluations``, ``objective_value``, ``lower_bound``, ``gap``, ``reason``, ``seconds``.
    ``threads``: BLAS threads while optimizing (1 is fastest on a shared 2-core machine, where
    OpenBLAS threads spin against other processes; None keeps the library default).
    """
    with blas_threads(threads):
        return _optimize_dense(n, participation, objective, workload, tol, max_iter, progress, info)


def _optimize_dense(n, participation, objective, workload, tol, max_iter, progress, info) -> Strategy:
    t0 = time.perf_counter()
    n, schema, objective, workload = check_problem(n, participation, objective, workload)
    if n > MAX_DENSE_N:
        raise CorrnoiseError("n", f"the dense optimizer supports n <= {MAX_DENSE_N} (O(n^3) per step), got {n}; use banded")
    st = _Structure(n, schema)
    a = workload.matrix(n)
    prefix = workload.is_prefix
    m0 = warm_start(n, schema, workload)
    x0 = st.pack(m0)
    state: dict = {}

    def apply_a(x: np.ndarray) -> np.ndarray:
        return np.cumsum(x, axis=0) if prefix else workload.apply(x)

    def per_query(m: np.ndarray):
        """(e, Y, ok): e_t = (A M^{-1} A^T)[t, t], Y = A M^{-1}."""
        c, info_ = lapack.dpotrf(m, lower=1, clean=1, overwrite_a=0)
        if info_ != 0:
            return None, None
        xinv, info_ = lapack.dpotri(c, lower=1, overwrite_c=1)
        if info_ != 0:
            return None, None
        xinv = np.tril(xinv) + np.tril(xinv, -1).T
        y = apply_a(xinv)
        e = np.einsum("ij,ij->i", a, y)
        return e, y

    def fun(x: np.ndarray, tau: float | None):
        m = st.gram(x)
        e, y = per_query(m)
        if e is None or not np.all(np.isfinite(e)) or np.any(e <= 0):
            return math.inf, np.zeros_like(x)
        if tau is None:
            w = np.ones(n)
            f = float(e.sum())
        else:
            w = softmax(e / tau)
            f = float(tau * logsumexp(e / tau))
        yw = np.sqrt(w)[:, None] * y
        h = blas.dsyrk(1.0, yw, trans=1, lower=0)  # upper triangle of Y_w^T Y_w = M^{-1} W_w M^{-1}
        grad = -2.0 * h[st.iu, st.ju]
        if st.cyclic:
            grad = np.concatenate([grad, -st.project_diag(np.diagonal(h).copy())])
        state.update(m=m, e=e, h=h, w=w)
        return f, grad

    def certify() -> tuple[float, float | None]:
        """(true objective, lower bound) at the last evaluated point."""
        m, e, h, w = state["m"], state["e"], state["h"], state["w"]
        hs = np.triu(h) + np.triu(h, 1).T
        lam = st.multiplier(hs)
        a_w = np.sqrt(w)[:, None] * a
        value = float(e.sum()) if objective == "rms" else float(e.max())
        return value, dual_lower_bound(a_w, lam, m)

    best = {"bound": -math.inf}
    counters = {"iterations": 0, "evaluations": 0}

    def certified_gap() -> float:
        """Relative gap between the objective at the last point and the best dual bound."""
        value, bound = certify()
        if bound is not None and bound > best["bound"]:
            best["bound"] = bound
        return (value - best["bound"]) / value

    recent: list[float] = []

    def stop(x, f, it):
        counters["iterations"] += 1
        recent.append(f)
        if it % 10 != 0:
            return False
        # the dual certificate costs an eigendecomposition: skip it while the objective still
        # falls by more than 10 tol per 10 iterations (the gap cannot be below tol for long then)
        if len(recent) > 10 and recent[-11] - f > 10.0 * tol * abs(f):
            return False
        gap = certified_gap()
        if gap < 1.0:
            frac = min(1.0, math.log(max(gap, 1e-12)) / math.log(tol))
            report_progress(progress, frac, f"dense n={n}: gap {gap:.1e}")
        return gap <= tol

    report_progress(progress, 0.0, f"dense n={n}")
    x = x0
    if objective == "rms":
        taus = [None]
    else:
        scale = float(per_query(st.gram(x0))[0].max())
        taus = [eta * scale for eta in (1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5)]
    reason = "max_iter"
    if objective == "rms" and not st.cyclic and st.band is None:
        # single participation: dual fixed point (few eigendecompositions), L-BFGS only polishes
        m_fp, bound_fp, fp_iters = dual_fixed_point(a, m0, tol, progress=progress)
        counters["fixed_point_iterations"] = fp_iters
        if bound_fp is not None:
            best["bound"] = max(best["bound"], bound_fp)
        if m_fp is not None:
            x = st.pack(m_fp)
    for tau in taus:
        f_start, _ = fun(x, tau)
        counters["evaluations"] += 1
        if math.isfinite(f_start) and certified_gap() <= tol:
            reason = "certified"
            break
        res = lbfgs(lambda z, tau=tau: fun(z, tau), x, max_iter=max_iter, stop=stop, rel_tol=1e-13, memory=10)
        x = res.x
        counters["evaluations"] += res.evaluations
        reason = res.reason
        fun(x, tau)
        gap = certified_gap()
        if gap <= tol:
            reason = "certified"
            break
    value, _ = certify()
    bound = best["bound"] if math.isfinite(best["bound"]) else None
    m = st.gram(x)
    c = reverse_cholesky(m)
    if st.band is not None:
        i, j = np.indices((n, n))
        c = np.where(i - j < st.band, c, 0.0)
    c = check_strategy_matrix(c)
    strategy: Strategy = Banded.from_matrix(c, st.band) if st.band is not None else Dense(c)
    report_progress(progress, 1.0, f"dense n={n}: done")
    if info is not None:
        info.update(
            iterations=counters["iterations"], evaluations=counters["evaluations"],
            fixed_point_iterations=counters.get("fixed_point_iterations", 0), objective_value=value,
            lower_bound=bound, gap=None if bound is None else (value - bound) / value,
            reason=reason, seconds=time.perf_counter() - t0,
        )
    return strategy


__all__ = ["MAX_DENSE_N", "dual_lower_bound", "optimize_dense", "sqrt_coefficients", "warm_start"]
