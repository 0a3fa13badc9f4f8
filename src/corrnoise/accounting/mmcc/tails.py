"""Probability Tail Bounds of MMCC (seed 001 Fig. 5 / Alg. 4, App. F.3): the conditional
sampling probabilities p~ of every (row group, column) pair, and the binomial tail count of
App. F.3 bounding the inner products with the history."""

from __future__ import annotations

import math

import numpy as np
from scipy.special import expit, logit, ndtri
from scipy.stats import binom

__all__ = ["binomial_tail_count", "probability_tail_bounds", "group_sensitivities"]


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


def probability_tail_bounds(
    cp: np.ndarray,
    p: float,
    noise_std: float,
    delta1: float,
    starts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """p~ for every (row group g, column j) with C^(b)[g, j] > 0 (seed 001 Fig. 5, Alg. 4).

    ``cp`` (rows x columns, non-negative, lower-triangular in blocks) and row groups starting
    at ``starts`` (default: every row, plain MMCC).  For column j with history
    v = C[:start_g, j] != 0 (two bad events of probability delta' = delta1 / (2 E) each, E the
    number of such pairs):

        s   = sum of the t largest <C[:start_g, j'], v> over the columns j' that can overlap v,
              t = smallest count with Pr[Binomial(#columns, p) > t] <= delta'   (App. F.3)
        eps = z ||v|| / nu + (2 s - ||v||^2) / (2 nu^2),   z = Phi^{-1}(1 - delta')
        p~  = p e^eps / (p e^eps + 1 - p)

    and p~ = p where the history is empty.  Returns (sens, q, events): the group sensitivities
    C^(b), the probabilities (same shape; 0 where sens is 0) and E.
    """
    rows, cols = cp.shape
    starts = np.arange(rows) if starts is None else np.asarray(starts, dtype=np.int64)
    sens = group_sensitivities(cp, starts)
    first, last = _column_supports(cp)
    q = np.where(sens > 0.0, p, 0.0)
    history = (sens > 0.0) & (first[None, :] < starts[:, None])
    events = int(history.sum())
    if events == 0:
        return sens, q, 0
    if delta1 <= 0.0:  # no failure probability allowed: nothing can be bounded
        q[history] = 1.0
        return sens, q, events
    delta_prime = delta1 / (2.0 * events)
    z = float(-ndtri(delta_prime))
    t_table = binomial_tail_count(np.arange(cols + 1), p, delta_prime)
    log_odds = math.inf if p >= 1.0 else float(logit(p))
    gram = np.zeros((cols, cols))
    ends = np.append(starts[1:], rows)
    nu2 = noise_std * noise_std
    for g in range(starts.size):
        r0, r1 = int(starts[g]), int(ends[g])
        cols_g = np.flatnonzero(history[g])
        if cols_g.size:
            lb = int(first[cols_g].min())
            win = np.flatnonzero((first < r0) & (last >= lb))
            contiguous = win[-1] - win[0] + 1 == win.size
            block = gram[win[0]:win[-1] + 1][:, cols_g] if contiguous else gram[np.ix_(win, cols_g)]
            t = int(t_table[win.size])
            if t >= win.size:
                s = block.sum(axis=0)
            elif t == 0:
                s = np.zeros(cols_g.size)
            else:
                s = np.partition(block, win.size - t, axis=0)[win.size - t:].sum(axis=0)
            norm2 = gram[cols_g, cols_g]
            eps = z * np.sqrt(norm2) / noise_std + (2.0 * s - norm2) / (2.0 * nu2)
            q[g, cols_g] = 1.0 if p >= 1.0 else expit(eps + log_odds)
        # add this group's rows to the Gram matrix of the history
        block_rows = cp[r0:r1]
        nzc = np.flatnonzero((block_rows != 0.0).any(axis=0))
        if nzc.size:
            lo, hi = int(nzc[0]), int(nzc[-1]) + 1
            x = block_rows[:, lo:hi]
            gram[lo:hi, lo:hi] += x.T @ x
    return sens, q, events

