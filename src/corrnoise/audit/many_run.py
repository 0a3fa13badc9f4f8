"""Many-run audit: independent runs with the canary ("in") and without ("out"), one score each.

A threshold test "score > t means in" has rates FPR (out-runs above t) and FNR (in-runs at or
below t). Clopper-Pearson upper bounds at level alpha/2 each (a union bound over the two rates)
hold together with probability >= 1 - alpha, and (HT-eps) of :mod:`.stats` turns them into a lower
bound on eps at delta.

Choosing t on the same scores would void the intervals. Correction used here: **sample
splitting**. The in- and out-runs are each shuffled (seeded) and cut in two; the threshold (and,
for :func:`many_run_audit_features`, the linear score itself) is chosen on the *selection* part
only, and the rates are counted on the *evaluation* part, which is independent of that choice.
Only the runs' independence is assumed, nothing about the score distributions.

The GDP fit (:func:`gdp_estimate`) assumes Gaussian scores with equal variance: it is reported
with ``kind="estimate"`` and never as a bound.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import betaincinv

from ..errors import CorrnoiseError, check_finite_array, check_int, check_real
from .result import AuditResult
from .stats import (auc_interval, clopper_pearson_upper, epsilon_from_rates, gdp_mu_from_scores, roc_auc,
                    tpr_at_fpr)

__all__ = ["fit_linear_score", "gdp_estimate", "many_run_audit", "many_run_audit_features", "split_runs"]


def _check_common(delta, confidence, select_fraction):
    delta = check_real("delta", delta, low=0.0, high=1.0, high_open=True)
    confidence = check_real("confidence", confidence, low=0.0, high=1.0, low_open=True, high_open=True)
    select_fraction = check_real("select_fraction", select_fraction, low=0.0, high=1.0, low_open=True,
                                 high_open=True)
    return delta, confidence, select_fraction


def split_runs(n: int, select_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(selection indices, evaluation indices) of a seeded random split of n runs; both non-empty."""
    n = check_int("runs", n, minimum=2)
    k = min(max(int(round(select_fraction * n)), 1), n - 1)
    order = rng.permutation(n)
    return np.sort(order[:k]), np.sort(order[k:])


