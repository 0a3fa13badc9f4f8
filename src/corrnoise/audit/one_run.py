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

__all__ = ["one_run_audit", "one_run_epsilon_lower", "one_run_gdp_p_value", "one_run_guesses", "one_run_mu_lower",
           "one_run_p_value"]

#: grid step of :func:`one_run_epsilon_lower`
EPS_STEP = 1e-2
#: grid step of :func:`one_run_mu_lower` and the eps at which (SNJ-GDP) is evaluated
MU_STEP = 1e-2
GDP_EPS_GRID = np.arange(0.0, 30.0 + 1e-9, 0.05)


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


def _p_values_profile(m: int, r: int, v: int, eps: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """(SNJ) at (eps_j, delta_j) pairs."""
    q = 1.0 / (1.0 + np.exp(-eps))
    f_v = binom.sf(v - 1, r, q)
    if v >= 1:
        j = np.arange(v - 1, -1, -1)[:, None]
        gaps = np.cumsum(binom.pmf(j, r, q[None, :]), axis=0) / np.arange(1, v + 1)[:, None]
        f_v = f_v + 2.0 * m * delta * gaps.max(axis=0)
    return np.minimum(1.0, f_v)


def one_run_gdp_p_value(m: int, r: int, v: int, mu: float, eps_grid: np.ndarray = GDP_EPS_GRID) -> float:
    """A p-value for "the run is mu-GDP with respect to each canary" (GDP refinement):

        min_{eps in grid} (SNJ)(eps, delta_mu(eps))                                       (SNJ-GDP)

    mu-GDP implies (eps, delta_mu(eps))-DP for *every* eps >= 0, with the Gaussian profile
    delta_mu(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) (Dong, Roth & Su 2022,
    Cor. 2.13), so each term bounds P[W >= v] by (SNJ) and so does their minimum. It uses the
    whole trade-off curve instead of one (eps, delta) point, which is the idea of the f-DP
    one-run audit of Mahloujifar et al. (2024); their sharper recursive bound is not
    implemented. Nondecreasing in mu (delta_mu(eps) grows with mu)."""
    from ..accounting.gaussian import gaussian_delta

    m, r, v = _mrv(m, r, v)
    mu = check_real("mu", mu, low=0.0)
    if mu == 0.0:
        return 1.0
    eps = np.asarray(eps_grid, dtype=float)
    delta = np.array([gaussian_delta(float(e), mu) for e in eps])
    return float(_p_values_profile(m, r, v, eps, delta).min())


def one_run_mu_lower(m: int, r: int, v: int, confidence: float = 0.95, mu_max: float = 20.0) -> float:
    """Lower bound on the GDP parameter of the run (kind ``lower_bound``, whatever the mechanism):
    the largest grid point mu_j (step :data:`MU_STEP`) that (SNJ-GDP) rejects at level
    1 - ``confidence``. (SNJ-GDP) is nondecreasing in mu, so every mu <= mu_j is rejected too and
    a bisection finds mu_j; if the run is mu*-GDP, mu_j > mu* needs (SNJ-GDP) at mu* <= alpha,
    which has probability <= alpha. 0 when no mu > 0 is rejected. Not a bound on eps(delta):
    turning mu into eps assumes the run's trade-off curve is Gaussian (an estimate)."""
    m, r, v = _mrv(m, r, v)
    alpha = 1.0 - check_real("confidence", confidence, low=0.0, high=1.0, low_open=True, high_open=True)
    lo, hi = 0, int(round(mu_max / MU_STEP))  # invariant: grid lo is rejected (or 0), grid hi + 1 is not known
    if one_run_gdp_p_value(m, r, v, MU_STEP) > alpha:
        return 0.0
    lo = 1
    if one_run_gdp_p_value(m, r, v, hi * MU_STEP) <= alpha:
        return hi * MU_STEP
    while hi - lo > 1:  # lo rejected, hi accepted
        mid = (lo + hi) // 2
        if one_run_gdp_p_value(m, r, v, mid * MU_STEP) <= alpha:
            lo = mid
        else:
            hi = mid
    return lo * MU_STEP


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
                  runs: int = 1, method: str = "one-run (Steinke-Nasr-Jagielski 2023)",
                  gdp: bool = False) -> AuditResult:
    """The one-run lower bound from canary scores and their coins (``included``: bool per canary,
    drawn by independent fair coins *before* the run).

    ``k_plus`` / ``k_minus``: numbers of "in" / "out" guesses; lists of candidates (same length)
    are tried with a Bonferroni correction (each at alpha / len) and the largest bound is
    reported. Default: k+ in {1, 2, 5, 10, 20, 50}% of m, k- = 0.

    ``gdp``: also the GDP refinement (:func:`one_run_mu_lower`, same candidates and Bonferroni
    split) in ``extras["gdp_lower"]``: ``mu_lower`` (kind ``lower_bound`` on the run's GDP
    parameter, valid at ``confidence`` on its own, not jointly with ``epsilon_lower``) and the eps
    at ``delta`` of that mu (kind ``estimate``: exact only for a Gaussian trade-off curve)."""
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
    if gdp:
        extras_gdp = _gdp_lower(s, inc, kp, km, per_try, delta, confidence)
    s_in, s_out = s[inc], s[~inc]
    auc = roc_auc(s_in, s_out) if s_in.size and s_out.size else None
    extras = {"included": int(inc.sum()), "candidates_tried": tries, "bonferroni_confidence_each": per_try,
              **best_at}
    if gdp:
        extras["gdp_lower"] = extras_gdp
    if auc is not None:
        extras["auc_interval"] = list(auc_interval(auc, s_in.size, s_out.size, confidence))
        extras["tpr_at_fpr"] = {str(f): tpr_at_fpr(s_in, s_out, f, confidence) for f in (1e-2, 1e-3)}
    return AuditResult(kind="lower_bound", method=method, delta=delta, confidence=confidence, canaries=m,
                       runs=int(runs), auc=auc, epsilon_lower=best, extras=extras, scores=(s_in, s_out))


def _gdp_lower(s, inc, kp, km, per_try, delta, confidence) -> dict:
    """extras["gdp_lower"] of :func:`one_run_audit`: the best :func:`one_run_mu_lower` over the
    guess candidates (each at the Bonferroni level ``per_try``)."""
    from ..accounting.gaussian import gaussian_epsilon

    best, at = 0.0, None
    for a, b in zip(kp, km):
        guess = one_run_guesses(s, int(a), int(b))
        r = int(np.sum(guess != 0))
        v = int(np.sum((guess == 1) & inc) + np.sum((guess == -1) & ~inc))
        mu = one_run_mu_lower(s.size, r, v, per_try)
        if at is None or mu > best:
            best, at = mu, {"k_plus": int(a), "k_minus": int(b)}
    eps = gaussian_epsilon(delta, best) if best > 0 and delta > 0 else 0.0
    return {"kind": "lower_bound", "quantity": "mu of mu-GDP", "mu_lower": best, "confidence": confidence,
            "method": "one-run GDP: min over eps of (SNJ) at the Gaussian delta profile", **at,
            "epsilon_if_gaussian": {"kind": "estimate", "epsilon_estimate": float(eps), "delta": delta,
                                    "assumes": "the run's trade-off curve is Gaussian (mu-GDP exactly)"}}
