"""Estimate-Verify-Release (seed 000 Algorithm 1, Thm 2.1, 2.2) and the one-call driver
:func:`account_balls_in_bins` (estimate / calibrate, then verify on a fresh sample)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...errors import CorrnoiseError, check_int, check_real
from ...progress import Progress
from .calibration import calibrate_noise_std
from .estimates import _delta_moments, _tail, estimate_delta
from .inputs import (_STREAM_ESTIMATE, _STREAM_VERIFY, DEFAULT_CALIBRATION_SAMPLES, DEFAULT_FAILURE_FRACTION,
                     DEFAULT_MARGIN_Z, DEFAULT_PRE_VERIFY_SAMPLES, DEFAULT_SAMPLES, DEFAULT_TAU, _check_delta,
                     _check_epsilon, _check_noise, _check_samples, resolve_seed, verification_seed)
from .sampling import ReducedPair, reduce_balls_in_bins


def failure_probability(samples: int, delta: float, tau: float = DEFAULT_TAU) -> float:
    """Seed 000 Thm 2.2: if H_{e^eps}(P, Q) >= tau * delta, then
    Pr[delta_hat < delta] <= exp(-s (tau - 1)^2 delta / (8 tau / 3 - 2 / 3)) with s samples."""
    samples = check_int("samples", samples, minimum=1)
    delta = _check_delta(delta)
    tau = check_real("tau", tau, low=1.0, low_open=True)
    return math.exp(-samples * (tau - 1.0) ** 2 * delta / (8.0 * tau / 3.0 - 2.0 / 3.0))


def upper_deviation(samples: int, mean_bound: float, failure: float) -> float:
    """Bernstein's inequality for the mean of ``samples`` (m) independent terms in [0, 1] whose
    mean is at most ``mean_bound`` (d; each term's variance is then at most its mean):
    Pr[mean_hat >= d + t] <= exp(-m t^2 / (2 (d + t / 3))). The t at which that bound equals
    ``failure``: the positive root of m t^2 - (2 L / 3) t - 2 L d = 0 with L = log(1 / failure)."""
    m = check_int("samples", samples, minimum=1)
    d = check_real("mean_bound", mean_bound, low=0.0, high=1.0)
    failure = check_real("failure", failure, low=0.0, high=1.0, low_open=True, high_open=True)
    log_term = math.log(1.0 / failure)
    return (2.0 * log_term / 3.0 + math.sqrt((2.0 * log_term / 3.0) ** 2 + 8.0 * m * log_term * d)) / (2.0 * m)


def verification_samples(delta: float, tau: float = DEFAULT_TAU,
                         failure: float | None = None) -> int:
    """Fewest samples for which verifying delta_hat <= delta / tau for both adjacencies fails with
    total probability (Thm 2.2, union bound over the two) at most ``failure`` (default
    1e-3 * delta), when the mechanism is not (eps, delta)-DP."""
    delta = _check_delta(delta)
    tau = check_real("tau", tau, low=1.0, low_open=True)
    failure = DEFAULT_FAILURE_FRACTION * delta if failure is None else check_real(
        "failure", failure, low=0.0, high=1.0, low_open=True, high_open=True)
    d_v = delta / tau
    rate = (tau - 1.0) ** 2 * d_v / (8.0 * tau / 3.0 - 2.0 / 3.0)
    return int(math.ceil(math.log(2.0 / failure) / rate))


def selection_delta(delta: float, verifications: int,
                    failure_fraction: float = DEFAULT_FAILURE_FRACTION) -> float:
    """delta_v: what each of up to ``verifications`` (K) Estimate-Verify-Release runs must verify so
    that releasing one mechanism *chosen from their outcomes* (the best that passed, else one
    with an analytic guarantee) is (epsilon, ``delta``)-DP -- the planner's situation.

    Seed 000 Thm 2.1 covers one verification with nothing released on failure.  With a choice J
    made from the verification samples only (never from the data), joint convexity of the
    hockey-stick divergence gives H(A(D), A(D')) <= sum_j Pr[J = j] H_j.  A mechanism with
    H_j <= delta_v contributes at most Pr[J = j] delta_v; one with H_j > delta_v passes its
    verification (threshold delta_v / tau) with probability at most f = failure_fraction * delta_v
    (Thm 2.2 with :func:`verification_samples`), so it contributes at most f.  Hence
    H <= delta_v + K f = delta_v (1 + K failure_fraction), which is ``delta`` for
    delta_v = delta / (1 + K failure_fraction)."""
    delta = _check_delta(delta)
    verifications = check_int("verifications", verifications, minimum=1)
    failure_fraction = check_real("failure_fraction", failure_fraction, low=0.0, low_open=True)
    return delta / (1.0 + verifications * failure_fraction)


def standing_deltas(delta: float, verifications: int) -> tuple[float, float]:
    """The deltas at which a passed verification stands for an (epsilon, ``delta``) guarantee of the
    same mechanism, epsilon and no less noise: ``delta`` itself (one Estimate-Verify-Release run,
    seed 000 Thm 2.1), and delta_v = :func:`selection_delta` (``delta``, K) for a mechanism chosen
    among up to K = ``verifications`` verified ones (the planner's release). Anything else is
    verified again."""
    return (_check_delta(delta), selection_delta(delta, verifications))


#: Most verification samples a run may ask for (at delta 1e-6 it needs 1.1e9; 1e-7 would need 1.3e10,
#: hours on a CPU): past it, a verified guarantee is refused before any sampling instead of running on.
MAX_VERIFY_SAMPLES = 1 << 31


def check_verification_cost(delta: float, tau: float = DEFAULT_TAU) -> int:
    """The verification samples for ``delta`` (:func:`verification_samples`), or a one-line error
    naming delta when they exceed :data:`MAX_VERIFY_SAMPLES` (the count grows like 1 / delta)."""
    needed = verification_samples(delta, tau)
    if needed > MAX_VERIFY_SAMPLES:
        raise CorrnoiseError("delta", f"a verified Monte Carlo guarantee (balls-in-bins, seed 000 Thm 2.2) at delta "
                             f"{delta:g} needs {needed:.2g} samples (at most {MAX_VERIFY_SAMPLES:.2g}: hours of work); "
                             "use delta >= 1e-6, or a batching with an analytic accountant (poisson, cyclic)")
    return needed


@dataclass(frozen=True)
class Verification:
    """Estimate-Verify-Release (seed 000 Algorithm 1, Thm 2.1, 2.2) on a fresh sample.

    ``verified``: delta_hat <= delta / tau for both adjacencies, with a total failure probability
    (Thm 2.2 for each adjacency, union bound) <= delta, so releasing is (epsilon, delta)-DP.
    """

    epsilon: float
    delta: float
    noise_std: float
    tau: float
    threshold: float  # delta / tau
    delta_add: float
    delta_remove: float
    std_error_add: float
    std_error_remove: float
    samples: int
    failure_probability: float
    verified: bool
    seed: int | None = None  # the verification sample's seed (fresh OS entropy unless given)


def verify_privacy(C: Any, bins: int, noise_std: float, epsilon: float, delta: float,
                   samples: int | None = None, seed: int | None = None, tau: float = DEFAULT_TAU,
                   workers: int | None = None, progress: Progress | bool | None = None,
                   _reduced: ReducedPair | None = None) -> Verification:
    """Verify (epsilon, delta)-DP at ``noise_std`` with a fresh, independent sample (stream 1 of
    ``seed``; without a seed, 128 fresh bits from the OS): estimate delta_hat for both adjacencies
    and check delta_hat <= delta / tau (Thm 2.1).  Only the flag is returned: releasing is
    :func:`release_verified`'s job."""
    red = _reduced if _reduced is not None else reduce_balls_in_bins(C, bins)
    noise_std = _check_noise(noise_std)
    epsilon = _check_epsilon(epsilon)
    delta = _check_delta(delta)
    tau = check_real("tau", tau, low=1.0, low_open=True)
    samples = verification_samples(delta, tau) if samples is None else samples
    samples = _check_samples(samples, red.bins)
    seed, _ = resolve_seed(seed)
    threshold = delta / tau
    fp = min(1.0, 2.0 * failure_probability(samples, threshold, tau))
    mom = _delta_moments(red, noise_std, epsilon, samples, seed, _STREAM_VERIFY, workers, progress,
                         "verifying")
    (da, sa), (dr, sr) = mom.add(), mom.remove()
    ok = bool(da <= threshold and dr <= threshold and fp <= delta)
    return Verification(epsilon, delta, noise_std, tau, threshold, da, dr, sa, sr, samples, fp, ok, seed)


def recalibration_advice(ver: Verification, samples: int) -> str:
    """The one-line refusal of a calibrated noise whose fresh-sample verification failed, with what
    to do: the calibration sample put delta_hat + margin at delta / tau, the fresh one above it (a
    rare draw of the calibration sample, by the margin of :func:`verification_margin_z`; a user
    probe met one with the README's own example). Calibrating again with more samples narrows the
    margin of error; each attempt adds its failure probability to the delta really spent (seed 000
    Thm 2.2), which the message states."""
    return (f"Monte Carlo verification of ({ver.epsilon:g}, {ver.delta:g})-DP at the calibrated noise_std "
            f"{ver.noise_std:.6g} failed (fresh-sample delta_hat: add {ver.delta_add:.3g}, remove {ver.delta_remove:.3g} "
            f"> delta / tau = {ver.threshold:.3g}); nothing is released: the calibration sample estimated delta too low "
            f"at this noise; calibrate again with more samples (samples / --samples {4 * samples}), each attempt adding "
            f"its failure probability {ver.failure_probability:.2g} to the delta spent")


def release_verified(ver: Verification) -> Verification:
    """The Release step of Estimate-Verify-Release (seed 000 Algorithm 1, Thm 2.1): a candidate
    whose fresh-sample verification failed is never released -- one-line CorrnoiseError naming
    ``verify`` (increase the noise, the samples, or delta)."""
    if ver.verified:
        return ver
    why = []
    if max(ver.delta_add, ver.delta_remove) > ver.threshold:
        why.append(f"fresh-sample delta_hat (add {ver.delta_add:.3g}, remove {ver.delta_remove:.3g}) exceeds "
                   f"delta / tau = {ver.threshold:.3g}")
    if ver.failure_probability > ver.delta:
        why.append(f"{ver.samples} verification samples give failure probability {ver.failure_probability:.3g} "
                   f"> delta = {ver.delta:g} (Thm 2.2)")
    raise CorrnoiseError("verify", f"Monte Carlo verification of ({ver.epsilon:g}, {ver.delta:g})-DP at noise_std "
                         f"{ver.noise_std:.6g} failed ({'; '.join(why)}); nothing is released: increase the noise "
                         "or the (verification) samples")



# ----------------------------------------------------------------------------------------------
# One call: estimate / calibrate, then (optionally) verify
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MonteCarloResult:
    """What balls-in-bins Monte Carlo accounting found.

    Unverified (``verified`` None), (epsilon, delta) is an estimate (``delta_*`` +-
    ``std_error_*``).  Verified (True) it is a formal guarantee (seed 000 Thm 2.1) and
    ``delta_*``/``std_error_*``/``samples`` are those of the fresh verification sample; a failed
    verification raises instead of returning.  ``seed`` is the estimation sample's seed (OS
    entropy unless given); ``extras["verify_seed"]`` the verification sample's.
    """

    epsilon: float
    delta: float
    noise_std: float
    noise_multiplier: float
    delta_add: float
    delta_remove: float
    std_error_add: float
    std_error_remove: float
    samples: int
    bins: int
    epochs: int
    seed: int
    verified: bool | None = None
    failure_probability: float | None = None
    extras: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in (
            "epsilon", "delta", "noise_std", "noise_multiplier", "delta_add", "delta_remove", "std_error_add",
            "std_error_remove", "samples", "bins", "epochs", "seed", "verified", "failure_probability")}
        out.update(self.extras)
        return out


def delta_candidate(delta_add: float, delta_remove: float, se_add: float, se_remove: float, samples: int,
                    tau: float, margin_z: float) -> float:
    """The delta to verify for delta(eps) by Estimate-Verify-Release (seed 000 Algorithm 1): tau
    times the larger upper confidence bound delta_hat + z * se of the estimation sample, so that a
    fresh sample's delta_hat is likely <= candidate / tau (Thm 2.1); at least tau * 3 / samples
    when no sampled loss exceeded eps.  Chosen from the estimation sample only."""
    upper = max(delta_add + margin_z * se_add, delta_remove + margin_z * se_remove, 3.0 / samples)
    return min(tau * upper, 0.5)


def verification_margin_z(margin_z: float, estimation_samples: int, verify_samples: int) -> float:
    """The margin (in standard errors of the estimation sample) to aim below delta / tau so that
    the fresh verification sample's own estimate also lands below it with high probability.

    Near the calibrated noise, the two estimates are independent means of the same loss with
    standard errors se and se * sqrt(m / s) (m estimation, s verification samples), so the
    verification estimate exceeds the threshold only if estimation error + verification error
    exceeds the margin: a margin of z * sqrt(se^2 + se^2 m / s) = z * se * sqrt(1 + m / s) makes
    that a z-sigma event (z = 3: about 0.1%). A failed verification releases nothing
    (Estimate-Verify-Release, seed 000 Algorithm 1), so the margin only costs noise, never privacy;
    without it a fresh sample smaller than the estimation sample failed about a quarter of the time.
    """
    return margin_z * math.sqrt(1.0 + estimation_samples / verify_samples)


def verification_calibration(C: Any, bins: int, epsilon: float, delta: float, samples: int, seed: int,
                             tau: float = DEFAULT_TAU, margin_z: float = DEFAULT_MARGIN_Z,
                             verify_samples: int | None = None, workers: int | None = None,
                             progress: Progress | bool | None = None, start: tuple[float, float] | None = None):
    """The Estimate step of Estimate-Verify-Release for calibrating (seed 000 Algorithm 2 aimed at
    delta / tau with the margin :func:`verification_margin_z`): the candidate noise a verified
    calibration with this ``seed`` and ``samples`` goes on to verify, computed alone. Only an
    estimate -- :func:`account_balls_in_bins` verifies it on a fresh sample before anything is
    released; a planner can rank candidates by exactly the noise their verification would test.
    ``start``: the calibration's starting bracket (:func:`calibrate_noise_std`)."""
    red = C if isinstance(C, ReducedPair) else reduce_balls_in_bins(C, bins)
    z = verification_margin_z(margin_z, samples, verify_samples or verification_samples(delta, tau))
    return calibrate_noise_std(red, bins, epsilon, delta / tau, samples, seed, z, workers=workers, progress=progress,
                               _reduced=red, start=start)


def account_balls_in_bins(C: Any, bins: int, *, delta: float | None = None, noise_std: float | None = None,
                          epsilon: float | None = None, verify: bool = True, samples: int | None = None,
                          verify_samples: int | None = None, seed: int | None = None,
                          verify_seed: int | None = None, tau: float = DEFAULT_TAU,
                          margin_z: float = DEFAULT_MARGIN_Z, workers: int | None = None,
                          progress: Progress | bool | None = None) -> MonteCarloResult:
    """Balls-in-bins Monte Carlo accounting of C (seed 000).

    - ``noise_std`` only: eps(delta);
    - ``epsilon`` only: calibrate the noise (Algorithm 2);
    - both (``delta`` None): delta(eps); verified, delta is :func:`delta_candidate`.

    By default (``verify=True``) the estimate / calibration aims at delta / tau with an upper
    confidence bound (``margin_z`` standard errors) and a fresh, independent sample verifies the
    formal (epsilon, delta) guarantee (Estimate-Verify-Release, Thm 2.1, 2.2); a failed
    verification raises (:func:`release_verified`).  ``verify=False`` returns an informal
    estimate.  Seeds: see :func:`verification_seed` (``seed`` None: OS entropy).
    """
    red = reduce_balls_in_bins(C, bins)
    given_both = noise_std is not None and epsilon is not None
    if given_both and delta is not None:
        raise CorrnoiseError("delta", "give two of noise_std, epsilon and delta (delta(eps) needs no delta)")
    if delta is None and not given_both:
        raise CorrnoiseError("delta", "give delta (or noise_std and epsilon for delta(eps))")
    delta = _check_delta(delta) if delta is not None else None
    seed, explicit = resolve_seed(seed)
    tau = check_real("tau", tau, low=1.0, low_open=True)
    if noise_std is None and epsilon is None:
        raise CorrnoiseError("noise", "give noise_std (to account) or epsilon (to calibrate)")
    if not verify and (verify_samples is not None or verify_seed is not None):
        raise CorrnoiseError("verify_samples" if verify_samples is not None else "verify_seed",
                             "only applies to a verified result (an estimate is not verified)")
    if verify and verify_samples is None and delta is not None:
        check_verification_cost(delta, tau)
    target = None if delta is None else (delta / tau if verify else delta)
    z = margin_z if verify else 0.0
    extras: dict[str, Any] = {"seed_source": "explicit" if explicit else "os"}
    calibrated_here, asked_samples = noise_std is None, 0
    if noise_std is None:
        epsilon = check_real("epsilon", epsilon, low=0.0, low_open=True)
        m = (DEFAULT_PRE_VERIFY_SAMPLES if verify else DEFAULT_CALIBRATION_SAMPLES) if samples is None else samples
        if verify:
            cal = verification_calibration(red, bins, epsilon, delta, m, seed, tau, margin_z, verify_samples,
                                           workers, progress)
        else:
            cal = calibrate_noise_std(red, bins, epsilon, target, m, seed, z, workers=workers, progress=progress,
                                      _reduced=red)
        noise_std = cal.noise_std
        est = (cal.delta_add, cal.delta_remove, cal.std_error_add, cal.std_error_remove, cal.samples)
        extras.update(calibration_samples=cal.samples, calibration_evaluations=cal.evaluations)
        asked_samples = m
    else:
        noise_std = _check_noise(noise_std)
        m = (DEFAULT_PRE_VERIFY_SAMPLES if verify else DEFAULT_SAMPLES) if samples is None else samples
        if epsilon is None:
            m = _check_samples(m, red.bins)
            if verify:
                z = verification_margin_z(z, m, verify_samples or verification_samples(delta, tau))
            tail = _tail(red, noise_std, m, seed, _STREAM_ESTIMATE, workers, progress)
            ea, er, ese = tail.solve(target, z)
            epsilon = max(ea, er)
            mom = tail.moments(epsilon)
            (da, sa), (dr, sr) = mom.add(), mom.remove()
            est = (da, dr, sa, sr, m)
            extras.update(epsilon_std_error=ese)
        else:
            epsilon = _check_epsilon(epsilon)
            d = estimate_delta(red, bins, noise_std, epsilon, m, seed, workers, progress, _reduced=red)
            est = (d.delta_add, d.delta_remove, d.std_error_add, d.std_error_remove, d.samples)
    nm = noise_std / red.column_norm
    da, dr, sa, sr, m = est
    if not verify:
        # calibrated or eps-from-delta: delta is the target; delta given eps: the estimate
        reported_delta = max(da, dr) if given_both else delta
        return MonteCarloResult(epsilon, reported_delta, noise_std, nm, da, dr, sa, sr, m, red.bins, red.epochs,
                                seed, None, None, extras)
    extras.update(estimate_delta_add=est[0], estimate_delta_remove=est[1], estimate_samples=est[4])
    if delta is None:
        delta = delta_candidate(da, dr, sa, sr, m, tau, z)
    vseed, vsource = verification_seed(seed, explicit, verify_seed)
    ver = verify_privacy(red, bins, noise_std, epsilon, delta, verify_samples, vseed, tau, workers, progress,
                         _reduced=red)
    if not ver.verified and calibrated_here and ver.failure_probability <= ver.delta:
        raise CorrnoiseError("verify", recalibration_advice(ver, asked_samples))
    ver = release_verified(ver)
    extras.update(tau=tau, verify_threshold=ver.threshold, verify_seed=vseed, verify_seed_source=vsource)
    return MonteCarloResult(epsilon, delta, noise_std, nm, ver.delta_add, ver.delta_remove, ver.std_error_add,
                            ver.std_error_remove, ver.samples, red.bins, red.epochs, seed, ver.verified,
                            ver.failure_probability, extras)

