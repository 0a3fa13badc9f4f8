"""What happened, apart from how it is accounted: the :class:`MechanismEvent`.

In the spirit of dp_accounting's DpEvents, an event records the private computation -- the
mechanism C, how batches were formed (the batching; for unamplified ``none`` batching the
participation schema lives inside it, :class:`~corrnoise.accounting.base.NoBatching`), the noise
standard deviation nu (absent while calibrating) and the number of steps run -- and nothing
about the analysis.  Accounting methods turn an event into (epsilon, delta); whether a method
may analyse an event at all is decided in one place, :func:`corrnoise.accounting.gate.prepare`.

An event validates its own fields on construction (a one-line CorrnoiseError naming the field):
the mechanism looks like a corrnoise Strategy, the batching parses, noise_std is finite and > 0,
1 <= steps <= n.  Preconditions relating the fields to a method (square C, non-negative C,
bands <= blocks ...) are not the event's business: see :mod:`.preconditions`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..errors import CorrnoiseError, check_int, check_real
from .base import Batching, parse_batching

__all__ = ["MechanismEvent", "as_event", "leading_strategy"]

#: What an event needs of its mechanism (the corrnoise Strategy interface).
_STRATEGY_ATTRIBUTES = ("n", "rows", "bands", "label", "is_nonnegative")


def leading_strategy(strategy, steps: int):
    """The mechanism of the first ``steps`` steps: C[:steps, :steps] (lower triangular, so the
    first rows of C^{-1} Z are unchanged; for the online tree, its first ``steps`` steps read only
    the nodes of the tree over ``steps`` leaves, with the same node ids).  Column-normalized and
    ``tree:full`` mechanisms are not
    truncated (their ``with_n`` re-designs rather than truncates): the full mechanism is
    analysed, which is conservative (its first ``steps`` outputs are a marginal of it)."""
    from ..strategies import ColumnNormalized, Tree

    if steps >= strategy.n or isinstance(strategy, (ColumnNormalized, Tree)):
        return strategy
    return strategy.with_n(steps)


@dataclass(frozen=True)
class MechanismEvent:
    """``steps`` steps of C G + Z (Z with entries N(0, ``noise_std``^2)) under ``batching``.

    ``strategy``: the mechanism C (a corrnoise Strategy, compared by identity).
    ``batching``: a :class:`~corrnoise.accounting.base.Batching` or its ``--batching`` spelling.
    ``noise_std``: nu, in units of the clip norm; None for an event whose noise is to be
    calibrated.  ``steps``: steps run, 1 <= steps <= n (default n); the accounted mechanism is
    the leading block :attr:`mechanism`.
    """

    strategy: Any
    batching: Batching | str
    noise_std: float | None = None
    steps: int | None = None

    def __post_init__(self):
        missing = [a for a in _STRATEGY_ATTRIBUTES if not hasattr(self.strategy, a)]
        if missing:
            raise CorrnoiseError("mechanism", f"must be a corrnoise Strategy, got {type(self.strategy).__name__}")
        object.__setattr__(self, "batching", parse_batching(self.batching))
        if self.noise_std is not None:
            object.__setattr__(self, "noise_std", check_real("noise_std", self.noise_std, low=0.0, low_open=True))
        n = int(self.strategy.n)
        steps = n if self.steps is None else check_int("steps", self.steps, minimum=1)
        if steps > n:
            raise CorrnoiseError("steps", f"{steps} steps exceed the mechanism's n = {n} ({self.strategy.label}); "
                                 f"build the mechanism for at least {steps} steps or run fewer")
        object.__setattr__(self, "steps", steps)

    @property
    def mechanism(self):
        """The mechanism the event ran: the leading ``steps`` x ``steps`` block of C
        (:func:`leading_strategy`)."""
        return leading_strategy(self.strategy, self.steps)

    def with_noise(self, noise_std: float) -> "MechanismEvent":
        """The same event with noise ``noise_std``."""
        return replace(self, noise_std=noise_std)

    def without_noise(self) -> "MechanismEvent":
        """The same event with its noise left to calibration."""
        return replace(self, noise_std=None)

    @property
    def spec(self) -> str:
        noise = "?" if self.noise_std is None else f"{self.noise_std:g}"
        return f"{self.strategy.label} x {self.steps} steps, {self.batching.spec}, noise_std {noise}"


def as_event(event_or_strategy, batching=None, steps: int | None = None) -> MechanismEvent:
    """A :class:`MechanismEvent` from either an event (``batching`` and ``steps`` then None) or a
    strategy and a batching (the older ``account(strategy, batching, ...)`` call form)."""
    if isinstance(event_or_strategy, MechanismEvent):
        if batching is not None or steps is not None:
            raise CorrnoiseError("batching", "an event already fixes the batching and steps; pass the event alone")
        return event_or_strategy
    if batching is None:
        raise CorrnoiseError("batching", "give a MechanismEvent, or a mechanism and its batching")
    return MechanismEvent(event_or_strategy, batching, steps=steps)
