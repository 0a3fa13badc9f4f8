"""Agreement of sampler, mechanism and accounting, and the privacy a run spends.

:func:`check_agreement` checks that the sampler that forms the batches and the accounting
describe the same run (same scheme, same rate, the sampler's participation covered by the
accounted schema), then passes the run's :class:`~corrnoise.accounting.MechanismEvent` through
the accounting gate (:func:`corrnoise.accounting.prepare`: steps within the mechanism, bands <=
blocks, square or non-negative C ...). Nothing else repeats those checks. :func:`privacy_spent`
accounts what ran; :func:`matching_guarantee` accepts a given guarantee only if it is of this
run, by content (:func:`~corrnoise.accounting.run_identity`), never by label.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..accounting import (
    BallsInBins,
    BlockCyclic,
    MechanismEvent,
    NoBatching,
    Poisson,
    PrivacyResult,
    account,
    parse_batching,
    prepare,
    run_identity,
    run_mismatch,
)
from ..accounting.base import note_proven, require_guarantee, was_proven
from ..errors import CorrnoiseError, check_int, check_real
from ..participation import covers, parse_participation
from ..sampling import BatchSampler
from ..strategies import Strategy

__all__ = ["Agreement", "accounted_steps", "balls_in_bins_accounted_steps", "check_agreement", "matching_guarantee",
           "privacy_spent", "refuse_non_guarantees", "reproved_guarantee"]


@dataclass(frozen=True)
class Agreement:
    """What :func:`check_agreement` established: the run's steps, batching and accounting method,
    and the :class:`~corrnoise.accounting.MechanismEvent` (without noise) that passed the gate."""

    steps: int
    batching: Any
    method: str
    event: MechanismEvent | None = None


def _same_batching(a, b) -> bool:
    """Whether accounting batching ``a`` describes sampler batching ``b``: same scheme and the
    same sampling rate, where the accounted rate may exceed the sampler's by round-off but never
    fall below it (a smaller accounted p would understate epsilon)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, Poisson):
        return b.p <= a.p <= b.p * (1 + 1e-9)
    if isinstance(a, BlockCyclic):
        return a.blocks == b.blocks and b.p <= a.p <= b.p * (1 + 1e-9)
    if isinstance(a, BallsInBins):
        return a.bins == b.bins
    return True


def check_agreement(
    strategy: Strategy,
    *,
    sampler: BatchSampler | None = None,
    batching: Any = None,
    participation: Any = None,
    steps: int | None = None,
    method: str = "auto",
    delta: float = 1e-5,
) -> Agreement:
    """Check that sampler and accounting describe one run, then pass the run's
    :class:`~corrnoise.accounting.MechanismEvent` through the accounting gate
    (:func:`corrnoise.accounting.prepare`); raise a CorrnoiseError naming the first parameter
    that disagrees.

    ``batching`` / ``participation`` are the accounting's (``--batching`` spellings); with a
    ``sampler`` they default to what the sampler supports and must otherwise equal it.
    ``steps`` defaults to the sampler's.  Only the sampler's agreement with the accounting is
    checked here; the mechanism against the batching (steps <= n, bands <= blocks, square C,
    participation fits ...) is the gate's.
    """
    if not isinstance(strategy, Strategy):
        raise CorrnoiseError("mechanism", f"must be a corrnoise Strategy, got {type(strategy).__name__}")
    if sampler is not None and not isinstance(sampler, BatchSampler):
        raise CorrnoiseError("sampler", f"must be a corrnoise.sampling sampler, got {type(sampler).__name__}")
    if steps is None:
        if sampler is None:
            raise CorrnoiseError("steps", "give the number of steps or a sampler")
        steps = sampler.steps
    steps = check_int("steps", steps, minimum=1)
    if sampler is not None and steps > sampler.steps:
        raise CorrnoiseError("steps", f"{steps} steps but the sampler yields only {sampler.steps} batches")
    check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)

    # --- the accounting's batching vs the sampler's -----------------------------------------
    if sampler is not None:
        own = sampler.batching()
        if batching is None:
            chosen = own
            if participation is not None and isinstance(own, NoBatching):
                chosen = parse_batching("none", participation)
        elif hasattr(batching, "spec"):
            chosen = batching
        elif str(batching).strip().lower() == "none":
            chosen = parse_batching("none", participation if participation is not None else sampler.participation)
        else:
            chosen = parse_batching(batching, participation)
        if not _same_batching(chosen, own):
            raise CorrnoiseError(
                "batching", f"the accounting assumes {chosen.spec} but {type(sampler).__name__} does "
                f"{own.spec}; account with --batching {own.spec} or use a matching sampler")
        if isinstance(chosen, NoBatching):
            actual = parse_participation(sampler.participation)
            if not covers(chosen.participation, actual):
                raise CorrnoiseError(
                    "participation", f"the accounting assumes {chosen.participation.spec} but the sampler's "
                    f"examples participate as {actual.spec}; use participation {actual.spec}")
        batching = chosen
    else:
        if batching is None:
            raise CorrnoiseError("batching", "give the batching (none, poisson:P, block-cyclic:BLOCKS:P, "
                                 "balls-in-bins:BINS) or a sampler")
        if not hasattr(batching, "spec"):
            none = str(batching).strip().lower() == "none"
            batching = parse_batching(batching, participation if none else None)

    # --- the mechanism vs the batching: the accounting gate, nowhere else --------------------
    event = MechanismEvent(strategy, batching, steps=steps)
    spec = prepare(event, method)
    return Agreement(steps=event.steps, batching=event.batching, method=spec.name, event=event)


