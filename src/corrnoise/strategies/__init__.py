"""Strategies (layer 2): mechanisms C and C^{-1}, column normalization, mechanism files."""

from .base import Strategy, register_family
from .colnorm import ColumnNormalized
from .dense import Banded, Dense
from .tree import OnlineTree, Tree
from .io import load_mechanism, mechanism_fingerprint, save_mechanism
from .registry import parse_strategy
from .toeplitz import BLT, DPCGD, BandedInverse, BandedInverseSqrt, BandedSqrt, Identity, Prefix, Toeplitz, ToeplitzSqrt

__all__ = [
    "BLT", "DPCGD", "Banded", "BandedInverse", "BandedInverseSqrt", "BandedSqrt", "ColumnNormalized", "Dense", "Identity", "Prefix",
    "OnlineTree", "Strategy", "Toeplitz", "ToeplitzSqrt", "Tree", "load_mechanism", "mechanism_fingerprint", "parse_strategy", "register_family",
    "save_mechanism",
]
