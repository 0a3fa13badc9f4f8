"""The plan of a private training run: :func:`plan_private`, the one gate for training.

:func:`plan_private` builds or checks the sampler, builds the mechanism, checks with
:func:`check_agreement` that the sampler that forms the batches and the accounting describe the
same run (same scheme, same rate, the sampler's participation covered by the accounted schema),
passes the run's :class:`~corrnoise.accounting.MechanismEvent` through the accounting gate
(:func:`corrnoise.accounting.prepare`: steps within the mechanism, bands <= blocks, square or
non-negative C ...) and calibrates the noise to a formal guarantee. Nothing else repeats those
checks: the front door (:func:`corrnoise.torch.make_private`), its thin helper
(:func:`corrnoise.torch.run.make_private_run`) and the Opacus-style
:class:`corrnoise.torch.opacus_adapter.PrivacyEngine` all plan through it. A mismatch is one
CorrnoiseError naming the parameter. :func:`privacy_spent` accounts what ran.

The old ``make_private(model, optimizer, loss_fn, dataset)`` / ``PrivateOptimizer.step(x, y)``
path (per-example gradients by torch.func) is gone; see :mod:`corrnoise.torch` for migrating.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..accounting import (
    BallsInBins,
    BlockCyclic,
    MechanismEvent,
    NoBatching,
    Poisson,
    PrivacyResult,
    account,
    calibrate,
    parse_batching,
    prepare,
)
from ..accounting.base import require_guarantee
from ..accounting.event import leading_strategy
from ..errors import CorrnoiseError, check_int, check_real
from ..participation import covers, parse_participation
from ..pipelines import BATCHINGS
from ..sampling import (
    BallsInBinsSampler,
    BatchSampler,
    BlockCyclicPoissonSampler,
    CyclicSampler,
    PoissonSampler,
)
from ..strategies import Strategy, parse_strategy

__all__ = ["Agreement", "PrivatePlan", "check_agreement", "check_run_size", "leading_strategy", "make_sampler", "plan_private",
           "privacy_spent"]


# ----------------------------------------------------------------------------------------------
# Agreement of sampler, mechanism and accounting
# ----------------------------------------------------------------------------------------------
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
        accounted_steps = max(steps, planned_steps or steps)
    elif isinstance(batching, BallsInBins):
        accounted_steps = balls_in_bins_accounted_steps(steps, batching.bins)  # MechanismEvent checks <= n
    else:
        accounted_steps = steps
    event = MechanismEvent(strategy, batching, noise_std=noise_std, steps=accounted_steps)
    result = require_guarantee(account(event, delta=delta, method=method, **options), "privacy_spent")
    return result.with_extras(steps=int(steps), accounted_steps=int(accounted_steps))


def balls_in_bins_accounted_steps(steps: int, bins: int) -> int:
    """ceil(steps / bins) * bins: the steps accounted after ``steps`` steps of balls-in-bins
    batching, whose Monte Carlo accounting (seed 000 Lemma 3.2) needs whole epochs of ``bins``
    steps. Conservative: row t of C^{-1} Z, hence the noise of step t, depends only on rows
    <= t of Z (C lower triangular), so the first ``steps`` outputs are post-processing of the
    longer run's outputs and their epsilon is at most the longer run's."""
    return -(-int(steps) // int(bins)) * int(bins)


# ----------------------------------------------------------------------------------------------
# The plan: sampler, mechanism, agreement, noise
# ----------------------------------------------------------------------------------------------
SAMPLINGS = BATCHINGS


def choose_batching(strategy: Strategy, num_examples: int, batch_size: int) -> str:
    """``batching="auto"``: the amplified batching whose analysis suits C (issue #10 item 3).

    DP-SGD (one band): Poisson sampling (PLD). A banded C whose bands fit as blocks
    (bands * batch_size <= N): block-cyclic Poisson (tutorial Thm 3.21). Any other
    non-negative C (BLT, DP-CGD, Toeplitz, dense): balls-in-bins with the verified Monte
    Carlo guarantee (seed 000). Otherwise fixed batches in cyclic order, unamplified.
    """
    bands = min(int(strategy.bands), strategy.n)
    if bands <= 1:
        return "poisson"
    if bands * batch_size <= num_examples and bands < strategy.n:
        return "block-cyclic"
    if strategy.rows == strategy.n and strategy.is_nonnegative():
        return "balls-in-bins"
    return "cyclic"


def make_sampler(
    sampling: str,
    strategy_bands: int,
    num_examples: int,
    batch_size: int,
    *,
    epochs: float | None = None,
    steps: int | None = None,
    seed: int | None = None,
) -> BatchSampler:
    """The sampler for ``sampling`` with expected batch size ``batch_size``.

    ``sampling`` is one of SAMPLINGS without ``auto`` (``auto`` needs the mechanism:
    :func:`choose_batching`). Steps default to ``epochs`` passes over the data
    (num_examples / batch_size steps per epoch; N // B for cyclic batches).
    """
    if sampling not in SAMPLINGS[1:]:
        raise CorrnoiseError("sampling", f"must be one of {', '.join(SAMPLINGS[1:])}, got {sampling!r}")
    n_ex = check_int("num_examples", num_examples, minimum=1)
    b = check_int("batch_size", batch_size, minimum=1, maximum=n_ex)
    if (steps is None) == (epochs is None):
        raise CorrnoiseError("steps", "give exactly one of steps and epochs")
    if sampling == "cyclic":
        per_epoch = n_ex // b
        if steps is None:
            steps = max(1, int(round(check_real("epochs", epochs, low=0.0, low_open=True) * per_epoch)))
        return CyclicSampler(n_ex, b, steps=steps, seed=seed)
    if sampling == "balls-in-bins":  # n = bins * epochs (seed 000 Def. 3.1): whole epochs of N // B bins
        bins = max(1, n_ex // b)
        if steps is None:
            e = check_real("epochs", epochs, low=0.0, low_open=True)
            if not e.is_integer():
                raise CorrnoiseError("epochs", f"balls-in-bins batching runs whole epochs (of {bins} batches), got {e:g}")
            steps = int(e) * bins
        return BallsInBinsSampler(n_ex, min(bins, steps), steps, batch_size=b, seed=seed)
    if steps is None:
        steps = max(1, int(round(check_real("epochs", epochs, low=0.0, low_open=True) * n_ex / b)))
    if sampling == "poisson":
        return PoissonSampler(n_ex, b / n_ex, steps, seed=seed)
    blocks = max(1, strategy_bands)  # block-cyclic, the last name of SAMPLINGS
    p = b * blocks / n_ex
    if p > 1.0:
        raise CorrnoiseError("batch_size", f"block-cyclic sampling with {blocks} blocks of ~{n_ex // blocks} "
                             f"examples cannot give batches of {b}; use a smaller batch or fewer bands")
    return BlockCyclicPoissonSampler(n_ex, blocks, p, steps, seed=seed)


def _parse_mechanism(mechanism: str, steps: int) -> Strategy:
    """The Strategy a mechanism name or file stands for, for ``steps`` steps; a bad name is
    reported against ``mechanism`` (what the user passed), with the parser's reason."""
    try:
        return parse_strategy(mechanism, steps)
    except CorrnoiseError as exc:
        if exc.param == "mechanism":
            raise
        raise CorrnoiseError("mechanism", f"{mechanism!r}: {exc}") from None


def plan_private(
    dataset=None,
    *,
    mechanism: str | Strategy = "identity",
    delta: float,
    epsilon: float | None = None,
    noise_std: float | None = None,
    noise_multiplier: float | None = None,
    batch_size: int | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    sampler: BatchSampler | str = "auto",
    seed: int | None = None,
    accounting_method: str = "auto",
    accounting_options: dict[str, Any] | None = None,
) -> "PrivatePlan":
    """The checked :class:`PrivatePlan` behind :func:`corrnoise.torch.make_private` (and the
    helpers over it). ``sampler``: a ready corrnoise sampler or a name of :func:`make_sampler`;
    exactly one of ``epsilon`` (calibrated to a formal guarantee), ``noise_std`` and
    ``noise_multiplier``; ``accounting_options`` asking for an estimate or a lower bound are
    refused."""
    if sum(v is not None for v in (epsilon, noise_std, noise_multiplier)) != 1:
        raise CorrnoiseError("epsilon", "give exactly one of epsilon, noise_std and noise_multiplier")
    num_examples = None
    if dataset is not None:
        try:
            num_examples = len(dataset)
        except TypeError:
            raise CorrnoiseError("dataset", "must have a length (a map-style torch Dataset)") from None
    if isinstance(sampler, BatchSampler):
        if num_examples is not None and sampler.num_examples != num_examples:
            raise CorrnoiseError("sampler", f"was built for {sampler.num_examples} examples, the dataset has "
                                 f"{num_examples}")
        if steps is not None and steps > sampler.steps:
            raise CorrnoiseError("steps", f"{steps} steps but the sampler yields only {sampler.steps} batches")
        run_steps = sampler.steps if steps is None else check_int("steps", steps, minimum=1)
        strategy = mechanism if isinstance(mechanism, Strategy) else _parse_mechanism(mechanism, run_steps)
    else:
        if num_examples is None:
            raise CorrnoiseError("dataset", "give the training dataset (or a ready sampler)")
        if batch_size is None:
            raise CorrnoiseError("batch_size", "give the (expected) batch size")
        if not isinstance(sampler, str):
            raise CorrnoiseError("sampler", f"must be a corrnoise sampler or one of {', '.join(SAMPLINGS)}")
        check_run_size(num_examples, batch_size, epochs, steps)
        # the number of bands decides the sampler; a name needs n, so parse it once for the bands
        probe_steps = steps if steps is not None else max(1, int(round(
            check_real("epochs", epochs if epochs is not None else math.nan, low=0.0, low_open=True)
            * num_examples / batch_size)))
        probe = mechanism if isinstance(mechanism, Strategy) else _parse_mechanism(mechanism, probe_steps)
        if sampler == "auto":
            sampler = choose_batching(probe, num_examples, batch_size)
        sampler = make_sampler(sampler, min(int(probe.bands), probe.n), num_examples, batch_size,
                               epochs=epochs if steps is None else None, steps=steps, seed=seed)
        run_steps = sampler.steps
        strategy = mechanism if isinstance(mechanism, Strategy) else _parse_mechanism(mechanism, run_steps)

    agreement = check_agreement(strategy, sampler=sampler, steps=run_steps, method=accounting_method, delta=delta)
    refuse_non_guarantees(accounting_options)
    if epsilon is not None:
        result = require_guarantee(calibrate(agreement.event, epsilon=epsilon, delta=delta,
                                             method=accounting_method, **(accounting_options or {})), "training")
        nu = result.noise_std
    elif noise_std is not None:
        nu = check_real("noise_std", noise_std, low=0.0, low_open=True)
    else:
        from ..accounting import column_norm

        nu = check_real("noise_multiplier", noise_multiplier, low=0.0, low_open=True) * column_norm(
            agreement.event.mechanism)

    return PrivatePlan(strategy, sampler, agreement, nu, result if epsilon is not None else None)


def check_run_size(num_examples: int, batch_size, epochs, steps) -> None:
    """The run's size as a user gives it: a batch no larger than the dataset, and its length
    (``epochs`` or ``steps``); else one line naming the parameter (before anything
    is built from them: a mechanism for 0 steps would report its own, unhelpful, limit)."""
    b = check_int("batch_size", batch_size, minimum=1)
    if b > num_examples:
        raise CorrnoiseError("batch_size", f"{b} is larger than the dataset ({num_examples} examples); use a batch of "
                             f"at most {num_examples}")
    if epochs is None and steps is None:
        raise CorrnoiseError("epochs", "give the run's length: epochs or steps (the mechanism and its noise are "
                             "built for it)")


class PrivatePlan(NamedTuple):
    """What :func:`plan_private` decided: the mechanism, the sampler, the checked agreement, the
    noise_std, and the calibration (the guarantee the noise was calibrated to, when it was)."""

    strategy: Strategy
    sampler: BatchSampler
    agreement: Agreement
    noise_std: float
    calibration: PrivacyResult | None


def refuse_non_guarantees(accounting_options: dict[str, Any] | None) -> None:
    """Training noise and ``privacy_spent`` rest on formal guarantees only (seed 000 Thm 2.1:
    an unverified Monte Carlo estimate is never released; an MMCC lower bound proves nothing), so
    accounting options asking for either are refused before anything runs."""
    for name in ("estimate", "lower_bound"):
        if (accounting_options or {}).get(name):
            raise CorrnoiseError(name, f"training needs a formal (epsilon, delta) guarantee; accounting option "
                                 f"{name}=True would give none (drop it)")