def privacy_spent(strategy: Strategy, batching, *, noise_std: float, delta: float, steps: int,
                  planned_steps: int | None = None, method: str = "auto", **options: Any) -> PrivacyResult:
    """(epsilon, delta) after ``steps`` steps of ``strategy`` with this noise and batching.

    Amplified batchings analyse the leading ``steps`` x ``steps`` block of C (fewer steps, fewer
    compositions); unamplified accounting analyses the ``planned_steps`` block, the run its
    participation schema describes (conservative before the end of the run). Balls-in-bins
    batching analyses the leading ceil(steps / bins) * bins steps (whole epochs; conservative
    mid-epoch). ``extras["accounted_steps"]`` is the number of steps analysed. Zero steps: 0.
    Only a formal guarantee is reported (Monte Carlo: verified, seed 000 Thm 2.1); options asking
    for an estimate or a lower bound raise.
    """
    if steps == 0:
        return PrivacyResult(0.0, delta, noise_std, math.nan, "none", {"steps": 0})
    if isinstance(batching, NoBatching):
        analysed = max(steps, planned_steps or steps)
    else:
        analysed = accounted_steps(batching, steps)  # MechanismEvent checks <= n
    event = MechanismEvent(strategy, batching, noise_std=noise_std, steps=analysed)
    result = require_guarantee(account(event, delta=delta, method=method, **options), "privacy_spent")
    return result.with_extras(steps=int(steps), accounted_steps=int(analysed))


