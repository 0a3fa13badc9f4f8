"""Structured lower-triangular matrices: Toeplitz series, BLT, banded and tree (layer 1)."""
