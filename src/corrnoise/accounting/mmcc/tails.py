"""Probability Tail Bounds of MMCC (seed 001 Fig. 5 / Alg. 4): the conditional sampling
probabilities p~ of every (row group, column) pair.

Sharper than the paper's subroutine (issue #12; the paper, App. A, remarks that its p~ "are not
tight and can be improved"): see :func:`probability_tail_bounds` for the bound and its proof.
The binomial tail count of App. F.3 (the paper's own relaxation) is kept as
:func:`binomial_tail_count` for reference and tests."""

from __future__ import annotations

import math

import numpy as np
from scipy.special import expit, log_ndtr, logit, ndtri
from scipy.stats import binom

__all__ = ["binomial_tail_count", "probability_tail_bounds", "group_sensitivities", "mixture_tail_threshold",
           "peeling_blocks"]


def binomial_tail_count(trials: np.ndarray | int, p: float, delta_prime: float) -> np.ndarray:
    """Smallest t with Pr[Binomial(trials, p) > t] <= delta_prime (seed 001 App. F.3), elementwise."""
    trials = np.atleast_1d(np.asarray(trials, dtype=np.int64))
    if p >= 1.0:
        return trials.copy()
    t = np.ceil(np.nan_to_num(binom.isf(delta_prime, trials, p), nan=0.0)).astype(np.int64)
    t = np.clip(t, 0, trials)
    for _ in range(64):  # fix the inverse's rounding so the defining inequality holds exactly
        up = (binom.sf(t, trials, p) > delta_prime) & (t < trials)
        if not up.any():
            break
        t[up] += 1
    for _ in range(64):
        down = (t > 0) & (binom.sf(t - 1, trials, p) <= delta_prime)
        if not down.any():
            break
        t[down] -= 1
    return t