def balls_in_bins_accounted_steps(steps: int, bins: int) -> int:
    """ceil(steps / bins) * bins: the steps accounted after ``steps`` steps of balls-in-bins
    batching, whose Monte Carlo accounting (seed 000 Lemma 3.2) needs whole epochs of ``bins``
    steps. Conservative: row t of C^{-1} Z, hence the noise of step t, depends only on rows
    <= t of Z (C lower triangular), so the first ``steps`` outputs are post-processing of the
    longer run's outputs and their epsilon is at most the longer run's."""
    return -(-int(steps) // int(bins)) * int(bins)


def accounted_steps(batching, steps: int) -> int:
    """The steps an amplified accounting analyses after ``steps`` steps (whole epochs for
    balls-in-bins, :func:`balls_in_bins_accounted_steps`; the steps themselves otherwise)."""
    if isinstance(batching, BallsInBins):
        return balls_in_bins_accounted_steps(steps, batching.bins)
    return steps


def refuse_non_guarantees(accounting_options: dict[str, Any] | None) -> None:
    """Training noise and ``privacy_spent`` rest on formal guarantees only (seed 000 Thm 2.1:
    an unverified Monte Carlo estimate is never released; an MMCC lower bound proves nothing), so
    accounting options asking for either are refused before anything runs."""
    for name in ("estimate", "lower_bound"):
        if (accounting_options or {}).get(name):
            raise CorrnoiseError(name, f"training needs a formal (epsilon, delta) guarantee; accounting option "
                                 f"{name}=True would give none (drop it)")


def matching_guarantee(guarantee: PrivacyResult, agreement: Agreement, delta: float) -> PrivacyResult:
    """``guarantee`` if it is the accounting of exactly this run (the mechanism by its
    fingerprint, steps, batching and participation: :func:`~corrnoise.accounting.run_identity`;
    delta no larger), else a one-line error naming ``guarantee`` and what differs."""
    event = agreement.event
    why = run_mismatch(guarantee, {"mechanism": event.mechanism.label, **run_identity(event)})
    if why is not None:
        raise CorrnoiseError("guarantee", f"was computed for {why}")
    if guarantee.delta > delta:
        raise CorrnoiseError("guarantee", f"has delta {guarantee.delta:g} > the run's delta {delta:g}")
    return guarantee


def reproved_guarantee(guarantee: PrivacyResult, event: MechanismEvent, method: str, options: dict[str, Any],
                       source: str, progress: bool = True) -> PrivacyResult:
    """``guarantee`` once this code has proved it for ``event``'s noise, or a one-line error naming
    ``guarantee``: a given result's epsilon is a claim (a file someone wrote, a dict edited, a plan
    rebuilt with another noise), and training reports it as spent. ``source`` names where it came
    from in the error; ``progress``: a fresh Monte Carlo verification says so on stderr. The
    caller has checked that it is of this run (:func:`matching_guarantee`).

    A guarantee this process's accounting computed, content for content
    (:func:`~corrnoise.accounting.base.was_proven`), at exactly the event's noise, is taken as it
    is. Otherwise, analytic methods: epsilon(delta) re-accounted (deterministic: the same number,
    up to rounding). Monte Carlo (balls-in-bins): a verified guarantee in the cache for this event,
    epsilon and a delta that leaves room for the planner's selection
    (:func:`corrnoise.accounting.montecarlo.selection_delta`), at no more noise than the plan's;
    else a fresh verification at the plan's (epsilon, delta) (Estimate-Verify-Release, seed 000
    Thm 2.1: a failure releases nothing)."""
    if guarantee.noise_std != event.noise_std:
        raise CorrnoiseError("guarantee", f"{source}: the guarantee is for noise_std {guarantee.noise_std!r}, the run "
                             f"adds {event.noise_std!r}")
    if was_proven(guarantee):
        return guarantee
    if method != "mc" or event.batching.bins == 1:  # one bin: the exact Gaussian mechanism, no sampling
        again = account(event, delta=guarantee.delta, method=method, **options)
        # a relative 1e-9: the same accounting on another machine's BLAS/FFT kernels may differ in
        # its last digits; an edit that matters is far larger
        if again.epsilon > guarantee.epsilon * (1.0 + 1e-9) + 1e-12:
            raise CorrnoiseError("guarantee", f"{source} says epsilon {guarantee.epsilon:.6g} but its noise_std gives "
                                 f"{again.epsilon:.6g} ({method}): it was edited or made by other code")
        return note_proven(guarantee)
    _check_verification_record(guarantee, source)
    if not _verified_in_cache(guarantee, event):
        from ..accounting.montecarlo import release_verified, verify_privacy
        from ..progress import LineProgress

        _screen_epsilon(guarantee, event, source)
        release_verified(verify_privacy(event.mechanism.matrix(), event.batching.bins, event.noise_std,
                                        guarantee.epsilon, guarantee.delta,
                                        progress=LineProgress(f"{source}: verifying its guarantee") if progress
                                        else None))
    return note_proven(guarantee)


def _check_verification_record(guarantee: PrivacyResult, source: str) -> None:
    """Refuse at once (one line naming ``guarantee``) a Monte Carlo guarantee whose fields contradict
    the verification it records (Estimate-Verify-Release, seed 000 Thm 2.1, 2.2): its delta is the
    one verified (delta_v = selection_delta(delta, K) where the planner selected it among K), the
    threshold delta_v / tau, the failure probability that of its samples at that threshold, the
    fresh-sample delta_hat within the threshold, and its epsilon the calibration's target. Found by
    a user probe: a plan whose guarantee delta was edited from 1e-5 to 1e-7 started a 30-minute
    verification (silent under --json); an edited epsilon failed that verification instead of
    being called edited. Fields the record lacks are not checked (the verification decides)."""
    from ..accounting.montecarlo import failure_probability, selection_delta

    ex, delta = guarantee.extras, guarantee.delta

    def edited(what: str):
        return CorrnoiseError("guarantee", f"{source}: {what}: it was edited")

    def differs(a, b) -> bool:
        return not math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)

    if ex.get("verified") is not True:
        raise edited(f"a Monte Carlo guarantee records verified={ex.get('verified')!r}")
    verified_at = delta
    if "verified_delta" in ex:
        k = check_int("selection_verifications", ex.get("selection_verifications"), minimum=1)
        verified_at = float(ex["verified_delta"])
        if differs(verified_at, selection_delta(delta, k)):
            raise edited(f"its delta {delta:g} is not what its verification at delta_v {verified_at:g} (one of {k}) "
                         "stands for")
    tau = ex.get("tau")
    if tau is None:
        return
    tau = check_real("tau", tau, low=1.0, low_open=True)
    threshold = ex.get("verify_threshold")
    if threshold is not None and differs(threshold, verified_at / tau):
        raise edited(f"its delta {delta:g} was verified at threshold {threshold:g}, not {verified_at:g} / tau = "
                     f"{verified_at / tau:g}")
    if ex.get("samples") is not None and ex.get("failure_probability") is not None:
        fp = min(1.0, 2.0 * failure_probability(int(ex["samples"]), verified_at / tau, tau))
        if differs(ex["failure_probability"], fp) or fp > verified_at:
            raise edited(f"{ex['samples']} verification samples at delta {verified_at:g} give failure probability "
                         f"{fp:.3g}, it records {ex['failure_probability']!r}")
    for side in ("delta_add", "delta_remove"):
        if ex.get(side) is not None and float(ex[side]) > verified_at / tau:
            raise edited(f"its verification's {side} {ex[side]:g} exceeds delta / tau = {verified_at / tau:g}: it "
                         "did not pass")
    target = ex.get("target_epsilon")
    if target is not None and differs(guarantee.epsilon, target):  # a Monte Carlo calibration lands on its target
        raise edited(f"its epsilon {guarantee.epsilon:g} is not the {float(target):g} it was calibrated and "
                     "verified for")


