"""Strategy names (docs/cli.md, "Mechanism names") -> strategy objects, and kind names -> classes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import CorrnoiseError, check_int
from .base import FAMILY_NAMES, Strategy, parse_floats
from .colnorm import ColumnNormalized
from .dense import Dense
from .tree import OnlineTree, Tree
from .io import load_mechanism
from .toeplitz import BLT, BandedInverse, BandedInverseSqrt, BandedSqrt, Identity, Prefix, ToeplitzSqrt

NAMES_HELP = (
    "identity (or dpsgd), prefix, toeplitz-sqrt, bsr:B, bisr:P, dpcgd:BETA, tree, tree:ls, tree:full, blt:A1,A2,...:L1,L2,..., "
    "matrix:PATH.npy or a mechanism file (.json), optionally with a +colnorm suffix"
)


def parse_strategy(name: str, n: int) -> Strategy:
    """Build the strategy called ``name`` (docs/cli.md "Mechanism names") for n steps."""
    n = check_int("n", n, minimum=1)
    name = str(name).strip()
    if name.endswith("+colnorm"):
        return ColumnNormalized(parse_strategy(name[: -len("+colnorm")], n))
    head, _, rest = name.partition(":")
    if name in ("identity", "dpsgd"):
        return Identity(n)
    if name == "prefix":
        return Prefix(n)
    if name == "toeplitz-sqrt":
        return ToeplitzSqrt(n)
    if name in ("tree", "tree:plain"):
        return OnlineTree(n)
    if name == "tree:ls":
        return OnlineTree(n, "ls")
    if name == "tree:full":
        return Tree(n)
    if head == "bsr" and rest:
        try:
            bands = int(rest)
        except ValueError:
            raise CorrnoiseError("bands", f"bsr:B needs an integer B, got {rest!r}") from None
        return BandedSqrt(n, bands)
    if head == "bisr" and rest:
        try:
            bands = int(rest)
        except ValueError:
            raise CorrnoiseError("bands", f"bisr:P needs an integer P, got {rest!r}") from None
        return BandedInverseSqrt(n, bands)
    if head in FAMILY_NAMES and rest:  # families registered in their own module (register_family)
        return FAMILY_NAMES[head].from_name(rest, n)
    if head == "blt" and rest:
        a, sep, lam = rest.partition(":")
        if not sep:
            raise CorrnoiseError("mechanism", f"{name!r}: a BLT is written blt:ALPHAS:LAMBDAS (comma lists, e.g. "
                                 "blt:0.3,0.1:0.9,0.5); the planner's blt:BUFFERS candidates are designed for a run "
                                 "(corrnoise plan --out DIR writes their mechanism files; mechanism 'blt' plans one)")
        return BLT(parse_floats("alpha", a), parse_floats("lambda", lam), n)
    if head == "bandmf" and rest:
        raise CorrnoiseError("mechanism", f"{name!r} is the planner's name for a BandMF it optimizes for a run: where a "
                             "run is planned (make_private, corrnoise train / plan) pass mechanism 'bandmf' (the planner's "
                             "best); elsewhere the file of corrnoise plan --out DIR, or optimize it (corrnoise optimize "
                             "banded); bsr:B is the closed-form banded square root")
    if head == "matrix" and rest:
        return Dense(_load_npy(rest)).with_n(n)
    if name.endswith(".json") or Path(name).is_file():
        return load_mechanism(name, n=n)
    raise CorrnoiseError("strategy", f"unknown strategy {name!r}; use one of: {NAMES_HELP}")


def _load_npy(path: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise CorrnoiseError("matrix", f"cannot read {path!r} as a .npy array ({exc.__class__.__name__})") from None
