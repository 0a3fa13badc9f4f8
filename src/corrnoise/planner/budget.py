"""The planner's noise-memory budget (issue #27 item 5): each candidate's noise state in bytes
(:func:`corrnoise.noise_memory.noise_state_bytes`) and what happens to one over the budget --
switched to regenerated noise where its family has that variant (same C, same noise, no
buffers), else excluded with the reason."""

from __future__ import annotations

from typing import Any

from ..noise_memory import format_size, noise_state_bytes, noise_state_vectors
from .constants import MAX_REGENERATE_N
from .designs import REGENERABLE_FAMILIES, _toeplitz_regenerate_cost
from .setup import PlanSetup
from .store import cached_numbers

__all__ = ["apply_noise_budget"]


def apply_noise_budget(candidates: list, setup: PlanSetup) -> dict[str, list[dict[str, Any]]]:
    """In place: every candidate's ``noise_memory_bytes`` (when ``setup.trainable_params`` is
    known) and, under ``setup.max_noise_memory``, the switch to regenerated noise or the exclusion
    (``excluded = True``, infeasible, never calibrated). Returns ``{"excluded": [...],
    "regenerated": [...]}``: one ``{"candidate", "batching", "noise_memory_bytes", "reason"}``
    per candidate affected (the bytes are those of the buffered noise that did not fit)."""
    report: dict[str, list[dict[str, Any]]] = {"excluded": [], "regenerated": []}
    if setup.trainable_params is None:
        return report
    for cand in candidates:
        cand.noise_memory_bytes = _bytes(cand, setup)
        budget = setup.max_noise_memory
        if budget is None or cand.noise_memory_bytes <= budget:
            continue
        entry = {"candidate": cand.mechanism, "batching": cand.batching, "noise_memory_bytes": cand.noise_memory_bytes}
        vectors = noise_state_vectors(cand.strategy, cand.noise_method)
        why = (f"buffered noise keeps {vectors} vectors = {format_size(cand.noise_memory_bytes)} > "
               f"max_noise_memory = {format_size(budget)}")
        if _regenerable(cand, setup):
            _regenerate(cand, setup)
            cand.note = f"{why}: regenerated instead (no buffers, {cand.noise_cost:.3g} randn/step)"
            report["regenerated"].append({**entry, "reason": cand.note})
        else:
            cand.excluded, cand.feasible = True, False
            cand.note = f"excluded: {why}{_no_regeneration(cand, setup)}"
            report["excluded"].append({**entry, "reason": cand.note})
    return report


def _bytes(cand, setup: PlanSetup) -> int:
    return noise_state_bytes(cand.strategy, setup.trainable_params, setup.noise_dtype, cand.noise_method)


def _regenerable(cand, setup: PlanSetup) -> bool:
    """Whether the candidate's family has a regenerated variant for this many steps."""
    return cand.family in REGENERABLE_FAMILIES and setup.n <= MAX_REGENERATE_N


def _no_regeneration(cand, setup: PlanSetup) -> str:
    if cand.family in REGENERABLE_FAMILIES:
        return f" (regenerated noise is offered for n <= {MAX_REGENERATE_N} steps, here n = {setup.n})"
    if cand.family == "tree":
        return " (the plain tree regenerates its nodes instead)"
    return ""


def _regenerate(cand, setup: PlanSetup) -> None:
    """Switch the candidate to memoryless regeneration of its C^{-1} (Toeplitz: its first column)."""
    n = setup.n
    (cost,) = cached_numbers(cand.strategy, "regenerate_cost",
                             lambda s: (_toeplitz_regenerate_cost(s.inverse_coefficients, n),), 1)
    cand.noise_method = "regenerate"
    cand.memory_vectors = noise_state_vectors(cand.strategy, "regenerate")
    cand.noise_cost = float(cost)
    cand.noise_memory_bytes = _bytes(cand, setup)