#: the screening's samples (about a second) and the chance it refuses a true claim (Bernstein, below)
_SCREEN_SAMPLES = 1 << 16
_SCREEN_FAILURE = 1e-12


def _screen_epsilon(guarantee: PrivacyResult, event: MechanismEvent, source: str) -> None:
    """Before a fresh verification (~1e8 samples, up to half an hour): a small Monte Carlo
    estimate of delta_remove at the claimed epsilon and noise (seed 000 Sec. 2, each term in
    [0, 1]). If the claim held (delta_remove <= delta), the mean of m terms exceeds delta + t
    with chance at most 1e-12 (Bernstein: :func:`~corrnoise.accounting.montecarlo.release.upper_deviation`),
    and an estimate above delta + t refuses the claim at once as edited
    (a consistently edited epsilon: the record alone cannot tell). Nothing is released by passing:
    the verification still decides."""
    from ..accounting.montecarlo import estimate_delta
    from ..accounting.montecarlo.release import upper_deviation

    d, m = guarantee.delta, _SCREEN_SAMPLES
    t = upper_deviation(m, d, _SCREEN_FAILURE)
    est = estimate_delta(event.mechanism.matrix(), event.batching.bins, event.noise_std, guarantee.epsilon, m, seed=0)
    if est.delta_remove > d + t:
        raise CorrnoiseError("guarantee", f"{source}: epsilon {guarantee.epsilon:g} at noise_std "
                             f"{event.noise_std:.6g} has delta_remove about {est.delta_remove:.3g} (Monte Carlo, {m} "
                             f"samples), far above its delta {d:g}: it was edited")


def _verified_in_cache(guarantee: PrivacyResult, event: MechanismEvent) -> bool:
    """Whether the cache holds a verified guarantee for this event and epsilon, at no more noise
    than the plan's, verified at the plan's delta or at the planner's delta_v for it."""
    from ..accounting.cache import cached_guarantee
    from ..accounting.montecarlo import standing_deltas
    from ..planner.constants import FINAL_MC_SAMPLES, MAX_FINALIZE

    for verified_at in standing_deltas(guarantee.delta, MAX_FINALIZE):
        for options in ({"samples": FINAL_MC_SAMPLES}, {}):  # the planner's calibration, make_private's
            hit = cached_guarantee(event.without_noise(), epsilon=guarantee.epsilon, delta=verified_at,
                                   method="mc", **options)
            if hit is not None and hit.noise_std <= event.noise_std:
                return True
    return False
