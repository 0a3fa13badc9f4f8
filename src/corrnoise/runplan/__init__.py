"""A private run, planned once (layer between the planner and torch): :func:`plan_run` ->
:class:`RunPlan`.

    >>> from corrnoise.runplan import plan_run, RunPlan
    >>> plan = plan_run(dataset_size=1437, batch_size=64, mechanism="bsr:4", epsilon=4.0, delta=1e-5,
    ...                 epochs=3)                                                     # doctest: +SKIP
    >>> plan.to_json("plan.json")           # review it: mechanism, batching, noise, guarantee  # doctest: +SKIP
    >>> RunPlan.from_json("plan.json")      # re-checked by content; then make_private(..., plan=plan)  # doctest: +SKIP

Torch-free. Every decision that :func:`corrnoise.torch.make_private`,
:func:`corrnoise.training.train`, ``corrnoise plan --plan-out`` and ``corrnoise train --plan``
take about mechanism, batching, sampler, agreement with the accounting and noise lives here
(:mod:`.plan`): the mechanism (:mod:`.mechanism`), the batching and its sampler without the
secret seed (:mod:`.batching`), the agreement of sampler and accounting and the privacy spent
(:mod:`.agreement`), the value and its file (:mod:`.value`).
"""

from .agreement import (Agreement, accounted_steps, balls_in_bins_accounted_steps, check_agreement, matching_guarantee,
                        privacy_spent, refuse_non_guarantees)
from .batching import SamplerSpec, choose_batching, estimated_steps, pipeline_batching, sampling_for, steps_per_epoch
from .mechanism import is_planned, parse_mechanism, plan_mechanism, planned_batching
from .plan import (PrivatePlan, candidate_choice, check_length, check_plan_out, check_run_size, choose_mechanism,
                   plan_choice, plan_of_recommendation, plan_private, plan_run)
from .value import RunPlan, check_plan_path

__all__ = [
    "Agreement", "PrivatePlan", "RunPlan", "SamplerSpec", "accounted_steps", "balls_in_bins_accounted_steps",
    "candidate_choice", "check_agreement", "check_length", "check_plan_out", "check_plan_path", "check_run_size", "choose_batching", "choose_mechanism",
    "estimated_steps", "is_planned", "matching_guarantee", "parse_mechanism", "pipeline_batching", "plan_choice",
    "plan_mechanism", "plan_of_recommendation", "plan_private", "plan_run", "planned_batching", "privacy_spent", "refuse_non_guarantees",
    "sampling_for", "steps_per_epoch",
]
