"""Product mixture of Gaussians (PMoG, seed 001 Def. 4.2, App. F.1-F.2): the PMF of one row's
sensitivity S = sum_j c_j Bernoulli(q_j) and the pessimistic PLDs (remove, add) of the mixture
S + N(0, nu^2) against N(0, nu^2)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from scipy.special import ndtr

from ...errors import CorrnoiseError
from .pld import _TAIL, DEFAULT_LOSS_DISCRETIZATION, DiscretePLD, _fft_convolve, _truncate, cut_tails

__all__ = ["DEFAULT_SENSITIVITY_TOLERANCE", "sensitivity_pmf", "pmog_pld"]

#: Relative accuracy of the sensitivity grid: expected round-up of S_i <= this * E[S_i].
DEFAULT_SENSITIVITY_TOLERANCE = 4e-3
#: Most points of the sensitivity or loss grid (float64: 256 MiB); beyond, MMCC gives no bound.
_MAX_GRID_POINTS = 2 ** 25
#: Standard deviations of Gaussian noise covered by the x grid (beyond: exact tail masses).
_XSPAN = 9.5


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


def _grid_points(c, s_step: float) -> float:
    """Points of the sensitivity grid for entries c rounded up to multiples of s_step (in float:
    no int64 overflow at vanishing steps)."""
    return float(np.ceil(np.asarray(c, dtype=np.float64) / s_step).sum())


def sensitivity_pmf(c: np.ndarray, q: np.ndarray, s_step: float, tail: float = _TAIL) -> tuple[np.ndarray, float]:
    """PMF of S = sum_j c_j Bernoulli(q_j) on the grid s_step * k, entries rounded up (Lemma B.4).

    Exact sequential convolution of the Bernoullis, truncated at a Chernoff bound for the
    ``tail`` quantile; returns (w, lost) with w[k] = Pr[S~ = k s_step, S~ <= cap] and
    lost = Pr[S~ > cap] (to be treated as infinite privacy loss).
    """
    points = _grid_points(c, s_step)
    if not points <= _MAX_GRID_POINTS:
        raise CorrnoiseError("s_step", f"{s_step:g} puts {points:.3g} points on the sensitivity grid "
                             f"(at most {_MAX_GRID_POINTS}); use a coarser step")
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
    lo, hi, moved_up, to_inf = cut_tails(pts, tail)
    idx, pts = idx[lo:hi], pts[lo:hi].copy()
    pts[0] += moved_up
    base = int(idx[0])
    if int(idx[-1]) - base >= _MAX_GRID_POINTS:
        # losses spread over more grid points than fit in memory (noise far below the
        # sensitivity): no bound from this row (delta(eps) = 1 for all eps, trivially valid)
        return DiscretePLD(0, np.zeros(1), 1.0, step)
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
    if not _grid_points(c, s_step) <= _MAX_GRID_POINTS:
        # noise far below the sensitivities: the grid of S would not fit in memory. No MMCC bound
        # then -- every loss counts as infinite (delta(eps) = 1 for all eps, trivially valid), so
        # the caller's unamplified analysis is what stands.
        void = DiscretePLD(0, np.zeros(1), 1.0, loss_step)
        return void, void
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
