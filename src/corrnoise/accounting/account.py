"""Accounting a noisy event: :func:`account` gives epsilon(delta) or delta(epsilon) after the gate.

delta(epsilon) is the smallest delta a method proves for a target epsilon at a given noise.

A method may register a direct ``delta_of`` (the exact Gaussian profile; Monte Carlo
Estimate-Verify-Release); otherwise delta is found by bisection on the method's own epsilon(delta),
which is non-increasing in delta: the answer is the upper end of the final bracket, so the
reported result is the method's (epsilon' <= epsilon, delta) guarantee at that delta.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import CorrnoiseError, check_real
from .base import PrivacyResult, method_options, require_guarantee
from .gate import _annotate, noisy_event, prepare

__all__ = ["account", "account_delta", "bisect_delta"]

#: delta below which the search stops (the mechanism is (epsilon, delta)-DP for this tiny delta).
_DELTA_FLOOR = 1e-30
_DELTA_CEIL = 0.5


def bisect_delta(epsilon_of, epsilon: float, rtol: float = 1e-3) -> float:
    """Smallest delta in [1e-30, 0.5] (up to relative ``rtol``) with ``epsilon_of(delta) <= epsilon``
    for a non-increasing ``epsilon_of``; bisection in log delta returning the upper end."""
    hi = _DELTA_CEIL
    if epsilon_of(hi) > epsilon:
        raise CorrnoiseError("epsilon", f"{epsilon:g} is not reached even at delta = {hi:g}; increase the noise "
                             "or epsilon")
    lo = hi
    while epsilon_of(lo) <= epsilon:
        hi = lo
        lo /= 1e4
        if lo < _DELTA_FLOOR:
            return hi if epsilon_of(_DELTA_FLOOR) > epsilon else _DELTA_FLOOR
    while hi / lo - 1.0 > rtol:
        mid = math.sqrt(lo * hi)
        if epsilon_of(mid) <= epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def account_delta(event_or_strategy, batching=None, *, epsilon, noise_std=None, noise_multiplier=None,
                  method: str = "auto", **options: Any) -> PrivacyResult:
    """delta(epsilon) of a MechanismEvent (or ``strategy`` under ``batching``) at the given noise,
    after the gate (:func:`.gate.prepare`): the method's direct
    ``delta_of`` when registered, else :func:`bisect_delta` on its epsilon(delta).  The result's
    ``epsilon`` is the target and ``delta`` what is proved for it (``extras["delta_of_epsilon"]``)."""
    epsilon = check_real("epsilon", epsilon, low=0.0)
    event = noisy_event(event_or_strategy, batching, noise_std, noise_multiplier)
    spec = prepare(event, method)
    strategy, batching, nu = event.mechanism, event.batching, event.noise_std
    if spec.delta_of is not None:
        result = spec.delta_of(strategy, batching, nu, epsilon, **method_options(spec, options))
    else:
        opts = method_options(spec, options)
        cache: dict[float, PrivacyResult] = {}

        def epsilon_of(delta: float) -> float:
            if delta not in cache:  # the bisection asks for its upper end twice
                cache[delta] = require_guarantee(spec.account(strategy, batching, nu, delta, **opts), "delta(epsilon)")
            return cache[delta].epsilon

        delta = bisect_delta(epsilon_of, epsilon)
        found = cache[delta]
        result = PrivacyResult(epsilon, delta, found.noise_std, found.noise_multiplier, found.method,
                               {**found.extras, "epsilon_at_delta": found.epsilon}, found.kind)
    return _annotate(result.with_extras(delta_of_epsilon=True), event)


def account(event_or_strategy, batching=None, *, delta=None, noise_std=None, noise_multiplier=None, epsilon=None,
            method: str = "auto", **options: Any) -> PrivacyResult:
    """(epsilon, delta) of a :class:`MechanismEvent` -- or of ``strategy`` under ``batching`` with
    the given noise (one of ``noise_std`` or ``noise_multiplier``) -- by ``method`` (``auto``
    picks as :func:`choose_method`): epsilon(delta) given ``delta``, or delta(epsilon) given
    ``epsilon`` (:func:`account_delta`).

    ``options`` (``samples``, ``seed``, ``accountant`` ...) go to the method; one it does not
    take raises, naming it.
    """
    if (delta is None) == (epsilon is None):
        raise CorrnoiseError("delta", "give exactly one of delta (for epsilon(delta)) and epsilon (for delta(epsilon))")
    if epsilon is not None:
        return account_delta(event_or_strategy, batching, epsilon=epsilon, noise_std=noise_std,
                             noise_multiplier=noise_multiplier, method=method, **options)
    event = noisy_event(event_or_strategy, batching, noise_std, noise_multiplier)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    spec = prepare(event, method)
    result = spec.account(event.mechanism, event.batching, event.noise_std, delta, **method_options(spec, options))
    if not isinstance(result, PrivacyResult) or math.isnan(result.epsilon):
        raise RuntimeError(f"accounting method {spec.name} returned {result!r}")
    return _annotate(result, event)
