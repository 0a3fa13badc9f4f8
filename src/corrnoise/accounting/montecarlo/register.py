"""Registration of balls-in-bins Monte Carlo accounting as method ``mc`` (seed 000; the
:mod:`corrnoise.accounting.base` registry imports this package on first use of "mc")."""

from __future__ import annotations

from typing import Any

from ...errors import CorrnoiseError
from .inputs import DEFAULT_TAU
from .release import MonteCarloResult, account_balls_in_bins


def _result(res: MonteCarloResult, strategy) -> "Any":
    """A verified result is a guarantee (seed 000 Thm 2.1); an unverified one an estimate."""
    from ..base import PrivacyResult

    extras = {k: v for k, v in res.to_dict().items()
              if k not in ("epsilon", "delta", "noise_std", "noise_multiplier")}
    return PrivacyResult(float(res.epsilon), float(res.delta), float(res.noise_std),
                         float(res.noise_multiplier), "mc", extras,
                         kind="guarantee" if res.verified else "estimate")


def _options(samples, seed, progress, verify, verify_samples, tau, estimate, verify_seed) -> dict[str, Any]:
    """The options of :func:`account_balls_in_bins`: a verified guarantee unless ``estimate`` is
    explicitly True (``verify=False`` alone is refused: an estimate must be asked for by name)."""
    estimate = bool(estimate)
    if estimate and verify:
        raise CorrnoiseError("estimate", "asks for an unverified estimate; it cannot be combined with verify "
                             "(a verified guarantee)")
    if verify is not None and not verify and not estimate:
        raise CorrnoiseError("verify", "verify=False would release an unverified Monte Carlo estimate; ask for "
                             "one explicitly with estimate=True")
    return {"samples": samples, "seed": seed, "progress": progress if callable(progress) else bool(progress), "verify": not estimate,
            "verify_samples": verify_samples, "verify_seed": verify_seed,
            "tau": DEFAULT_TAU if tau is None else tau}


def _single_bin_gaussian(strategy, delta: float, noise_std: float | None = None,
                         epsilon: float | None = None):
    """Balls-in-bins with one bin (seed 000 Lemma 3.2 with b = 1): every example is in every step,
    so P = N(m_0, nu^2 I) with m_0 = C 1 is a single Gaussian and no sampling randomness is left
    to amplify.  The mechanism is exactly the Gaussian mechanism with sensitivity
    sens(C, every step) (tutorial Lemma 1.13; = ||C 1|| for a non-negative C), accounted exactly
    as mu-GDP by :mod:`.gaussian` -- no Monte Carlo, no verification needed."""
    from ...participation import Cyclic
    from ..base import NoBatching
    from ..gaussian import account_gaussian, calibrate_gaussian

    every_step = NoBatching(Cyclic(int(strategy.n), 1))
    if epsilon is not None and noise_std is not None:
        from ..gaussian import delta_gaussian

        res = delta_gaussian(strategy, every_step, noise_std, epsilon)
    elif epsilon is not None:
        res = calibrate_gaussian(strategy, every_step, epsilon, delta)
    else:
        res = account_gaussian(strategy, every_step, noise_std, delta)
    return res.with_extras(bins=1, epochs=int(strategy.n), exact=True,
                           note="balls-in-bins:1 puts every example in every step: exact Gaussian mechanism "
                                "accounting (no Monte Carlo)")


def _calibrate_mc(strategy, batching, epsilon: float, delta: float, samples=None, seed=None, progress=False,
                  verify=None, verify_samples=None, tau=None, estimate=None, verify_seed=None):
    """Calibrate the noise for balls-in-bins batching (seed 000 Algorithm 2; verified with EVR)."""
    opts = _options(samples, seed, progress, verify, verify_samples, tau, estimate, verify_seed)
    if batching.bins == 1:
        return _single_bin_gaussian(strategy, delta, epsilon=epsilon)
    res = account_balls_in_bins(strategy, batching.bins, delta=delta, epsilon=epsilon, **opts)
    return _result(res, strategy)


def _delta_mc(strategy, batching, noise_std: float, epsilon: float, samples=None, seed=None, progress=False,
              verify=None, verify_samples=None, tau=None, estimate=None, verify_seed=None):
    """delta(eps) for balls-in-bins batching: estimate, then verify tau times the upper confidence
    bound on a fresh sample (:func:`delta_candidate`, seed 000 Thm 2.1)."""
    opts = _options(samples, seed, progress, verify, verify_samples, tau, estimate, verify_seed)
    if batching.bins == 1:
        return _single_bin_gaussian(strategy, None, noise_std=noise_std, epsilon=epsilon)
    res = account_balls_in_bins(strategy, batching.bins, noise_std=noise_std, epsilon=epsilon, **opts)
    return _result(res, strategy)


def _register() -> None:
    from ..base import BallsInBins, register_method
    from ..preconditions import require_square, require_whole_epochs

    @register_method("mc", batchings=(BallsInBins,), requires_nonnegative=True, calibrate=_calibrate_mc,
                     preconditions=(require_square, require_whole_epochs),
                     delta_of=_delta_mc,
                     description="balls-in-bins Monte Carlo accounting (seed 000), verified by default")
    def account_mc(strategy, batching, noise_std: float, delta: float, samples=None, seed=None, progress=False,
                   verify=None, verify_samples=None, tau=None, estimate=None, verify_seed=None):
        """eps(delta) of C under balls-in-bins batching by Monte Carlo (seed 000 Lemma 3.2, Sec. 2),
        released only after Estimate-Verify-Release (Thm 2.1) unless ``estimate=True``."""
        opts = _options(samples, seed, progress, verify, verify_samples, tau, estimate, verify_seed)
        if batching.bins == 1:
            return _single_bin_gaussian(strategy, delta, noise_std=noise_std)
        res = account_balls_in_bins(strategy, batching.bins, delta=delta, noise_std=noise_std, **opts)
        return _result(res, strategy)


try:  # the accounting interface may be absent in a partial build; the functions above still work
    _register()
except ImportError:  # pragma: no cover
    pass
