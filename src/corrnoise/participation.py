"""Participation schemas: which steps one example may influence (tutorial Sec. 3.3.3).

A *participation pattern* is the set of steps ``t in [n]`` in which one example contributes a
(clipped, norm <= 1) gradient; a *participation schema* is the set of allowed patterns
(Def. 3.12).  Under zero-out adjacency two gradient streams are adjacent iff they differ only in
the rows of one allowed pattern.  Three schemas are provided:

* :class:`Single` -- streaming, every example appears once: patterns ``(t,)`` for ``t in [n]``.
* :class:`Cyclic` ``(k, b)`` -- fixed batches visited in a fixed order, ``b`` steps per epoch and
  ``k`` epochs (Eq. 3.16): patterns ``(l, l + b, ..., l + (k - 1) b)`` for ``l in [b]``, truncated
  to steps ``< n``.  Requires ``k == ceil(n / b)`` and ``b <= n``.
* :class:`MinSep` ``(k, b)`` -- b-minimum separation with at most ``k`` participations
  (Def. 3.14, Eq. 3.17): every non-empty set of at most ``k`` steps whose pairwise gaps are
  ``>= b``.  Requires ``(k - 1) b < n`` (Eq. 3.18), i.e. ``k <= ceil(n / b)``.

Specs (``--participation``): ``single``, ``cyclic:K:B``, ``minsep:K:B``.
This module depends on nothing above numpy-level helpers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .errors import CorrnoiseError, check_int

__all__ = [
    "Participation",
    "Single",
    "Cyclic",
    "MinSep",
    "parse_participation",
    "covers",
]

_PARAM = "participation"


def _check_n(n) -> int:
    return check_int("n", n, minimum=1)


def _positive_int(spec_name: str, field: str, value) -> int:
    """``value`` as an int >= 1, else a CorrnoiseError naming the participation parameter."""
    if isinstance(value, bool):
        raise CorrnoiseError(_PARAM, f"{spec_name} {field} must be an integer >= 1, got {value!r}")
    try:
        v = check_int(field, value, minimum=1)
    except CorrnoiseError:
        raise CorrnoiseError(
            _PARAM, f"{spec_name} {field} must be an integer >= 1, got {value!r}"
        ) from None
    return v


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Participation:
    """Base class of participation schemas (immutable values).

    Subclasses provide ``spec``, ``max_participations(n)``, ``validate(n)``, ``patterns(n)`` and
    ``count(n)``.  ``patterns`` and ``count`` validate ``n`` first.
    """

    __slots__ = ()

    @property
    def spec(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def validate(self, n: int) -> int:  # pragma: no cover - abstract
        """Raise CorrnoiseError('participation', ...) if the schema is infeasible for ``n`` steps;
        return ``n`` as an int."""
        raise NotImplementedError

    def max_participations(self, n: int) -> int:  # pragma: no cover - abstract
        """Largest pattern size over ``n`` steps."""
        raise NotImplementedError

    def patterns(self, n: int) -> Iterator[tuple[int, ...]]:  # pragma: no cover - abstract
        """Every allowed pattern as a sorted tuple of steps in ``[n]``."""
        raise NotImplementedError

    def count(self, n: int) -> int:  # pragma: no cover - abstract
        """Number of allowed patterns, computed without enumerating them."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.spec


@dataclass(frozen=True)
class Single(Participation):
    """Streaming: each example participates in exactly one step."""

    @property
    def spec(self) -> str:
        return "single"

    def validate(self, n: int) -> int:
        return _check_n(n)

    def max_participations(self, n: int) -> int:
        self.validate(n)
        return 1

    def patterns(self, n: int) -> Iterator[tuple[int, ...]]:
        n = self.validate(n)
        return ((t,) for t in range(n))

    def count(self, n: int) -> int:
        return self.validate(n)


@dataclass(frozen=True)
class _KB(Participation):
    """Shared part of the ``(k, b)`` schemas: both parameters ints >= 1, spec ``NAME:K:B``, and at
    most ``k`` participations (Eq. 3.16 / Eq. 3.17). Subclasses set ``_name`` and ``validate``."""

    k: int
    b: int

    _name = "abstract"

    def __post_init__(self):
        object.__setattr__(self, "k", _positive_int(self._name, "k", self.k))
        object.__setattr__(self, "b", _positive_int(self._name, "b", self.b))

    @property
    def spec(self) -> str:
        return f"{self._name}:{self.k}:{self.b}"

    def max_participations(self, n: int) -> int:
        self.validate(n)
        return self.k


