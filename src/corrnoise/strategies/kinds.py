"""Kind names (as written in mechanism files) -> strategy classes."""

from __future__ import annotations

from ..errors import CorrnoiseError
from .base import Strategy
from .dense import Banded, Dense
from .tree import OnlineTree, Tree
from .toeplitz import BLT, DPCGD, BandedInverse, BandedInverseSqrt, BandedSqrt, Identity, Prefix, Toeplitz, ToeplitzSqrt

__all__ = ["KINDS", "kind_class"]

#: The base kinds; column normalization is a flag of the file, not a kind of its own.
KINDS: dict[str, type[Strategy]] = {
    cls.kind: cls for cls in (Identity, Prefix, ToeplitzSqrt, BandedSqrt, BandedInverseSqrt, BandedInverse, Toeplitz, BLT, DPCGD, Dense, Banded, Tree, OnlineTree)
}


def kind_class(kind: str) -> type[Strategy]:
    try:
        return KINDS[kind]
    except KeyError:
        raise CorrnoiseError("mechanism", f"unknown kind {kind!r}; known kinds: {', '.join(sorted(KINDS))}") from None
