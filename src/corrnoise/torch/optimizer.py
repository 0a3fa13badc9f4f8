"""Private training in three lines: ``make_private`` and the :class:`PrivateOptimizer` wrapper.

    private = make_private(model, optimizer, loss_fn, train_set, mechanism="bsr:4",
                           epsilon=8.0, delta=1e-5, batch_size=64, epochs=10)
    for x, y in private.data_loader:
        private.step(x, y)
    print(private.privacy_spent())        # PrivacyResult: epsilon, delta, noise_std, ...

Each ``step`` is one iteration of tutorial Alg. 3.1: per-example gradients, clipping to the
clip norm, summing (:mod:`.per_example`), adding zeta * nu * (C^{-1} Z)[t] and dividing by the
expected batch size (:mod:`.privatizer`), then the wrapped ``torch.optim`` optimizer's own
update (SGD, momentum, Adam, ...: any first-order rule is post-processing of g_hat_t; the
tutorial recommends the prefix-sum workload whatever the optimizer, Sec. 4.4.1).

Before anything runs, :func:`check_agreement` checks that the sampler that forms the batches
and the accounting describe the same run (same scheme, same rate, the sampler's participation
covered by the accounted schema); what runs is then one
:class:`~corrnoise.accounting.MechanismEvent`, and whether the accounting method may analyse it
(steps within the mechanism, bands <= blocks, square or non-negative C ...) is decided by the one
accounting gate, :func:`corrnoise.accounting.prepare` -- nothing here repeats those checks. A
mismatch is one CorrnoiseError naming the parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

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
from ..participation import Cyclic, MinSep, Single, parse_participation
from ..sampling import (
    BallsInBinsSampler,
    BatchSampler,
    BlockCyclicPoissonSampler,
    CyclicSampler,
    PoissonSampler,
)
from ..strategies import Strategy, parse_strategy
from .per_example import clipped_gradient_sum, trainable_parameters
from .privatizer import Privatizer

__all__ = ["Agreement", "check_agreement", "leading_strategy", "privacy_spent", "PrivateOptimizer", "make_private",
           "make_sampler", "plan_private"]


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


def _participation_covers(accounted, actual) -> bool:
    """Whether every pattern of the sampler's schema ``actual`` is allowed by ``accounted``."""
    if accounted.spec == actual.spec:
        return True
    if isinstance(accounted, MinSep):
        if isinstance(actual, (Cyclic, MinSep)):
            return actual.b >= accounted.b and actual.k <= accounted.k
        if isinstance(actual, Single):
            return True
    if isinstance(actual, Single):
        return True  # one participation is allowed by every schema
    return False


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
            if not _participation_covers(chosen.participation, actual):
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
        accounted_steps = balls_in_bins_accounted_steps(steps, batching.bins)
        if accounted_steps > strategy.n:
            raise CorrnoiseError(
                "steps", f"{steps} steps of balls-in-bins:{batching.bins} are accounted as {accounted_steps} "
                f"(whole epochs of {batching.bins} bins) but {strategy.label} has only n = {strategy.n} steps; "
                f"build the mechanism for a multiple of {batching.bins} steps")
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
# The optimizer wrapper
# ----------------------------------------------------------------------------------------------
class PrivateOptimizer:
    """Wraps a ``torch.optim`` optimizer: ``step(inputs, targets)`` runs one private step.

    Built by :func:`make_private` (or directly, with a ready :class:`Privatizer`). Attributes:
    ``optimizer`` (the wrapped one), ``model``, ``privatizer``, ``strategy``, ``batching``,
    ``delta``, ``steps`` (planned), ``steps_taken``, ``sampler`` / ``data_loader`` when known,
    ``last_stats`` (non-private loss, batch count, clipped fraction of the last step).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        privatizer: Privatizer,
        *,
        strategy: Strategy,
        batching: Any,
        delta: float,
        steps: int,
        accounting_method: str = "auto",
        sampler: BatchSampler | None = None,
        chunk_size: int | None = None,
        accounting_options: dict[str, Any] | None = None,
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise CorrnoiseError("optimizer", f"must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.model = model
        self.loss_fn = loss_fn
        self.params = list(trainable_parameters(model).values())
        ids = {id(p) for p in self.params}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in ids:
                    raise CorrnoiseError("optimizer", "optimizes a tensor that is not a trainable parameter of the "
                                         "model; its gradient would not be privatized")
        self.privatizer = privatizer
        self.strategy = strategy
        self.delta = check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
        agreement = check_agreement(strategy, sampler=sampler, batching=batching, steps=steps,
                                    method=accounting_method, delta=self.delta)
        self.batching = agreement.batching
        self.accounting_method = accounting_method
        self.accounting_options = dict(accounting_options or {})
        self.steps = agreement.steps
        if privatizer.steps < self.steps:
            raise CorrnoiseError("steps", f"the noise generator has {privatizer.steps} rows for {self.steps} steps")
        self.sampler = sampler
        self.data_loader = None
        self.chunk_size = chunk_size
        self.steps_taken = 0
        self.last_stats: dict[str, Any] = {}

    # torch.optim look-alike ---------------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def noise_std(self) -> float:
        return self.privatizer.noise_std

    @property
    def clip_norm(self) -> float:
        return self.privatizer.clip_norm

    # the private step ------------------------------------------------------------------------
    def _check_step(self) -> None:
        if self.steps_taken >= self.steps:
            raise CorrnoiseError(
                "steps", f"all {self.steps} planned steps are done; the privacy guarantee covers no more "
                "(plan more steps with make_private)")
        if self.privatizer.step != self.steps_taken:
            raise CorrnoiseError(
                "steps", f"the noise generator is at row {self.privatizer.step} but this is step {self.steps_taken}; "
                "step t must add row t (a row used twice is reused noise): use a fresh privatizer, or restore "
                "both from one state_dict")

    def apply_sums(self, sums: list[torch.Tensor]) -> None:
        """Privatize summed clipped gradients (one per trainable parameter), write them to
        ``.grad`` and run the wrapped optimizer's step."""
        self._check_step()
        noisy = self.privatizer.privatize(sums)
        for p, g in zip(self.params, noisy):
            p.grad = g.to(dtype=p.dtype)
        self.optimizer.step()
        self.steps_taken += 1

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None) -> dict[str, Any]:
        """One step of Alg. 3.1 on this batch (may be empty); returns non-private statistics."""
        self._check_step()
        sums, stats = clipped_gradient_sum(self.model, self.loss_fn, inputs, targets, self.clip_norm,
                                           weights=weights, chunk_size=self.chunk_size)
        self.apply_sums(sums)
        self.last_stats = stats
        return stats

    # privacy ------------------------------------------------------------------------------
    def privacy_spent(self, steps: int | None = None, **options: Any) -> PrivacyResult:
        """(epsilon, delta) for the steps taken so far (or ``steps``), by the accounting that
        calibrated the noise. Zero steps: epsilon 0."""
        k = self.steps_taken if steps is None else check_int("steps", steps, minimum=0, maximum=self.steps)
        return privacy_spent(self.strategy, self.batching, noise_std=self.noise_std, delta=self.delta, steps=k,
                             planned_steps=self.steps, method=self.accounting_method, **{**self.accounting_options, **options})

    def _sampler_state(self) -> dict[str, Any] | None:
        return None if self.sampler is None else {"seed": int(self.sampler.seed), **self.sampler.describe()}

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, privatizer (noise seed and step) and sampler (seed and description) state:
        as private as the data (the seeds rebuild the noise and the batches)."""
        return {"optimizer": self.optimizer.state_dict(), "privatizer": self.privatizer.state_dict(),
                "steps_taken": self.steps_taken, "sampler": self._sampler_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`. The sampler must be the one the checkpoint's batches
        came from (same seed and description): a block split, shuffle or bin assignment drawn
        anew would put examples in steps the accounting's schema does not allow."""
        mine, saved = self._sampler_state(), state.get("sampler")
        if mine is not None and saved != mine:
            if saved is None:
                raise CorrnoiseError("sampler", "the checkpoint records no sampler; its batches cannot be "
                                     "continued safely")
            diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
            raise CorrnoiseError("sampler", f"this sampler differs from the checkpoint's in {', '.join(diff)}; "
                                 "rebuild it with the checkpoint's (state['sampler']['seed'] as the seed)")
        self.optimizer.load_state_dict(state["optimizer"])
        self.privatizer.load_state_dict(state["privatizer"])
        self.steps_taken = check_int("steps_taken", state["steps_taken"], minimum=0, maximum=self.steps)
        if self.sampler is not None:
            self.sampler.start_step = self.steps_taken


