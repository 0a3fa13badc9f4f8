"""MMCC: amplified privacy accounting for any non-negative lower-triangular C (method ``mmcc``).

Matrix Mechanism Conditional Composition (seed 001, Fig. 1 / Thm 4.3): with Poisson sampling
at rate p every round, the output of round i *conditioned on rounds 1..i-1* is a mixture of
Gaussians whose sensitivity is dominated (w.h.p.) by the product mixture

    S_i = sum_j C[i, j] * Bernoulli(p~[i, j]),      p~[i, j] = p e^eps_ij / (p e^eps_ij + 1 - p),

where eps_ij is a tail bound on the privacy loss of a participation in round j given the first
i - 1 outputs (Probability Tail Bounds, seed 001 Fig. 5, with App. F.3's binomial bound on the
inner products).  The bad events have total probability delta_1 (Thm 3.1 / C.2); the composition
of the per-row PMoG privacy loss distributions is (eps, delta_2)-DP, so the mechanism is
(eps, delta_1 + delta_2)-DP.  ``delta_1`` is chosen to minimize eps.

Generalized MMCC (seed 001 App. D, Alg. 3) analyses block-cyclic sampling (tutorial Def. 3.20:
step t samples block t mod BLOCKS with rate p): keep the columns of one block's rounds, compose
one vector mixture per *visit of the block* (rows of a visit reduced to their column norms,
Cor. B.6), with tail bounds conditioned on all earlier rows.  For C with bands <= BLOCKS the
history of every kept column is empty, every p~ = p and the analysis is exactly DP-SGD with
ceil(n / BLOCKS) steps (tutorial Thm 3.21, ``bandmf``).

Implementation (seed 001 App. F, re-derived for speed; everything pessimistic):

* PMF of S_i: entries rounded *up* to a power-of-two grid (Lemma B.4), exact sequential
  convolution of the Bernoullis, the tail beyond a Chernoff cap counted as infinite loss.
* PLD of the mixture P = sum_k w_k N(s_k, nu^2) against Q = N(0, nu^2), both adjacencies: the
  loss l(x) = log(P(x)/Q(x)) is convex and increasing in x (a log-sum-exp of affine functions),
  so it is evaluated exactly (separable log-sum-exp with BLAS) on a coarse grid and bounded on a
  fine grid by chords (from above, remove) and tangents (from below, add); interval masses of P
  come from one FFT convolution of w with Gaussian-CDF increments, those of Q in closed form.
  Each interval's mass goes to the largest loss on it, rounded up to the loss grid.
* Composition: FFT convolutions in a balanced tree, identical rows (banded Toeplitz: every row
  from 2b-1 on) computed once and self-composed by repeated squaring; tails truncated
  pessimistically (low tail moved up, high tail to infinity).

Plain functions: :func:`mmcc_epsilon`, :func:`mmcc_delta`, :func:`probability_tail_bounds`,
:func:`pmog_pld`, :func:`compose`, ...; :func:`account_mmcc` is the registry adapter.
"""

from __future__ import annotations

import heapq
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import scipy.fft as sfft
from scipy.signal import lfilter
from scipy.special import expit, logit, ndtr, ndtri
from scipy.stats import binom

from ..errors import CorrnoiseError, check_int, check_real
from .base import BlockCyclic, Poisson, PrivacyResult, register_method

__all__ = [
    "DiscretePLD",
    "DEFAULT_LOSS_DISCRETIZATION",
    "binomial_tail_count",
    "probability_tail_bounds",
    "sensitivity_pmf",
    "pmog_pld",
    "compose",
    "self_compose",
    "pld_epsilon",
    "pld_delta",
    "mmcc_plds",
    "mmcc_epsilon",
    "mmcc_delta",
    "unamplified_sensitivity",
    "account_mmcc",
]

#: Loss-grid spacing of the discretized PLDs (as dp_accounting's default); each row's losses
#: are rounded up to it, so composing R rows costs at most R * step in epsilon (~R * step / 2).
DEFAULT_LOSS_DISCRETIZATION = 1e-4
#: Relative accuracy of the sensitivity grid: expected round-up of S_i <= this * E[S_i].
DEFAULT_SENSITIVITY_TOLERANCE = 4e-3
#: Probability mass allowed to be pushed to infinite loss by one truncation.
_TAIL = 1e-14
#: Standard deviations of Gaussian noise covered by the x grid (beyond: exact tail masses).
_XSPAN = 9.5
#: Default candidate fractions delta_1 / delta for the delta split search.
_SPLIT_CANDIDATES = (0.01, 0.03, 0.1, 0.3, 0.6, 0.85)


# ----------------------------------------------------------------------------------------------
# Discrete privacy loss distributions
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiscretePLD:
    """A pessimistic privacy loss distribution: mass ``probs[k]`` at loss (offset + k) * step,
    plus ``inf_mass`` at +infinity.  delta(eps) = inf_mass + sum_L m(L) (1 - e^(eps - L))_+."""

    offset: int
    probs: np.ndarray
    inf_mass: float
    step: float

    @property
    def losses(self) -> np.ndarray:
        return (self.offset + np.arange(self.probs.size)) * self.step

    @property
    def size(self) -> int:
        return int(self.probs.size)


def _truncate(offset: int, probs: np.ndarray, inf_mass: float, step: float, tail: float = _TAIL) -> DiscretePLD:
    """Drop tails pessimistically: the lowest-loss mass <= tail moves up to the first kept loss,
    the highest-loss mass <= tail moves to +infinity.  Negative FFT round-off is clipped."""
    probs = np.maximum(probs, 0.0)
    if probs.size == 0:
        return DiscretePLD(0, np.zeros(1), float(min(1.0, inf_mass)), step)
    cum = np.cumsum(probs)
    lo = int(np.searchsorted(cum, tail, side="right"))  # first index whose prefix sum exceeds tail
    rcum = np.cumsum(probs[::-1])
    cut = int(np.searchsorted(rcum, tail, side="right"))  # number of top entries with mass <= tail
    hi = probs.size - cut  # keep [lo, hi)
    if hi <= lo:  # everything is tail (tiny total mass): keep the top entry
        lo, hi = probs.size - 1, probs.size
        cut = 0
    moved_up = cum[lo - 1] if lo > 0 else 0.0
    to_inf = rcum[cut - 1] if cut > 0 else 0.0
    kept = probs[lo:hi].copy()
    kept[0] += moved_up
    return DiscretePLD(offset + lo, kept, float(min(1.0, inf_mass + to_inf)), step)


