"""Calibration: the smallest noise for a target (epsilon, delta), for any accounting method.

epsilon(noise_std) is non-increasing for every method (more noise never hurts privacy), so the
smallest admissible noise is found by bracketing and then shrinking the bracket
[lo, hi] with eps(lo) > target >= eps(hi).  The shrinking step interpolates log(eps) linearly in
log(noise) (epsilon is close to a power law in the noise) with the Illinois safeguard, and is
clamped away from the ends so the bracket always shrinks; it stops when eps(hi) is within
``rtol`` of the target or the bracket is narrower than ``rtol / 10``.  The answer is always the
upper end ``hi``, so account(calibrate(eps)) <= eps holds by construction.

Methods with a native calibration (exact Gaussian inversion; Monte Carlo bisection on common
random numbers, seed 000 Algorithm 2) register it and are used instead.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ..errors import CorrnoiseError, check_real
from .base import PrivacyResult, column_norm, method_accepts, method_options, require_guarantee
from .event import as_event
from .gate import _annotate, prepare

__all__ = ["calibrate", "calibrate_noise", "DEFAULT_RTOL"]

DEFAULT_RTOL = 1e-3
_COARSE_DISCRETIZATION = 1e-3
#: The search gives up beyond noise multipliers outside [1/_RANGE, _RANGE].
_RANGE = 1e6
#: :func:`calibrate` searches no lower than this noise multiplier: a target met with less noise
#: (delta near 1, epsilon in the hundreds) gets this much, more than it needs (still a valid
#: calibration, reported as what it is), since the PLD grids grow like 1 / noise^2 (a minute per
#: evaluation at noise multiplier 0.05, hours below: a hang, not an answer).
MIN_NOISE_MULTIPLIER = 0.125


def calibrate_noise(
    epsilon_of: Callable[[float], float],
    target: float,
    start: float,
    rtol: float = DEFAULT_RTOL,
    max_evaluations: int = 200,
    factor: float = 4.0,
    floor: float | None = None,
) -> tuple[float, float, int]:
    """Smallest x > 0 (up to ``rtol``) with ``epsilon_of(x) <= target``, for a non-increasing
    ``epsilon_of``.  Returns ``(x, epsilon_of(x), evaluations)`` with ``epsilon_of(x) <= target``.

    ``start`` is the first guess (the noise at noise multiplier 1, say); the bracket grows from
    it by ``factor`` per step (use a factor near 1 when ``start`` is already close).  Raises
    CorrnoiseError if even ``start * 1e6`` is not enough. Going down it stops below ``floor``
    (default ``start / 1e6``) and returns the smallest noise tried (which meets the target).
    """
    if not factor > 1.0:
        raise CorrnoiseError("factor", f"must be > 1, got {factor!r}")
    target = check_real("epsilon", target, low=0.0, low_open=True)
    rtol = check_real("rtol", rtol, low=0.0, high=1.0, low_open=True, high_open=True)
    evaluations = 0

    def f(x: float) -> float:
        nonlocal evaluations
        evaluations += 1
        value = float(epsilon_of(x))
        if math.isnan(value):
            raise RuntimeError(f"epsilon is NaN at noise {x!r}")
        return value

    # --- bracket: eps(lo) > target >= eps(hi) ---------------------------------------------
    x = float(start)
    e = f(x)
    if target * (1.0 - rtol) <= e <= target:  # the first guess is already good enough
        return x, e, evaluations
    if e <= target:
        hi, e_hi = x, e
        lo, e_lo = x, e
        limit = start / _RANGE if floor is None else floor
        while e_lo <= target:
            hi, e_hi = lo, e_lo
            if lo <= limit:  # even the least noise searched meets the target: keep it
                return hi, e_hi, evaluations
            lo = max(lo / factor, limit)
            e_lo = f(lo)
    else:
        lo, e_lo = x, e
        hi, e_hi = x, e
        while e_hi > target:
            lo, e_lo = hi, e_hi
            hi = hi * factor
            if hi > start * _RANGE:
                raise CorrnoiseError(
                    "epsilon", f"target {target:g} is not reached even with noise multiplier {_RANGE:g}; "
                    "raise epsilon or delta")
            e_hi = f(hi)

    # --- shrink: Illinois regula falsi on g(log x) = log eps - log target --------------------
    log_t = math.log(target)

    def g(eps: float) -> float:
        if eps <= 0.0:
            return -50.0
        return math.log(eps) - log_t if math.isfinite(eps) else 50.0

    a, b = math.log(lo), math.log(hi)
    ga, gb = g(e_lo), g(e_hi)  # ga > 0 >= gb
    side = 0
    while evaluations < max_evaluations:
        if e_hi >= target * (1.0 - rtol) or b - a <= rtol / 10.0:
            break
        width = b - a
        m = a + ga * width / (ga - gb) if ga - gb > 0 else a + width / 2
        m = min(max(m, a + 0.05 * width), b - 0.05 * width)
        x = math.exp(m)
        e = f(x)
        gm = g(e)
        if e <= target:
            b, gb, hi, e_hi = m, gm, x, e
            if side == -1:
                ga /= 2.0
            side = -1
        else:
            a, ga, lo, e_lo = m, gm, x, e
            if side == 1:
                gb /= 2.0
            side = 1
    return hi, e_hi, evaluations


def calibrate(event_or_strategy, batching=None, *, epsilon, delta, method: str = "auto", rtol: float = DEFAULT_RTOL,
              start: float | None = None, **options: Any) -> PrivacyResult:
    """The smallest noise_std for which a MechanismEvent without noise (or ``strategy`` under
    ``batching``) is (epsilon, delta)-DP; the event passes the gate (:func:`.gate.prepare`) first.

    Uses the method's native calibration when it has one, else :func:`calibrate_noise` on its
    ``account`` function.  The result is the accounting at the returned noise (its ``epsilon``
    is <= the target) with ``target_epsilon`` and ``calibration_evaluations`` in ``extras``.
    Only a formal guarantee sizes noise: an estimate or a lower bound raises
    (:func:`~corrnoise.accounting.base.require_guarantee`).

    ``start``: a noise close to the answer (PLD methods: a calibration at a coarser
    discretization, e.g. a planner's screening); the coarse search is skipped and the fine search
    starts there in a narrow bracket, as it does after the coarse search. The result is found
    the same way (smallest noise meeting the target, to ``rtol``); from the coarse search's own
    result (discretization 1e-3, this rtol) it is the same number. Methods with a native
    calibration ignore it.
    """
    target = check_real("epsilon", epsilon, low=0.0, low_open=True)
    event = as_event(event_or_strategy, batching)
    if event.noise_std is not None:
        raise CorrnoiseError("noise_std", "calibrate finds the noise; pass the event without noise_std "
                             "(event.without_noise())")
    delta = check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    spec = prepare(event, method)
    strategy, batching = event.mechanism, event.batching
    if spec.calibrate is not None:
        result = spec.calibrate(strategy, batching, target, delta, **method_options(spec, options, calibrating=True))
        require_guarantee(result, "calibrate")
        return _annotate(result.with_extras(target_epsilon=target), event)

    opts = method_options(spec, options)
    cache: dict[float, PrivacyResult] = {}

    def epsilon_of(noise_std: float) -> float:
        cache[noise_std] = spec.account(strategy, batching, noise_std, delta, **opts)
        return cache[noise_std].epsilon

    col, factor, evaluations = column_norm(strategy), 4.0, 0
    floor = MIN_NOISE_MULTIPLIER * col
    coarse_search = "discretization" not in opts and method_accepts(spec, "discretization")
    if start is not None:  # the coarse search's result, given
        start = check_real("start", start, low=0.0, low_open=True)
        if coarse_search:
            factor = 1.0 + 4.0 * rtol
    else:
        start = col
        if coarse_search:
            # PLD methods: search with a 10x coarser (still pessimistic) discretization, ~10x cheaper,
            # then finish at the requested one from that point in a narrow bracket.
            coarse = dict(opts, discretization=_COARSE_DISCRETIZATION)
            start, _, evaluations = calibrate_noise(
                lambda nu: spec.account(strategy, batching, nu, delta, **coarse).epsilon, target, start, rtol=rtol,
                floor=floor)
            factor = 1.0 + 4.0 * rtol
    noise_std, _, fine = calibrate_noise(epsilon_of, target, start=start, rtol=rtol, factor=factor, floor=floor)
    require_guarantee(cache[noise_std], "calibrate")
    result = cache[noise_std].with_extras(target_epsilon=target, calibration_evaluations=evaluations + fine,
                                          calibration_rtol=rtol)
    return _annotate(result, event)
