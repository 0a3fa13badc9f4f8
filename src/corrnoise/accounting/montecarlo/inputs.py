"""Balls-in-bins Monte Carlo accounting (seed 000): defaults, input checks and the seeds of the
samples (fresh OS entropy unless given; the verification seed of Estimate-Verify-Release, Thm 2.1)."""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np

from ...errors import CorrnoiseError, check_int, check_real
from .._common import as_lower_triangular

#: Samples for an (informal) estimate of delta(eps) or eps(delta).
DEFAULT_SAMPLES = 1 << 20
#: Samples for Algorithm 2 (noise calibration on common random numbers).
DEFAULT_CALIBRATION_SAMPLES = 1 << 22
#: Samples for the estimate / calibration that precedes a verification: the upper confidence
#: bound of a rare-event estimate needs many samples to be reliable (one pass costs ~5% of the
#: default verification).
DEFAULT_PRE_VERIFY_SAMPLES = 1 << 24
#: Slack between the verified threshold and the claimed delta (seed 000 App. E uses 1.25).
DEFAULT_TAU = 1.25
#: Default cap on the verification failure probability, relative to delta.
DEFAULT_FAILURE_FRACTION = 1e-3
#: Calibrating for verification aims the upper confidence bound delta_hat + z * se at delta / tau.
DEFAULT_MARGIN_Z = 3.0

_STREAM_ESTIMATE, _STREAM_VERIFY, _STREAM_PILOT, _STREAM_CALIBRATE = 0, 1, 2, 3
_CHUNK_ELEMENTS = 1 << 18  # ~2 MB of float64 per chunk: stays in cache
_PILOT_SAMPLES = 1 << 16
_TINY = 1e-250  # below this a fast-path sum may have lost its dominant term to underflow


def _as_matrix(C: Any) -> np.ndarray:
    """C as a float64 square, lower-triangular, non-negative matrix, or a one-line error on ``C``."""
    return as_lower_triangular(C, param="C", method="balls-in-bins Monte Carlo accounting (seed 000 Lemma 3.2)",
                               require_nonzero=False)[0]


def _check_bins(n: int, bins: Any) -> int:
    bins = check_int("bins", bins, minimum=1)
    if n % bins:
        raise CorrnoiseError("bins", f"must divide the number of steps n = {n} (n = bins * epochs), got {bins}")
    return bins


def _check_noise(noise_std: Any) -> float:
    return check_real("noise_std", noise_std, low=0.0, low_open=True)


def _check_delta(delta: Any) -> float:
    return check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)


def _check_epsilon(epsilon: Any) -> float:
    return check_real("epsilon", epsilon, low=0.0)


def fresh_entropy() -> int:
    """128 bits of OS randomness (``secrets``) seeding a Monte Carlo sample: the default whenever no
    seed is given, so no two runs share a sample unless asked to (seed 000 Thm 2.1, 2.2 hold for
    one sample drawn independently of the candidate being verified)."""
    return secrets.randbits(128)


def resolve_seed(seed: Any, name: str = "seed") -> tuple[int, bool]:
    """(seed, explicit): ``seed`` checked, or :func:`fresh_entropy` when it is None."""
    if seed is None:
        return fresh_entropy(), False
    return check_int(name, seed, minimum=0), True


def verification_seed(seed: int, explicit: bool, verify_seed: Any = None) -> tuple[int, str]:
    """Seed of the verification sample of Estimate-Verify-Release (seed 000 Algorithm 1, Thm 2.1),
    and where it came from (``"given"``, ``"derived"``, ``"os"``).

    Thm 2.1 needs the verifying sample independent of everything that chose the candidate noise:
    without an explicit seed it is fresh OS entropy, never derived from the estimation seed.  An
    explicit ``verify_seed`` reproduces a recorded run.  With only an explicit ``seed`` the
    verification uses its own stream (1) of that seed -- reproducible, but a retry with the same
    seed re-uses the verification sample, voiding the failure probability (experiments only).
    """
    if verify_seed is not None:
        return check_int("verify_seed", verify_seed, minimum=0), "given"
    if explicit:
        return seed, "derived"
    return fresh_entropy(), "os"


def _check_samples(samples: Any, bins: int, name: str = "samples") -> int:
    samples = check_int(name, samples, minimum=1)
    return -(-samples // bins) * bins  # a whole number of rounds over the bins

