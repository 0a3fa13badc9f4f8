"""Seed 000 Algorithm 2: noise calibration by bisection on common random numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...errors import CorrnoiseError, check_real
from ...progress import Progress
from .estimates import _Moments, _stratified_ids
from .inputs import (_PILOT_SAMPLES, _STREAM_CALIBRATE, _STREAM_PILOT, DEFAULT_CALIBRATION_SAMPLES, _check_delta,
                     _check_epsilon, _check_samples, resolve_seed)
from .sampling import (ReducedPair, _hockey, _Losses, _lse_bins, _lse_shift, _map_chunks, _Offsets, reduce_balls_in_bins,
                       screen_rows)


@dataclass(frozen=True)
class Calibration:
    """Result of seed 000 Algorithm 2: the noise at which max_adj (delta_hat + z se) = target."""

    noise_std: float
    epsilon: float
    target_delta: float
    margin_z: float
    delta_add: float
    delta_remove: float
    std_error_add: float
    std_error_remove: float
    samples: int
    evaluations: int
    seed: int | None = None


class _Kept:
    """Reduced samples that can contribute for some noise in [lo, hi] (the rest give f = 0 there)."""

    def __init__(self, u_add, ids_add, u_rem, bins, samples, lo, hi):
        self.u_add, self.ids_add, self.u_rem = u_add, ids_add, u_rem
        self.bins, self.samples, self.lo, self.hi = bins, samples, lo, hi

    def objective(self, red: ReducedPair, noise_std: float, epsilon: float, z: float) -> tuple[float, _Moments]:
        losses = _Losses(red, noise_std)
        mom = _Moments(self.bins)
        r = self.samples // self.bins
        f_add = _hockey(losses.add(self.u_add, self.ids_add), epsilon) if self.ids_add.size else np.zeros(0)
        f_rem = _hockey(losses.remove(self.u_rem), epsilon) if self.u_rem.shape[0] else np.zeros(0)
        mom.update_add(f_add, self.ids_add, np.full(self.bins, r))
        mom.update_remove(f_rem, self.samples)
        (da, sa), (dr, sr) = mom.add(), mom.remove()
        return max(da + z * sa, dr + z * sr), mom


def _keep_bounds(red: ReducedPair, u: np.ndarray, bin_ids: np.ndarray | None, lo: float, hi: float,
                 epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows of u whose privacy loss can exceed eps for some noise in [lo, hi] (add, remove).

    With t = 1/nu in [t1, t2], every exponent is bounded termwise: t u_k <= max(t1 u_k, t2 u_k),
    t^2 A_ki <= max(t1^2 A_ki, t2^2 A_ki), and -t^2 G_kk/2 >= -t2^2 G_kk/2, t u_k >=
    min(t1 u_k, t2 u_k).  log-sum-exp is increasing in every argument, so (Y-add) and (Y-remove)
    are bounded by the log-sum-exp of the termwise bounds -- equal to them when t1 = t2.
    """
    t1, t2 = 1.0 / hi, 1.0 / lo
    log_b = math.log(red.bins)
    diag = np.diag(red.gram)
    A = red.gram - 0.5 * diag[:, None]  # (k, i)
    off = _Offsets(np.maximum(t1 * t1 * A, t2 * t2 * A))
    lin = u * t1
    extra = np.maximum(u, 0.0)
    extra *= t2 - t1
    lin += extra  # max(t1 u, t2 u)
    bound_add = _lse_bins(lin, off, bin_ids) - log_b
    lin = u * t1
    extra = np.minimum(u, 0.0)
    extra *= t2 - t1
    lin += extra  # min(t1 u, t2 u)
    bound_rem = log_b - _lse_shift(lin, -(t2 * t2 * 0.5) * diag)
    return bound_add > epsilon, bound_rem > epsilon


def _bisect(f: Callable[[float], float], lo: float, hi: float, rtol: float) -> tuple[float, int]:
    """Bisection in log(noise) for f(lo) > 0 >= f(hi); returns the upper end (f <= 0 there)."""
    evaluations = 0
    while hi / lo - 1.0 > rtol:
        mid = math.sqrt(lo * hi)
        evaluations += 1
        if f(mid) > 0.0:
            lo = mid
        else:
            hi = mid
    return hi, evaluations


def _unamplified_noise(red: ReducedPair, epsilon: float, delta: float) -> float:
    """Noise that makes the Gaussian mechanism with sensitivity max_i ||m_i|| (epsilon, delta)-DP:
    by joint convexity of the hockey-stick divergence an upper bound on the noise needed."""
    from ..gaussian import gaussian_mu

    return red.sensitivity / gaussian_mu(max(epsilon, 1e-9), delta)


