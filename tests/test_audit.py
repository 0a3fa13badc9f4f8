"""Issue #28: empirical privacy auditing. Statistics against independent computations
(scipy.stats.beta / binom, brute force, simulation with known epsilon), the white-box canary path
of make_private, sensitivity to four broken noise paths, soundness on correct runs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.stats import beta, binom

from corrnoise.accounting import gaussian_epsilon, gaussian_mu
from corrnoise.audit import (AuditResult, clopper_pearson, clopper_pearson_upper, epsilon_from_rates, gdp_estimate,
                             many_run_audit, many_run_audit_features, one_run_audit, one_run_epsilon_lower,
                             one_run_p_value, roc_auc, tpr_at_fpr)
from corrnoise.errors import CorrnoiseError


# --- statistics -------------------------------------------------------------------------------
@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (10, 10), (7, 1000), (500, 1000)])
def test_clopper_pearson_matches_beta_quantiles_and_binomial_tails(k, n):
    lo, hi = clopper_pearson(k, n, 0.95)
    assert lo == (0.0 if k == 0 else pytest.approx(beta.ppf(0.025, k, n - k + 1), rel=1e-9))
    assert hi == (1.0 if k == n else pytest.approx(beta.ppf(0.975, k + 1, n - k), rel=1e-9))
    up = clopper_pearson_upper(k, n, 0.05)
    if k < n:  # defining property: P[Bin(n, p_hi) <= k] = alpha
        assert binom.cdf(k, n, up) == pytest.approx(0.05, rel=1e-6)
    if k > 0:
        assert binom.sf(k - 1, n, lo) == pytest.approx(0.025, rel=1e-6)


def test_epsilon_from_rates_inverts_randomized_response():
    for eps in (0.5, 1.0, 3.0):
        q = 1 / (1 + math.exp(eps))  # RR: FPR = FNR = 1/(1+e^eps), exactly eps-DP
        assert epsilon_from_rates(q, q, 0.0) == pytest.approx(eps, rel=1e-12)
        assert epsilon_from_rates(q, q, 0.01) < eps
    assert epsilon_from_rates(0.5, 0.5, 0.0) == 0.0 and epsilon_from_rates(0.0, 0.0, 0.0) == math.inf


def test_auc_and_tpr_at_fpr_against_brute_force():
    rng = np.random.default_rng(1)
    a, b = np.round(rng.normal(1, 1, 300), 1), np.round(rng.normal(0, 1, 400), 1)  # with ties
    brute = (np.sum(a[:, None] > b[None, :]) + 0.5 * np.sum(a[:, None] == b[None, :])) / (a.size * b.size)
    assert roc_auc(a, b) == pytest.approx(brute, rel=1e-12)
    row = tpr_at_fpr(a, b, 0.01)
    assert row["fpr"] <= 0.01 and row["tpr"] == np.mean(a > row["threshold"]) and row["resolved"]
    assert not tpr_at_fpr(a, b, 1e-3)["resolved"]


def _rr_scores(rng, eps, n):
    p_in = 1 / (1 + math.exp(-eps))
    return (rng.random(n) < p_in).astype(float), (rng.random(n) < 1 - p_in).astype(float)


def test_many_run_bound_covers_randomized_response_where_the_point_estimate_does_not():
    """Randomized response is exactly eps-DP and the threshold test is optimal, so a bound without
    intervals exceeds eps about half the time; the Clopper-Pearson bound at 95% must not exceed
    it in more than 5% of 200 trials (binomial slack: <= 18 of 200)."""
    rng, eps, n, trials = np.random.default_rng(7), 1.0, 20000, 200
    over = naive_over = 0
    for trial in range(trials):
        s_in, s_out = _rr_scores(rng, eps, n)
        res = many_run_audit(s_in, s_out, delta=0.0, seed=trial)
        over += res.epsilon_lower > eps
        naive_over += epsilon_from_rates(np.mean(s_out > 0), np.mean(s_in <= 0), 0.0) > eps
        assert res.epsilon_lower > 0.9 * eps  # and it is sharp here
    assert over <= 18 and naive_over >= 60


def test_many_run_gaussian_bound_below_truth_and_estimate_labelled():
    rng, mu = np.random.default_rng(3), 1.5
    res = many_run_audit(rng.normal(mu, 1, 3000), rng.normal(0, 1, 3000), delta=1e-5)
    true = gaussian_epsilon(1e-5, mu)
    assert 0 < res.epsilon_lower < true
    est = res.extras["gdp_estimate"]
    assert est["kind"] == "estimate" and "epsilon_lower" not in est
    assert est["epsilon_estimate"] == pytest.approx(true, rel=0.15)
    d = json.loads(json.dumps(res.to_dict()))
    assert d["kind"] == "lower_bound" and {"epsilon_lower", "confidence", "method", "canaries", "runs", "auc"} <= set(d)


def test_lda_finds_a_noise_free_difference():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(400, 4))
    feats = np.c_[z[:, 0], z[:, 0], z[:, 1:]]  # two identical noise coordinates (a reused noise row)
    f_in, f_out = feats[:200] + np.array([1, 0, 0, 0, 0]), feats[200:]
    assert many_run_audit_features(f_in, f_out, delta=1e-5).epsilon_lower > 3.0


def test_one_run_p_value_matches_its_theorem_by_brute_force():
    m, r, v, eps, delta = 200, 60, 45, 0.7, 1e-4
    q = math.exp(eps) / (1 + math.exp(eps))
    f = lambda x: binom.sf(x - 1, r, q)  # noqa: E731  P[Bin(r, q) >= x]
    want = f(v) + 2 * m * delta * max((f(v - i) - f(v)) / i for i in range(1, m + 1))
    assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(min(1.0, want), rel=1e-9)
    assert one_run_p_value(m, r, v, eps, 0.0) == pytest.approx(f(v), rel=1e-12)


def test_one_run_bound_covers_randomized_response():
    """All-guess randomized response canaries: W ~ Bin(m, e^eps/(1+e^eps)) exactly (the theorem is
    tight): the 95% bound exceeds eps in <= 5% of 300 trials (slack: <= 25) and in some (sharp)."""
    rng, eps, m = np.random.default_rng(11), 2.0, 500
    q = math.exp(eps) / (1 + math.exp(eps))
    over = sum(one_run_epsilon_lower(m, m, int(v), 0.0) > eps for v in rng.binomial(m, q, 300))
    assert 1 <= over <= 25


def test_one_run_gaussian_simulation_sound_and_positive():
    """Scores N(mu, 1) for included canaries, N(0, 1) otherwise (a Gaussian mechanism, mu-GDP per
    canary): over 20 trials the 95% bound stays below the true eps(delta) (>= 95% of trials, here
    all) and is positive for mu = 4."""
    rng, delta, m = np.random.default_rng(5), 1e-5, 1000
    for mu in (1.0, 4.0):
        true = gaussian_epsilon(delta, mu)
        lows = []
        for _ in range(20):
            inc = rng.random(m) < 0.5
            lows.append(one_run_audit(rng.normal(size=m) + mu * inc, inc, delta=delta).epsilon_lower)
        assert sum(x > true for x in lows) <= 1
        if mu == 4.0:
            assert min(lows) > 1.0


def test_results_say_what_they_are_and_bad_input_is_one_line():
    with pytest.raises(CorrnoiseError):
        AuditResult(kind="lower_bound", method="x", delta=1e-5, confidence=0.95, canaries=1, runs=2, auc=None,
                    epsilon_estimate=1.0)
    with pytest.raises(CorrnoiseError) as e:
        many_run_audit([1.0], [0.0, 1.0], delta=1e-5)
    assert e.value.param == "runs" and "\n" not in str(e.value)
    with pytest.raises(CorrnoiseError) as e:
        one_run_audit([1.0, 2.0], [True], delta=1e-5)
    assert e.value.param == "included"
    est = gdp_estimate([1.0, 2.0, 3.0], [0.0, 0.5, 1.0], delta=1e-5)
    assert est.kind == "estimate" and est.epsilon_lower is None
