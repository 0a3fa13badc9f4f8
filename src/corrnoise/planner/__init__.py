"""The planner (layer 7): which mechanism, batching and noise for a training run (issue #11).

    >>> from corrnoise.planner import plan
    >>> result = plan(dataset_size=2000, batch_size=100, epochs=4, epsilon=2.0, delta=1e-5)  # doctest: +SKIP
    >>> result.recommended.mechanism, result.recommended.batching, result.recommended.noise_std  # doctest: +SKIP

Torch-free at import (strategy optimizers load what they need when a candidate is built); no
click or rich: progress goes through a ``progress(label, done, total)`` callback.  See
:mod:`corrnoise.planner.core` for the candidates, their optimization and accounting, and the
screening / final calibration.
"""

from .core import (
    BANDS,
    BETAS,
    BUFFERS,
    FAMILIES,
    PIPELINES,
    SCREEN_DISCRETIZATION,
    SCREEN_MC_SAMPLES,
    Candidate,
    PlanResult,
    PlanSetup,
    error_curve,
    best_final,
    finalize_candidate,
    make_setup,
    plan,
)

__all__ = [
    "BANDS", "BETAS", "BUFFERS", "FAMILIES", "PIPELINES", "SCREEN_DISCRETIZATION", "SCREEN_MC_SAMPLES",
    "Candidate", "PlanResult", "PlanSetup", "best_final", "error_curve", "finalize_candidate", "make_setup", "plan",
]
