"""Dense and general banded lower-triangular strategies (the binary tree is in tree.py)."""

from __future__ import annotations

from functools import cached_property

import numpy as np
from scipy import linalg as sla

from ..errors import CorrnoiseError, check_finite_array, check_int
from ..linalg.streaming import BandedStream, DenseStream, NoiseStream
from ..linalg.toeplitz import check_lower_triangular
from .base import Strategy


def count_bands(c: np.ndarray) -> int:
    """Smallest b with C[t, tau] = 0 for t - tau >= b (tutorial Def. 2.12)."""
    rows, cols = np.nonzero(c)
    return int(np.max(rows - cols)) + 1 if rows.size else 1


class Dense(Strategy):
    """An arbitrary invertible lower-triangular C (tutorial Sec. 2.2)."""

    kind = "dense"

    def __init__(self, matrix: np.ndarray):
        self._m = check_lower_triangular("matrix", matrix).copy()
        self.n = self._m.shape[0]

    @cached_property
    def bands(self) -> int:
        return count_bands(self._m)

    def matrix(self):
        return self._m.copy()

    def noising_matrix(self):
        return sla.solve_triangular(self._m, np.eye(self.n), lower=True)

    def is_nonnegative(self):
        return bool(np.all(self._m >= 0.0))

    def column_norms_squared(self):
        return np.sum(self._m**2, axis=0)

    def multiply(self, x):
        return self._m @ self._check_rows("x", x, self.n)

    def inverse_multiply(self, z):
        return sla.solve_triangular(self._m, self._check_rows("z", z, self.n), lower=True)

    def multiply_stream(self):
        return DenseStream(self._m)

    def inverse_stream(self):
        return DenseStream(self._m, inverse=True)

    def noise_stream(self) -> NoiseStream:
        """Banded forward substitution when C has fewer than n bands, else regeneration."""
        if self.bands < self.n:
            return NoiseStream.banded(Banded.from_matrix(self._m, self.bands).band)
        return self.regeneration_stream()

    def arrays(self):
        return {"matrix": self._m}

    @classmethod
    def from_params(cls, n, params, arrays):
        m = np.asarray(arrays["matrix"], dtype=np.float64)
        if m.shape != (n, n):
            raise CorrnoiseError("mechanism", f"matrix has shape {m.shape}, expected ({n}, {n})")
        return cls(m)

    def with_n(self, n):
        n = check_int("n", n, minimum=1)
        if n <= self.n:
            return Dense(self._m[:n, :n])
        return super().with_n(n)


class Banded(Strategy):
    """A general (non-Toeplitz) b-banded lower-triangular C stored as band[t, j] = C[t, t - j].

    O(n b) storage; streaming products need the last b - 1 rows only (tutorial Alg. 2.1).
    """

    kind = "banded"

    def __init__(self, band: np.ndarray):
        band = check_finite_array("band", band, ndim=2).copy()
        n, b = band.shape
        if n < 1 or b < 1:
            raise CorrnoiseError("band", f"must have shape (n, bands) with n, bands >= 1, got {band.shape}")
        if b > n:
            raise CorrnoiseError("bands", f"must be <= n = {n}, got {b}")
        for j in range(1, b):  # entries above the matrix's first column do not exist
            band[:j, j] = 0.0
        if np.any(band[:, 0] == 0.0):
            raise CorrnoiseError("band", f"C is singular (zero on the diagonal at row {int(np.argmax(band[:, 0] == 0.0))})")
        self.band = band
        self.n = n

    @classmethod
    def from_matrix(cls, c: np.ndarray, bands: int | None = None) -> "Banded":
        c = check_lower_triangular("matrix", c)
        b = count_bands(c) if bands is None else check_int("bands", bands, minimum=1)
        if count_bands(c) > b:
            raise CorrnoiseError("bands", f"matrix has {count_bands(c)} bands, more than {b}")
        n = c.shape[0]
        band = np.zeros((n, b))
        for j in range(b):
            band[j:, j] = np.diagonal(c, offset=-j)
        return cls(band)

    @property
    def bands(self) -> int:
        return int(self.band.shape[1])

    def matrix(self):
        c = np.zeros((self.n, self.n))
        for j in range(self.bands):
            idx = np.arange(j, self.n)
            c[idx, idx - j] = self.band[j:, j]
        return c

    def is_nonnegative(self):
        return bool(np.all(self.band >= 0.0))

    def column_norms_squared(self):
        out = np.zeros(self.n)
        for j in range(self.bands):
            out[: self.n - j] += self.band[j:, j] ** 2
        return out

    def multiply_stream(self):
        return BandedStream(self.band)

    def inverse_stream(self):
        return BandedStream(self.band, inverse=True)

    def noise_stream(self) -> NoiseStream:
        """Forward substitution over the last b - 1 rows (non-Toeplitz Alg. 2.1)."""
        return NoiseStream.banded(self.band)

    def arrays(self):
        return {"band": self.band}

    @classmethod
    def from_params(cls, n, params, arrays):
        band = np.asarray(arrays["band"], dtype=np.float64)
        if band.shape[0] != n:
            raise CorrnoiseError("mechanism", f"band has {band.shape[0]} rows, expected {n}")
        return cls(band)

    def with_n(self, n):
        n = check_int("n", n, minimum=1)
        if n <= self.n:
            return Banded(self.band[:n, : min(self.bands, n)])
        return super().with_n(n)
