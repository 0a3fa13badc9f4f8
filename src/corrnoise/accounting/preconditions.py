"""Named preconditions of the accounting methods: one small function per theorem hypothesis.

Each takes a :class:`~corrnoise.accounting.event.MechanismEvent` and returns None when the
hypothesis holds, else a :class:`Violation` (the parameter to blame and a one-line reason with
the fix).  A method lists the ones its theorem needs where it registers
(``register_method(..., preconditions=...)``); the gate
:func:`corrnoise.accounting.gate.prepare` runs them before any method code, and ``auto``
(:func:`corrnoise.accounting.gate.choose_method`) picks the first candidate whose
preconditions all hold.  Nothing else in corrnoise re-checks these hypotheses.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from ..errors import CorrnoiseError
from .batching import BallsInBins, BlockCyclic, NoBatching, Poisson

__all__ = ["Violation", "Precondition", "require_square", "require_nonnegative", "require_diagonal_for_poisson",
           "require_bands_within_blocks", "require_participation_fits", "require_mechanism_cut_to_steps",
           "require_whole_epochs", "first_violation"]


class Violation(NamedTuple):
    """A failed precondition: ``CorrnoiseError(param, message)`` once the gate names the method."""

    param: str
    message: str


Precondition = Callable[..., "Violation | None"]


def require_square(event) -> Violation | None:
    """Amplified accounting analyses a square lower-triangular C, one row per step: block-cyclic
    sampling (tutorial Def. 3.20, Thm 3.21), MMCC (seed 001 Sec. 1.2: lower-triangular encoder C
    for adaptive inputs) and balls-in-bins (seed 000 Lemma 3.2: C in R^{n x n}).  A C with more
    rows than steps (the tree) has no such analysis."""
    c = event.mechanism
    if event.batching.amplified and c.rows != c.n:
        return Violation("mechanism", f"{c.label} has {c.rows} rows for {c.n} steps; amplified accounting needs a "
                         "square lower-triangular C (use --batching none)")
    return None


def require_nonnegative(event) -> Violation | None:
    """MMCC assumes a non-negative C (seed 001 Sec. 1.2, "We will assume C is non-negative"), as
    does the balls-in-bins dominating pair (seed 000 Lemma 3.2: lower-triangular C with
    non-negative entries).  Unamplified accounting and Thm 3.21 do not need it."""
    c = event.mechanism
    if event.batching.amplified and not c.is_nonnegative():
        return Violation("mechanism", f"{c.label} has negative entries; this amplified accounting needs a "
                         "non-negative C (use a non-negative mechanism or --batching none)")
    return None


def require_diagonal_for_poisson(event) -> Violation | None:
    """Poisson sampling on every step is DP-SGD accounting (tutorial Sec. 1.2, 3.4: one Poisson
    subsampled Gaussian per step), valid for a diagonal C only -- tutorial Thm 3.21 with one
    block, which needs bands <= 1.  A banded C needs MMCC (seed 001) or more blocks."""
    bands = int(event.mechanism.bands)
    if isinstance(event.batching, Poisson) and bands > 1:
        return Violation("method", f"Poisson sampling on every step is accounted as DP-SGD, which needs a "
                         f"diagonal C, but {event.mechanism.label} has {bands} bands: use --method mmcc, or "
                         f"--batching block-cyclic:{bands}:P")
    return None


def require_bands_within_blocks(event) -> Violation | None:
    """Tutorial Thm 3.21 (Choquette-Choo et al. 2023a): block-cyclic amplification of C G + Z
    needs C with at most ``blocks`` bands, so that successive visits of a block touch disjoint
    rows of C G.  MMCC (seed 001 App. D) handles more bands."""
    bands = int(event.mechanism.bands)
    if isinstance(event.batching, BlockCyclic) and bands > event.batching.blocks:
        blocks = event.batching.blocks
        return Violation("batching", f"{event.mechanism.label} has {bands} bands > {blocks} blocks; block-cyclic "
                         f"amplification (tutorial Thm 3.21) needs bands <= blocks: use block-cyclic:{bands}:P or "
                         f"more blocks, a mechanism with <= {blocks} bands, or --method mmcc")
    return None


def require_participation_fits(event) -> Violation | None:
    """Unamplified accounting takes the worst case over the participation schema (tutorial
    Sec. 3.3, Eq. 3.16 / 3.17); the schema must be feasible for the steps run."""
    if isinstance(event.batching, NoBatching):
        schema = event.batching.participation
        try:
            schema.validate(event.steps)
        except CorrnoiseError as exc:
            return Violation("participation", f"{schema.spec} does not fit {event.steps} steps: {exc.message}")
    return None


def require_mechanism_cut_to_steps(event) -> Violation | None:
    """Unamplified accounting validates the schema on the accounted mechanism's columns (Lemma
    3.15 over the patterns of its n steps).  A column-normalized or ``tree:full`` mechanism is not
    cut to fewer steps (:func:`~corrnoise.accounting.event.leading_strategy`), so a schema of
    repeated participation that describes the steps run does not describe its n (found in review:
    cyclic:2:4 of an 8-step run on a 20-step mechanism was planned with a given noise, trained,
    and then had no guarantee).  Single participation needs no pattern over n."""
    from ..participation import Single

    if isinstance(event.batching, NoBatching) and not isinstance(event.batching.participation, Single):
        n, steps = int(event.mechanism.n), int(event.steps)
        if n > steps:
            return Violation("mechanism", f"{event.mechanism.label} is built for n = {n} steps and is accounted "
                             f"whole (not cut to the run's {steps}), which {event.batching.participation.spec} "
                             f"does not describe: build the mechanism for {steps} steps")
    return None


def require_whole_epochs(event) -> Violation | None:
    """Balls-in-bins accounting analyses whole epochs, n = bins * epochs (seed 000 Def. 3.1,
    Lemma 3.2): a run of steps that are not whole epochs of its bins has no such analysis (found in
    review: 5 steps of 3 bins, planned with a given noise, trained and then had no guarantee)."""
    if isinstance(event.batching, BallsInBins):
        bins, steps = event.batching.bins, int(event.steps)
        if steps % bins:
            whole = steps // bins * bins
            return Violation("steps", f"balls-in-bins batching runs whole epochs of {bins} batches (n = bins * "
                             f"epochs, seed 000), got {steps} steps: use {max(whole, bins)} or {whole + bins}, "
                             "or another batching")
    return None


def first_violation(event, preconditions) -> Violation | None:
    """The first of ``preconditions`` that ``event`` violates, or None."""
    for check in preconditions:
        found = check(event)
        if found is not None:
            return found
    return None
