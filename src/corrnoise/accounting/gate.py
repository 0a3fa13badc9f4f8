"""One privacy event, one gate: which method may account a :class:`MechanismEvent`, and ``account``.

Every entry point -- :func:`account`, :func:`~corrnoise.accounting.calibrate.calibrate`,
delta(epsilon), the torch ``make_private`` / Opacus adapter / ``corrnoise train`` -- describes
what runs as a :class:`~corrnoise.accounting.event.MechanismEvent` and passes it through
:func:`prepare`, which checks that the method analyses the event's batching and that every
precondition the method registered (:mod:`.preconditions`) holds.  A violated precondition is one
CorrnoiseError whose parameter and text depend only on the event and the method, so every entry
point reports the same line.  Method functions may assume their preconditions.

``auto`` (:func:`choose_method`) tries, per batching, the candidates of :data:`AUTO_CANDIDATES`
in order and picks the first available one whose preconditions hold (docs/design.md): none ->
gaussian; Poisson -> pld (diagonal C, DP-SGD) else mmcc (seed 001); block-cyclic -> bandmf
(bands <= blocks, tutorial Thm 3.21) else mmcc; balls-in-bins -> mc (seed 000).
"""

from __future__ import annotations

from typing import Any

from ..errors import CorrnoiseError
from ..participation import covers
from .base import (
    RUN_IDENTITY_KEYS,
    BallsInBins,
    Batching,
    BlockCyclic,
    MethodSpec,
    NoBatching,
    Poisson,
    PrivacyResult,
    get_method,
    method_available,
    note_proven,
    resolve_noise_std,
)
from .event import MechanismEvent, as_event
from .preconditions import Violation, first_violation

__all__ = ["AUTO_CANDIDATES", "choose_method", "prepare", "check_event", "noisy_event", "run_identity", "run_mismatch", "RUN_IDENTITY_KEYS"]

#: ``--method auto``: the methods tried, in order, for each kind of batching.
AUTO_CANDIDATES: dict[type, tuple[str, ...]] = {
    NoBatching: ("gaussian",),
    Poisson: ("pld", "mmcc"),
    BlockCyclic: ("bandmf", "mmcc"),
    BallsInBins: ("mc",),
}

def _raise(violation: Violation, method: str):
    raise CorrnoiseError(violation.param, f"{violation.message} (accounting method {method})")


def check_event(event: MechanismEvent, spec: MethodSpec) -> Violation | None:
    """The first reason ``spec`` cannot account ``event`` (its batching, then its registered
    preconditions in order), or None."""
    if not spec.supports(event.batching):
        kinds = ", ".join(sorted(getattr(cls, "head", "") or cls.__name__ for cls in spec.batchings))
        return Violation("method", f"{spec.name} does not analyse {event.batching.spec} batching (it handles: "
                         f"{kinds}); use --method auto")
    return first_violation(event, spec.preconditions)


def choose_method(event_or_strategy, batching: Batching | str | None = None) -> str:
    """``--method auto``: the first available candidate (:data:`AUTO_CANDIDATES`) whose
    preconditions hold for the event.  If none holds, the last available candidate's violation
    is raised; if none is available, a ``method`` error says which module is missing."""
    event = as_event(event_or_strategy, batching)
    candidates = AUTO_CANDIDATES.get(type(event.batching))
    if candidates is None:
        raise CorrnoiseError("batching", f"no accounting method for {event.batching!r}")
    refused, missing = None, []
    for name in candidates:
        if not method_available(name):
            missing.append(name)
            continue
        found = check_event(event, get_method(name))
        if found is None:
            return name
        refused, missing = (name, found), []
    if refused is not None:
        name, found = refused
        if missing:  # the candidate that would have handled it is not in this build
            found = Violation(found.param, f"{found.message}; {'/'.join(missing)} is not available in this build")
        _raise(found, name)
    raise CorrnoiseError("method", f"{event.batching.spec} batching of {event.mechanism.label} needs method "
                         f"{' or '.join(missing)}, which is not available in this build; choose another --batching")


