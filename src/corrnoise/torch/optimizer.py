"""Moved: the torch-free plan of a private run lives in :mod:`corrnoise.runplan` (the run as one
value, :class:`~corrnoise.runplan.RunPlan`, built by :func:`~corrnoise.runplan.plan_run`), the
samplers' factory in :func:`corrnoise.sampling.make_sampler`, and the private optimizer in
:mod:`corrnoise.torch.dp_optimizer`. The names below stay importable from here.
"""

from __future__ import annotations

from ..accounting.event import leading_strategy
from ..pipelines import BATCHINGS as SAMPLINGS
from ..runplan import (Agreement, PrivatePlan, balls_in_bins_accounted_steps, check_agreement, check_run_size,
                       choose_batching, plan_private, privacy_spent, refuse_non_guarantees)
from ..sampling import make_sampler

__all__ = ["Agreement", "PrivatePlan", "SAMPLINGS", "balls_in_bins_accounted_steps", "check_agreement",
           "check_run_size", "choose_batching", "leading_strategy", "make_sampler", "plan_private", "privacy_spent",
           "refuse_non_guarantees"]