def _fft_convolve(a: np.ndarray, b: np.ndarray, workers: int = 1) -> np.ndarray:
    size = a.size + b.size - 1
    if min(a.size, b.size) <= 32:
        return np.convolve(a, b)
    nfft = sfft.next_fast_len(size, real=True)
    fa = sfft.rfft(a, nfft, workers=workers)
    fa *= sfft.rfft(b, nfft, workers=workers)
    return sfft.irfft(fa, nfft, workers=workers)[:size]


def compose(first: DiscretePLD, second: DiscretePLD, workers: int = 1, tail: float = _TAIL) -> DiscretePLD:
    """PLD of the composition (sum of independent losses; seed 001 Lem. C.1): FFT convolution."""
    if not math.isclose(first.step, second.step, rel_tol=0.0, abs_tol=0.0):
        raise CorrnoiseError("pld", f"cannot compose loss grids {first.step!r} and {second.step!r}")
    probs = _fft_convolve(first.probs, second.probs, workers)
    inf_mass = first.inf_mass + second.inf_mass - first.inf_mass * second.inf_mass
    return _truncate(first.offset + second.offset, probs, inf_mass, first.step, tail)


def self_compose(pld: DiscretePLD, times: int, workers: int = 1, tail: float = _TAIL) -> DiscretePLD:
    """``times``-fold composition of ``pld`` with itself by repeated squaring."""
    times = check_int("times", times, minimum=1)
    result: DiscretePLD | None = None
    power = pld
    while True:
        if times & 1:
            result = power if result is None else compose(result, power, workers, tail)
        times >>= 1
        if not times:
            break
        power = compose(power, power, workers, tail)
    assert result is not None
    return result


def compose_all(plds: Sequence[tuple[DiscretePLD, int]], workers: int = 1, tail: float = _TAIL) -> DiscretePLD:
    """Compose ``(pld, multiplicity)`` pairs: powers first, then smallest-first pairing."""
    heap: list[tuple[int, int, DiscretePLD]] = []
    for idx, (pld, times) in enumerate(plds):
        powered = self_compose(pld, times, workers, tail) if times > 1 else pld
        heap.append((powered.size, idx, powered))
    if not heap:
        raise CorrnoiseError("pld", "nothing to compose")
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        c = compose(a, b, workers, tail)
        heapq.heappush(heap, (c.size, counter, c))
        counter += 1
    return heap[0][2]


def _positive_part(pld: DiscretePLD) -> tuple[np.ndarray, np.ndarray]:
    losses = pld.losses
    keep = losses > 0.0
    return losses[keep], pld.probs[keep]


def pld_delta(pld: DiscretePLD, epsilon: float) -> float:
    """Hockey-stick divergence delta(eps) = inf_mass + sum_{L > eps} m(L) (1 - e^(eps - L))."""
    losses = pld.losses
    keep = losses > epsilon
    terms = pld.probs[keep] * -np.expm1(epsilon - losses[keep])
    return float(min(1.0, pld.inf_mass + terms.sum()))


def pld_epsilon(pld: DiscretePLD, delta: float) -> float:
    """Smallest eps >= 0 with delta(eps) <= delta (exact for the discrete distribution).

    On (L_{k-1}, L_k] the set {L > eps} is fixed, so delta(eps) = A_k - e^eps B_k is solved in
    closed form; A_k, B_k come from reverse cumulative sums (the e^(-L) sums by a stable
    first-order recursion, scipy.signal.lfilter)."""
    if pld.inf_mass > delta:
        return math.inf
    losses, m = _positive_part(pld)
    if losses.size == 0 or pld_delta(pld, 0.0) <= delta:
        return 0.0
    step = pld.step
    # S0[k] = sum_{j >= k} m_j;   W[k] = sum_{j >= k} m_j e^(L_k - L_j)  (<= S0[k])
    s0 = np.cumsum(m[::-1])[::-1]
    decay = math.exp(-step)
    w_rev = lfilter([1.0], [1.0, -decay], m[::-1])  # y[n] = x[n] + decay * y[n-1]
    w = w_rev[::-1]
    # delta at eps = L_k: sum over j > k  ->  A = inf + S0[k+1], B = W[k+1] e^{-step}
    s0_next = np.append(s0[1:], 0.0)
    w_next = np.append(w[1:], 0.0)
    delta_at = pld.inf_mass + s0_next - w_next * decay
    k = int(np.argmax(delta_at <= delta))  # first grid loss where the target holds
    if delta_at[k] > delta:  # pragma: no cover - delta_at[-1] = inf_mass <= delta
        return math.inf
    # on (L_{k-1}, L_k]: delta(eps) = inf + S0[k] - e^(eps - L_k) W[k]
    a = pld.inf_mass + s0[k] - delta
    lower = losses[k - 1] if k > 0 else 0.0
    if w[k] <= 0.0 or a <= 0.0:
        return float(lower)
    eps = losses[k] + math.log(a / w[k])
    return float(min(max(eps, lower), losses[k]))


# ----------------------------------------------------------------------------------------------
# Probability Tail Bounds (seed 001 Fig. 5 / Alg. 4, App. F.3)
# ----------------------------------------------------------------------------------------------
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


def _group_sensitivities(cp: np.ndarray, starts: np.ndarray) -> np.ndarray:
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
    sens = _group_sensitivities(cp, starts)
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


