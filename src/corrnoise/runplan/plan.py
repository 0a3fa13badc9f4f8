"""Planning a private run once: :func:`plan_run` -> :class:`~corrnoise.runplan.RunPlan`.

Every decision about a private run -- the mechanism (a name, a file, a Strategy, or the
planner's choice for ``auto`` / a family), the batching (``auto``: what suits the mechanism; a
pipeline: what it forms), the sampler, the agreement of sampler and accounting, the accounting
gate and the noise (calibrated to a formal guarantee, or given, or a given guarantee checked to
be of exactly this run) -- is made here, for :func:`corrnoise.torch.make_private`,
:func:`corrnoise.training.train`, the planner's ``--plan-out`` and ``corrnoise train --plan``.
:func:`plan_private` is the older tuple-valued form (a sampler built with its seed).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

from ..accounting import PrivacyResult, column_norm
from ..accounting.cache import cached_calibrate
from ..accounting.base import require_guarantee
from ..errors import CorrnoiseError, check_int, check_real
from ..pipelines import AUTO, BATCHINGS, PIPELINES, pipeline_of
from ..sampling import BatchSampler, make_sampler
from ..strategies import Strategy
from ..strategies.registry import NAMES_HELP
from .agreement import Agreement, check_agreement, matching_guarantee, refuse_non_guarantees, reproved_guarantee
from .batching import SamplerSpec, choose_batching, estimated_steps, pipeline_batching, sampling_for, steps_per_epoch
from .mechanism import is_planned, parse_mechanism, plan_mechanism, planned_batching
from .value import RunPlan, check_plan_path

__all__ = ["PrivatePlan", "candidate_choice", "check_length", "check_plan_out", "check_run_size", "choose_mechanism",
           "plan_choice", "plan_of_recommendation", "plan_private", "plan_run"]


# ----------------------------------------------------------------------------------------------
# The run as one value
# ----------------------------------------------------------------------------------------------
def plan_run(
    *,
    dataset_size: int,
    batch_size: int,
    delta: float,
    mechanism: str | Strategy = AUTO,
    batching: str | BatchSampler = AUTO,
    pipeline: str | None = None,
    epsilon: float | None = None,
    noise_std: float | None = None,
    noise_multiplier: float | None = None,
    guarantee: PrivacyResult | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    accounting_method: str = "auto",
    accounting_options: dict[str, Any] | None = None,
    progress=None,
    noise_budget=None,
) -> RunPlan:
    """The :class:`RunPlan` of a private run on ``dataset_size`` examples in (expected) batches of
    ``batch_size`` -- every decision about mechanism, batching, sampler and noise, made once.

    ``mechanism``: ``auto`` or a planner family (the planner's best for the run and the pipeline
    ``batching`` describes), a name (``identity``, ``bsr:4``, ``dpcgd:0.9`` ...), a mechanism file
    or a Strategy. ``batching``: ``auto`` (what suits the mechanism,
    :func:`~corrnoise.runplan.choose_batching`), a name of :data:`corrnoise.pipelines.BATCHINGS`
    or a ready :mod:`corrnoise.sampling` sampler. Or ``pipeline`` instead of ``batching``: the
    data pipeline the user has (:data:`corrnoise.pipelines.PIPELINES`, ``corrnoise train
    --batching``), with ``epsilon`` and ``epochs``: the planner's choice for it, or a named
    mechanism with the batching the pipeline forms that suits it. Exactly one of ``epsilon``
    (noise calibrated to a formal guarantee), ``noise_std``, ``noise_multiplier`` and
    ``guarantee`` (a formal guarantee of exactly this run, by content: its noise is used).
    Exactly one of ``epochs`` and ``steps`` (a ready sampler may stand for both).
    ``accounting_options`` asking for an estimate or a lower bound are refused. ``noise_budget``
    (:class:`corrnoise.noise_memory.NoiseBudget`): a planned mechanism is chosen within it.
    """
    if pipeline is not None:
        return _plan_for_pipeline(pipeline, mechanism, batching, dataset_size=dataset_size, batch_size=batch_size,
                                  delta=delta, epsilon=epsilon, others=(noise_std, noise_multiplier, guarantee, steps),
                                  epochs=epochs, accounting_method=accounting_method,
                                  accounting_options=accounting_options, progress=progress)
    epochs, steps = check_length(epochs, steps)
    ready = batching if isinstance(batching, BatchSampler) else None
    if ready is None:
        if batching not in BATCHINGS:
            raise CorrnoiseError("batching", f"must be one of {', '.join(BATCHINGS)} or a corrnoise.sampling sampler, "
                                 f"got {batching!r}")
        check_run_size(dataset_size, batch_size, epochs, steps)
    given_epochs, label, planned = epochs, mechanism if isinstance(mechanism, str) else None, None
    asked_pipeline = None if ready is not None else pipeline_of(batching)
    if is_planned(mechanism, calibrated=epsilon is not None):
        if guarantee is not None or epsilon is None:
            raise CorrnoiseError("mechanism", f"{mechanism!r} is chosen by the planner for an epsilon: give epsilon, "
                                 f"or name a mechanism to use a given noise ({NAMES_HELP})")
        if ready is not None:
            raise CorrnoiseError("mechanism", f"{mechanism!r} is chosen with its batching: pass batching as a name")
        asked = batching
        mechanism, batching, steps, guarantee, planned = plan_mechanism(
            mechanism, batching, num_examples=dataset_size, batch_size=batch_size, epochs=epochs, steps=steps,
            epsilon=epsilon, delta=delta, progress=progress, noise_budget=noise_budget)
        epsilon, epochs, label = None, None, planned.recommended.mechanism
        _warn_other_batching(asked, batching, label)
    if guarantee is not None:
        if any(v is not None for v in (epsilon, noise_std, noise_multiplier)):
            raise CorrnoiseError("guarantee", "give a guarantee or one of epsilon, noise_std, noise_multiplier, not both")
        if not isinstance(guarantee, PrivacyResult) or guarantee.kind != "guarantee":
            raise CorrnoiseError("guarantee", "must be a PrivacyResult of kind 'guarantee' (estimates and lower "
                                 "bounds never calibrate training noise)")
        noise_std = guarantee.noise_std
    name = None if ready is not None else sampling_for(batching, mechanism, dataset_size, batch_size, epochs, steps)
    strategy, sampler, agreement, nu, calibration = _plan_private(
        dataset_size, mechanism=mechanism, delta=delta, epsilon=epsilon, noise_std=noise_std,
        noise_multiplier=noise_multiplier, batch_size=batch_size, epochs=epochs, steps=steps,
        sampler=ready if ready is not None else name, seed=0,  # seed 0: a probe; the run draws its own
        accounting_method=accounting_method, accounting_options=accounting_options)
    if guarantee is not None:
        calibration = reproved_guarantee(matching_guarantee(guarantee, agreement, delta),
                                         agreement.event.with_noise(nu), agreement.method,
                                         dict(accounting_options or {}), "the given guarantee")
    return RunPlan(strategy, SamplerSpec.of(name, sampler, batch_size), agreement.event.with_noise(nu),
                   agreement.method, calibration, dataset_size, batch_size, given_epochs,
                   steps_per_epoch(sampler, given_epochs, dataset_size, batch_size), delta, accounting_method,
                   dict(accounting_options or {}), label or strategy.label, asked_pipeline,
                   tuple(c.to_dict() for c in planned.candidates) if planned is not None else (), planned,
                   _planned_noise_method(planned))


def _warn_other_batching(asked: str, formed: str, label: str) -> None:
    """A UserWarning where the planner's pick for an explicitly named ``batching`` forms its batches
    another way: a Poisson or balls-in-bins pipeline may be accounted unamplified (tutorial
    Sec. 3.3: any batches, the pipeline's participation), and its batches are then formed in
    cyclic order. The guarantee holds for what runs; the warning says the asked sampling is not
    what runs (found by a user probe: ``batching="poisson"`` with ``mechanism="bandmf"`` trained
    on cyclic batches without a word)."""
    if asked == AUTO or pipeline_of(formed) == pipeline_of(asked):
        return
    import warnings

    from ..errors import user_stacklevel

    warnings.warn(f"batching={asked!r}: the planner's best {label} for this run is accounted without amplification, "
                  f"so its batches are formed as {formed!r}, not by {asked} sampling; name a mechanism (identity, "
                  f"bsr:4, ...) to train on {asked} batches, or pass batching='auto'", UserWarning,
                  stacklevel=user_stacklevel())


def _plan_for_pipeline(pipeline, mechanism, batching, *, dataset_size, batch_size, delta, epsilon, others, epochs,
                       accounting_method, accounting_options, progress) -> RunPlan:
    """:func:`plan_run` for a data ``pipeline`` (``corrnoise train``): :func:`choose_mechanism`,
    then :func:`plan_choice`."""
    if pipeline not in PIPELINES:
        raise CorrnoiseError("pipeline", f"must be one of {', '.join(PIPELINES)}, got {pipeline!r}")
    if batching != AUTO:
        raise CorrnoiseError("batching", "give the batching or the pipeline, not both")
    if any(v is not None for v in others) or epsilon is None or epochs is None:
        raise CorrnoiseError("pipeline", "a plan for a pipeline takes epsilon and epochs")
    choice = choose_mechanism(mechanism, num_examples=dataset_size, batch_size=batch_size, epochs=epochs,
                              epsilon=epsilon, delta=delta, pipeline=pipeline, progress=progress)
    return plan_choice(choice, dataset_size=dataset_size, batch_size=batch_size, epochs=epochs, delta=delta,
                       pipeline=pipeline, accounting_method=accounting_method, accounting_options=accounting_options)


def check_length(epochs, steps) -> tuple[float | None, int | None]:
    """The run's length as given: at most one of ``epochs`` (a positive number) and ``steps``
    (a positive integer); else one line naming the parameter."""
    if epochs is not None and steps is not None:
        raise CorrnoiseError("steps", "give exactly one of epochs and steps (the run's length)")
    if epochs is not None:
        if isinstance(epochs, (str, bool)):
            raise CorrnoiseError("epochs", f"must be a number, got {epochs!r}")
        epochs = check_real("epochs", epochs, low=0.0, low_open=True)
    if steps is not None:
        steps = check_int("steps", steps, minimum=1)
    return epochs, steps


def check_run_size(num_examples: int, batch_size, epochs, steps) -> None:
    """The run's size as a user gives it: a batch no larger than the dataset, and its length
    (``epochs`` or ``steps``); else one line naming the parameter (before anything
    is built from them: a mechanism for 0 steps would report its own, unhelpful, limit)."""
    b = check_int("batch_size", batch_size, minimum=1)
    if num_examples == 0:  # "use a batch of at most 0" said it before (a user probe)
        raise CorrnoiseError("data_loader", "the dataset is empty (len() is 0): there is nothing to train on")
    if b > num_examples:
        raise CorrnoiseError("batch_size", f"{b} is larger than the dataset ({num_examples} examples); use a batch of "
                             f"at most {num_examples}")
    if epochs is None and steps is None:
        raise CorrnoiseError("epochs", "give the run's length: epochs or steps (the mechanism and its noise are "
                             "built for it)")


# ----------------------------------------------------------------------------------------------
# What to train for a pipeline: the planner's candidate, or a named mechanism
# ----------------------------------------------------------------------------------------------
def candidate_choice(candidate, planned) -> dict[str, Any]:
    """What to train for one of the planner's candidates (given its final guarantee, see
    :func:`corrnoise.planner.finalize_candidate`): the :func:`choose_mechanism` dict."""
    if not candidate.final:
        raise CorrnoiseError("candidate", f"{candidate.mechanism} under {candidate.batching} has no final guarantee")
    return {"mechanism": candidate.strategy, "batching": planned_batching(candidate.batching),
            "label": candidate.mechanism, "noise": {"guarantee": candidate.result}, "steps": planned.setup.n,
            "plan": planned, "candidates": [c.to_dict() for c in planned.candidates]}


def choose_mechanism(mechanism: str, *, num_examples: int, batch_size: int, epochs: float, epsilon: float,
                     delta: float, pipeline: str, progress=None) -> dict[str, Any]:
    """What to train: ``{"mechanism", "batching", "steps" | "epochs", "noise", "label", "candidates"}``.

    ``auto`` and the planner's families go to the planner (:func:`plan_mechanism`), which
    returns the mechanism, its batching for the pipeline and the guarantee its noise was
    calibrated to (verified where it is Monte Carlo); an explicit name is trained as named with
    the batching the pipeline forms that suits it (:func:`pipeline_batching`), its noise
    calibrated for ``epsilon``.
    """
    if is_planned(mechanism, calibrated=True):
        planned = plan_mechanism(mechanism, pipeline, num_examples=num_examples, batch_size=batch_size, epochs=epochs,
                                 steps=None, epsilon=epsilon, delta=delta, progress=progress)[-1]
        return candidate_choice(planned.recommended, planned)
    from ..planner import FAMILIES as PLANNED
    from ..strategies import parse_strategy

    n = estimated_steps(num_examples, batch_size, epochs)
    try:
        probe = mechanism if isinstance(mechanism, Strategy) else parse_strategy(mechanism, n)
    except CorrnoiseError as exc:
        raise CorrnoiseError("mechanism", f"{exc.message}; or a family: auto, {', '.join(PLANNED)}") from None
    return {"mechanism": mechanism, "batching": pipeline_batching(probe, pipeline, num_examples, batch_size),
            "label": mechanism if isinstance(mechanism, str) else probe.label, "noise": {"epsilon": epsilon},
            "epochs": epochs}


def plan_choice(choice: dict[str, Any], *, dataset_size: int, batch_size: int, epochs: float | None, delta: float,
                pipeline: str | None = None, accounting_method: str = "auto",
                accounting_options: dict[str, Any] | None = None) -> RunPlan:
    """The :class:`RunPlan` of a :func:`choose_mechanism` / :func:`candidate_choice` result."""
    if not isinstance(choice, dict) or not {"mechanism", "batching", "noise", "label"} <= set(choice):
        raise CorrnoiseError("choice", "must be a choose_mechanism() / candidate_choice() result")
    length = {"steps": choice["steps"]} if "steps" in choice else {"epochs": epochs}
    plan = plan_run(dataset_size=dataset_size, batch_size=batch_size, delta=delta, mechanism=choice["mechanism"],
                    batching=choice["batching"], accounting_method=accounting_method,
                    accounting_options=accounting_options, **length, **choice["noise"])
    # a planner candidate is given in steps (its loader pass stays the natural one), planned for ``epochs``
    return replace(plan, label=choice["label"], pipeline=pipeline if pipeline is not None else plan.pipeline,
                   epochs=plan.epochs if plan.epochs is not None else epochs,
                   candidates=tuple(choice.get("candidates", ())), planner_result=choice.get("plan"),
                   noise_method=_planned_noise_method(choice.get("plan")))


def _planned_noise_method(planned) -> str:
    """The planner's noise method for its recommendation ("regenerate" where a noise memory
    budget did not fit the buffers), "auto" without a planner result."""
    rec = getattr(planned, "recommended", None)
    return getattr(rec, "noise_method", "auto") or "auto"


def plan_of_recommendation(planned, candidate=None) -> RunPlan:
    """The :class:`RunPlan` of the planner's recommended (or another final) candidate of a
    :class:`~corrnoise.planner.PlanResult` planned by dataset size, batch size and epochs
    (``corrnoise plan --plan-out``): its mechanism, batching and guarantee, checked to be of
    exactly that run."""
    setup = planned.setup
    check_plan_out(None, setup)
    return plan_choice(candidate_choice(candidate if candidate is not None else planned.recommended, planned),
                       dataset_size=setup.dataset_size, batch_size=setup.batch_size, epochs=setup.epochs,
                       delta=setup.delta, pipeline=setup.pipeline)


def check_plan_out(path, setup) -> None:
    """Before planning: a plan file is a ``.json`` path, and of a data set (the planner's setup
    gives the dataset size and batch size, not only steps)."""
    if path is not None:
        check_plan_path(path, "plan_out")
    if setup.dataset_size is None or setup.batch_size is None:
        raise CorrnoiseError("plan_out", "a plan file is of a data set: plan with --dataset-size and --batch-size")


# ----------------------------------------------------------------------------------------------
# The older form: a checked plan with a ready sampler
# ----------------------------------------------------------------------------------------------
class PrivatePlan(NamedTuple):
    """What :func:`plan_private` decided: the mechanism, the sampler, the checked agreement, the
    noise_std, and the calibration (the guarantee the noise was calibrated to, when it was)."""

    strategy: Strategy
    sampler: BatchSampler
    agreement: Agreement
    noise_std: float
    calibration: PrivacyResult | None


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
) -> PrivatePlan:
    """The checked :class:`PrivatePlan` of a run on ``dataset``: ``sampler`` a ready corrnoise
    sampler or a batching name (:func:`corrnoise.sampling.make_sampler`, built with ``seed``);
    ``mechanism`` a name, file or Strategy (no planner); exactly one of ``epsilon`` (calibrated
    to a formal guarantee), ``noise_std`` and ``noise_multiplier``; ``accounting_options``
    asking for an estimate or a lower bound are refused. :func:`plan_run` builds on it."""
    if sum(v is not None for v in (epsilon, noise_std, noise_multiplier)) != 1:
        raise CorrnoiseError("epsilon", "give exactly one of epsilon, noise_std and noise_multiplier")
    num_examples = None
    if dataset is not None:
        try:
            num_examples = len(dataset)
        except TypeError:
            raise CorrnoiseError("dataset", "must have a length (a map-style torch Dataset)") from None
    return _plan_private(num_examples, mechanism=mechanism, delta=delta, epsilon=epsilon, noise_std=noise_std,
                         noise_multiplier=noise_multiplier, batch_size=batch_size, epochs=epochs, steps=steps,
                         sampler=sampler, seed=seed, accounting_method=accounting_method,
                         accounting_options=accounting_options)


def _plan_private(num_examples, *, mechanism, delta, epsilon, noise_std, noise_multiplier, batch_size, epochs, steps,
                  sampler, seed, accounting_method, accounting_options) -> PrivatePlan:
    if sum(v is not None for v in (epsilon, noise_std, noise_multiplier)) != 1:
        raise CorrnoiseError("epsilon", "give exactly one of epsilon, noise_std and noise_multiplier")
    if isinstance(sampler, BatchSampler):
        if num_examples is not None and sampler.num_examples != num_examples:
            raise CorrnoiseError("sampler", f"was built for {sampler.num_examples} examples, the dataset has "
                                 f"{num_examples}")
        if steps is not None and steps > sampler.steps:
            raise CorrnoiseError("steps", f"{steps} steps but the sampler yields only {sampler.steps} batches")
        run_steps = sampler.steps if steps is None else check_int("steps", steps, minimum=1)
        strategy = mechanism if isinstance(mechanism, Strategy) else parse_mechanism(mechanism, run_steps)
    else:
        if num_examples is None:
            raise CorrnoiseError("dataset", "give the training dataset (or a ready sampler)")
        if batch_size is None:
            raise CorrnoiseError("batch_size", "give the (expected) batch size")
        if not isinstance(sampler, str):
            raise CorrnoiseError("sampler", f"must be a corrnoise sampler or one of {', '.join(BATCHINGS)}")
        check_run_size(num_examples, batch_size, epochs, steps)
        # the number of bands decides the sampler; a name needs n, so parse it once for the bands
        probe = mechanism if isinstance(mechanism, Strategy) else parse_mechanism(
            mechanism, estimated_steps(num_examples, batch_size, epochs, steps))
        if sampler == AUTO:
            sampler = choose_batching(probe, num_examples, batch_size)
        sampler = make_sampler(sampler, min(int(probe.bands), probe.n), num_examples, batch_size,
                               epochs=epochs if steps is None else None, steps=steps, seed=seed)
        run_steps = sampler.steps
        strategy = mechanism if isinstance(mechanism, Strategy) else parse_mechanism(mechanism, run_steps)

    agreement = check_agreement(strategy, sampler=sampler, steps=run_steps, method=accounting_method, delta=delta)
    refuse_non_guarantees(accounting_options)
    result = None
    if epsilon is not None:
        # through the cache of verified guarantees: the same run planned again (or its plan file
        # loaded, agreement.reproved_guarantee) reads the guarantee instead of sampling ~1e8 Monte
        # Carlo draws
        result = require_guarantee(cached_calibrate(agreement.event, epsilon=epsilon, delta=delta,
                                                    method=accounting_method, **(accounting_options or {})),
                                   "training")
        nu = result.noise_std
    elif noise_std is not None:
        nu = check_real("noise_std", noise_std, low=0.0, low_open=True)
    else:
        nu = check_real("noise_multiplier", noise_multiplier, low=0.0, low_open=True) * column_norm(
            agreement.event.mechanism)
    return PrivatePlan(strategy, sampler, agreement, nu, result)
