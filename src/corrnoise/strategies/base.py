"""The strategy interface (layer 2): a lower-triangular C, its noising matrix C^{-1}, streams.

Rows are iterations t = 0..n-1 and the noise added at step t is (C^{-1} Z)[t] (docs/design.md).
Each kind stores only what it needs (coefficients, a band, BLT parameters) and materializes
n x n matrices only when asked.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from ..errors import CorrnoiseError, check_int
from ..linalg.streaming import NoiseStream, StreamingOperator, run_stream


class Strategy(ABC):
    """A strategy matrix C for n steps."""

    kind: ClassVar[str] = "abstract"
    n: int

    # --- structure -------------------------------------------------------------------
    @property
    def label(self) -> str:
        """Name as used on the command line (e.g. ``bsr:4``)."""
        return self.kind

    @property
    def rows(self) -> int:
        """Number of rows of C (n, except for the binary tree)."""
        return self.n

    @property
    def bands(self) -> int:
        """Number of bands b: C[t, tau] = 0 whenever t - tau >= b (tutorial Def. 2.12)."""
        return self.n

    @property
    def toeplitz_coefficients(self) -> np.ndarray | None:
        """First column of C when C is Toeplitz, else None."""
        return None

    @property
    def column_normalized(self) -> bool:
        return False

    def is_nonnegative(self) -> bool:
        """Whether every entry of C is >= 0 (required by the amplification analyses)."""
        return bool(np.all(self.matrix() >= 0.0))

    # --- matrices ----------------------------------------------------------------------
    @abstractmethod
    def matrix(self) -> np.ndarray:
        """C materialized, shape (rows, n)."""

    def noising_matrix(self) -> np.ndarray:
        """C^{-1} materialized (the matrix that correlates the noise), shape (n, rows)."""
        return self.inverse_multiply(np.eye(self.rows))

    def column_norms_squared(self) -> np.ndarray:
        """||C[:, t]||^2 for every column t."""
        return np.sum(self.matrix() ** 2, axis=0)

    # --- products ----------------------------------------------------------------------
    @abstractmethod
    def multiply_stream(self) -> StreamingOperator:
        """Streaming operator for x -> C x."""

    @abstractmethod
    def inverse_stream(self) -> StreamingOperator:
        """Streaming operator for z -> C^{-1} z (noise generation, tutorial Eq. 2.3)."""

    def multiply(self, x: np.ndarray) -> np.ndarray:
        """C @ x (x of shape (n,) or (n, m))."""
        return run_stream(self.multiply_stream(), self._check_rows("x", x, self.n))

    def inverse_multiply(self, z: np.ndarray) -> np.ndarray:
        """C^{-1} @ z (z of shape (n,) or (n, m))."""
        return run_stream(self.inverse_stream(), self._check_rows("z", z, self.rows))

    # --- the noise stream ----------------------------------------------------------------
    def noise_stream(self) -> NoiseStream:
        """How the training-time noise (C^{-1} Z)[t] is produced step by step: the one place that
        says so. The torch generators (:func:`corrnoise.noise.make_generator`) and the numpy
        operator (:meth:`NoiseStream.operator`) are both built from it.

        Each kind overrides this with its cheapest recurrence; the default is memoryless
        regeneration (:meth:`regeneration_stream`), correct for any C, so a new subclass that
        says nothing still gets the right noise.
        """
        return self.regeneration_stream()

    def regeneration_stream(self) -> NoiseStream:
        """(C^{-1} Z)[t] = sum_tau C^{-1}[t, tau] Z[tau] with every needed Z[tau] regenerated from
        the key (tutorial Sec. 4.4.5, Approach 2): O(m) memory for any C. Default: C^{-1}
        materialized (:meth:`noising_matrix`)."""
        return NoiseStream.regenerate(noising=self.noising_matrix())

    # --- closed forms (fast paths of corrnoise.losses) ------------------------------------
    def closed_form_sensitivity_squared(self) -> tuple[float, str] | None:
        """(max column norm squared ||C||_col^2, name of the closed form) when this kind has one
        (single participation), else None: the losses then use :meth:`column_norms_squared`."""
        return None

    def closed_form_prefix_errors_squared(self) -> tuple[float, float] | None:
        """(||B||_F^2 / n, max_t ||B[t]||^2) for the prefix-sum workload in closed form, or None
        when this kind (or this instance) has none."""
        return None

    @staticmethod
    def _check_rows(name: str, x: np.ndarray, rows: int) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        if x.ndim not in (1, 2) or x.shape[0] != rows:
            raise CorrnoiseError(name, f"must have {rows} rows (one per step), got shape {x.shape}")
        return x

    def __repr__(self) -> str:
        """Class, label and n, for people (identity is :func:`~corrnoise.strategies.mechanism_fingerprint`)."""
        return f"{type(self).__name__}({self.label!r}, n={self.n})"

    # --- persistence -------------------------------------------------------------------
    def params(self) -> dict[str, Any]:
        """JSON-able parameters that rebuild this strategy with :meth:`from_params`."""
        return {}

    def arrays(self) -> dict[str, np.ndarray]:
        """Large arrays stored beside the JSON (sibling .npz)."""
        return {}

    @classmethod
    @abstractmethod
    def from_params(cls, n: int, params: dict[str, Any], arrays: dict[str, np.ndarray]) -> "Strategy":
        """Rebuild from :meth:`params` and :meth:`arrays`."""

    def with_n(self, n: int) -> "Strategy":
        """The same mechanism for n steps (n-independent kinds), or an error for n > self.n."""
        n = check_int("n", n, minimum=1)
        if n == self.n:
            return self
        raise CorrnoiseError("n", f"{self.label} was built for n = {self.n} steps and cannot be resized to {n}")


# ----------------------------------------------------------------------------------------------
# Families that register themselves (docs/design.md, "Adding a mechanism")
# ----------------------------------------------------------------------------------------------
#: kind (as written in mechanism files) -> class of every registered family: the built-in kinds
#: (:mod:`.kinds`) and those registered with :func:`register_family`.
FAMILY_KINDS: dict[str, type[Strategy]] = {}
#: name head (``HEAD:ARGS`` in the mechanism grammar, :func:`~corrnoise.strategies.parse_strategy`)
#: -> class whose ``from_name(args, n)`` builds it.
FAMILY_NAMES: dict[str, type[Strategy]] = {}


def register_family(*names: str):
    """Class decorator: register a Strategy family in one place -- its ``kind`` for mechanism files
    (it round-trips through :meth:`Strategy.params`, :meth:`Strategy.arrays` and
    ``from_params``, and is fingerprinted by them) and the name heads ``names`` of the mechanism
    grammar (``HEAD:ARGS``), parsed by its classmethod ``from_name(args, n)``."""

    def register(cls):
        for table, keys in ((FAMILY_KINDS, (cls.kind,)), (FAMILY_NAMES, names)):
            for key in keys:
                if table.get(key, cls) is not cls:
                    raise ValueError(f"{key!r} is registered to {table[key].__name__} already")
                table[key] = cls
        return cls

    return register


def parse_floats(param: str, text: str) -> list[float]:
    """The comma-separated numbers of a name's ARGS; else one line naming ``param``."""
    try:
        return [float(v) for v in text.split(",") if v != ""]
    except ValueError:
        raise CorrnoiseError(param, f"cannot parse numbers from {text!r}") from None


def parse_float(param: str, text: str) -> float:
    """The one number of a name's ARGS; else one line naming ``param``."""
    values = parse_floats(param, text)
    if len(values) != 1:
        raise CorrnoiseError(param, f"expected one number, got {text!r}")
    return values[0]
