"""Unamplified accounting: the Gaussian mechanism, exactly (method ``gaussian``).

Without amplification the correlated noise mechanism C G + Z is a Gaussian mechanism whose
sensitivity is sens(C, Pi) (tutorial Lemma 1.13, Def. 3.13); with noise_std nu it is mu-GDP with
mu = sens(C, Pi) / nu (tutorial Def. 1.3, Lemma 1.6).  mu-GDP is *exactly* the trade-off of
N(0, 1) vs N(mu, 1), whose privacy profile is (Balle & Wang 2018, Thm 8; Dong, Roth & Su 2022,
Cor. 2.13)

    delta(eps) = Phi(-eps / mu + mu / 2) - e^eps * Phi(-eps / mu - mu / 2).          (GDP-profile)

This module evaluates that curve in log space (``scipy.special.log_ndtr``), inverts it for eps
given delta and for mu given (eps, delta).  If ``sens(C, Pi)`` is only an upper bound (see
:mod:`corrnoise.sensitivity`), the reported epsilon is still a valid guarantee; the result says
``sensitivity_exact``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import log_ndtr

from ..errors import CorrnoiseError, check_real
from .base import NoBatching, PrivacyResult, column_norm, register_method
from .preconditions import require_mechanism_cut_to_steps, require_participation_fits

__all__ = [
    "gaussian_delta",
    "gaussian_log_delta",
    "gaussian_epsilon",
    "gaussian_mu",
    "account_gaussian",
    "calibrate_gaussian",
]


def gaussian_log_delta(epsilon: float, mu: float) -> float:
    """log delta(eps) of mu-GDP (GDP-profile above), accurate far into the tails."""
    a = -epsilon / mu + mu / 2.0
    b = -epsilon / mu - mu / 2.0
    log_pa = float(log_ndtr(a))
    ratio = epsilon + float(log_ndtr(b)) - log_pa  # log(e^eps Phi(b) / Phi(a)) < 0 for mu > 0
    if ratio >= 0.0:  # only by rounding when delta underflows relative to Phi(a)
        return -math.inf
    return log_pa + math.log1p(-math.exp(ratio))


def gaussian_delta(epsilon: float, mu: float) -> float:
    """delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) for mu-GDP (GDP-profile)."""
    epsilon = check_real("epsilon", epsilon, low=0.0)
    mu = check_real("gdp_mu", mu, low=0.0, low_open=True)
    return math.exp(gaussian_log_delta(epsilon, mu))


#: Largest mu solved for exactly (epsilon ~ mu^2 / 2 = 5e11); beyond it the float arithmetic of the
#: profile breaks down and the tail bound of :func:`epsilon_tail_bound` is used instead.
MU_MAX = 1e6


def epsilon_tail_bound(mu: float, delta: float) -> float:
    """eps = mu^2 / 2 + mu sqrt(2 log(1/delta)) gives (eps, delta)-DP for mu-GDP: the privacy loss is
    N(mu^2/2, mu^2), delta(eps) <= Pr[L > eps] <= exp(-z^2 / 2) = delta at z = sqrt(2 log(1/delta))
    (the Chernoff bound of the Gaussian tail). A valid, looser epsilon."""
    return mu * mu / 2.0 + mu * math.sqrt(2.0 * math.log(1.0 / delta))


def gaussian_epsilon(delta: float, mu: float) -> float:
    """Smallest eps >= 0 with delta(eps) <= delta for mu-GDP: the inverse of (GDP-profile) in eps.

    delta(eps) decreases strictly in eps; the root lies below the tail bound
    eps_max = mu^2/2 + mu sqrt(2 log(1/delta)) (the privacy loss is N(mu^2/2, mu^2)).
    """
    delta = check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    mu = check_real("gdp_mu", mu, low=0.0, low_open=True)
    if mu > MU_MAX:  # almost no noise: the tail bound (inf when mu^2 overflows)
        return epsilon_tail_bound(mu, delta)
    log_target = math.log(delta)
    if gaussian_log_delta(0.0, mu) <= log_target:
        return 0.0
    hi = epsilon_tail_bound(mu, delta) + 1.0
    while gaussian_log_delta(hi, mu) > log_target:  # pragma: no cover - the tail bound suffices
        hi *= 2.0
    f = lambda e: gaussian_log_delta(e, mu) - log_target  # noqa: E731
    from scipy.optimize import brentq  # on first use: importing scipy.optimize takes ~0.2 s

    eps = brentq(f, 0.0, hi, xtol=1e-14, rtol=4 * np.finfo(float).eps, maxiter=500)
    # brentq returns a point within tolerance (1e-14) of the root; step up until the guarantee holds,
    # doubling the step (a fixed relative step takes ~1e13 tries at eps ~ 1e-12)
    step = max(eps * 1e-15, 1e-300)
    while f(eps) > 0.0:
        eps, step = eps + step, 2.0 * step
    return float(eps)


def gaussian_mu(epsilon: float, delta: float) -> float:
    """Largest mu such that mu-GDP implies (epsilon, delta)-DP (inverse of GDP-profile in mu).

    delta(eps; mu) increases strictly in mu, so bracket and solve; the returned mu satisfies
    delta(eps; mu) <= delta.
    """
    epsilon = check_real("epsilon", epsilon, low=0.0, low_open=True)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    if epsilon >= epsilon_tail_bound(MU_MAX, delta):  # met with mu = MU_MAX already: more is not solved for
        return MU_MAX
    log_target = math.log(delta)
    f = lambda m: gaussian_log_delta(epsilon, m) - log_target  # noqa: E731
    lo, hi = 1e-3, 1.0
    while f(lo) > 0.0:
        lo /= 10.0
        if lo < 1e-300:  # pragma: no cover - delta(eps; mu) -> 0 as mu -> 0
            raise CorrnoiseError("epsilon", f"cannot reach ({epsilon:g}, {delta:g})-DP with any noise")
    while f(hi) <= 0.0:
        lo, hi = hi, hi * 2.0
    from scipy.optimize import brentq  # on first use: importing scipy.optimize takes ~0.2 s

    mu = brentq(f, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=500)
    shrink = 1e-15
    while f(mu) > 0.0:  # down (less mu = more noise) until the guarantee holds, doubling the step
        mu, shrink = mu * (1.0 - shrink), min(2.0 * shrink, 0.5)
    return float(mu)


def calibrate_gaussian(strategy, batching: NoBatching, epsilon: float, delta: float) -> PrivacyResult:
    """Smallest noise_std for (epsilon, delta): nu = sens(C, Pi) / mu*(epsilon, delta), exactly."""
    from ..losses import mechanism_sensitivity

    sens = mechanism_sensitivity(strategy, batching.participation)
    # A relative margin of 1e-9 keeps the recomputed epsilon <= the target despite root-finding
    # tolerances (the noise is 1e-9 larger than the exact optimum).
    mu_star = gaussian_mu(epsilon, delta) * (1.0 - 1e-9)
    noise_std = sens.value / mu_star
    mu = sens.value / noise_std
    while gaussian_log_delta(epsilon, mu) > math.log(delta):  # rounding in sens / (sens / mu*)
        noise_std *= 1.0 + 4e-16
        mu = sens.value / noise_std
    return _result(strategy, batching, sens, mu, noise_std, delta, target_epsilon=float(epsilon))


def delta_gaussian(strategy, batching: NoBatching, noise_std: float, epsilon: float) -> PrivacyResult:
    """delta(epsilon) exactly: the GDP profile (GDP-profile above) at mu = sens(C, Pi) / noise_std."""
    from ..losses import mechanism_sensitivity

    sens = mechanism_sensitivity(strategy, batching.participation)
    mu = sens.value / noise_std
    res = _result(strategy, batching, sens, mu, noise_std, 0.5)
    return PrivacyResult(float(epsilon), gaussian_delta(epsilon, mu), noise_std, res.noise_multiplier, "gaussian",
                         res.extras)


@register_method("gaussian", batchings=(NoBatching,), calibrate=calibrate_gaussian, delta_of=delta_gaussian,
                 preconditions=(require_participation_fits, require_mechanism_cut_to_steps),
                 description="exact Gaussian mechanism / mu-GDP, no amplification")
def account_gaussian(strategy, batching: NoBatching, noise_std: float, delta: float) -> PrivacyResult:
    """Unamplified: mu = sens(C, Pi) / noise_std, epsilon from the exact GDP profile."""
    from ..losses import mechanism_sensitivity

    sens = mechanism_sensitivity(strategy, batching.participation)
    mu = sens.value / noise_std
    return _result(strategy, batching, sens, mu, noise_std, delta)


def _result(strategy, batching: NoBatching, sens, mu: float, noise_std: float, delta: float,
            **extra) -> PrivacyResult:
    """The mu-GDP result shared by account and calibrate: epsilon from the exact GDP profile
    (GDP-profile above) at mu = sens(C, Pi) / noise_std; ``extra`` is appended to the extras."""
    return PrivacyResult(
        epsilon=gaussian_epsilon(delta, mu),
        delta=delta,
        noise_std=noise_std,
        noise_multiplier=noise_std / column_norm(strategy),
        method="gaussian",
        extras={
            "gdp_mu": float(mu),
            "sensitivity": float(sens.value),
            "sensitivity_exact": bool(sens.exact),
            "sensitivity_method": sens.method,
            "participation": batching.participation.spec,
            **extra,
        },
    )