def calibrate_noise_std(C: Any, bins: int, epsilon: float, delta: float,
                        samples: int = DEFAULT_CALIBRATION_SAMPLES, seed: int | None = None, margin_z: float = 0.0,
                        rtol: float = 1e-4, workers: int | None = None, progress: Progress | bool | None = None,
                        _reduced: ReducedPair | None = None, start: tuple[float, float] | None = None
                        ) -> Calibration:
    """Seed 000 Algorithm 2: the noise_std nu* with max_adj delta_hat(nu*) (+ margin_z * se) = delta,
    by bisection on one fixed sample (i_j, Z_j) (common random numbers).

    A pilot of 2^16 samples (held in memory) brackets nu*; then the main sample is drawn once and
    only the samples whose privacy loss can exceed eps anywhere in the bracket are kept
    (:func:`_keep_bounds`), so each bisection step costs a fraction of a pass.  The answer is the
    upper end of the final bracket (delta_hat there is <= the target).

    ``start``: the bracket where the pilot starts looking, e.g. from a lower bound on the noise
    (:func:`corrnoise.accounting.montecarlo.noise_lower_bound`); it is widened as needed, so it
    changes the work done, not what is solved for (default: [unamplified / 16, unamplified]).
    """
    red = _reduced if _reduced is not None else reduce_balls_in_bins(C, bins)
    epsilon = _check_epsilon(epsilon)
    delta = _check_delta(delta)
    samples = _check_samples(samples, red.bins)
    seed, _ = resolve_seed(seed)
    margin_z = check_real("margin_z", margin_z, low=0.0)
    b = red.bins
    evaluations = 0

    def draw_kept(stream: int, m: int, lo: float, hi: float) -> _Kept:
        def fn(u, sums):
            # a cheap screen first (:func:`screen_rows`, one pass, no exponentials), then the
            # termwise bounds of _keep_bounds on the rows it leaves; a row either drops has
            # Y <= eps at every noise in [lo, hi], so the objective is the same as with all rows
            ids = _stratified_ids(u.shape[0], b)
            ra, rr = screen_rows(red, u, 1.0 / hi, 1.0 / lo, epsilon, sums)
            if ra.size:
                ra = ra[_keep_bounds(red, u[ra], ids[ra], lo, hi, epsilon)[0]]
            if rr.size:
                rr = rr[_keep_bounds(red, u[rr], ids[rr], lo, hi, epsilon)[1]]
            return u[ra], ids[ra], u[rr]

        parts = _map_chunks(red, seed, stream, m, fn, workers, progress, "calibrating noise", with_sums=True)
        return _Kept(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                     np.concatenate([p[2] for p in parts]), b, m, lo, hi)

    def excess(kept: _Kept) -> Callable[[float], float]:
        def f(nu: float) -> float:
            nonlocal evaluations
            evaluations += 1
            return kept.objective(red, nu, epsilon, margin_z)[0] - delta

        return f

    def bracket(stream: int, m: int, lo: float, hi: float, grow: float) -> tuple[_Kept, float, float]:
        """Widen [lo, hi] until f(lo) > 0 >= f(hi) on the kept sample (redrawn per bracket)."""
        for _ in range(80):
            kept = draw_kept(stream, m, lo, hi)
            f = excess(kept)
            if f(hi) > 0.0:  # the estimate (plus margin) still exceeds the target at the upper end
                lo, hi = hi, hi * grow
            elif f(lo) <= 0.0:
                if lo < 1e-12 * red.sensitivity:
                    return kept, lo, lo  # (almost) no noise is needed
                lo, hi = lo / grow, lo
            else:
                return kept, lo, hi
        raise CorrnoiseError("epsilon", f"could not bracket the noise for ({epsilon:g}, {delta:g})")

    # --- pilot (2^16 samples): bracket between a low guess and the unamplified noise ------------
    hi = _unamplified_noise(red, epsilon, delta)
    lo, grow = hi / 16.0, 16.0
    if start is not None:
        lo, hi = (check_real("start", v, low=0.0, low_open=True) for v in start)
        if not lo < hi:
            raise CorrnoiseError("start", f"must be (low, high) with low < high, got {start!r}")
        grow = 1.5
    pilot_m = min(samples, _check_samples(_PILOT_SAMPLES, b))
    final = pilot_m == samples
    kept, lo, hi = bracket(_STREAM_CALIBRATE if final else _STREAM_PILOT, pilot_m, lo, hi, grow)
    nu = _bisect(excess(kept), lo, hi, rtol if final else 1e-3)[0] if lo < hi else hi
    if not final:
        # --- main sample: a narrow bracket around the pilot's answer, drawn once ------------------
        kept, lo, hi = bracket(_STREAM_CALIBRATE, samples, nu / 1.1, nu * 1.1, 1.2)
        nu = _bisect(excess(kept), lo, hi, rtol)[0] if lo < hi else hi
    obj, mom = kept.objective(red, nu, epsilon, margin_z)
    (da, sa), (dr, sr) = mom.add(), mom.remove()
    return Calibration(nu, epsilon, delta, margin_z, da, dr, sa, sr, samples, evaluations, seed)