@dataclass(frozen=True)
class Cyclic(_KB):
    """Cyclic participation (Eq. 3.16): ``b`` steps per epoch, ``k`` epochs."""

    _name = "cyclic"

    def validate(self, n: int) -> int:
        n = _check_n(n)
        k, b = self.k, self.b
        if b > n:
            raise CorrnoiseError(
                _PARAM,
                f"{self.spec} needs b <= n (b = steps per epoch = {b}, n = {n}); "
                f"use b <= {n} or single participation",
            )
        fit = _ceil_div(n, b)
        if k != fit:
            raise CorrnoiseError(
                _PARAM,
                f"{self.spec} does not fit n={n}: b={b} steps per epoch give k = ceil(n/b) = {fit} "
                f"epochs (need k*b >= n > (k-1)*b); use cyclic:{fit}:{b}",
            )
        return n

    def patterns(self, n: int) -> Iterator[tuple[int, ...]]:
        n = self.validate(n)
        k, b = self.k, self.b
        return (tuple(t for t in range(l, min(n, l + k * b), b)) for l in range(b))

    def count(self, n: int) -> int:
        self.validate(n)
        return self.b


@dataclass(frozen=True)
class MinSep(_KB):
    """b-minimum-separation participation with at most ``k`` participations (Eq. 3.17)."""

    _name = "minsep"

    def validate(self, n: int) -> int:
        n = _check_n(n)
        k, b = self.k, self.b
        if (k - 1) * b >= n:
            fit = _ceil_div(n, b)
            raise CorrnoiseError(
                _PARAM,
                f"{self.spec} is infeasible for n={n}: k participations {b} steps apart need "
                f"(k-1)*b < n; with b={b} at most k={fit} fits (use minsep:{fit}:{b})",
            )
        return n

    def patterns(self, n: int) -> Iterator[tuple[int, ...]]:
        n = self.validate(n)
        k, b = self.k, self.b

        def extend(prefix: tuple[int, ...], start: int) -> Iterator[tuple[int, ...]]:
            for t in range(start, n):
                pattern = prefix + (t,)
                yield pattern
                if len(pattern) < k:
                    yield from extend(pattern, t + b)

        return extend((), 0)

    def count(self, n: int) -> int:
        """Number of non-empty b-separated subsets of ``[n]`` with at most ``k`` elements.

        Dynamic program over steps: ``ways[j][t]`` = number of size-``j`` separated subsets of
        ``{t, ..., n-1}``; ``ways[j][t] = ways[j][t+1] + ways[j-1][t+b]`` (skip ``t`` or take it).
        Exact Python integers, ``O(n k)``.
        """
        n = self.validate(n)
        k, b = self.k, self.b
        prev = [1] * (n + b + 1)  # size-0 subsets: exactly one (the empty set), any suffix
        total = 0
        for _ in range(k):
            cur = [0] * (n + b + 1)
            for t in range(n - 1, -1, -1):
                cur[t] = cur[t + 1] + prev[t + b]
            total += cur[0]
            prev = cur
        return total


def parse_participation(spec) -> Participation:
    """Parse ``single``, ``cyclic:K:B`` or ``minsep:K:B`` (a Participation passes through)."""
    if isinstance(spec, Participation):
        return spec
    if not isinstance(spec, str):
        raise CorrnoiseError(
            _PARAM, f"expected a string single, cyclic:K:B or minsep:K:B, got {spec!r}"
        )
    text = spec.strip().lower()
    parts = text.split(":")
    usage = f"expected single, cyclic:K:B or minsep:K:B (K, B integers >= 1), got {spec!r}"
    if parts == ["single"]:
        return Single()
    if len(parts) != 3 or parts[0] not in ("cyclic", "minsep"):
        raise CorrnoiseError(_PARAM, usage)
    values = []
    for p in parts[1:]:
        p = p.strip()
        if not (p.isascii() and p.isdigit()) or int(p) < 1:
            raise CorrnoiseError(_PARAM, usage)
        values.append(int(p))
    kind = Cyclic if parts[0] == "cyclic" else MinSep
    return kind(values[0], values[1])


def covers(accounted: Participation | str, actual: Participation | str) -> bool:
    """Whether every pattern of schema ``actual`` is allowed by ``accounted``, up to sub-patterns:
    then a guarantee computed for ``accounted`` (a worst case over its patterns) holds for a run
    whose examples participate as ``actual``. A sub-pattern is dominated by its pattern under
    zero-out adjacency (the other steps' gradients may be zero, Def. 3.12), so one participation
    (``single``, or k = 1) is covered by every schema, and b-min-sep with k participations
    (Def. 3.14) covers every cyclic or min-sep schema with at most k participations at least b
    apart. Anything else only by the same spec."""
    accounted, actual = parse_participation(accounted), parse_participation(actual)
    if accounted.spec == actual.spec or isinstance(actual, Single) or getattr(actual, "k", None) == 1:
        return True
    if isinstance(accounted, MinSep) and isinstance(actual, (Cyclic, MinSep)):
        return actual.b >= accounted.b and actual.k <= accounted.k
    return False