# ----------------------------------------------------------------------------------------------
# make_private
# ----------------------------------------------------------------------------------------------
SAMPLINGS = ("auto", "poisson", "block-cyclic", "cyclic", "balls-in-bins")


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

    ``auto``: Poisson for a diagonal C; block-cyclic Poisson with blocks = bands when
    batch_size * bands <= num_examples (tutorial Sec. 4.4.3: the preferred centralized schema);
    otherwise cyclic fixed batches (no amplification). Steps default to ``epochs`` passes over
    the data (num_examples / batch_size steps per epoch; N // B for cyclic batches).
    """
    if sampling not in SAMPLINGS:
        raise CorrnoiseError("sampling", f"must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
    n_ex = check_int("num_examples", num_examples, minimum=1)
    b = check_int("batch_size", batch_size, minimum=1, maximum=n_ex)
    if sampling == "auto":
        if strategy_bands <= 1:
            sampling = "poisson"
        elif b * strategy_bands <= n_ex:
            sampling = "block-cyclic"
        else:
            sampling = "cyclic"
    if (steps is None) == (epochs is None):
        raise CorrnoiseError("steps", "give exactly one of steps and epochs")
    if sampling == "cyclic":
        per_epoch = n_ex // b
        if steps is None:
            steps = max(1, int(round(check_real("epochs", epochs, low=0.0, low_open=True) * per_epoch)))
        return CyclicSampler(n_ex, b, steps=steps, seed=seed)
    if steps is None:
        steps = max(1, int(round(check_real("epochs", epochs, low=0.0, low_open=True) * n_ex / b)))
    if sampling == "poisson":
        return PoissonSampler(n_ex, b / n_ex, steps, seed=seed)
    if sampling == "block-cyclic":
        blocks = max(1, strategy_bands)
        p = b * blocks / n_ex
        if p > 1.0:
            raise CorrnoiseError("batch_size", f"block-cyclic sampling with {blocks} blocks of ~{n_ex // blocks} "
                                 f"examples cannot give batches of {b}; use a smaller batch or fewer bands")
        return BlockCyclicPoissonSampler(n_ex, blocks, p, steps, seed=seed)
    bins = max(1, n_ex // b)
    return BallsInBinsSampler(n_ex, min(bins, steps), steps, batch_size=b, seed=seed)


class _SafeCollate:
    """default_collate, except that an empty batch (Poisson sampling) becomes tensors with a
    leading dimension 0 shaped like the dataset's items."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.template = None

    def __call__(self, batch):
        from torch.utils.data import default_collate

        if len(batch):
            return default_collate(batch)
        if self.template is None:
            self.template = default_collate([self.dataset[0]])
        return _empty_like(self.template)


def _empty_like(value):
    if isinstance(value, torch.Tensor):
        return value[:0]
    if isinstance(value, (list, tuple)):
        return type(value)(_empty_like(v) for v in value)
    if isinstance(value, dict):
        return {k: _empty_like(v) for k, v in value.items()}
    return value


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
) -> tuple[Strategy, BatchSampler, Agreement, float]:
    """(strategy, sampler, agreement, noise_std): the checked plan behind :func:`make_private`
    (and the Opacus adapter). Arguments as for :func:`make_private`."""
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
        strategy = mechanism if isinstance(mechanism, Strategy) else parse_strategy(mechanism, run_steps)
    else:
        if num_examples is None:
            raise CorrnoiseError("dataset", "give the training dataset (or a ready sampler)")
        if batch_size is None:
            raise CorrnoiseError("batch_size", "give the (expected) batch size")
        if not isinstance(sampler, str):
            raise CorrnoiseError("sampler", f"must be a corrnoise sampler or one of {', '.join(SAMPLINGS)}")
        # the number of bands decides the sampler; a name needs n, so parse it once for the bands
        probe_steps = steps if steps is not None else max(1, int(round(
            check_real("epochs", epochs if epochs is not None else math.nan, low=0.0, low_open=True)
            * num_examples / batch_size)))
        probe = mechanism if isinstance(mechanism, Strategy) else parse_strategy(mechanism, probe_steps)
        sampler = make_sampler(sampler, min(int(probe.bands), probe.n), num_examples, batch_size,
                               epochs=epochs if steps is None else None, steps=steps, seed=seed)
        run_steps = sampler.steps
        strategy = mechanism if isinstance(mechanism, Strategy) else parse_strategy(mechanism, run_steps)

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


