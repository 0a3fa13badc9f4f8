"""Statistics of privacy auditing (torch-free): Clopper-Pearson intervals, the hypothesis-testing
bound on epsilon, ROC summaries and the Gaussian (GDP) fit.

Definitions (tutorial, seed 004, Sec. 1): a mechanism is (eps, delta)-DP iff every test of
"canary in" vs "canary out" on its output has false-positive rate FPR and false-negative rate
FNR with

    FPR + e^eps FNR >= 1 - delta   and   FNR + e^eps FPR >= 1 - delta           (HT-DP)

(Kairouz, Oh & Viswanath 2015, Thm 2.1; Dong, Roth & Su 2022, Prop. 2.4 / Wasserman & Zhou
2010). Hence from *upper* confidence bounds on the two rates of one fixed test,

    eps >= max( log((1 - delta - FNR_hi) / FPR_hi), log((1 - delta - FPR_hi) / FNR_hi) )   (HT-eps)

(the right-hand side decreases in FPR and FNR, so it stays below the true eps whenever
FPR <= FPR_hi and FNR <= FNR_hi).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import betaincinv, ndtr, ndtri

from ..errors import CorrnoiseError, check_finite_array, check_int, check_real

__all__ = [
    "auc_interval",
    "clopper_pearson",
    "clopper_pearson_upper",
    "epsilon_from_rates",
    "gdp_mu_from_scores",
    "roc_auc",
    "tpr_at_fpr",
]


def _counts(k, n) -> tuple[int, int]:
    n = check_int("n", n, minimum=1)
    k = check_int("k", k, minimum=0, maximum=n)
    return k, n


def clopper_pearson_upper(k: int, n: int, alpha: float) -> float:
    """One-sided upper 1 - alpha confidence bound on a binomial rate from k successes in n trials
    (Clopper & Pearson 1934): the p with P[Bin(n, p) <= k] = alpha, i.e. the (1 - alpha) quantile
    of Beta(k + 1, n - k); 1 when k = n."""
    k, n = _counts(k, n)
    alpha = check_real("alpha", alpha, low=0.0, high=1.0, low_open=True, high_open=True)
    if k >= n:
        return 1.0
    return float(betaincinv(k + 1, n - k, 1.0 - alpha))


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided Clopper-Pearson interval at ``confidence`` for a binomial rate (k of n):
    [Beta(k, n-k+1) quantile alpha/2, Beta(k+1, n-k) quantile 1 - alpha/2] with 0 / 1 at the ends."""
    k, n = _counts(k, n)
    confidence = check_real("confidence", confidence, low=0.0, high=1.0, low_open=True, high_open=True)
    a = (1.0 - confidence) / 2.0
    lo = 0.0 if k == 0 else float(betaincinv(k, n - k + 1, a))
    hi = 1.0 if k == n else float(betaincinv(k + 1, n - k, 1.0 - a))
    return lo, hi


def epsilon_from_rates(fpr: float, fnr: float, delta: float) -> float:
    """The largest eps that (HT-DP) excludes for a test with these rates (module docstring,
    (HT-eps)); 0 when none (the rates are those of a coin). Given *upper* bounds on the rates,
    a lower bound on eps."""
    fpr = check_real("fpr", fpr, low=0.0, high=1.0)
    fnr = check_real("fnr", fnr, low=0.0, high=1.0)
    delta = check_real("delta", delta, low=0.0, high=1.0, high_open=True)
    best = 0.0
    for a, b in ((fnr, fpr), (fpr, fnr)):
        num = 1.0 - delta - a
        if num <= 0.0:
            continue
        best = max(best, math.inf if b == 0.0 else math.log(num / b))
    return best


def _scores(name: str, x) -> np.ndarray:
    arr = check_finite_array(name, x, ndim=1)
    if arr.size == 0:
        raise CorrnoiseError(name, "needs at least one score")
    return arr


