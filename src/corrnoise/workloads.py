"""Workload matrices A (layer 2): what the noisy prefix sums are used for.

Both workloads are lower-triangular Toeplitz with a *banded inverse*: prefix sums have
A^{-1} = I - S and SGD with momentum beta and weight decay w has
A^{-1} = (I - beta S)(I - (1 - w) S) (S = the down-shift). That lets the loss code compute
B = A C^{-1} row by row with a two- or three-term recurrence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import CorrnoiseError, check_int, check_real
from .linalg.toeplitz import toeplitz_matrix


def _signal():
    """scipy.signal, imported on first use: the import takes ~1 s (scipy's array-API backends pull in
    scipy.stats), which every ``import corrnoise`` paid before."""
    from scipy import signal

    return signal


@dataclass(frozen=True)
class Workload:
    """A lower-triangular Toeplitz workload given by the banded series of its inverse."""

    name: str
    inverse_coefficients: tuple[float, ...]

    @property
    def spec(self) -> str:
        return self.name

    @property
    def is_prefix(self) -> bool:
        return self.inverse_coefficients == (1.0, -1.0)

    def coefficients(self, n: int) -> np.ndarray:
        """First column a_0..a_{n-1} of A (for momentum: tutorial Eq. 3.5)."""
        n = check_int("n", n, minimum=1)
        impulse = np.zeros(n)
        impulse[0] = 1.0
        return _signal().lfilter([1.0], list(self.inverse_coefficients), impulse)

    def matrix(self, n: int) -> np.ndarray:
        """The n x n matrix A (tutorial Eq. 3.3 / 3.6)."""
        return toeplitz_matrix(self.coefficients(n))

    def apply(self, x: np.ndarray) -> np.ndarray:
        """A @ x along axis 0 without materializing A (an IIR filter with A^{-1}'s taps)."""
        return _signal().lfilter([1.0], list(self.inverse_coefficients), np.asarray(x, dtype=np.float64), axis=0)


def prefix() -> Workload:
    """A_pre = tril(ones) (tutorial Eq. 3.3)."""
    return Workload("prefix", (1.0, -1.0))


def momentum(beta: float, weight_decay: float = 0.0) -> Workload:
    """SGD with momentum beta and weight decay w (tutorial Eq. 3.4-3.6).

    a_t = sum_{tau<=t} beta^tau (1-w)^(t-tau), whose generating function is
    1 / ((1 - beta x)(1 - (1 - w) x)).
    """
    beta = check_real("beta", beta, 0.0, 1.0, high_open=True)
    weight_decay = check_real("weight_decay", weight_decay, 0.0, 1.0, high_open=True)
    r = 1.0 - weight_decay
    name = f"momentum:{beta:g}" + (f":{weight_decay:g}" if weight_decay else "")
    return Workload(name, (1.0, -(beta + r), beta * r))


def parse_workload(spec: str) -> Workload:
    """Parse ``prefix`` or ``momentum:BETA[:WEIGHT_DECAY]``."""
    parts = str(spec).split(":")
    if parts == ["prefix"]:
        return prefix()
    if parts[0] == "momentum" and len(parts) in (2, 3):
        try:
            values = [float(p) for p in parts[1:]]
        except ValueError:
            raise CorrnoiseError("workload", f"cannot parse {spec!r}; use momentum:BETA or momentum:BETA:WEIGHT_DECAY") from None
        return momentum(*values)
    raise CorrnoiseError("workload", f"unknown workload {spec!r}; use prefix or momentum:BETA[:WEIGHT_DECAY]")