def make_private(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
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
    clip_norm: float = 1.0,
    seed: int | None = None,
    noise_seed: int | None = None,
    accounting_method: str = "auto",
    noise_method: str = "auto",
    num_workers: int = 0,
    chunk_size: int | None = None,
    accounting_options: dict[str, Any] | None = None,
) -> PrivateOptimizer:
    """Privatize an existing training loop.

    ``mechanism``: a :class:`Strategy` or a name (``identity``, ``bsr:4``, ``dpcgd:0.5``,
    ``blt:...``, a mechanism file ...; built for the number of steps). The noise is calibrated
    for ``epsilon`` (with ``delta``) under the sampler's batching, or given as ``noise_std``
    (nu) or ``noise_multiplier`` (sigma = nu / ||C||_col). ``sampler`` is a ready
    :mod:`corrnoise.sampling` sampler or one of ``auto, poisson, block-cyclic, cyclic,
    balls-in-bins`` built from ``batch_size`` and ``epochs`` / ``steps``. With a ``dataset``
    the result has a ``data_loader`` yielding the sampler's batches (possibly empty); with a
    fixed-size balls-in-bins sampler it yields ``((x, y), w)`` with weight 0 for padding entries:
    call ``step(x, y, weights=w)`` (seed 000 App. I: always B entries, always divided by B).
    ``accounting_options`` go to the accounting method for calibration and ``privacy_spent``
    (e.g. ``{"discretization": 1e-3}`` for a coarser, still pessimistic, PLD grid).
    ``seed`` drives the sampler only. ``noise_seed`` drives the noise: leave it None (a secret
    seed from the OS) for any real release -- whoever knows it can regenerate and subtract the
    noise; set it only for reproducible experiments and tests.
    """
    strategy, sampler, agreement, nu, _ = plan_private(
        dataset, mechanism=mechanism, delta=delta, epsilon=epsilon, noise_std=noise_std,
        noise_multiplier=noise_multiplier, batch_size=batch_size, epochs=epochs, steps=steps, sampler=sampler,
        seed=seed, accounting_method=accounting_method, accounting_options=accounting_options)
    run_steps = agreement.steps
    params = list(trainable_parameters(model).values())
    privatizer = Privatizer.for_parameters(strategy, params, noise_std=nu, clip_norm=clip_norm,
                                           expected_batch_size=sampler.expected_batch_size, seed=noise_seed,
                                           method=noise_method)
    private = PrivateOptimizer(optimizer, model, loss_fn, privatizer, strategy=strategy, batching=agreement.batching,
                               delta=delta, steps=run_steps, accounting_method=accounting_method, sampler=sampler,
                               chunk_size=chunk_size, accounting_options=accounting_options)
    if dataset is not None:
        from torch.utils.data import DataLoader

        if isinstance(sampler, BallsInBinsSampler) and sampler.batch_size is not None:
            dataset = sampler.wrap_dataset(dataset)  # padding entries -> (item, weight 0), seed 000 App. I
        private.data_loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=_SafeCollate(dataset),
                                         num_workers=num_workers)
    return private