def _upper_vec(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """clopper_pearson_upper for an array of counts (1 where k = n)."""
    k = np.asarray(k)
    out = np.ones(k.shape, dtype=float)
    ok = k < n
    out[ok] = betaincinv(k[ok] + 1.0, n - k[ok], 1.0 - alpha)
    return out


def _eps_vec(fpr_hi: np.ndarray, fnr_hi: np.ndarray, delta: float) -> np.ndarray:
    """(HT-eps) of :mod:`.stats` for arrays of rate bounds (0 where nothing is excluded)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(1 - delta - fnr_hi > 0, np.log(np.maximum(1 - delta - fnr_hi, 1e-300) / fpr_hi), 0.0)
        b = np.where(1 - delta - fpr_hi > 0, np.log(np.maximum(1 - delta - fpr_hi, 1e-300) / fnr_hi), 0.0)
    return np.maximum(np.maximum(a, b), 0.0)


def choose_threshold(sel_in: np.ndarray, sel_out: np.ndarray, delta: float, alpha: float) -> float:
    """The threshold (among the selection scores) whose (HT-eps) bound *on the selection runs* is
    largest: the selection step of the split; its value is no privacy number."""
    cands = np.unique(np.concatenate([sel_in, sel_out]))
    s_out, s_in = np.sort(sel_out), np.sort(sel_in)
    fp = s_out.size - np.searchsorted(s_out, cands, side="right")
    fn = np.searchsorted(s_in, cands, side="right")
    eps = _eps_vec(_upper_vec(fp, s_out.size, alpha / 2), _upper_vec(fn, s_in.size, alpha / 2), delta)
    return float(cands[int(np.argmax(eps))])


def _audit_split(sel_in, sel_out, ev_in, ev_out, *, delta, confidence, method, all_in, all_out,
                 runs, extras) -> AuditResult:
    alpha = 1.0 - confidence
    t = choose_threshold(sel_in, sel_out, delta, alpha)
    fp, fn = int(np.sum(ev_out > t)), int(np.sum(ev_in <= t))
    fpr_hi = clopper_pearson_upper(fp, ev_out.size, alpha / 2)
    fnr_hi = clopper_pearson_upper(fn, ev_in.size, alpha / 2)
    eps_lo = epsilon_from_rates(fpr_hi, fnr_hi, delta)
    auc = roc_auc(all_in, all_out)
    # eps(0) of mu-GDP is infinite: no GDP estimate at delta = 0
    estimate = gdp_estimate(all_in, all_out, delta=delta, runs=runs).to_dict() if delta > 0 else None
    return AuditResult(
        kind="lower_bound", method=method, delta=delta, confidence=confidence, canaries=1, runs=runs, auc=auc,
        epsilon_lower=eps_lo,
        extras={"threshold": t, "selection": "split", "runs_in": int(all_in.size), "runs_out": int(all_out.size),
                "evaluated_in": int(ev_in.size), "evaluated_out": int(ev_out.size), "false_positives": fp,
                "false_negatives": fn, "fpr_upper": fpr_hi, "fnr_upper": fnr_hi,
                "auc_interval": list(auc_interval(auc, all_in.size, all_out.size, confidence)),
                "tpr_at_fpr": {str(f): tpr_at_fpr(all_in, all_out, f, confidence) for f in (1e-2, 1e-3)},
                "gdp_estimate": estimate, **extras}, scores=(all_in, all_out))


def many_run_audit(scores_in, scores_out, *, delta: float, confidence: float = 0.95, select_fraction: float = 0.5,
                   seed: int = 0, method: str = "many-run threshold") -> AuditResult:
    """A lower bound on eps at ``delta``, valid with probability >= ``confidence``, from the
    scores of independent runs with (``scores_in``) and without (``scores_out``) the canary.

    The threshold is chosen on a ``select_fraction`` of each (seeded shuffle, ``seed``) and the
    Clopper-Pearson bounds on FPR and FNR (alpha/2 each) are taken on the rest (module
    docstring). ``extras`` holds the counts, the AUC interval, TPR at FPR 1e-2 / 1e-3 and the GDP
    fit (``kind: "estimate"``)."""
    delta, confidence, select_fraction = _check_common(delta, confidence, select_fraction)
    s_in = check_finite_array("scores_in", scores_in, ndim=1)
    s_out = check_finite_array("scores_out", scores_out, ndim=1)
    if s_in.size < 2 or s_out.size < 2:
        raise CorrnoiseError("runs", "needs at least 2 runs with and 2 without the canary (one of each to choose "
                             "the threshold, one to evaluate it)")
    rng = np.random.default_rng(check_int("seed", seed, minimum=0))
    si, ei = split_runs(s_in.size, select_fraction, rng)
    so, eo = split_runs(s_out.size, select_fraction, rng)
    return _audit_split(s_in[si], s_out[so], s_in[ei], s_out[eo], delta=delta, confidence=confidence,
                        method=method, all_in=s_in, all_out=s_out, runs=s_in.size + s_out.size, extras={})


def fit_linear_score(features_in, features_out, ridge: float = 1e-6) -> np.ndarray:
    """Fisher's linear discriminant w = (Sigma + ridge tr(Sigma)/d I)^-1 (mean_in - mean_out) with
    Sigma the pooled covariance: the likelihood-ratio direction when the runs' features are
    Gaussian with a common covariance (it learns the noise's correlations, a reused noise row
    included). Fit on selection runs only; any w gives a valid audit on other runs."""
    f_in = check_finite_array("features_in", features_in, ndim=2)
    f_out = check_finite_array("features_out", features_out, ndim=2)
    if f_in.shape[1] != f_out.shape[1]:
        raise CorrnoiseError("features", f"in-runs have {f_in.shape[1]} features, out-runs {f_out.shape[1]}")
    d = f_in.shape[1]
    centred = np.concatenate([f_in - f_in.mean(0), f_out - f_out.mean(0)])
    sigma = centred.T @ centred / max(centred.shape[0] - 2, 1)
    sigma += (ridge * max(np.trace(sigma) / d, 1e-300)) * np.eye(d)
    return np.linalg.solve(sigma, f_in.mean(0) - f_out.mean(0))


def many_run_audit_features(features_in, features_out, *, delta: float, confidence: float = 0.95,
                            select_fraction: float = 0.5, seed: int = 0, ridge: float = 1e-6,
                            method: str = "many-run linear discriminant") -> AuditResult:
    """:func:`many_run_audit` on a score learned from the runs: the linear discriminant
    (:func:`fit_linear_score`) of the selection runs' feature vectors (e.g. the released updates
    along the canary direction, one entry per step), then the threshold on the same selection
    runs, then Clopper-Pearson on the evaluation runs, which took part in neither choice."""
    delta, confidence, select_fraction = _check_common(delta, confidence, select_fraction)
    f_in = check_finite_array("features_in", features_in, ndim=2)
    f_out = check_finite_array("features_out", features_out, ndim=2)
    if f_in.shape[0] < 3 or f_out.shape[0] < 3:
        raise CorrnoiseError("runs", "needs at least 3 runs with and 3 without the canary")
    rng = np.random.default_rng(check_int("seed", seed, minimum=0))
    si, ei = split_runs(f_in.shape[0], select_fraction, rng)
    so, eo = split_runs(f_out.shape[0], select_fraction, rng)
    w = fit_linear_score(f_in[si], f_out[so], ridge)
    s_in, s_out = f_in @ w, f_out @ w
    return _audit_split(s_in[si], s_out[so], s_in[ei], s_out[eo], delta=delta, confidence=confidence,
                        method=method, all_in=s_in, all_out=s_out, runs=s_in.size + s_out.size, extras={})


def gdp_estimate(scores_in, scores_out, *, delta: float, runs: int | None = None,
                 canaries: int = 1) -> AuditResult:
    """The GDP-fitted *estimate* of eps at ``delta``: mu from the empirical ROC under a Gaussian
    assumption (:func:`.stats.gdp_mu_from_scores`), then eps(delta) of mu-GDP
    (:func:`corrnoise.accounting.gaussian.gaussian_epsilon`, the GDP profile). ``kind="estimate"``:
    it rests on that assumption and is no bound."""
    from ..accounting.gaussian import gaussian_epsilon

    delta = check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    s_in = check_finite_array("scores_in", scores_in, ndim=1)
    s_out = check_finite_array("scores_out", scores_out, ndim=1)
    mu = gdp_mu_from_scores(s_in, s_out)
    eps = 0.0 if not mu > 0 else gaussian_epsilon(delta, mu)
    return AuditResult(kind="estimate", method="gdp-fit (Gaussian scores assumed)", delta=delta, confidence=None,
                       canaries=canaries, runs=int(runs if runs is not None else s_in.size + s_out.size),
                       auc=roc_auc(s_in, s_out), epsilon_estimate=float(eps), extras={"gdp_mu": mu})
