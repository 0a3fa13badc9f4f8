"""The result of an audit: a measured lower bound on epsilon (or a labelled estimate), never a guarantee."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorrnoiseError

__all__ = ["AuditResult", "AUDIT_KINDS"]

#: ``lower_bound``: valid at ``confidence`` with no assumption on the mechanism (a breach if it
#: exceeds a guarantee); ``estimate``: depends on a modelling assumption (e.g. Gaussian scores),
#: never a bound and never compared to a guarantee as evidence of a breach.
AUDIT_KINDS = ("lower_bound", "estimate")


def _json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if isinstance(value, AuditResult):
        return value.to_dict()
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _json(value.item())
    return value


@dataclass(frozen=True)
class AuditResult:
    """One audit's number and what it is.

    ``kind="lower_bound"``: ``epsilon_lower`` is a lower bound on the epsilon (at ``delta``) of
    the audited run that holds with probability >= ``confidence`` over the audit's own
    randomness, whatever the mechanism (many-run: the runs are assumed independent, and with
    several canaries a run, the canaries within a run too -- each on its own coordinates), or
    over the canaries' fair coins (one-run). ``kind="estimate"``: ``epsilon_estimate`` under an
    assumption named in ``method`` (e.g. ``gdp-fit``); no confidence, no bound.
    ``canaries``: canaries scored; ``runs``: training runs used; ``auc``: area under the ROC of
    the scores (in vs out), ``extras``: intervals, TPR at low FPR, counts, thresholds.
    """

    kind: str
    method: str
    delta: float
    confidence: float | None
    canaries: int
    runs: int
    auc: float | None
    epsilon_lower: float | None = None
    epsilon_estimate: float | None = None
    extras: dict[str, Any] = field(default_factory=dict, compare=False)
    #: (scores of canaries / runs in, scores out) for plots; not serialized
    scores: tuple[Any, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in AUDIT_KINDS:
            raise CorrnoiseError("kind", f"must be one of {', '.join(AUDIT_KINDS)}, got {self.kind!r}")
        if self.kind == "lower_bound" and (self.epsilon_lower is None or self.epsilon_estimate is not None
                                           or self.confidence is None):
            raise CorrnoiseError("kind", "a lower bound has epsilon_lower and a confidence, and no epsilon_estimate")
        if self.kind == "estimate" and (self.epsilon_estimate is None or self.epsilon_lower is not None):
            raise CorrnoiseError("kind", "an estimate has epsilon_estimate and no epsilon_lower")

    @property
    def epsilon(self) -> float:
        """The audit's number, whichever its kind (read ``kind`` before using it)."""
        return float(self.epsilon_lower if self.kind == "lower_bound" else self.epsilon_estimate)

    def with_extras(self, **extras: Any) -> "AuditResult":
        return AuditResult(self.kind, self.method, self.delta, self.confidence, self.canaries, self.runs, self.auc,
                           self.epsilon_lower, self.epsilon_estimate, {**self.extras, **extras}, self.scores)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "lower_bound":
            out["epsilon_lower"] = float(self.epsilon_lower)
        else:
            out["epsilon_estimate"] = float(self.epsilon_estimate)
        out.update({"delta": float(self.delta), "confidence": self.confidence, "method": self.method,
                    "canaries": int(self.canaries), "runs": int(self.runs), "auc": self.auc})
        for key, value in self.extras.items():
            if key not in out:
                out[key] = value
        return _json(out)