def prepare(event: MechanismEvent, method: str = "auto") -> MethodSpec:
    """The gate: the method (``auto``: :func:`choose_method`) that accounts ``event``, after
    checking that it analyses the event's batching and that all its registered preconditions
    hold; otherwise one CorrnoiseError (one line, naming the parameter)."""
    if not isinstance(event, MechanismEvent):
        raise CorrnoiseError("event", f"expected a MechanismEvent, got {type(event).__name__}")
    if not isinstance(method, str):
        raise CorrnoiseError("method", f"expected a method name, got {method!r}")
    name = choose_method(event) if method == "auto" else method
    spec = get_method(name)
    found = check_event(event, spec)
    if found is not None:
        _raise(found, spec.name)
    return spec


def noisy_event(event_or_strategy, batching=None, noise_std: Any = None, noise_multiplier: Any = None
                ) -> MechanismEvent:
    """The event with its noise: from the event itself, or exactly one of ``noise_std`` (nu) and
    ``noise_multiplier`` (sigma = nu / ||C||_col of the event's mechanism)."""
    if isinstance(event_or_strategy, MechanismEvent):
        event = as_event(event_or_strategy, batching)
        if event.noise_std is not None:
            if noise_std is not None or noise_multiplier is not None:
                raise CorrnoiseError("noise", "the event already has its noise_std; do not pass another")
            return event
        return event.with_noise(resolve_noise_std(event.mechanism, noise_std, noise_multiplier))
    nu = resolve_noise_std(event_or_strategy, noise_std, noise_multiplier)
    return as_event(event_or_strategy, batching).with_noise(nu)


def run_identity(event: MechanismEvent) -> dict[str, Any]:
    """What identifies the run an event describes, by content: the mechanism's fingerprint
    (:func:`~corrnoise.strategies.mechanism_fingerprint` of the accounted C), its n, the batching
    spec and, for unamplified ``none`` batching, the participation schema (``none`` alone says
    nothing about how often an example participates). The label is for people, not identity."""
    from ..strategies import mechanism_fingerprint

    mechanism = event.mechanism
    identity = {"fingerprint": mechanism_fingerprint(mechanism), "n": int(mechanism.n),
                "batching": event.batching.spec}
    if isinstance(event.batching, NoBatching):
        identity["participation"] = event.batching.participation.spec
    return identity


def run_mismatch(result: PrivacyResult, identity: dict[str, Any]) -> str | None:
    """How ``result`` was computed for another run than the one ``identity``
    (:func:`run_identity`) describes -- the first differing field, said for people -- or None
    when it is this run's (its participation schema may be wider: :func:`~corrnoise.participation.covers`). A result that carries no fingerprint (computed by hand, or before
    results carried one) identifies no mechanism and is never taken for this run's."""
    theirs = result.extras
    # the step count first: a C for another n has another fingerprint too, and "another mechanism
    # (same label, other C)" would hide that only the length differs
    for key in sorted(RUN_IDENTITY_KEYS, key=lambda k: k != "n"):
        if theirs.get(key) == identity.get(key):
            continue
        if key == "participation" and isinstance(theirs.get(key), str) and isinstance(identity.get(key), str) \
                and covers(theirs[key], identity[key]):
            continue  # a guarantee over a wider schema holds for this run's
        if key == "fingerprint":
            if not isinstance(theirs.get(key), str):
                return "an unidentified mechanism (the result carries no mechanism fingerprint)"
            same = " (same label, other C)" if theirs.get("mechanism") == identity.get("mechanism") else ""
            return (f"another mechanism: {theirs.get('mechanism')!s} with fingerprint {theirs[key][:12]}, this run's "
                    f"is {identity.get('mechanism')!s} with {str(identity.get(key))[:12]}{same}")
        return f"{key} = {theirs.get(key)!r}, this run has {identity.get(key)!r}"
    return None


def _annotate(result: PrivacyResult, event: MechanismEvent) -> PrivacyResult:
    """``result`` with the event's mechanism label (unless the method named it) and its
    :func:`run_identity` (always the event's) in its extras."""
    extras = {**result.extras, "mechanism": result.extras.get("mechanism", event.mechanism.label),
              **run_identity(event)}
    return note_proven(PrivacyResult(result.epsilon, result.delta, result.noise_std, result.noise_multiplier,
                                     result.method, extras, result.kind))