# ----------------------------------------------------------------------------------------------
# Product mixture of Gaussians: sensitivity PMF and PLD (seed 001 Def. 4.2, App. F.1-F.2)
# ----------------------------------------------------------------------------------------------
def _choose_sensitivity_step(c: np.ndarray, q: np.ndarray, noise_std: float, tolerance: float) -> float:
    """Largest power of two s_step with E[round-up of S] <= tolerance * E[S] (and <= nu / 4)."""
    mean = float(np.dot(q, c))
    cap = min(noise_std / 4.0, float(c.max()))
    e = math.floor(math.log2(cap))
    for _ in range(40):
        step = 2.0 ** e
        bias = float(np.dot(q, np.ceil(c / step) * step - c))
        if bias <= tolerance * mean:
            return step
        e -= 1
    return 2.0 ** e


def sensitivity_pmf(c: np.ndarray, q: np.ndarray, s_step: float, tail: float = _TAIL) -> tuple[np.ndarray, float]:
    """PMF of S = sum_j c_j Bernoulli(q_j) on the grid s_step * k, entries rounded up (Lemma B.4).

    Exact sequential convolution of the Bernoullis, truncated at a Chernoff bound for the
    ``tail`` quantile; returns (w, lost) with w[k] = Pr[S~ = k s_step, S~ <= cap] and
    lost = Pr[S~ > cap] (to be treated as infinite privacy loss).
    """
    k = np.ceil(np.asarray(c, dtype=np.float64) / s_step).astype(np.int64)
    q = np.asarray(q, dtype=np.float64)
    keep = (k > 0) & (q > 0.0)
    k, q = k[keep], q[keep]
    total = int(k.sum())
    if total == 0:
        return np.ones(1), 0.0
    # Chernoff cap: Pr[S >= a] <= exp(Lambda(theta) - theta a) for theta > 0
    thetas = np.geomspace(1e-3, 60.0, 80) / max(float(k.max()), 1.0)
    lam = np.log1p(q[None, :] * np.expm1(thetas[:, None] * k[None, :])).sum(axis=1)
    cap = int(min(total, np.ceil(np.min((lam - math.log(tail)) / thetas))))
    w = np.zeros(cap + 1)
    w[0] = 1.0
    top = 0
    lost = 0.0
    order = np.argsort(k, kind="stable")
    for kj, qj in zip(k[order].tolist(), q[order].tolist()):
        # w[i] (i <= top) moves to i + kj with probability qj; beyond the cap it is lost
        n_move = min(top, cap - kj) + 1 if kj <= cap else 0
        if n_move < top + 1:
            lost += qj * float(w[n_move: top + 1].sum())
        moved = w[:n_move].copy()
        if qj >= 1.0:
            w[: top + 1] = 0.0
        else:
            w[: top + 1] *= 1.0 - qj
        w[kj: kj + n_move] += qj * moved
        top = min(cap, top + kj) if n_move else top
    return w[: top + 1], lost


