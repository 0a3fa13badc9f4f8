"""The accounting interface (layer 5): batching specs, results, and the method registry.

Every privacy analysis in corrnoise answers the same question -- *mechanism C + batching scheme +
noise level -> (epsilon, delta)* -- and is a plain function registered under a short name::

    @register_method("mmcc", batchings=(Poisson, BlockCyclic),
                     preconditions=(require_square, require_nonnegative))
    def account_mmcc(strategy, batching, noise_std, delta, **options) -> PrivacyResult: ...

The values here are small and immutable, in the spirit of dp_accounting's DpEvents: a batching
spec says *how batches are formed*; a :class:`PrivacyResult` says *what was proved*.  What ran is
a :class:`~corrnoise.accounting.event.MechanismEvent`; the one gate
(:func:`corrnoise.accounting.gate.prepare`) checks the batching a method supports and the
preconditions it registered (:mod:`corrnoise.accounting.preconditions`: square C, non-negative C,
bands <= blocks ...) before calling it, so method functions may assume them.

Conventions (docs/design.md): ``noise_std`` (nu) is the standard deviation of every entry of Z in
units of the clip norm; ``noise_multiplier`` (sigma) = nu / ||C||_col.  Zero-out (add/remove)
adjacency.

Batching specs (``--batching``) live in :mod:`corrnoise.accounting.batching`.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import CorrnoiseError, check_real, first_line
from .batching import BallsInBins, Batching, BlockCyclic, NoBatching, Poisson, parse_batching

__all__ = [
    "Batching",
    "NoBatching",
    "Poisson",
    "BlockCyclic",
    "BallsInBins",
    "parse_batching",
    "PrivacyResult",
    "RESULT_KINDS",
    "RUN_IDENTITY_KEYS",
    "note_proven",
    "was_proven",
    "require_guarantee",
    "MethodSpec",
    "register_method",
    "get_method",
    "registered_methods",
    "method_available",
    "KNOWN_METHODS",
    "column_norm",
]

# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------
#: What a :class:`PrivacyResult` is: a formal (epsilon, delta) ``guarantee``; an informal Monte
#: Carlo ``estimate`` (seed 000 Sec. 2, unverified; also MMCC's p~ = p reference under block-cyclic
#: sampling, see :func:`corrnoise.accounting.mmcc.driver._reference_kind`); a ``lower_bound`` on
#: epsilon (plain MMCC with p~ = p, seed 001), which shows how tight an analysis is but guarantees nothing.
RESULT_KINDS = ("guarantee", "estimate", "lower_bound")


@dataclass(frozen=True)
class PrivacyResult:
    """What an accounting method found for the mechanism with ``noise_std``: (epsilon, delta) and
    its ``kind`` (:data:`RESULT_KINDS`) -- only a ``"guarantee"`` proves (epsilon, delta)-DP.

    ``extras`` carries method-specific, JSON-able scalars (``gdp_mu``, ``steps``, ``std_error``,
    ``verified`` ...); :meth:`to_dict` flattens them after the core fields.
    """

    epsilon: float
    delta: float
    noise_std: float
    noise_multiplier: float
    method: str
    extras: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    kind: str = "guarantee"

    def __post_init__(self):
        if self.kind not in RESULT_KINDS:
            raise CorrnoiseError("kind", f"must be one of {', '.join(RESULT_KINDS)}, got {self.kind!r}")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "epsilon": float(self.epsilon),
            "delta": float(self.delta),
            "noise_std": float(self.noise_std),
            "noise_multiplier": float(self.noise_multiplier),
            "method": self.method,
            "kind": self.kind,
        }
        for key, value in self.extras.items():
            if key not in out:
                out[key] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PrivacyResult":
        """The inverse of :meth:`to_dict` (keys other than the core fields become extras)."""
        core = ("epsilon", "delta", "noise_std", "noise_multiplier", "method", "kind")
        try:
            values = {k: data[k] for k in core}
        except (KeyError, TypeError):
            raise CorrnoiseError("result", f"needs the fields {', '.join(core)}") from None
        extras = {k: v for k, v in data.items() if k not in core}
        return cls(float(values["epsilon"]), float(values["delta"]), float(values["noise_std"]),
                   float(values["noise_multiplier"]), str(values["method"]), extras, str(values["kind"]))

    def with_extras(self, **extras: Any) -> "PrivacyResult":
        """A copy with more extras (later keys win); a proven guarantee stays proven
        (:func:`note_proven`) unless the new extras rename its run."""
        out = PrivacyResult(self.epsilon, self.delta, self.noise_std, self.noise_multiplier, self.method,
                            {**self.extras, **extras}, self.kind)
        if not set(extras) & {"mechanism", *RUN_IDENTITY_KEYS} and was_proven(self):
            note_proven(out)
        return out


#: the fields of :func:`~corrnoise.accounting.gate.run_identity`: a privacy result is of a run iff
#: all of them match
RUN_IDENTITY_KEYS = ("fingerprint", "n", "batching", "participation")

#: content digests of the guarantees this process's accounting computed or read from its cache
_PROVEN: set[str] = set()


def _content_digest(result: PrivacyResult) -> str:
    text = json.dumps(result.to_dict(), sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def note_proven(result: PrivacyResult) -> PrivacyResult:
    """Record ``result`` (a guarantee this process's accounting computed, or read from its cache
    of verified guarantees) by content, and return it. A result handed back later (a
    ``guarantee=`` argument, a plan rebuilt with ``dataclasses.replace``) is trusted without
    re-accounting only if its whole content is one of these (found in review: a guarantee with
    its noise_std edited to a third was trained with, and its epsilon 2 reported for a run of
    epsilon 7.08): :func:`corrnoise.runplan.agreement.reproved_guarantee`."""
    if result.kind == "guarantee":
        _PROVEN.add(_content_digest(result))
    return result


def was_proven(result: PrivacyResult) -> bool:
    """Whether ``result``, content for content, is one :func:`note_proven` recorded."""
    return result.kind == "guarantee" and _content_digest(result) in _PROVEN


def require_guarantee(result: PrivacyResult, use: str) -> PrivacyResult:
    """``result`` if it is a formal guarantee, else a one-line CorrnoiseError: noise that is
    calibrated, trained with or reported as spent must rest on a proof, never on an unverified
    Monte Carlo estimate (seed 000 Thm 2.1: only a verified estimate may be released) or on a
    lower bound.  ``use`` says what needed it (``calibrate``, ``training`` ...)."""
    if result.kind == "guarantee":
        return result
    reference = result.method == "mmcc-lower"  # MMCC's p~ = p reference (a lower bound, or an estimate)
    fix = ("drop lower_bound=True" if reference
           else "drop estimate=True (Monte Carlo results are verified by default)")
    param = "lower_bound" if reference else "estimate"
    raise CorrnoiseError(param, f"{use} needs a formal (epsilon, delta) guarantee, but {result.method} gave "
                         f"{'an' if result.kind == 'estimate' else 'a'} {result.kind.replace('_', ' ')} "
                         f"(epsilon {result.epsilon:.4g}); {fix}")


# ----------------------------------------------------------------------------------------------
# Method registry
# ----------------------------------------------------------------------------------------------
AccountFn = Callable[..., PrivacyResult]
"""``(strategy, batching, noise_std, delta, **options) -> PrivacyResult``."""

CalibrateFn = Callable[..., PrivacyResult]
"""``(strategy, batching, epsilon, delta, **options) -> PrivacyResult`` with the smallest noise."""


@dataclass(frozen=True)
class MethodSpec:
    """A registered accounting method."""

    name: str
    account: AccountFn
    batchings: tuple[type, ...]
    requires_nonnegative: bool = False
    calibrate: CalibrateFn | None = None
    options: tuple[str, ...] = ()
    description: str = ""
    delta_of: Callable[..., PrivacyResult] | None = None
    #: The method's theorem hypotheses, as named functions of a MechanismEvent
    #: (:mod:`corrnoise.accounting.preconditions`), run in order by the gate
    #: (:func:`corrnoise.accounting.gate.prepare`) before the method is called.
    preconditions: tuple[Callable[..., Any], ...] = ()

    def supports(self, batching: Batching) -> bool:
        """Whether the method analyses this kind of batching at all."""
        return isinstance(batching, self.batchings)


_REGISTRY: dict[str, MethodSpec] = {}

#: Built-in method name -> module (relative to this package) that registers it on import.
#: Modules are imported lazily, so a method whose module is missing gives a one-line error.
KNOWN_METHODS: dict[str, str] = {
    "gaussian": "gaussian",
    "pld": "bandmf",
    "rdp": "bandmf",
    "bandmf": "bandmf",
    "mmcc": "mmcc",
    "mc": "montecarlo",
}


def register_method(
    name: str,
    *,
    batchings: tuple[type, ...],
    requires_nonnegative: bool = False,
    calibrate: CalibrateFn | None = None,
    options: tuple[str, ...] = (),
    description: str = "",
    delta_of: Callable[..., PrivacyResult] | None = None,
    preconditions: tuple[Callable[..., Any], ...] | None = None,
) -> Callable[[AccountFn], AccountFn]:
    """Decorator registering ``fn(strategy, batching, noise_std, delta, **options)`` as ``name``.

    ``batchings``: the :class:`Batching` classes the method can analyse.
    ``preconditions``: the named hypotheses of the method's theorem
    (:mod:`corrnoise.accounting.preconditions`), checked in order by the one gate
    :func:`corrnoise.accounting.gate.prepare`; the method may then assume them.  None (the
    default) means :func:`~.preconditions.require_square` for a method of amplified batchings.
    ``requires_nonnegative``: shorthand adding :func:`~.preconditions.require_nonnegative`.
    ``calibrate``: optional native calibration ``(strategy, batching, epsilon, delta, **options)``
    (e.g. Monte Carlo bisection on common random numbers); otherwise the generic bisection of
    :mod:`corrnoise.accounting.calibrate` is used.
    ``options``: extra option names to pass even if the signature does not show them; normally
    the dispatcher passes exactly the (non-None) options the function's signature accepts.
    Options the command line may pass: ``samples``, ``seed``, ``progress`` (bool: a terminal is
    attached and not ``--json``), ``accountant``, ``discretization``.
    """

    checks = _preconditions(batchings, requires_nonnegative, preconditions)

    def decorate(fn: AccountFn) -> AccountFn:
        _REGISTRY[name] = MethodSpec(
            name=name,
            account=fn,
            batchings=tuple(batchings),
            requires_nonnegative=any(getattr(c, "__name__", "") == "require_nonnegative" for c in checks),
            calibrate=calibrate,
            options=tuple(options),
            description=description or first_line(fn.__doc__),
            delta_of=delta_of,
            preconditions=checks,
        )
        return fn

    return decorate


def _preconditions(batchings, requires_nonnegative: bool, preconditions) -> tuple[Callable[..., Any], ...]:
    """The precondition functions of a method being registered (see :func:`register_method`)."""
    from . import preconditions as pre  # imports this module: only once it is fully loaded

    if preconditions is None:
        amplified = any(getattr(cls, "amplified", True) for cls in batchings)
        preconditions = (pre.require_square,) if amplified else ()
    checks = tuple(preconditions)
    if requires_nonnegative and pre.require_nonnegative not in checks:
        checks += (pre.require_nonnegative,)
    return checks


def get_method(name: str) -> MethodSpec:
    """The method registered as ``name``, importing its built-in module on first use."""
    if name not in _REGISTRY and name in KNOWN_METHODS:
        module = f"{__package__}.{KNOWN_METHODS[name]}"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            raise CorrnoiseError(
                "method", f"{name} is not available in this build (module {module} is missing); "
                f"choose another --method"
            ) from None
    try:
        return _REGISTRY[name]
    except KeyError:
        known = sorted(set(KNOWN_METHODS) | set(_REGISTRY))
        raise CorrnoiseError("method", f"unknown method {name!r}; known: auto, {', '.join(known)}") from None


def method_available(name: str) -> bool:
    """Whether ``name`` can be used (its module imports and registers it)."""
    try:
        get_method(name)
    except CorrnoiseError:
        return False
    return True


def registered_methods() -> list[str]:
    """Names of the methods registered so far (built-ins load lazily; see :data:`KNOWN_METHODS`)."""
    return sorted(_REGISTRY)


def column_norm(strategy) -> float:
    """||C||_col = max_t ||C[:, t]|| (tutorial Sec. 1.3.1): the noise_std -> noise_multiplier scale."""
    if hasattr(strategy, "max_column_norm_squared"):
        value = float(strategy.max_column_norm_squared())
    else:
        value = float(max(strategy.column_norms_squared()))
    if not math.isfinite(value) or value <= 0.0:
        raise CorrnoiseError("mechanism", f"{strategy.label} has max column norm {value!r}; it must be finite and > 0")
    return math.sqrt(value)


# ----------------------------------------------------------------------------------------------
# Method options
# ----------------------------------------------------------------------------------------------
#: Options that only steer the display: a method that does not take them just shows no progress.
DISPLAY_OPTIONS = ("progress",)
#: The positional inputs of account / calibrate functions: never options.
_INPUTS = ("strategy", "batching", "noise_std", "delta", "epsilon")


def _option_names(fn: Callable[..., Any], extra: tuple[str, ...] = ()) -> set[str] | None:
    """The option names ``fn`` takes (its keyword parameters other than the inputs, plus
    ``extra``), or None if it takes ``**kwargs`` (anything)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins
        params = {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    names = {name for name, p in params.items()
             if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return (names - set(_INPUTS)) | set(extra)


def accepted_options(fn: Callable[..., Any], options: dict[str, Any], extra: tuple[str, ...] = (),
                     method: str = "this method") -> dict[str, Any]:
    """The set (non-None) ``options`` for ``fn``.  An option ``fn`` does not take raises a one-line
    CorrnoiseError naming it -- an option dropped silently (a misspelt ``discretisation``, a
    ``verify`` the method cannot honour) would change what is proved without saying so.  Only the
    display options (:data:`DISPLAY_OPTIONS`) are dropped where unsupported."""
    names = _option_names(fn, extra)
    out = {}
    for key, value in options.items():
        if value is None:
            continue
        if names is None or key in names:
            out[key] = value
        elif key not in DISPLAY_OPTIONS:
            known = ", ".join(sorted(names)) or "none"
            raise CorrnoiseError(key, f"is not an option of accounting method {method} (its options: {known})")
    return out


def method_accepts(spec: MethodSpec, name: str, calibrating: bool = False) -> bool:
    """Whether ``spec``'s account (or native calibrate) function takes option ``name``."""
    fn = spec.calibrate if calibrating and spec.calibrate is not None else spec.account
    names = _option_names(fn, spec.options)
    return names is None or name in names


def method_options(spec: MethodSpec, options: dict[str, Any], calibrating: bool = False) -> dict[str, Any]:
    """The options for ``spec``'s account (or native calibrate) function, unset ones dropped; an
    unsupported one raises (:func:`accepted_options`)."""
    fn = spec.calibrate if calibrating and spec.calibrate is not None else spec.account
    return accepted_options(fn, options, spec.options, spec.name)


def resolve_noise_std(strategy, noise_std: Any = None, noise_multiplier: Any = None) -> float:
    """noise_std from exactly one of noise_std (nu) or noise_multiplier (sigma = nu / ||C||_col)."""
    if (noise_std is None) == (noise_multiplier is None):
        raise CorrnoiseError("noise", "give exactly one of noise_std (--noise-std) or noise_multiplier (--sigma)")
    if noise_std is not None:
        return check_real("noise_std", noise_std, low=0.0, low_open=True)
    sigma = check_real("sigma", noise_multiplier, low=0.0, low_open=True)
    return sigma * column_norm(strategy)
