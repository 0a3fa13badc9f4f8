"""Batching specs (``--batching``): how batches are formed, apart from how they are accounted.

=========================  ==========================================================  ==============
spec                       meaning                                                      value
=========================  ==========================================================  ==============
``none``                   fixed batches, no amplification; who participates when is    NoBatching
                           the participation schema (``--participation``)
``poisson:P``              every example joins every step independently w.p. P          Poisson
``block-cyclic:BLOCKS:P``  data split into BLOCKS parts, step t Poisson-samples part       BlockCyclic
                           t mod BLOCKS with rate P = B * BLOCKS / N (tutorial Def. 3.20)
``balls-in-bins:BINS``     each example thrown into one of BINS bins, bin t mod BINS is   BallsInBins
                           the batch of step t (seed 000 Sec. 2)
=========================  ==========================================================  ==============
"""

from __future__ import annotations


from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from ..errors import CorrnoiseError, check_int, check_real
from ..participation import Participation, Single, parse_participation

__all__ = ["Batching", "NoBatching", "Poisson", "BlockCyclic", "BallsInBins", "parse_batching"]

_BATCHING_USAGE = "expected none, poisson:P, block-cyclic:BLOCKS:P or balls-in-bins:BINS"


# ----------------------------------------------------------------------------------------------
# Batching specs
# ----------------------------------------------------------------------------------------------
class Batching:
    """How batches are formed.  Subclasses are frozen dataclasses with a ``spec`` string whose
    first word is their ``head``."""

    __slots__ = ()
    #: Whether the randomness of the batching is used for privacy amplification.
    amplified: ClassVar[bool] = True
    #: The first word of the spec (``poisson`` of ``poisson:P``).
    head: ClassVar[str] = ""

    @property
    def spec(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def __str__(self) -> str:
        return self.spec


def _check_probability(value: Any) -> float:
    return check_real("p", value, low=0.0, high=1.0, low_open=True)


@dataclass(frozen=True)
class NoBatching(Batching):
    """No amplification: the worst case over the participation schema (tutorial Sec. 3.3)."""

    head: ClassVar[str] = "none"

    participation: Participation = field(default_factory=Single)
    amplified: ClassVar[bool] = False

    def __post_init__(self):
        object.__setattr__(self, "participation", parse_participation(self.participation))

    @property
    def spec(self) -> str:
        return self.head


@dataclass(frozen=True)
class Poisson(Batching):
    """Poisson sampling: each example joins each step independently with probability ``p``."""

    head: ClassVar[str] = "poisson"

    p: float

    def __post_init__(self):
        object.__setattr__(self, "p", _check_probability(self.p))

    @property
    def spec(self) -> str:
        return f"{self.head}:{self.p!r}"


@dataclass(frozen=True)
class BlockCyclic(Batching):
    """Block-cyclic Poisson sampling (tutorial Def. 3.20): step t samples block t mod ``blocks``
    with probability ``p`` (= B * blocks / N for an expected batch size B out of N examples)."""

    head: ClassVar[str] = "block-cyclic"

    blocks: int
    p: float

    def __post_init__(self):
        object.__setattr__(self, "blocks", check_int("blocks", self.blocks, minimum=1))
        object.__setattr__(self, "p", _check_probability(self.p))

    @property
    def spec(self) -> str:
        return f"{self.head}:{self.blocks}:{self.p!r}"

    def steps_per_block(self, n: int) -> int:
        """Largest number of steps that sample one block: ceil(n / blocks) (block 0)."""
        n = check_int("n", n, minimum=1)
        return -(-n // self.blocks)


@dataclass(frozen=True)
class BallsInBins(Batching):
    """Balls-in-bins batching (seed 000 Sec. 2): every example lands in one of ``bins`` bins
    uniformly at random, once; step t uses bin t mod ``bins``."""

    head: ClassVar[str] = "balls-in-bins"

    bins: int

    def __post_init__(self):
        object.__setattr__(self, "bins", check_int("bins", self.bins, minimum=1))

    @property
    def spec(self) -> str:
        return f"{self.head}:{self.bins}"


def _field(kind: str, text: str, parse: Callable[[str], Any]) -> Any:
    try:
        return parse(text.strip())
    except ValueError:
        raise CorrnoiseError("batching", f"cannot parse {text!r} in {kind}; {_BATCHING_USAGE}") from None


def parse_batching(spec: Any, participation: Participation | str | None = None) -> Batching:
    """Parse a ``--batching`` SPEC (a :class:`Batching` passes through).

    ``participation`` is only meaningful with ``none``; with an amplified batching the
    participation follows from the batching itself, so passing one is an error.
    """
    if isinstance(spec, Batching):
        batching = spec
        if participation is not None and not batching.amplified:
            asked = parse_participation(participation)
            if asked != batching.participation:  # never account a different schema silently
                raise CorrnoiseError(
                    "participation", f"{asked.spec} conflicts with the batching's own participation "
                    f"{batching.participation.spec}; pass NoBatching({asked.spec!r}) or the string 'none'")
    elif not isinstance(spec, str):
        raise CorrnoiseError("batching", f"{_BATCHING_USAGE}, got {spec!r}")
    else:
        parts = spec.strip().lower().split(":")
        kind, args = parts[0], parts[1:]
        if kind == "none" and not args:
            batching = NoBatching(parse_participation(participation or "single"))
            return batching
        if kind == "poisson" and len(args) == 1:
            batching = Poisson(_field(kind, args[0], float))
        elif kind == "block-cyclic" and len(args) == 2:
            batching = BlockCyclic(_field(kind, args[0], int), _field(kind, args[1], float))
        elif kind in ("balls-in-bins", "bins") and len(args) == 1:
            batching = BallsInBins(_field(kind, args[0], int))
        else:
            raise CorrnoiseError("batching", f"{_BATCHING_USAGE}, got {spec!r}")
    if participation is not None and batching.amplified:
        raise CorrnoiseError(
            "participation",
            f"only used with --batching none; {batching.spec} fixes who participates when",
        )
    return batching

