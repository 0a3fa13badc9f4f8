"""Column normalization as a transform on any strategy (tutorial Def. 2.10)."""

from __future__ import annotations

from functools import cached_property

import numpy as np

from ..errors import CorrnoiseError
from ..linalg.streaming import ScaledStream
from .base import Strategy


class ColumnNormalized(Strategy):
    """C_norm[:, t] = C[:, t] / ||C[:, t]||, i.e. C_norm = C D^{-1} with D = diag(column norms).

    B_norm = A C_norm^{-1} = A D C^{-1}; the noise is D (C^{-1} Z), at the base's cost
    (Remark 2.19). Banded stays banded; Toeplitz does not stay Toeplitz.
    """

    kind = "colnorm"

    def __init__(self, base: Strategy):
        if isinstance(base, ColumnNormalized):
            raise CorrnoiseError("strategy", "is already column-normalized")
        self.base = base
        self.n = base.n

    @cached_property
    def scale(self) -> np.ndarray:
        """D: the column norms of the base strategy."""
        return np.sqrt(self.base.column_norms_squared())

    @property
    def label(self):
        return f"{self.base.label}+colnorm"

    @property
    def rows(self):
        return self.base.rows

    @property
    def bands(self):
        return self.base.bands

    @property
    def column_normalized(self):
        return True

    def is_nonnegative(self):
        return self.base.is_nonnegative()

    def matrix(self):
        return self.base.matrix() / self.scale

    def noising_matrix(self):
        return self.scale[:, None] * self.base.noising_matrix()

    def column_norms_squared(self):
        return np.ones(self.n)

    def multiply(self, x):
        x = self._check_rows("x", x, self.n)
        return self.base.multiply(x / self.scale.reshape((-1,) + (1,) * (x.ndim - 1)))

    def inverse_multiply(self, z):
        out = self.base.inverse_multiply(z)
        return out * self.scale.reshape((-1,) + (1,) * (out.ndim - 1))

    def multiply_stream(self):
        return ScaledStream(self.base.multiply_stream(), self.scale)

    def inverse_stream(self):
        return ScaledStream(self.base.inverse_stream(), self.scale, inverse=True)

    def noise_stream(self):
        """The base's stream with row t scaled by its column norm: D (C^{-1} Z)[t] (Remark 2.19)."""
        return self.base.noise_stream().scaled(self.scale)

    def regeneration_stream(self):
        return self.base.regeneration_stream().scaled(self.scale)

    def params(self):
        return {"base_kind": self.base.kind, "base_params": self.base.params()}

    def arrays(self):
        return self.base.arrays()

    @classmethod
    def from_params(cls, n, params, arrays):
        from .kinds import kind_class

        return cls(kind_class(params["base_kind"]).from_params(n, params["base_params"], arrays))

    def with_n(self, n):
        return ColumnNormalized(self.base.with_n(n))