def group_sensitivities(cp: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Row-group column norms C^(b)[g, j] = ||C[rows of g, j]||_2 (seed 001 Alg. 3 line 5)."""
    if starts.size == cp.shape[0] and np.array_equal(starts, np.arange(cp.shape[0])):
        return cp.copy()
    return np.sqrt(np.add.reduceat(cp * cp, starts, axis=0))


def _column_supports(cp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    nz = cp != 0.0
    rows = cp.shape[0]
    first = np.where(nz.any(axis=0), nz.argmax(axis=0), rows)
    last = np.where(nz.any(axis=0), rows - 1 - nz[::-1].argmax(axis=0), -1)
    return first, last


_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
#: Points of the coarse search over tangent points u in [0, Phi^{-1}(1 - delta) + 0.5]
#: (the optimum lies below the Gaussian quantile: the Bernoulli part takes some of the tail).
_U_COARSE = 9
_GOLDEN_STEPS = 14


def _threshold_at(u: np.ndarray, weights: np.ndarray, log_q: float, log_1mq: float, scale: np.ndarray,
                  log_delta: float) -> np.ndarray:
    """b(u) = scale (log Phibar(u) + r u + K(r / scale) - log delta) / r, r = phi(u) / Phibar(u),
    K(lam) = sum_k log(1 - q + q e^{lam w_k}) (columns of ``weights``); u has one entry per column."""
    log_tail = log_ndtr(-u)
    r = np.exp(-0.5 * u * u - _LOG_SQRT_2PI - log_tail)
    lam = r / scale
    cgf = np.logaddexp(log_1mq, log_q + weights * lam[None, :]).sum(axis=0)
    return scale * (log_tail + r * u + cgf - log_delta) / r


def mixture_tail_threshold(weights: np.ndarray, q: float, scale: np.ndarray, delta: float) -> np.ndarray:
    """A threshold b per column k with Pr[X_k + N_k > b_k] <= delta, for X_k = sum_m weights[m, k]
    B_m (B_m i.i.d. Bernoulli(q), weights >= 0) and N_k ~ N(0, scale_k^2) independent of X_k.

    Claim: for every real u, Pr[X + N > b] <= Phibar(u) exp(K(lam) - lam x0) with x0 = b - scale u,
    lam = r(u) / scale, r(u) = phi(u) / Phibar(u) the inverse Mills ratio, K the cumulant
    generating function of X.  Proof: h(x) = Pr[N > b - x] = Phibar((b - x) / scale) is
    log-concave in x (Phibar is log-concave), so log h lies below its tangent at x0, whose slope is
    r(u) / scale: h(x) <= h(x0) e^{lam (x - x0)}; take the expectation over X (independent of N):
    Pr[X + N > b] = E h(X) <= h(x0) E e^{lam (X - x0)}.  Setting the right side to delta and
    solving for b gives b(u) = scale (log Phibar(u) + r u + K(lam) - log delta) / r; every u gives a
    valid b, and we return the smallest over a grid refined by golden-section search.  For a
    deterministic X = x the bound is exact at u = (b - x) / scale, so nothing is lost to the
    Gaussian part (the paper instead splits delta between two separate tails, and App. F.3 bounds X
    by the sum of the t largest weights).
    """
    weights = np.asarray(weights, dtype=np.float64)
    scale = np.asarray(scale, dtype=np.float64)
    k = scale.size
    if q >= 1.0:  # X is the constant sum of the weights: the exact Gaussian quantile
        return weights.sum(axis=0) - scale * float(ndtri(delta))
    log_q, log_1mq, log_delta = math.log(q), math.log1p(-q), math.log(delta)
    best = np.full(k, np.inf)
    best_u = np.zeros(k)
    grid = np.linspace(0.0, float(-ndtri(delta)) + 0.5, _U_COARSE)
    for u0 in grid:
        b = _threshold_at(np.full(k, u0), weights, log_q, log_1mq, scale, log_delta)
        better = b < best
        best[better], best_u[better] = b[better], u0
    # golden-section refinement around the best grid point (b(u) is smooth; any u stays valid)
    width = grid[1] - grid[0]
    lo, hi = np.maximum(best_u - width, 0.0), best_u + width
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, c = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa = _threshold_at(a, weights, log_q, log_1mq, scale, log_delta)
    fc = _threshold_at(c, weights, log_q, log_1mq, scale, log_delta)
    for _ in range(_GOLDEN_STEPS):
        left = fa < fc
        hi = np.where(left, c, hi)
        lo = np.where(left, lo, a)
        c_new = np.where(left, a, lo + ratio * (hi - lo))
        a_new = np.where(left, hi - ratio * (hi - lo), c)
        f_keep = np.where(left, fa, fc)
        a, c = a_new, c_new
        f_new = _threshold_at(np.where(left, a, c), weights, log_q, log_1mq, scale, log_delta)
        fa, fc = np.where(left, f_new, f_keep), np.where(left, f_keep, f_new)
        best = np.minimum(best, np.minimum(fa, fc))
    # round-off guard: any threshold above a valid b(u) is valid (the tail decreases in b)
    return best + 1e-12 * np.abs(best)


def peeling_blocks(offset: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dyadic peeling of a column's history groups: group offset e (0 = the first group with a
    history) lies in block k = floor(log2(e + 1)), i.e. blocks {0}, {1, 2}, {3..6}, {7..14}, ...;
    the block ends at offset min(2^(k+1) - 2, last).  Returns (k, end offset), elementwise."""
    offset = np.asarray(offset, dtype=np.int64)
    k = np.floor(np.log2(offset + 1.0)).astype(np.int64)
    # fix float log2 at exact powers of two
    k = np.where((1 << (k + 1)) - 1 <= offset, k + 1, k)
    k = np.where((1 << k) - 1 > offset, k - 1, k)
    end = np.minimum((1 << (k + 1)) - 2, np.asarray(last, dtype=np.int64))
    return k, end


def probability_tail_bounds(
    cp: np.ndarray,
    p: float,
    noise_std: float,
    delta1: float,
    starts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """p~ for every (row group g, column j) with C^(b)[g, j] > 0 (replaces seed 001 Fig. 5 / Alg. 4
    and App. F.3), valid simultaneously with probability >= 1 - delta1.

    ``cp`` (rows x columns, non-negative, lower-triangular in blocks), row groups starting at
    ``starts`` (default: every row, plain MMCC).  Returns (sens, q, events): the group
    sensitivities C^(b), the probabilities (same shape; 0 where sens is 0, p where the history
    is empty) and the number of bad events E in the union bound.

    What must hold (seed 001 Thm 4.3 proof, step 3; Lemma C.3): with v_gj = C[:start_g, j] and
    theta = C[:start_g] 1_S + z the earlier outputs (S the rounds the example takes part in,
    i.i.d. Bernoulli(p) under the distribution *with* the example; z ~ N(0, nu^2 I)), the
    conditional probability is at most p_gj = p e^a / (p e^a + 1 - p), a = (2 Y_gj - ||v_gj||^2)
    / (2 nu^2), Y_gj = <theta, v_gj>; so p~_gj >= p_gj for all (g, j) at once whenever
    Y_gj <= b_gj for all (g, j), and p~_gj is p_gj with Y_gj = b_gj.  Need:
    Pr[exists (g, j): Y_gj > b_gj] <= delta1.  (Under the add adjacency the bad events are
    measured without the example, where Y_gj = <z, v_gj> is stochastically smaller, C >= 0.)

    The paper's bound (Fig. 5 + F.3): b_gj = z' ||v|| nu + s_gj for *every* pair separately, a
    union bound over 2 (nnz(C) - n) events of probability delta1 / (2 (nnz(C) - n)) each: one for
    the Gaussian part at its own z', one for X = sum_j' <v_gj', v_gj> B_j' bounded by the sum of
    the t largest inner products.  Ours differs in two ways, each a valid bound:

    1. Peeling with Levy's maximal inequality (one event per block instead of per pair).  For a
       fixed column j, as g grows, the signal part X_gj = sum_j' B_j' <C[:start_g, j'], C[:start_g, j]>
       is non-decreasing (C >= 0) and the noise part N_gj = sum_{rows r < start_g} C[r, j] z_r is a
       sum of independent symmetric increments.  For a block of groups ending at g_e:
       Pr[exists g in block: Y_gj > b] <= Pr[X_{g_e j} + max_{g <= g_e} N_gj > b]
       <= 2 Pr[X_{g_e j} + N_{g_e j} > b]   (conditionally on S, Levy's inequality
       Pr[max_m S_m >= a] <= 2 Pr[S_M >= a] for sums of independent symmetric variables; z is
       independent of S).  So one threshold b per block, computed at its last group, serves the
       whole block at cost 2 x its tail.  Blocks are dyadic in the group offset
       (:func:`peeling_blocks`): E = number of (column, block) pairs with a needed pair,
       about n log2 n instead of n^2 / 2.
    2. The joint tail of X + N (one event, not two) by the log-concave tangent bound of
       :func:`mixture_tail_threshold`, with the exact cumulant generating function of X (no
       largest-t relaxation).  Each block's event gets delta1 / (2 E) (the 2 from Levy).

    Union bound over the E blocks: total failure probability <= E * 2 * delta1 / (2 E) = delta1.
    """
    rows, cols = cp.shape
    starts = np.arange(rows) if starts is None else np.asarray(starts, dtype=np.int64)
    sens = group_sensitivities(cp, starts)
    first, last = _column_supports(cp)
    q = np.where(sens > 0.0, p, 0.0)
    history = (sens > 0.0) & (first[None, :] < starts[:, None])
    if not history.any():
        return sens, q, 0
    hg, hj = np.nonzero(history)
    g0 = np.searchsorted(starts, first, side="right")  # first group with a non-empty history
    last_off = np.full(cols, -1, dtype=np.int64)
    np.maximum.at(last_off, hj, hg - g0[hj])
    block, end_off = peeling_blocks(hg - g0[hj], last_off[hj])
    end_g = g0[hj] + end_off
    keys = np.unique(hj * 64 + block)
    events = int(keys.size)
    if delta1 <= 0.0 or p >= 1.0:  # no failure probability allowed / no amplification
        q[history] = 1.0
        return sens, q, events
    delta_event = delta1 / (2.0 * events)
    # thresholds at the block ends: b[end group, column]
    thr = np.zeros((starts.size, cols))
    needed = np.zeros((starts.size, cols), dtype=bool)
    needed[end_g, hj] = True
    norm2 = np.zeros((starts.size, cols))
    gram = np.zeros((cols, cols))
    ends = np.append(starts[1:], rows)
    for g in range(starts.size):
        r0, r1 = int(starts[g]), int(ends[g])
        hist_g = np.flatnonzero(history[g])
        if hist_g.size:
            norm2[g, hist_g] = gram[hist_g, hist_g]
        cols_g = np.flatnonzero(needed[g])
        if cols_g.size:
            lb = int(first[cols_g].min())
            win = np.flatnonzero((first < r0) & (last >= lb))
            contiguous = win[-1] - win[0] + 1 == win.size
            block_w = gram[win[0]:win[-1] + 1][:, cols_g] if contiguous else gram[np.ix_(win, cols_g)]
            scale = noise_std * np.sqrt(gram[cols_g, cols_g])
            thr[g, cols_g] = mixture_tail_threshold(block_w, p, scale, delta_event)
        block_rows = cp[r0:r1]
        nzc = np.flatnonzero((block_rows != 0.0).any(axis=0))
        if nzc.size:
            lo, hi = int(nzc[0]), int(nzc[-1]) + 1
            x = block_rows[:, lo:hi]
            gram[lo:hi, lo:hi] += x.T @ x
    b = thr[end_g, hj]
    a = (2.0 * b - norm2[hg, hj]) / (2.0 * noise_std * noise_std)
    q[hg, hj] = expit(a + float(logit(p)))
    return sens, q, events
