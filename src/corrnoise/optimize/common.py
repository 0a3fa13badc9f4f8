"""Shared pieces of the strategy optimizers (layer 4): validation, L-BFGS, warm starts, checks.

Everything here is float64. The optimizers never report their internal objective: the loss of a
returned strategy is always recomputed by :func:`corrnoise.losses.loss_report`.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Callable

import numpy as np
from scipy import linalg as sla

from ..errors import CorrnoiseError, check_int
from ..participation import Cyclic, MinSep, Participation, parse_participation
from ..workloads import Workload, parse_workload, prefix

OBJECTIVES = ("rms", "max")

#: ``progress(done_fraction, message)``; the command line turns it into a rich progress bar.
Progress = Callable[[float, str], None]


# ------------------------------------------------------------------------------ validation


def check_objective(objective) -> str:
    """``rms`` or ``max`` (tutorial Def. 2.23 / Def. 2.3), else CorrnoiseError('objective')."""
    if not isinstance(objective, str) or objective.strip().lower() not in OBJECTIVES:
        raise CorrnoiseError("objective", f"must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    return objective.strip().lower()


def check_workload(workload) -> Workload:
    """A Workload, or a spec string for :func:`corrnoise.workloads.parse_workload`."""
    if workload is None:
        return prefix()
    if isinstance(workload, Workload):
        return workload
    return parse_workload(workload)


def check_problem(n, participation, objective, workload) -> tuple[int, Participation, str, Workload]:
    """Validate the arguments shared by every optimizer."""
    n = check_int("n", n, minimum=1)
    schema = parse_participation(participation if participation is not None else "single")
    schema.validate(n)
    return n, schema, check_objective(objective), check_workload(workload)


def check_progress(progress):
    """None or a callable (the BLT and Toeplitz optimizers call it as ``progress(iteration, loss)``)."""
    if progress is not None and not callable(progress):
        raise CorrnoiseError("progress", f"must be a callable(iteration, loss) or None, got {progress!r}")
    return progress


def check_bands(bands, n: int, schema: Participation) -> int:
    """``1 <= bands <= n``; with cyclic / min-sep participation also ``bands <= b`` (the
    separation), the condition under which a column-normalized banded strategy has
    sensitivity sqrt(k) whatever its signs (tutorial Lemma 3.16(b))."""
    bands = check_int("bands", bands, minimum=1)
    if bands > n:
        raise CorrnoiseError("bands", f"must be <= n = {n}, got {bands}")
    if isinstance(schema, (Cyclic, MinSep)) and schema.k > 1 and bands > schema.b:
        raise CorrnoiseError(
            "bands",
            f"must be <= the participation separation b = {schema.b} for {schema.spec} (got {bands}); "
            f"use --bands {schema.b} or fewer",
        )
    return bands


# ------------------------------------------------------------------------------ closed forms


def series_sqrt(a: np.ndarray, m: int) -> np.ndarray:
    """First ``m`` coefficients of the power-series square root of ``a`` (a_0 > 0).

    The Toeplitz matrix with this first column squares to the Toeplitz workload A (tutorial
    Thm 2.5 for A_pre, where it gives 4^-t binom(2t, t); used as the initializer for any
    Toeplitz workload); s_0 = sqrt(a_0), s_k = (a_k - sum_{j=1}^{k-1} s_j s_{k-j}) / (2 s_0),
    the coefficient identity of s(x)^2 = a(x). Coefficients of ``a`` past its end count as 0
    (a polynomial a(x)). O(m^2).
    """
    a = np.asarray(a, dtype=np.float64)
    if a.size == 0 or not a[0] > 0.0:
        raise CorrnoiseError("workload", "the workload's first coefficient must be positive")
    s = np.zeros(m)
    s[0] = math.sqrt(a[0])
    for k in range(1, m):
        ak = a[k] if k < a.size else 0.0
        s[k] = (ak - float(np.dot(s[1:k], s[k - 1 : 0 : -1]))) / (2.0 * s[0])
    return s


def reverse_cholesky(m: np.ndarray) -> np.ndarray:
    """Lower-triangular C with positive diagonal and C^T C = M (tutorial Problem 4.3 step (ii)).

    With J the exchange matrix and J M J = L L^T (ordinary Cholesky), C = J L^T J.
    Raises CorrnoiseError when M is not numerically positive definite.
    """
    try:
        lower = sla.cholesky(m[::-1, ::-1], lower=True, check_finite=True)
    except (sla.LinAlgError, ValueError):
        raise CorrnoiseError("strategy", "the optimized Gram matrix is not positive definite") from None
    return np.ascontiguousarray(lower.T[::-1, ::-1])


# ------------------------------------------------------------------------------ validity


def check_strategy_matrix(c: np.ndarray) -> np.ndarray:
    """Refuse anything but a finite lower-triangular C with a positive diagonal."""
    c = np.asarray(c, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] != c.shape[1]:
        raise CorrnoiseError("strategy", f"optimizer produced a non-square matrix {c.shape}")
    if not np.all(np.isfinite(c)):
        raise CorrnoiseError("strategy", "optimizer produced non-finite entries; try fewer steps or bands")
    if np.any(np.triu(c, 1) != 0.0):
        raise CorrnoiseError("strategy", "optimizer produced a matrix that is not lower-triangular")
    if np.any(np.diagonal(c) <= 0.0):
        raise CorrnoiseError("strategy", "optimizer produced a non-positive diagonal entry")
    return c


def check_band(band: np.ndarray) -> np.ndarray:
    """Same checks for the band storage band[t, j] = C[t, t - j] (diagonal = column 0)."""
    band = np.asarray(band, dtype=np.float64)
    if not np.all(np.isfinite(band)):
        raise CorrnoiseError("strategy", "optimizer produced non-finite entries; try fewer bands")
    if np.any(band[:, 0] <= 0.0):
        raise CorrnoiseError("strategy", "optimizer produced a non-positive diagonal entry")
    return band


# ------------------------------------------------------------------------------ L-BFGS


class LBFGSResult:
    def __init__(self, x, f, iterations, evaluations, reason):
        self.x, self.f, self.iterations, self.evaluations, self.reason = x, f, iterations, evaluations, reason


def lbfgs(
    fun: Callable[[np.ndarray], tuple[float, np.ndarray]],
    x0: np.ndarray,
    max_iter: int = 1000,
    memory: int = 20,
    rel_tol: float = 1e-12,
    stall_iters: int = 5,
    stop: Callable[[np.ndarray, float, int], bool] | None = None,
) -> LBFGSResult:
    """Limited-memory BFGS with a backtracking (Armijo) line search (Nocedal & Wright Alg. 7.4/7.5).

    ``fun(x)`` returns ``(f, grad)``; an infeasible point (e.g. a Gram matrix that is not
    positive definite, tutorial Fig. 4.2) returns ``f = inf`` and the step is shortened, so the
    iterates never leave the feasible region. Stops after ``max_iter`` iterations, when the
    relative decrease stays below ``rel_tol`` for ``stall_iters`` iterations, when no descent
    step is found, or when ``stop(x, f, iteration)`` returns True (a duality-gap certificate).
    """
    x = np.array(x0, dtype=np.float64)
    f, g = fun(x)
    evals = 1
    if not math.isfinite(f):
        raise CorrnoiseError("strategy", "the optimizer's starting point is infeasible")
    s_hist: list[np.ndarray] = []
    y_hist: list[np.ndarray] = []
    rho_hist: list[float] = []
    stalled = 0
    reason = "max_iter"
    it = 0
    for it in range(1, max_iter + 1):
        # two-loop recursion: d = -H g
        q = g.copy()
        alphas = []
        for s, y, rho in zip(reversed(s_hist), reversed(y_hist), reversed(rho_hist)):
            a = rho * float(np.dot(s, q))
            alphas.append(a)
            q -= a * y
        if s_hist:
            gamma = float(np.dot(s_hist[-1], y_hist[-1]) / np.dot(y_hist[-1], y_hist[-1]))
        else:
            gnorm = float(np.linalg.norm(g))
            gamma = 1.0 / gnorm if gnorm > 0 else 1.0
            gamma *= min(1.0, 0.1 * max(1.0, float(np.linalg.norm(x))))
        q *= gamma
        for (s, y, rho), a in zip(zip(s_hist, y_hist, rho_hist), reversed(alphas)):
            b = rho * float(np.dot(y, q))
            q += (a - b) * s
        d = -q
        slope = float(np.dot(g, d))
        if slope >= 0:  # not a descent direction: restart from steepest descent
            s_hist.clear(), y_hist.clear(), rho_hist.clear()
            d = -g * gamma
            slope = float(np.dot(g, d))
            if slope >= 0:
                reason = "zero_gradient"
                break
        step = 1.0
        accepted = False
        for _ in range(40):
            x_new = x + step * d
            f_new, g_new = fun(x_new)
            evals += 1
            if math.isfinite(f_new) and f_new <= f + 1e-4 * step * slope:
                accepted = True
                break
            step *= 0.5 if math.isfinite(f_new) else 0.25
        if not accepted:
            reason = "line_search"
            break
        s_vec, y_vec = x_new - x, g_new - g
        sy = float(np.dot(s_vec, y_vec))
        if sy > 1e-12 * float(np.dot(y_vec, y_vec)):
            s_hist.append(s_vec), y_hist.append(y_vec), rho_hist.append(1.0 / sy)
            if len(s_hist) > memory:
                s_hist.pop(0), y_hist.pop(0), rho_hist.pop(0)
        decrease = (f - f_new) / max(abs(f), 1e-300)
        x, f, g = x_new, f_new, g_new
        stalled = stalled + 1 if decrease < rel_tol else 0
        if stop is not None and stop(x, f, it):
            reason = "certified"
            break
        if stalled >= stall_iters:
            reason = "stalled"
            break
    return LBFGSResult(x, f, it, evals, reason)


@contextlib.contextmanager
def blas_threads(threads: int | None):
    """Limit BLAS/LAPACK (threadpoolctl, shipped with scikit-learn) and torch intra-op threads
    inside the block; restored afterwards."""
    if threads is None:
        yield
        return
    torch = sys.modules.get("torch")
    torch_threads = torch.get_num_threads() if torch is not None else None
    try:
        from threadpoolctl import threadpool_limits

        limiter = threadpool_limits(limits=int(threads), user_api="blas")
    except ImportError:  # pragma: no cover - scikit-learn pulls it in
        limiter = contextlib.nullcontext()
    try:
        if torch is not None:
            torch.set_num_threads(int(threads))
        with limiter:
            yield
    finally:
        if torch is not None:
            torch.set_num_threads(torch_threads)


def report_progress(progress: Progress | None, fraction: float, message: str) -> None:
    if progress is not None:
        progress(min(max(fraction, 0.0), 1.0), message)


def designed_for(schema: Participation, objective: str, workload: Workload) -> dict:
    return {"participation": schema.spec, "objective": objective, "workload": workload.spec}


__all__ = [
    "OBJECTIVES", "Progress", "blas_threads", "check_bands", "check_objective", "check_progress", "check_problem", "check_workload",
    "check_band", "check_strategy_matrix", "designed_for", "lbfgs", "reverse_cholesky", "series_sqrt",
]
