"""Kind names (as written in mechanism files) -> strategy classes."""

from __future__ import annotations

from ..errors import CorrnoiseError
from .base import FAMILY_KINDS, Strategy, register_family
from .dense import Banded, Dense
from .tree import OnlineTree, Tree
from .toeplitz import BLT, BandedInverse, BandedInverseSqrt, BandedSqrt, Identity, Prefix, Toeplitz, ToeplitzSqrt

__all__ = ["KINDS", "kind_class"]

for _cls in (Identity, Prefix, ToeplitzSqrt, BandedSqrt, BandedInverseSqrt, BandedInverse, Toeplitz, BLT, Dense, Banded,
             Tree, OnlineTree):
    register_family()(_cls)  # kinds whose names parse_strategy spells out itself

#: The base kinds (the built-in ones above and every :func:`~corrnoise.strategies.base.register_family`
#: family, e.g. DP-CGD in its own module); column normalization is a flag of the file, not a kind.
KINDS: dict[str, type[Strategy]] = FAMILY_KINDS


def kind_class(kind: str) -> type[Strategy]:
    try:
        return KINDS[kind]
    except KeyError:
        raise CorrnoiseError("mechanism", f"unknown kind {kind!r}; known kinds: {', '.join(sorted(KINDS))}") from None