def roc_auc(scores_in, scores_out) -> float:
    """Area under the ROC curve of "higher score = canary in": the Mann-Whitney probability
    P[S_in > S_out] + P[S_in = S_out] / 2, exactly (from ranks)."""
    from scipy.stats import rankdata

    s_in, s_out = _scores("scores_in", scores_in), _scores("scores_out", scores_out)
    ranks = rankdata(np.concatenate([s_in, s_out]))
    n1, n0 = s_in.size, s_out.size
    return float((ranks[:n1].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def auc_interval(auc: float, n_in: int, n_out: int, confidence: float = 0.95) -> tuple[float, float]:
    """Approximate (normal) confidence interval for the AUC with the variance of Hanley & McNeil
    (1982, Eq. 2): [A(1-A) + (n1-1)(Q1-A^2) + (n0-1)(Q2-A^2)] / (n1 n0), Q1 = A/(2-A),
    Q2 = 2A^2/(1+A). Descriptive only: the AUC is no privacy number."""
    a = check_real("auc", auc, low=0.0, high=1.0)
    n1, n0 = check_int("n_in", n_in, minimum=1), check_int("n_out", n_out, minimum=1)
    q1, q2 = a / (2.0 - a), 2.0 * a * a / (1.0 + a)
    var = max((a * (1 - a) + (n1 - 1) * (q1 - a * a) + (n0 - 1) * (q2 - a * a)) / (n1 * n0), 0.0)
    z = float(ndtri(0.5 + confidence / 2.0))
    return max(0.0, a - z * math.sqrt(var)), min(1.0, a + z * math.sqrt(var))


def tpr_at_fpr(scores_in, scores_out, fpr: float, confidence: float = 0.95) -> dict:
    """TPR of the threshold test whose empirical FPR is the largest not above ``fpr`` (guess "in"
    for scores > threshold), with Clopper-Pearson intervals on both rates. With fewer than 1/fpr
    out-scores the threshold is the largest out-score (empirical FPR 0) and ``resolved`` is False:
    the data cannot resolve that FPR."""
    s_in, s_out = _scores("scores_in", scores_in), np.sort(_scores("scores_out", scores_out))
    fpr = check_real("fpr", fpr, low=0.0, high=1.0, low_open=True, high_open=True)
    n0, n1 = s_out.size, s_in.size
    allowed = int(math.floor(fpr * n0 + 1e-9))  # out-scores allowed above the threshold
    threshold = float(s_out[n0 - 1 - allowed]) if allowed < n0 else -math.inf
    fp = int(np.sum(s_out > threshold))
    tp = int(np.sum(s_in > threshold))
    return {"fpr_target": fpr, "threshold": threshold, "fpr": fp / n0, "tpr": tp / n1,
            "fpr_interval": list(clopper_pearson(fp, n0, confidence)),
            "tpr_interval": list(clopper_pearson(tp, n1, confidence)), "resolved": bool(allowed >= 1)}


def gdp_mu_from_scores(scores_in, scores_out, quantiles=np.linspace(0.05, 0.95, 19)) -> float:
    """mu of the Gaussian trade-off curve that fits the empirical ROC: under N(0,1) vs N(mu,1)
    scores (the mu-GDP trade-off, tutorial Def. 1.3), Phi^-1(TPR) - Phi^-1(FPR) = mu at every
    threshold; the median of that difference over thresholds at the ``quantiles`` of the
    out-scores (rates clipped to [1/(2n), 1 - 1/(2n)]). An estimate resting on that assumption."""
    s_in, s_out = _scores("scores_in", scores_in), _scores("scores_out", scores_out)
    n1, n0 = s_in.size, s_out.size
    diffs = []
    for t in np.quantile(s_out, quantiles):
        fpr = np.clip(np.mean(s_out > t), 0.5 / n0, 1 - 0.5 / n0)
        tpr = np.clip(np.mean(s_in > t), 0.5 / n1, 1 - 0.5 / n1)
        diffs.append(float(ndtri(tpr) - ndtri(fpr)))
    return float(np.median(diffs))


def gaussian_tradeoff(fpr, mu: float):
    """The mu-GDP trade-off beta(alpha) = Phi(Phi^-1(1 - alpha) - mu) (tutorial Def. 1.3)."""
    return ndtr(ndtri(1.0 - np.asarray(fpr, dtype=float)) - mu)
