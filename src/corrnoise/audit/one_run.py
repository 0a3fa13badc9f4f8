"""One-run audit (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run",
arXiv:2305.08846): m canaries, each included by an independent fair coin S_i; the auditor guesses
"in" for the k+ highest scores and "out" for the k- lowest (r = k+ + k- guesses, the rest
abstain); W = number of correct guesses.

Their main theorem: if the training run is (eps, delta)-DP with respect to each canary, then for
every v

    P[W >= v] <= f(v) + 2 m delta max_{i = 1..v} (f(v - i) - f(v)) / i,                    (SNJ)

    f(v) = P[Binomial(r, q) >= v],   q = e^eps / (1 + e^eps)

(for delta = 0: W is stochastically dominated by Binomial(r, q)). (SNJ) at the observed count is
a p-value for the hypothesis "(eps, delta)-DP"; the lower bound is the largest eps rejected at
level alpha = 1 - confidence, found on a grid so that it stays valid even where (SNJ) is not
monotone in eps (:func:`one_run_epsilon_lower`).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import binom

from ..errors import CorrnoiseError, check_finite_array, check_int, check_real
from .result import AuditResult
from .stats import auc_interval, roc_auc, tpr_at_fpr

__all__ = ["one_run_audit", "one_run_epsilon_lower", "one_run_guesses", "one_run_p_value"]

#: grid step of :func:`one_run_epsilon_lower`
EPS_STEP = 1e-2


def _mrv(m, r, v):
    m = check_int("m", m, minimum=1)
    r = check_int("r", r, minimum=0, maximum=m)
    v = check_int("v", v, minimum=0, maximum=r)
    return m, r, v


def _p_values(m: int, r: int, v: int, eps: np.ndarray, delta: float) -> np.ndarray:
    """(SNJ) for an array of eps (vectorized :func:`one_run_p_value`)."""
    q = 1.0 / (1.0 + np.exp(-np.asarray(eps, dtype=float)))
    f_v = binom.sf(v - 1, r, q)  # P[Bin >= v]
    if delta > 0.0 and v >= 1:
        # f(v - i) - f(v) = P[v - i <= Bin < v] = sum_{j = v-i}^{v-1} pmf(j), i = 1..v
        j = np.arange(v - 1, -1, -1)[:, None]
        gaps = np.cumsum(binom.pmf(j, r, q[None, :]), axis=0) / np.arange(1, v + 1)[:, None]
        f_v = f_v + 2.0 * m * delta * gaps.max(axis=0)
    return np.minimum(1.0, f_v)


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """(SNJ) of the module docstring: an upper bound on P[W >= v] for an (eps, delta)-DP run with
    m fair-coin canaries and r guesses; at most 1."""
    m, r, v = _mrv(m, r, v)
    epsilon = check_real("epsilon", epsilon, low=0.0)
    delta = check_real("delta", delta, low=0.0, high=1.0)
    return float(_p_values(m, r, v, np.array([epsilon]), delta)[0])


def one_run_epsilon_lower(m: int, r: int, v: int, delta: float, confidence: float = 0.95,
                          eps_max: float = 30.0) -> float:
    """The lower bound of the one-run audit: the largest grid point eps_j (0, :data:`EPS_STEP`,
    2 EPS_STEP, ...) such that (SNJ) rejects every grid point eps_i <= eps_j at level
    1 - ``confidence``.

    Valid without monotonicity of (SNJ) in eps: if the run is eps*-DP it is eps_i-DP for the
    first grid point eps_i >= eps*, which the test rejects with probability <= alpha; reporting
    a value above eps* needs that rejection. 0 when eps = 0 is not rejected."""
    m, r, v = _mrv(m, r, v)
    alpha = 1.0 - check_real("confidence", confidence, low=0.0, high=1.0, low_open=True, high_open=True)
    delta = check_real("delta", delta, low=0.0, high=1.0)
    grid = np.arange(0.0, eps_max + EPS_STEP / 2, EPS_STEP)
    chunk = max(64, int(2e6 // max(v, 1)))
    for lo in range(0, grid.size, chunk):
        accepted = np.nonzero(_p_values(m, r, v, grid[lo: lo + chunk], delta) > alpha)[0]
        if accepted.size:
            first = lo + int(accepted[0])
            return 0.0 if first == 0 else float(grid[first - 1])
    return float(grid[-1])


def one_run_guesses(scores, k_plus: int, k_minus: int) -> np.ndarray:
    """Guesses +1 ("in") for the k+ highest scores, -1 for the k- lowest, 0 (abstain) otherwise;
    ties broken by position (stable sort), never by the coins."""
    s = check_finite_array("scores", scores, ndim=1)
    k_plus = check_int("k_plus", k_plus, minimum=0, maximum=s.size)
    k_minus = check_int("k_minus", k_minus, minimum=0, maximum=s.size - k_plus)
    order = np.argsort(s, kind="stable")
    guess = np.zeros(s.size, dtype=np.int64)
    if k_minus:
        guess[order[:k_minus]] = -1
    if k_plus:
        guess[order[s.size - k_plus:]] = 1
    return guess


def one_run_audit(scores, included, *, delta: float, confidence: float = 0.95, k_plus=None, k_minus=None,
                  runs: int = 1, method: str = "one-run (Steinke-Nasr-Jagielski 2023)") -> AuditResult:
    """The one-run lower bound from canary scores and their coins (``included``: bool per canary,
    drawn by independent fair coins *before* the run).

    ``k_plus`` / ``k_minus``: numbers of "in" / "out" guesses; lists of candidates (same length)
    are tried with a Bonferroni correction (each at alpha / len) and the largest bound is
    reported. Default: k+ in {1, 2, 5, 10, 20, 50}% of m, k- = 0."""
    s = check_finite_array("scores", scores, ndim=1)
    inc = np.asarray(included)
    if inc.shape != s.shape or inc.dtype != bool:
        raise CorrnoiseError("included", f"must be a bool array of the scores' shape {s.shape}")
    m = s.size
    delta = check_real("delta", delta, low=0.0, high=1.0, high_open=True)
    confidence = check_real("confidence", confidence, low=0.0, high=1.0, low_open=True, high_open=True)
    if k_plus is None:
        k_plus = sorted({max(1, int(round(f * m))) for f in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)})
        k_minus = [0] * len(k_plus) if k_minus is None else k_minus
    kp = list(np.atleast_1d(k_plus))
    km = list(np.atleast_1d(0 if k_minus is None else k_minus))
    if len(km) == 1 and len(kp) > 1:
        km = km * len(kp)
    if len(kp) != len(km):
        raise CorrnoiseError("k_minus", f"give as many candidates as k_plus ({len(kp)}), got {len(km)}")
    tries = len(kp)
    per_try = 1.0 - (1.0 - confidence) / tries
    best, best_at = 0.0, None
    for a, b in zip(kp, km):
        guess = one_run_guesses(s, int(a), int(b))
        r = int(np.sum(guess != 0))
        v = int(np.sum((guess == 1) & inc) + np.sum((guess == -1) & ~inc))
        eps = one_run_epsilon_lower(m, r, v, delta, per_try)
        if best_at is None or eps > best:
            best, best_at = eps, {"k_plus": int(a), "k_minus": int(b), "guesses": r, "correct": v}
    s_in, s_out = s[inc], s[~inc]
    auc = roc_auc(s_in, s_out) if s_in.size and s_out.size else None
    extras = {"included": int(inc.sum()), "candidates_tried": tries, "bonferroni_confidence_each": per_try,
              **best_at}
    if auc is not None:
        extras["auc_interval"] = list(auc_interval(auc, s_in.size, s_out.size, confidence))
        extras["tpr_at_fpr"] = {str(f): tpr_at_fpr(s_in, s_out, f, confidence) for f in (1e-2, 1e-3)}
    return AuditResult(kind="lower_bound", method=method, delta=delta, confidence=confidence, canaries=m,
                       runs=int(runs), auc=auc, epsilon_lower=best, extras=extras, scores=(s_in, s_out))
