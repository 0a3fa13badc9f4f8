"""A cheap, deterministic *lower* bound on the noise balls-in-bins Monte Carlo accounting can
release (seed 000), for choosing between candidates -- never for calibrating.

Lemma 3.2's dominating pair is P = (1/b) sum_i N(m_i, nu^2 I) against Q = N(0, nu^2 I) (add:
H_{e^eps}(P || Q), remove: H_{e^eps}(Q || P)).  Every (epsilon, delta) guarantee the accountant
releases at noise nu has, but for the verification's failure probability (Thm 2.2: if
H >= tau * (delta / tau) = delta, a fresh-sample check passes with probability <= the stated
failure probability), H(nu) < delta for both adjacencies.  For any event S,

    H_{e^eps}(P || Q) >= P(S) - e^eps Q(S),      H_{e^eps}(Q || P) >= Q(S^c) - e^eps P(S^c),   (HS)

(the hockey-stick divergence is a supremum over events).  With unit directions v_1..v_c and
S = {x : max_j <v_j, x> / nu > tau}, writing a_ij = <m_i, v_j> / nu,

    Q(S) <= min(1, c Phi_bar(tau))                           (union bound; <v_j, x>/nu ~ N(0, 1))
    P(S) >= (1/b) sum_i max_j Phi_bar(tau - a_ij)            (one direction per component)
    P(S^c) <= (1/b) sum_i min_j Phi(tau - a_ij)

so (HS) gives explicit bounds, maximized over tau on a grid (any tau is valid).  Two families of
directions are used (:func:`_directions`):

* ``union``: v_i = m_i / ||m_i||, one per mode (c = b): a_ii = ||m_i|| / nu -- the adversary asks
  "did some bin's mode appear?"; tight when the modes are near-orthogonal (DP-SGD, short bands);
* ``mean``: v = sum_i m_i / ||sum_i m_i|| (c = 1): a one-dimensional projection, exact up to the
  tau grid for that projection (its likelihood ratio is monotone since a_i >= 0 for C >= 0) --
  tight when the modes are near-parallel (long correlations, few bins).

The true divergences are non-increasing in nu (more noise is post-processing: N(0, nu2^2 - nu1^2)
added to both distributions), so once a bound exceeds delta at some nu_lower, H(nu) >= H(nu_lower)
> delta for every nu <= nu_lower: a released noise is larger than nu_lower. The search needs no
monotonicity of the computed bound itself (its tau grid moves with nu); it brackets and bisects in
log nu and returns a point where the bound exceeds delta. For b = 1 both families are the exact
Gaussian mechanism's delta(eps) (up to the tau grid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import ndtr

from .inputs import _check_delta, _check_epsilon
from .pair import balls_in_bins_modes

__all__ = ["NoiseLowerBound", "noise_lower_bound", "hockey_stick_lower_bound"]

#: tau grid: a coarse grid over [-4, max a + 12], then a fine one around each maximum.
_GRID_POINTS = 200
_FINE_POINTS = 64


@dataclass(frozen=True)
class NoiseLowerBound:
    """nu_lower for (epsilon, delta) (module docstring) and the direction family that gave it."""

    noise_std: float
    which: str  # "union" or "mean"
    epsilon: float
    delta: float


def _directions(modes: np.ndarray) -> dict[str, tuple[np.ndarray, int]]:
    """(a_i * nu, c) per direction family: the projections <m_i, v> of the family whose Q-event
    count is c (module docstring). ``union`` keeps only the own projection ||m_i|| of each mode
    (the max over j of Phi_bar(tau - a_ij) is at least that term; modes are >= 0)."""
    norms = np.sqrt(np.sum(modes * modes, axis=0))
    total = modes.sum(axis=1)
    tn = float(np.linalg.norm(total))
    mean_proj = (modes.T @ total) / tn if tn > 0.0 else np.zeros(modes.shape[1])
    return {"union": (norms, modes.shape[1]), "mean": (mean_proj, 1)}


def _best_tau(values: np.ndarray, tau: np.ndarray) -> tuple[float, float]:
    i = int(np.argmax(values))
    return float(values[i]), float(tau[i])


def hockey_stick_lower_bound(shifts: np.ndarray, count: int, epsilon: float) -> float:
    """max over a tau grid of the (HS) bounds, add and remove, for standardized shifts
    a_i (= <m_i, v> / nu) and ``count`` directions c (module docstring, Eq. HS): a coarse grid,
    then a fine one around each maximum (any tau gives a valid bound)."""
    a = np.asarray(shifts, dtype=np.float64)
    if a.size == 0 or float(a.max()) <= 0.0:
        return 0.0
    e = math.exp(epsilon)

    def add(tau):  # P(S) - e^eps Q(S) >= (1/b) sum_i Phi_bar(tau - a_i) - e^eps min(1, c Phi_bar(tau))
        return ndtr(a[None, :] - tau[:, None]).mean(axis=1) - e * np.minimum(1.0, count * ndtr(-tau))

    def remove(tau):  # Q(S^c) - e^eps P(S^c) >= max(0, 1 - c Phi_bar(tau)) - e^eps (1/b) sum_i Phi(tau - a_i)
        return np.maximum(0.0, 1.0 - count * ndtr(-tau)) - e * ndtr(tau[:, None] - a[None, :]).mean(axis=1)

    coarse = np.linspace(-4.0, float(a.max()) + 12.0, _GRID_POINTS)
    step = coarse[1] - coarse[0]
    best = 0.0
    for fn in (add, remove):
        _, t = _best_tau(fn(coarse), coarse)
        fine = np.linspace(t - 2.0 * step, t + 2.0 * step, _FINE_POINTS)
        best = max(best, _best_tau(fn(fine), fine)[0])
    return float(best)


def _shrink(gap, lo: float, hi: float, g_lo: float, g_hi: float, rtol: float) -> float:
    """The bracket [lo, hi] (gap(lo) > 0 >= gap(hi)) shrunk to rtol by regula falsi in log noise
    with the Illinois safeguard (a clamped step keeps it shrinking); returns its lower end, where
    the bound still exceeds delta."""
    a, b = math.log(lo), math.log(hi)
    ga, gb = g_lo, (g_hi if math.isfinite(g_hi) else -50.0)
    side = 0
    for _ in range(60):
        if b - a <= math.log1p(rtol):
            break
        w = b - a
        m = a + ga * w / (ga - gb) if ga - gb > 0.0 else a + 0.5 * w
        m = min(max(m, a + 0.05 * w), b - 0.05 * w)
        gm = gap(math.exp(m))
        if gm > 0.0:
            a, ga = m, gm
            if side == 1:
                gb /= 2.0
            side = 1
        else:
            b, gb = m, (gm if math.isfinite(gm) else -50.0)
            if side == -1:
                ga /= 2.0
            side = -1
    return math.exp(a)


def noise_lower_bound(C: Any, bins: int, epsilon: float, delta: float, rtol: float = 1e-3,
                      modes: np.ndarray | None = None) -> NoiseLowerBound:
    """The largest noise (to ``rtol``) at which a lower bound (module docstring) on the dominating
    pair's hockey-stick divergence still exceeds ``delta``: every verified balls-in-bins guarantee
    for (epsilon, delta) has more noise (but for the verification's failure probability).
    Returns 0 noise when no noise is needed (all modes zero)."""
    from ..gaussian import gaussian_mu

    epsilon = _check_epsilon(epsilon)
    delta = _check_delta(delta)
    M = balls_in_bins_modes(C, bins) if modes is None else np.asarray(modes, dtype=np.float64)
    best = NoiseLowerBound(0.0, "none", epsilon, delta)
    for which, (proj, count) in _directions(M).items():
        top = float(np.max(proj)) if proj.size else 0.0
        if top <= 0.0:
            continue

        def gap(nu: float, proj=proj, count=count) -> float:  # log(bound / delta): > 0 where it exceeds delta
            value = hockey_stick_lower_bound(proj / nu, count, epsilon)
            return math.log(value / delta) if value > 0.0 else -math.inf

        # an upper end: the unamplified Gaussian mechanism with sensitivity max_i ||m_i|| meets
        # (epsilon, delta), so its noise leaves every lower bound <= delta
        hi = float(np.sqrt(np.max(np.sum(M * M, axis=0)))) / gaussian_mu(max(epsilon, 1e-9), delta) * 1.01
        g_hi = gap(hi)
        lo = hi / 2.0
        g_lo = gap(lo)
        while g_lo <= 0.0:
            hi, g_hi, lo = lo, g_lo, lo / 2.0
            if lo < 1e-12 * hi:
                lo = 0.0
                break
            g_lo = gap(lo)
        if lo <= 0.0:
            continue
        lo = hi if g_hi > 0.0 else _shrink(gap, lo, hi, g_lo, g_hi, rtol)  # (a bound > delta at hi: hi)
        if lo > best.noise_std:
            best = NoiseLowerBound(lo, which, epsilon, delta)
    return best
