"""MMCC Probability Tail Bounds after issue #12: the log-concave tangent bound for the joint tail
of (Bernoulli mixture + Gaussian), Levy peeling along each column, and the resulting p~ --
checked against enumeration of all participation patterns, simulation of the mechanism, and an
exact (quadrature) privacy curve for n = 2.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.special import expit, logit
from scipy.stats import norm

from corrnoise.accounting import mmcc as M
from corrnoise.accounting.mmcc.driver import _analysis_matrices
from corrnoise.accounting.mmcc.tails import mixture_tail_threshold, peeling_blocks


def _patterns(w: np.ndarray, q: float) -> tuple[np.ndarray, np.ndarray]:
    bits = np.array(list(itertools.product((0.0, 1.0), repeat=w.size)))
    probs = np.prod(np.where(bits == 1.0, q, 1.0 - q), axis=1)
    return bits @ w, probs


def exact_tail(w: np.ndarray, q: float, scale: float, b: float) -> float:
    """Pr[sum_m w_m B_m + N(0, scale^2) > b] by enumerating all Bernoulli patterns."""
    sums, probs = _patterns(w, q)
    return float(probs @ norm.sf((b - sums) / scale))


def exact_quantile(w: np.ndarray, q: float, scale: float, delta: float) -> float:
    """Smallest b with exact_tail(b) <= delta, by bisection."""
    sums, probs = _patterns(w, q)
    lo, hi = -1.0, float(w.sum()) + 40.0 * scale
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if float(probs @ norm.sf((mid - sums) / scale)) <= delta:
            hi = mid
        else:
            lo = mid
    return hi


# ----------------------------------------------------------------------------------------------
# mixture_tail_threshold: valid (tail <= delta) and tight (tail >= delta / 3) against enumeration
# ----------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), m=st.integers(1, 7), q=st.sampled_from([0.01, 0.1, 0.4, 0.8]),
       log_delta=st.sampled_from([-3.0, -7.0, -12.0]), spread=st.sampled_from([0.1, 1.0, 5.0]))
def test_mixture_tail_threshold_is_valid_and_tight(seed, m, q, log_delta, spread):
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.0, spread, (m, 3)) * (rng.uniform(size=(m, 3)) < 0.8)
    scale = rng.uniform(0.3, 3.0, 3)
    delta = 10.0**log_delta
    b = mixture_tail_threshold(w, q, scale, delta)
    for k in range(3):
        tail = exact_tail(w[:, k], q, scale[k], b[k])
        assert tail <= delta * (1 + 1e-9)
        assert tail >= delta / 3.0  # within a factor 3 of the exact quantile's probability


def test_mixture_tail_threshold_exact_without_bernoulli_part():
    scale = np.array([0.5, 1.0, 7.0])
    b = mixture_tail_threshold(np.zeros((4, 3)), 0.2, scale, 1e-9)
    # exact up to the golden-section search (never below: any tangent point gives a valid bound)
    assert np.all(b >= norm.isf(1e-9) * scale)
    np.testing.assert_allclose(b, norm.isf(1e-9) * scale, rtol=1e-7)
    w = np.array([[1.0, 2.0, 0.0], [0.5, 0.0, 3.0]])
    b = mixture_tail_threshold(w, 1.0, scale, 1e-9)  # q = 1: X is the constant sum
    np.testing.assert_allclose(b, w.sum(axis=0) + norm.isf(1e-9) * scale, rtol=1e-12)


def test_peeling_blocks_are_dyadic_and_end_at_the_last_offset():
    offsets = np.arange(40)
    for last in (0, 5, 14, 39):
        k, end = peeling_blocks(offsets[: last + 1], np.full(last + 1, last))
        for e in range(last + 1):
            kk = next(kk for kk in range(10) if 2**kk - 1 <= e <= 2 ** (kk + 1) - 2)
            assert k[e] == kk and end[e] == min(2 ** (kk + 1) - 2, last) and end[e] >= e


# ----------------------------------------------------------------------------------------------
# probability_tail_bounds against a loop implementation with exact quantiles
# ----------------------------------------------------------------------------------------------
def _brute_force_q(cp: np.ndarray, starts: np.ndarray, p: float, nu: float, delta1: float):
    """Independent loops: history groups per column, dyadic blocks, exact quantile per block end
    (enumeration + bisection), p~ = expit(logit p + (2 b - ||v||^2) / (2 nu^2))."""
    rows, cols = cp.shape
    ends = list(starts[1:]) + [rows]
    blocks = []  # (column, block end group, member groups)
    for j in range(cols):
        nz = np.flatnonzero(cp[:, j])
        if nz.size == 0:
            continue
        g0 = next((g for g in range(len(starts)) if starts[g] > nz[0]), None)
        if g0 is None:
            continue
        members = [g for g in range(g0, len(starts)) if np.any(cp[starts[g]:ends[g], j] != 0)]
        if not members:
            continue
        last = members[-1] - g0
        by_block: dict[int, list[int]] = {}
        for g in members:
            e = g - g0
            kk = int(math.floor(math.log2(e + 1)))
            by_block.setdefault(kk, []).append(g)
        for kk, gs in by_block.items():
            blocks.append((j, g0 + min(2 ** (kk + 1) - 2, last), gs))
    events = len(blocks)
    q = np.zeros((len(starts), cols))
    b_exact = {}
    for j, g_end, gs in blocks:
        hist = cp[: starts[g_end]]
        v = hist[:, j]
        w = np.array([hist[:, jp] @ v for jp in range(cols)])
        b = exact_quantile(w, p, nu * np.linalg.norm(v), delta1 / (2 * events))
        for g in gs:
            vg = cp[: starts[g], j]
            q[g, j] = expit(logit(p) + (2 * b - vg @ vg) / (2 * nu * nu))
            b_exact[g, j] = b
    return q, events, b_exact


@pytest.mark.parametrize("blocks", [1, 2])
def test_tail_bounds_dominate_exact_quantiles(blocks):
    rng = np.random.default_rng(3)
    n = 8
    c = np.tril(rng.uniform(0.1, 1.0, (n, n)))
    cp, starts = _analysis_matrices(c, blocks, 0)
    p, nu, delta1 = 0.15, 1.3, 1e-4
    sens, q, events = M.probability_tail_bounds(cp, p, nu, delta1, starts)
    q_exact, events_exact, b_exact = _brute_force_q(cp, starts, p, nu, delta1)
    assert events == events_exact
    assert events < (np.count_nonzero(cp) - cp.shape[1])  # fewer events than the paper's union
    for (g, j), b in b_exact.items():
        assert q[g, j] >= q_exact[g, j] * (1 - 1e-12)  # valid: at least the exact-quantile p~
        # tight: our threshold exceeds the exact quantile by at most 0.3 noise standard deviations
        vg = cp[: starts[g], j]
        b_ours = (2 * nu * nu * (logit(q[g, j]) - logit(p)) + vg @ vg) / 2
        assert b_ours <= b + 0.3 * nu * np.linalg.norm(cp[: starts[g], j]) + 1e-9
    no_history = (sens > 0) & (q_exact == 0)
    assert np.all(q[no_history] == p)


# ----------------------------------------------------------------------------------------------
# Simulation of the mechanism: Lemma C.3 holds and the bad event has probability <= delta1
# ----------------------------------------------------------------------------------------------
def test_bad_event_probability_and_exact_posteriors_by_simulation():
    rng = np.random.default_rng(0)
    n, p, nu, delta1 = 5, 0.3, 0.8, 0.05
    c = np.tril(rng.uniform(0.2, 1.0, (n, n)))
    _, q, _ = M.probability_tail_bounds(c, p, nu, delta1)
    trials = 100_000
    S = (rng.uniform(size=(trials, n)) < p).astype(float)
    theta = S @ c.T + nu * rng.standard_normal((trials, n))
    patterns = np.array(list(itertools.product((0.0, 1.0), repeat=n)))
    means = patterns @ c.T  # (2^n, n)
    log_prior = patterns.sum(1) * math.log(p) + (n - patterns.sum(1)) * math.log1p(-p)
    bad = np.zeros(trials, dtype=bool)
    for i in range(1, n):
        h = theta[:, :i]
        # exact posterior of the patterns given the first i outputs
        logpost = log_prior[None, :] + (2 * h @ means[:, :i].T - (means[:, :i] ** 2).sum(1)) / (2 * nu * nu)
        post = np.exp(logpost - logpost.max(axis=1, keepdims=True))
        post /= post.sum(axis=1, keepdims=True)
        for j in range(i):
            v = c[:i, j]
            p_ij = expit(logit(p) + (2 * h @ v - v @ v) / (2 * nu * nu))  # Lemma C.3
            exact = post[:, patterns[:, j] == 1].sum(axis=1)
            assert np.all(exact <= p_ij * (1 + 1e-9))
            bad |= p_ij > q[i, j]
    rate = bad.mean()
    assert rate <= delta1 + 4 * math.sqrt(delta1 / trials)
    assert rate > 0.0  # the bound is not vacuous at this failure probability


# ----------------------------------------------------------------------------------------------
# End to end: for n = 2 the exact privacy curve (2-d quadrature) is below MMCC's guarantee
# ----------------------------------------------------------------------------------------------
def densities_2d(c: np.ndarray, p: float, nu: float, step: float, span: float):
    """(h, mixture, gaussian): the Poisson mixture sum_b P(b) N(C b, nu^2 I) and N(0, nu^2 I) on a
    square grid of step ``step * nu`` covering ``span`` noise standard deviations past the means."""
    h = step * nu
    grid = np.arange(-span * nu, span * nu + c.sum() + h, h)
    x, y = np.meshgrid(grid, grid, indexing="ij")
    qd = norm.pdf(x, scale=nu) * norm.pdf(y, scale=nu)
    pd = np.zeros_like(qd)
    for bits in itertools.product((0, 1), repeat=2):
        m = c @ np.array(bits, dtype=float)
        w = np.prod([p if b else 1 - p for b in bits])
        pd += w * norm.pdf(x - m[0], scale=nu) * norm.pdf(y - m[1], scale=nu)
    return h, pd, qd


def _exact_delta_2d(c: np.ndarray, p: float, nu: float, eps: float) -> tuple[float, float]:
    h, pd, qd = densities_2d(c, p, nu, 0.025, 12)
    remove = float(np.maximum(pd - math.exp(eps) * qd, 0.0).sum() * h * h)
    add = float(np.maximum(qd - math.exp(eps) * pd, 0.0).sum() * h * h)
    return remove, add


@pytest.mark.parametrize("p,nu", [(0.3, 0.8), (0.1, 0.5)])
def test_mmcc_dominates_exact_privacy_curve_n2(p, nu):
    c = np.array([[1.0, 0.0], [0.9, 1.0]])
    delta = 1e-3
    res = M.mmcc_epsilon(c, None, p, nu, delta)
    low = M.mmcc_epsilon(c, None, p, nu, delta, lower_bound=True)
    remove, add = _exact_delta_2d(c, p, nu, res.epsilon)
    assert max(remove, add) <= delta
    assert low.epsilon <= res.epsilon
    # the exact curve's epsilon is not far below: at 0.6 * MMCC's epsilon delta already exceeds
    # the target, so the test would notice a bound that is valid only by being useless
    assert max(_exact_delta_2d(c, p, nu, 0.6 * res.epsilon)) > delta