def _log_mixture_ratio(x: np.ndarray, s: np.ndarray, logw: np.ndarray,
                       noise_std: float) -> tuple[np.ndarray, np.ndarray]:
    """l(x) = log sum_k w_k exp((2 s_k x - s_k^2) / (2 nu^2)) and l'(x) = E_post[s] / nu^2 on a
    uniform grid x, by a separable log-sum-exp: x = x1 + x2, one BLAS product (no cancellation:
    every term is positive)."""
    nu2 = noise_std * noise_std
    npts = x.size
    hx = (x[-1] - x[0]) / max(npts - 1, 1)
    smax = float(s.max()) if s.size else 0.0
    # inner block width limited so exp(s * x2 / nu^2) stays below e^40
    inner = max(1, min(int(math.isqrt(npts)) + 1, int(40.0 * nu2 / max(smax * hx, 1e-300)) + 1))
    outer = -(-npts // inner)
    x1 = x[0] + hx * inner * np.arange(outer)
    x2 = hx * np.arange(inner)
    base = logw - s * s / (2.0 * nu2)
    u = base[None, :] + np.outer(x1, s) / nu2
    umax = u.max(axis=1, keepdims=True)
    ue = np.exp(u - umax)
    v = np.exp(np.outer(s, x2) / nu2)
    num0 = ue @ v
    num1 = ue @ (s[:, None] * v)
    ell = (umax + np.log(num0)).ravel()[:npts]
    deriv = (num1 / num0).ravel()[:npts] / nu2
    return ell, deriv


def _spread(lo_loss: np.ndarray, hi_loss: np.ndarray, mass: np.ndarray, ymass: np.ndarray,
            inf_mass: float, step: float, tail: float) -> DiscretePLD:
    """Discretize pieces of a privacy loss distribution onto the loss grid, pessimistically.

    Piece i has probability ``mass[i]``, losses in [lo_loss[i], hi_loss[i]] and
    E[e^{-L}; piece i] = ``ymass[i]`` (known exactly: e^{-L} is the likelihood ratio, so this is
    the other distribution's mass of the piece).  Its mass is split between the grid points
    k_lo = floor(lo / step) and k_hi = ceil(hi / step) keeping E[e^{-L}] (a mean-preserving
    spread of Y = e^{-L}).  delta(eps) = E[(1 - e^eps Y)_+] is convex in Y, also for compositions
    (one coordinate at a time), so every delta(eps) can only grow ("connect the dots", Doroshenko
    et al. 2022).  A piece whose lower end is -inf goes entirely to k_hi.
    """
    ok = mass > 0.0
    lo_loss, hi_loss, mass, ymass = lo_loss[ok], hi_loss[ok], mass[ok], ymass[ok]
    up_inf = ~np.isfinite(hi_loss)
    inf_mass += float(mass[up_inf].sum())
    lo_loss, hi_loss, mass, ymass = lo_loss[~up_inf], hi_loss[~up_inf], mass[~up_inf], ymass[~up_inf]
    if mass.size == 0:
        return DiscretePLD(0, np.zeros(1), float(min(1.0, inf_mass)), step)
    k_hi = np.ceil(hi_loss / step)
    with np.errstate(invalid="ignore", over="ignore"):
        k_lo = np.where(np.isfinite(lo_loss), np.floor(lo_loss / step), k_hi)
    k_lo = np.minimum(k_lo, k_hi)
    gap = k_hi - k_lo
    # mass at k_hi: b = (mass - ymass e^{k_lo step}) / (1 - e^{-gap step}), clipped to [0, mass]
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        scaled = np.exp(np.log(ymass) + k_lo * step)
        b = (mass - scaled) / -np.expm1(-gap * step)
    b = np.where(gap > 0.0, np.clip(np.nan_to_num(b, nan=1.0, posinf=1.0, neginf=0.0), 0.0, 1.0), 0.0)
    b = np.where(gap > 0.0, np.minimum(b, mass), mass)
    a = mass - b
    idx = np.concatenate([k_lo, k_hi]).astype(np.int64)
    pts = np.concatenate([a, b])
    order = np.argsort(idx, kind="stable")
    idx, pts = idx[order], pts[order]
    # truncate by mass before histogramming (far tails can span huge loss ranges)
    cum = np.cumsum(pts)
    lo = int(np.searchsorted(cum, tail, side="right"))
    rcum = np.cumsum(pts[::-1])
    cut = int(np.searchsorted(rcum, tail, side="right"))
    hi = pts.size - cut
    if hi <= lo:
        lo, hi, cut = pts.size - 1, pts.size, 0
    moved_up = cum[lo - 1] if lo > 0 else 0.0
    to_inf = rcum[cut - 1] if cut > 0 else 0.0
    idx, pts = idx[lo:hi], pts[lo:hi].copy()
    pts[0] += moved_up
    base = int(idx[0])
    probs = np.bincount(idx - base, weights=pts)
    return _truncate(base, probs, inf_mass + to_inf, step, tail)


def pmog_pld(
    c: Sequence[float] | np.ndarray,
    q: Sequence[float] | np.ndarray,
    noise_std: float,
    loss_step: float = DEFAULT_LOSS_DISCRETIZATION,
    *,
    sensitivity_tolerance: float = DEFAULT_SENSITIVITY_TOLERANCE,
    s_step: float | None = None,
    coarse_points: int = 2048,
    x_resolution: float = 8.0,
    workers: int = 1,
    tail: float = _TAIL,
) -> tuple[DiscretePLD, DiscretePLD]:
    """Pessimistic PLDs (remove, add) of the PMoG mechanism M_PMoG({q_j}, {c_j}) with noise nu
    (seed 001 Def. 4.2): P = law of S + N(0, nu^2), S = sum_j c_j Bernoulli(q_j), vs Q = N(0, nu^2).

    remove: L = l(X), X ~ P;  add: L = -l(X), X ~ Q;  l(x) = log(dP/dQ)(x), convex increasing.
    """
    c = np.asarray(c, dtype=np.float64).ravel()
    q = np.asarray(q, dtype=np.float64).ravel()
    nu = float(noise_std)
    keep = (c > 0.0) & (q > 0.0)
    c, q = c[keep], q[keep]
    if c.size == 0:  # the output does not depend on the example
        zero = DiscretePLD(0, np.ones(1), 0.0, loss_step)
        return zero, zero
    if s_step is None:
        s_step = _choose_sensitivity_step(c, q, nu, sensitivity_tolerance)
    w, lost = sensitivity_pmf(c, q, s_step, tail)
    mean = float(np.dot(q, c))
    sd = math.sqrt(float(np.dot(q * (1.0 - q), c * c)))
    # x grid spacing: h * l'(x) <= x_resolution * loss_step in the bulk (l' ~ E_post[S] / nu^2);
    # wider x intervals only widen the mean-preserving spread of _spread, never bias it
    s_ref = max(min(w.size * s_step, mean + 3.0 * sd), s_step)
    h_target = x_resolution * loss_step * nu * nu / s_ref
    # mixture grid: S~ rounded up once more, to m_step = s_step * 2^j <= h_target with a bias
    # <= tolerance * E[S] (one round-up per row, Lemma B.4)
    m_step = s_step
    while m_step * 2.0 <= h_target and m_step * 2.0 <= max(sensitivity_tolerance * mean, s_step):
        m_step *= 2.0
    if m_step > s_step:
        factor = int(round(m_step / s_step))
        w = np.bincount(-(-np.arange(w.size) // factor), weights=w)
    K = w.size - 1
    # fine grid (spacing h, m_step = R h) for the FFT; the x grid of the pieces is every
    # ``agg``-th fine node (spacing agg * h ~ h_target)
    R, agg = 1, 1
    while m_step / R > h_target and R < 2 ** 20:
        R *= 2
    while m_step * agg * 2 <= h_target and agg < 2 ** 20:
        agg *= 2
    h = m_step / R
    span = lambda hh: agg * math.ceil(_XSPAN * nu / (hh * agg))  # noqa: E731
    while K * R + 2 * span(h) > 2 ** 22:  # keep the grid bounded; coarser x costs accuracy only
        if R == 1:  # pragma: no cover - only for absurd parameters
            raise CorrnoiseError("noise_std", f"{nu!r} is too small for the MMCC discretization")
        R //= 2
        h *= 2.0
    a_lo = -span(h)
    nf = K * R + 2 * span(h)
    nf += (-nf) % agg  # whole x intervals
    s = m_step * np.arange(K + 1)
    # --- interval masses ---------------------------------------------------------------------
    # g[d] = Phi(u_{d+1}) - Phi(u_d), u_d = (x_lo + d h) / nu, d = -K R .. nf - 1, from one
    # evaluation of min(Phi(u), Phi(-u)) per node (no cancellation in either tail)
    ud = (a_lo + np.arange(-K * R, nf + 1)) * (h / nu)
    tails = ndtr(-np.abs(ud))
    pos = ud > 0.0
    g = np.where(pos[:-1], tails[:-1] - tails[1:],
                 np.where(pos[1:], (1.0 - tails[1:]) - tails[:-1], tails[1:] - tails[:-1]))
    g = np.maximum(g, 0.0)
    # P: sum_k w_k [Phi((x_{a+1} - s_k)/nu) - Phi((x_a - s_k)/nu)] = (w_up * g)[a + K R]
    w_up = np.zeros(K * R + 1)
    w_up[::R] = w
    p_mass = np.maximum(_fft_convolve(w_up, g, workers)[K * R: K * R + nf], 0.0)
    q_cdf_diff = g[K * R:]  # Q-mass of the fine intervals
    if agg > 1:
        p_mass = p_mass.reshape(-1, agg).sum(axis=1)
        q_cdf_diff = q_cdf_diff.reshape(-1, agg).sum(axis=1)
    nx = nf // agg
    x = (a_lo + agg * np.arange(nx + 1)) * h
    q_below, q_above = float(ndtr(x[0] / nu)), float(ndtr(-x[-1] / nu))
    p_below = float(np.dot(w, ndtr((x[0] - s) / nu)))
    p_above = float(np.dot(w, ndtr((s - x[-1]) / nu)))
    # --- loss bounds on the fine grid ----------------------------------------------------------
    support = w > 0.0
    ncoarse = min(coarse_points, nx)
    stride = -(-nx // ncoarse)
    coarse_idx = np.arange(0, nx + 1, stride)
    if coarse_idx[-1] != nx:
        coarse_idx = np.append(coarse_idx, nx)
    xc = x[coarse_idx]
    # the coarse grid is uniform except possibly its last interval: evaluate the uniform part
    # separably and the last node directly
    uniform = coarse_idx[:-1] if coarse_idx[-1] - coarse_idx[-2] != stride else coarse_idx
    ell_u, der_u = _log_mixture_ratio(x[uniform], s[support], np.log(w[support]), nu)
    if uniform.size != coarse_idx.size:
        ell_l, der_l = _log_mixture_direct(x[-1:], s[support], np.log(w[support]), nu)
        ell_c, der_c = np.append(ell_u, ell_l), np.append(der_u, der_l)
    else:
        ell_c, der_c = ell_u, der_u
    # bounds of l on the fine grid: chords from above, tangents from below (l convex)
    upper = np.interp(x, xc, ell_c)
    seg = np.clip(np.searchsorted(xc, x, side="right") - 1, 0, xc.size - 2)
    tan_left = ell_c[seg] + der_c[seg] * (x - xc[seg])
    tan_right = ell_c[seg + 1] + der_c[seg + 1] * (x - xc[seg + 1])
    lower = np.minimum(np.maximum(tan_left, tan_right), upper)
    log_w0 = math.log(w[0]) if w[0] > 0.0 else -math.inf
    # remove: L = l(X), X ~ P; on (x_a, x_{a+1}] L in [l(x_a), l(x_{a+1})], E[e^-L; I] = Q(I)
    remove = _spread(
        np.concatenate([lower[:-1], [log_w0]]),
        np.concatenate([upper[1:], [ell_c[0]]]),
        np.concatenate([p_mass, [p_below]]),
        np.concatenate([q_cdf_diff, [q_below]]),
        lost + p_above, loss_step, tail)
    # add: L = -l(X), X ~ Q; on I: L in [-l(x_{a+1}), -l(x_a)], E[e^-L; I] = P(I)
    add = _spread(
        np.concatenate([-upper[1:], [-ell_c[0], -np.inf]]),
        np.concatenate([-lower[:-1], [-log_w0, -ell_c[-1]]]),
        np.concatenate([q_cdf_diff, [q_below, q_above]]),
        np.concatenate([p_mass, [p_below, p_above]]),
        0.0, loss_step, tail)
    return remove, add


def _log_mixture_direct(x: np.ndarray, s: np.ndarray, logw: np.ndarray, noise_std: float):
    nu2 = noise_std * noise_std
    u = logw[None, :] + (2.0 * np.outer(x, s) - s * s) / (2.0 * nu2)
    umax = u.max(axis=1, keepdims=True)
    e = np.exp(u - umax)
    tot = e.sum(axis=1)
    ell = umax.ravel() + np.log(tot)
    deriv = (e @ s) / tot / nu2
    return ell, deriv


# ----------------------------------------------------------------------------------------------
# MMCC drivers
# ----------------------------------------------------------------------------------------------
def _as_matrix(strategy: Any, n: int | None) -> tuple[np.ndarray, str]:
    """Dense C (n x n, float64) from a Strategy, a strategy name (with n) or an array; checked."""
    if isinstance(strategy, str):
        from ..strategies import parse_strategy

        if n is None:
            raise CorrnoiseError("n", "a strategy name needs the number of steps n")
        strategy = parse_strategy(strategy, n)
    if hasattr(strategy, "matrix") and callable(strategy.matrix):
        if n is not None and int(n) != int(strategy.n):
            strategy = strategy.with_n(check_int("n", n, minimum=1))
        if strategy.rows != strategy.n:
            raise CorrnoiseError("mechanism", f"{strategy.label} has {strategy.rows} rows for {strategy.n} steps; "
                                 "MMCC needs a square lower-triangular C")
        label = strategy.label
        cmat = np.asarray(strategy.matrix(), dtype=np.float64)
    else:
        label = "matrix"
        try:
            cmat = np.asarray(strategy, dtype=np.float64)
        except (TypeError, ValueError):
            raise CorrnoiseError("mechanism", "expected a strategy or a square matrix, "
                                 f"got {type(strategy).__name__}") from None
        if n is not None and cmat.ndim == 2 and cmat.shape[0] != int(n):
            raise CorrnoiseError("n", f"matrix has {cmat.shape[0]} rows but n = {n}")
    if cmat.ndim != 2 or cmat.shape[0] != cmat.shape[1] or cmat.shape[0] == 0:
        raise CorrnoiseError("mechanism", f"MMCC needs a square n x n matrix C, got shape {cmat.shape}")
    if not np.all(np.isfinite(cmat)):
        raise CorrnoiseError("mechanism", f"{label} has NaN or infinite entries")
    if np.any(np.triu(cmat, 1) != 0.0):
        raise CorrnoiseError("mechanism", f"{label} is not lower-triangular; MMCC needs a lower-triangular C")
    if np.any(cmat < 0.0):
        raise CorrnoiseError("mechanism", f"{label} has negative entries; MMCC amplification needs a non-negative C "
                             "(use a non-negative mechanism or --batching none)")
    if not np.any(cmat > 0.0):
        raise CorrnoiseError("mechanism", f"{label} is zero")
    return cmat, label


def _quantize_up(q: np.ndarray) -> np.ndarray:
    """Round probabilities up to multiples of 2^-44 (valid: larger p~ is dominated; makes
    identical rows bitwise identical)."""
    scale = 2.0 ** 44
    return np.minimum(np.ceil(q * scale) / scale, 1.0)


@dataclass(frozen=True)
class _Rows:
    """The per-row (or per-visit) PMoGs of one MMCC analysis, deduplicated."""

    unique: list[tuple[np.ndarray, np.ndarray]]  # (sensitivities, probabilities)
    counts: list[int]
    rows: int
    events: int
    max_ratio: float  # max p~ / p


def _collect_rows(sens: np.ndarray, q: np.ndarray, p: float, events: int, dedupe: bool) -> _Rows:
    seen: dict[bytes, int] = {}
    unique: list[tuple[np.ndarray, np.ndarray]] = []
    counts: list[int] = []
    max_ratio = 0.0
    for g in range(sens.shape[0]):
        nz = np.flatnonzero(sens[g] > 0.0)
        if nz.size == 0:
            continue
        c, qq = sens[g, nz], _quantize_up(q[g, nz])
        max_ratio = max(max_ratio, float(qq.max()) / p)
        order = np.lexsort((qq, c))
        c, qq = c[order], qq[order]
        key = c.tobytes() + b"|" + qq.tobytes()
        if dedupe and key in seen:
            counts[seen[key]] += 1
            continue
        seen[key] = len(unique)
        unique.append((c, qq))
        counts.append(1)
    return _Rows(unique, counts, int(sum(counts)), events, max_ratio)


def _analysis_matrices(cmat: np.ndarray, blocks: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """(C', starts) of Generalized MMCC for the examples of block ``offset`` (seed 001 Alg. 3):
    the columns of that block's rounds, rows from its first round on, one group per visit."""
    n = cmat.shape[0]
    cp = cmat[offset:, offset::blocks]
    starts = np.arange(0, n - offset, blocks)
    return cp, starts


def _row_plds(rows: _Rows, noise_std: float, loss_step: float, workers: int, tolerance: float,
              progress: Callable[[int, int], None] | None) -> list[tuple[DiscretePLD, DiscretePLD]]:
    def one(item):
        c, q = item
        return pmog_pld(c, q, noise_std, loss_step, sensitivity_tolerance=tolerance)

    total = len(rows.unique)
    out: list[tuple[DiscretePLD, DiscretePLD]] = []
    if workers > 1 and total > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for i, res in enumerate(pool.map(one, rows.unique)):
                out.append(res)
                if progress:
                    progress(i + 1, total)
    else:
        for i, item in enumerate(rows.unique):
            out.append(one(item))
            if progress:
                progress(i + 1, total)
    return out


def mmcc_plds(
    strategy: Any,
    n: int | None,
    p: float,
    noise_std: float,
    delta1: float,
    *,
    blocks: int = 1,
    offset: int = 0,
    lower_bound: bool = False,
    loss_discretization: float = DEFAULT_LOSS_DISCRETIZATION,
    sensitivity_tolerance: float = DEFAULT_SENSITIVITY_TOLERANCE,
    workers: int | None = None,
    dedupe: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[DiscretePLD, DiscretePLD, dict[str, Any]]:
    """Composed (remove, add) PLDs of (Generalized) MMCC with tail-bound failure probability
    ``delta1`` for the examples of block ``offset``; ``lower_bound`` sets every p~ = p."""
    cmat, _ = _as_matrix(strategy, n)
    p, noise_std = _check_common(p, noise_std)
    workers = _workers(workers)
    cp, starts = _analysis_matrices(cmat, blocks, offset)
    timings = {}
    with _single_threaded_blas():
        t0 = time.perf_counter()
        if lower_bound:
            sens = _group_sensitivities(cp, starts)
            q, events = np.where(sens > 0.0, p, 0.0), 0
        else:
            sens, q, events = probability_tail_bounds(cp, p, noise_std, delta1, starts)
        rows = _collect_rows(sens, q, p, events, dedupe)
        t1 = time.perf_counter()
        plds = _row_plds(rows, noise_std, loss_discretization, workers, sensitivity_tolerance, progress)
        t2 = time.perf_counter()
        remove = compose_all([(r, k) for (r, _), k in zip(plds, rows.counts)], workers)
        add = compose_all([(a, k) for (_, a), k in zip(plds, rows.counts)], workers)
        t3 = time.perf_counter()
    timings = {"seconds_tail_bounds": t1 - t0, "seconds_row_plds": t2 - t1, "seconds_composition": t3 - t2}
    info = {"rows": rows.rows, "unique_rows": len(rows.unique), "tail_events": rows.events,
            "max_p_tilde_ratio": rows.max_ratio, **timings}
    return remove, add, info


def _single_threaded_blas():
    """BLAS threads spin badly on a loaded machine; rows are parallelized by our own pool."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl ships with scikit-learn / scipy stacks
        import contextlib

        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def _check_common(p: Any, noise_std: Any) -> tuple[float, float]:
    p = check_real("p", p, low=0.0, high=1.0, low_open=True)
    noise_std = check_real("noise_std", noise_std, low=0.0, low_open=True)
    return p, noise_std


def _workers(workers: int | None) -> int:
    if workers is None:
        return max(1, min(2, os.cpu_count() or 1))
    return check_int("workers", workers, minimum=1)


def unamplified_sensitivity(cmat: np.ndarray, blocks: int = 1) -> float:
    """sens(C, Pi) of the same mechanism without amplification: the example takes part in every
    round it can be sampled in, i.e. cyclic participation with ``blocks`` steps per epoch
    (blocks = 1: every round).  For non-negative C the worst pattern is all-ones on the rounds
    of one block (tutorial Lemma 3.15 with C^T C >= 0): max_o ||C 1_{o, o+b, ...}||_2 -- the
    value corrnoise.losses.mechanism_sensitivity(C, Cyclic(ceil(n/b), b)) computes, in O(n^2)."""
    n = cmat.shape[0]
    blocks = min(int(blocks), n)
    best = 0.0
    for o in range(blocks):
        best = max(best, float(np.linalg.norm(cmat[:, o::blocks].sum(axis=1))))
    return best


def _is_toeplitz(cmat: np.ndarray) -> bool:
    return bool(np.array_equal(cmat[1:, 1:], cmat[:-1, :-1]))


def _offsets(cmat: np.ndarray, blocks: int, offsets: Any) -> list[int]:
    n = cmat.shape[0]
    usable = list(range(min(blocks, n)))
    if offsets is None or offsets == "auto":
        # Toeplitz: block 0 sees the leading principal submatrix of every other block's analysis
        # plus more rounds, so it is the worst (seed 001 App. D)
        return [0] if _is_toeplitz(cmat) else usable
    if offsets == "all":
        return usable
    out = sorted({check_int("offsets", o, minimum=0, maximum=len(usable) - 1) for o in offsets})
    return out


def _split_candidates(delta_split: Any) -> tuple[float, ...]:
    if delta_split is None or delta_split == "auto":
        return _SPLIT_CANDIDATES
    if isinstance(delta_split, (list, tuple)):
        return tuple(check_real("delta_split", f, low=0.0, high=1.0, low_open=True, high_open=True)
                     for f in delta_split)
    return (check_real("delta_split", delta_split, low=0.0, high=1.0, low_open=True, high_open=True),)


def _search_order(candidates: Sequence[float], evaluate: Callable[[float], float]):
    """Walk the sorted candidate fractions from the middle towards the better side (epsilon is
    unimodal in delta_1 in practice: a larger delta_1 buys tighter p~ and costs PLD delta);
    stop as soon as epsilon gets worse or the split is irrelevant (no tail events)."""
    cands = sorted(set(candidates))
    if len(cands) == 1:
        evaluate(cands[0])
        yield cands[0]
        return
    mid = (len(cands) - 1) // 2
    first = evaluate(cands[mid])
    yield cands[mid]
    if first == -math.inf:
        return
    second = evaluate(cands[mid + 1])
    yield cands[mid + 1]
    if second < first:
        direction, i, last = 1, mid + 1, second
    else:
        direction, i, last = -1, mid, first
    while 0 <= i + direction < len(cands):
        i += direction
        value = evaluate(cands[i])
        yield cands[i]
        if value >= last:
            return
        last = value


def mmcc_epsilon(
    strategy: Any,
    n: int | None,
    p: float,
    noise_std: float,
    delta: float,
    lower_bound: bool = False,
    *,
    blocks: int = 1,
    delta_split: Any = "auto",
    offsets: Any = "auto",
    loss_discretization: float = DEFAULT_LOSS_DISCRETIZATION,
    sensitivity_tolerance: float = DEFAULT_SENSITIVITY_TOLERANCE,
    workers: int | None = None,
    dedupe: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> PrivacyResult:
    """epsilon of the matrix mechanism C with Poisson sampling at rate ``p`` every round
    (``blocks`` = 1, seed 001 Thm 4.3) or block-cyclic sampling with ``blocks`` blocks sampled at
    rate ``p`` (Generalized MMCC, seed 001 App. D / Thm D.1), noise_std nu, at ``delta``.

    delta = delta_1 (tail bounds) + delta_2 (PLD); the split is the best of ``delta_split``
    candidate fractions delta_1 / delta (a float fixes it).  The reported epsilon is the
    smaller of MMCC and the unamplified Gaussian mechanism (both are valid guarantees; the
    extras say which one binds).  ``lower_bound=True`` instead composes the rows as if
    independent with every p~ = p and all of delta in the PLD (seed 001 "Tightness"): an
    estimate from below of the true epsilon, for reporting how tight MMCC is -- not a guarantee.
    """
    started = time.perf_counter()
    cmat, label = _as_matrix(strategy, n)
    p, noise_std = _check_common(p, noise_std)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    blocks = check_int("blocks", blocks, minimum=1)
    loss_discretization = check_real("loss_discretization", loss_discretization, low=0.0, high=0.1, low_open=True)
    workers = _workers(workers)
    from .gaussian import gaussian_epsilon

    sens_value = unamplified_sensitivity(cmat, blocks)
    mu = sens_value / noise_std
    eps_unamp = gaussian_epsilon(delta, mu)
    candidates = _split_candidates(delta_split)
    kw = dict(blocks=blocks, loss_discretization=loss_discretization, sensitivity_tolerance=sensitivity_tolerance,
              workers=workers, dedupe=dedupe, progress=progress)
    worst: tuple[float, dict[str, Any]] | None = None
    for off in _offsets(cmat, blocks, offsets):
        best: tuple[float, dict[str, Any]] | None = None
        if lower_bound:
            rem, add, info = mmcc_plds(cmat, None, p, noise_std, 0.0, offset=off, lower_bound=True, **kw)
            eps = max(pld_epsilon(rem, delta), pld_epsilon(add, delta))
            best = (eps, {**info, "delta_tail": 0.0, "delta_pld": delta})
        else:
            def evaluate(frac: float) -> float:
                nonlocal best
                rem, add, info = mmcc_plds(cmat, None, p, noise_std, frac * delta, offset=off, **kw)
                d1 = frac * delta if info["tail_events"] else 0.0
                eps = max(pld_epsilon(rem, delta - d1), pld_epsilon(add, delta - d1))
                if best is None or eps < best[0]:
                    split = frac if info["tail_events"] else 0.0
                    best = (eps, {**info, "delta_tail": d1, "delta_pld": delta - d1, "delta_split": split})
                return eps if info["tail_events"] else -math.inf

            for _ in _search_order(candidates, evaluate):
                pass
        assert best is not None
        best[1]["offset"] = off
        if worst is None or best[0] > worst[0]:
            worst = best
    assert worst is not None
    eps_raw, info = worst
    eps = min(eps_raw, eps_unamp)
    extras = {
        **info,
        "epsilon_mmcc": float(eps_raw),
        "epsilon_unamplified": float(eps_unamp),
        "unamplified_sensitivity": float(sens_value),
        "unamplified_gdp_mu": float(mu),
        "binding": "mmcc" if eps_raw <= eps_unamp else "unamplified",
        "lower_bound": bool(lower_bound),
        "blocks": blocks,
        "sampling_probability": p,
        "loss_discretization": loss_discretization,
        "seconds": time.perf_counter() - started,
    }
    col = float(np.sqrt((cmat * cmat).sum(axis=0).max()))
    return PrivacyResult(float(eps), delta, noise_std, noise_std / col, "mmcc-lower" if lower_bound else "mmcc", extras,
                         kind="lower_bound" if lower_bound else "guarantee")


def mmcc_delta(
    strategy: Any,
    n: int | None,
    p: float,
    noise_std: float,
    epsilon: float,
    *,
    blocks: int = 1,
    offsets: Any = "auto",
    loss_discretization: float = DEFAULT_LOSS_DISCRETIZATION,
    sensitivity_tolerance: float = DEFAULT_SENSITIVITY_TOLERANCE,
    workers: int | None = None,
    dedupe: bool = True,
) -> PrivacyResult:
    """Smallest delta such that MMCC proves (epsilon, delta)-DP: min over delta_1 of
    delta_1 + delta_PLD(epsilon; p~(delta_1)), capped by the unamplified Gaussian delta(epsilon).

    delta_1 is searched on a log grid upwards from the PLD delta of the independent-rows
    composition (p~ = p), below which the tail bounds cannot pay off."""
    cmat, _ = _as_matrix(strategy, n)
    p, noise_std = _check_common(p, noise_std)
    epsilon = check_real("epsilon", epsilon, low=0.0)
    blocks = check_int("blocks", blocks, minimum=1)
    workers = _workers(workers)
    from .gaussian import gaussian_delta

    sens_value = unamplified_sensitivity(cmat, blocks)
    delta_unamp = gaussian_delta(epsilon, sens_value / noise_std) if epsilon > 0 else 1.0
    kw = dict(blocks=blocks, loss_discretization=loss_discretization, sensitivity_tolerance=sensitivity_tolerance,
              workers=workers, dedupe=dedupe)
    worst = 0.0
    for off in _offsets(cmat, blocks, offsets):
        rem, add, info = mmcc_plds(cmat, None, p, noise_std, 0.0, offset=off, lower_bound=True, **kw)
        base = max(pld_delta(rem, epsilon), pld_delta(add, epsilon), 1e-300)

        def total(d1: float) -> float:
            rem, add, info = mmcc_plds(cmat, None, p, noise_std, d1, offset=off, **kw)
            if not info["tail_events"]:
                return max(pld_delta(rem, epsilon), pld_delta(add, epsilon))
            return d1 + max(pld_delta(rem, epsilon), pld_delta(add, epsilon))

        if not info["rows"]:
            continue
        # delta_1 + delta_PLD(delta_1) is unimodal in log delta_1: walk up from the
        # independent-rows delta in factors of 10, then refine by factors of sqrt(10)
        d1 = min(base, 0.5)
        best_d1, best = d1, total(d1)
        while d1 < 0.5:
            d1 = min(10.0 * d1, 0.5)
            value = total(d1)
            if value >= best:
                break
            best_d1, best = d1, value
        for d1 in (best_d1 / math.sqrt(10.0), best_d1 * math.sqrt(10.0)):
            if 0.0 < d1 <= 0.5:
                best = min(best, total(d1))
        worst = max(worst, best)
    delta = min(worst, delta_unamp, 1.0)
    col = float(np.sqrt((cmat * cmat).sum(axis=0).max()))
    return PrivacyResult(float(epsilon), float(delta), noise_std, noise_std / col, "mmcc",
                         {"delta_mmcc": float(worst), "delta_unamplified": float(delta_unamp), "blocks": blocks})


# ----------------------------------------------------------------------------------------------
# Registry adapter (corrnoise.accounting.base imports this module on first use of "mmcc")
# ----------------------------------------------------------------------------------------------
@register_method(
    "mmcc",
    batchings=(Poisson, BlockCyclic),
    requires_nonnegative=True,
    options=("lower_bound", "delta_split", "discretization", "workers"),
    description="matrix mechanism conditional composition (seed 001): any non-negative C, Poisson or block-cyclic",
)
def account_mmcc(strategy, batching, noise_std: float, delta: float, lower_bound: bool = False,
                 delta_split: Any = "auto", discretization: float = DEFAULT_LOSS_DISCRETIZATION,
                 workers: int | None = None) -> PrivacyResult:
    """MMCC (seed 001 Thm 4.3) for Poisson sampling, Generalized MMCC (Thm D.1) for block-cyclic.

    ``discretization`` is the loss-grid step (the name the PLD methods use, so that generic
    calibration can search on a coarse grid first)."""
    blocks = batching.blocks if isinstance(batching, BlockCyclic) else 1
    return mmcc_epsilon(strategy, strategy.n, batching.p, noise_std, delta, lower_bound=bool(lower_bound),
                        blocks=blocks, delta_split=delta_split, loss_discretization=discretization,
                        workers=workers)
