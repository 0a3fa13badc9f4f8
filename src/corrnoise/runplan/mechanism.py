"""Which mechanism a run uses: a name or file parsed for the run's steps, or the planner's choice.

``mechanism="auto"`` or a planner family (:data:`corrnoise.planner.FAMILIES`) with an epsilon
asks the planner (:mod:`corrnoise.planner`, one set of rules) for the run's pipeline
(:func:`is_planned`); any other string is a mechanism name or file (``identity``, ``bsr:4``,
``dpcgd:0.9``, ``plan/recommended.json``).
"""

from __future__ import annotations

from typing import Any

from ..errors import CorrnoiseError, check_int
from ..pipelines import AUTO, batching_name, pipeline_of
from ..strategies import Strategy, parse_strategy

__all__ = ["is_planned", "parse_mechanism", "plan_mechanism", "planned_batching"]


def parse_mechanism(mechanism: str, steps: int) -> Strategy:
    """The Strategy a mechanism name or file stands for, for ``steps`` steps; a bad name is
    reported against ``mechanism`` (what the user passed), with the parser's reason."""
    try:
        return parse_strategy(mechanism, steps)
    except CorrnoiseError as exc:
        if exc.param == "mechanism":
            raise
        raise CorrnoiseError("mechanism", f"{mechanism!r}: {exc}") from None


def is_planned(mechanism: Any, *, calibrated: bool) -> bool:
    """Whether ``mechanism`` is the planner's to choose: ``auto``, or a planner family whose noise
    is to be ``calibrated`` for an epsilon. A family that is also one mechanism's name (``dpsgd``:
    identity; ``tree``) with a given noise (noise_multiplier, noise_std, a guarantee) is that
    mechanism, as :func:`corrnoise.strategies.parse_strategy` reads it: ``mechanism="dpsgd",
    noise_multiplier=1.0`` is DP-SGD, as in Opacus."""
    from ..planner import FAMILIES

    if not isinstance(mechanism, str) or (mechanism != AUTO and mechanism not in FAMILIES):
        return False
    return mechanism == AUTO or calibrated or not _names_a_mechanism(mechanism)


def _names_a_mechanism(name: str) -> bool:
    """Whether ``name`` is a mechanism :func:`corrnoise.strategies.parse_strategy` builds (a planner
    family such as ``bandmf`` is not: the planner designs its members for a run)."""
    try:
        parse_strategy(name, 1)
    except CorrnoiseError:
        return False
    return True


def plan_mechanism(mechanism: str, batching: str, *, num_examples: int, batch_size: int, epochs, steps,
                   epsilon: float, delta: float, progress=None, noise_budget=None):
    """``mechanism="auto"`` (or a family): the planner's recommendation (:mod:`corrnoise.planner`)
    for this run and the pipeline ``batching`` describes -> (strategy, batching name, steps, the
    guarantee its noise was calibrated to, the :class:`~corrnoise.planner.PlanResult`). One
    planner, no second set of rules. ``noise_budget`` (a :class:`corrnoise.noise_memory.NoiseBudget`):
    the planner chooses within it (its ``noise_method`` says how the noise is generated)."""
    from ..planner import plan

    per_epoch = max(1, num_examples // batch_size)
    if steps is not None:
        steps = check_int("steps", steps, minimum=1)
        if steps % per_epoch:
            below, above = steps // per_epoch * per_epoch, -(-steps // per_epoch) * per_epoch
            nearest = f"{below} or {above}" if below else f"{above}"
            raise CorrnoiseError("steps", f"the planner plans whole epochs of {per_epoch} steps (N // B = {num_examples} "
                                 f"// {batch_size}), got {steps}: give epochs, a multiple of {per_epoch} steps "
                                 f"({nearest}), or name a mechanism (identity for DP-SGD, bsr:4, ...), which runs any "
                                 "number of steps")
        epochs = steps // per_epoch
    if epochs is None or not float(epochs).is_integer():
        raise CorrnoiseError("epochs", f"the planner plans whole epochs, got {epochs!r}")
    result = plan(dataset_size=num_examples, batch_size=batch_size, epochs=int(epochs), epsilon=epsilon, delta=delta,
                  pipeline=pipeline_of(batching), only=None if mechanism == AUTO else (mechanism,),
                  progress=progress, **(noise_budget.planner_settings() if noise_budget is not None else {}))
    rec = result.recommended
    return rec.strategy, planned_batching(rec.batching), result.setup.n, rec.result, result


def planned_batching(spec: str) -> str:
    """The front door's batching name for a planner batching spec (``poisson:P`` -> ``poisson``,
    ``none`` (unamplified, the pipeline's participation) -> ``cyclic``)."""
    return batching_name(spec)
