"""Toeplitz strategies: general, identity, prefix, A^{1/2}, banded square root, banded inverse
square root, BLT, DP-CGD."""

from __future__ import annotations

from functools import cached_property
from typing import Any

import numpy as np

from ..errors import CorrnoiseError, check_finite_array, check_int, check_real
from ..linalg import blt as bltmath
from ..linalg import toeplitz as tp
from ..linalg.streaming import NoiseStream, ToeplitzStream
from .base import Strategy, parse_float, register_family

# Coefficient vectors up to this length go inline into the mechanism file's JSON.
INLINE_MAX = 1024


class Toeplitz(Strategy):
    """Lower-triangular Toeplitz C with first column ``coefficients`` (zero-padded to n).

    A coefficient vector shorter than n is a banded Toeplitz matrix (tutorial Sec. 2.4).
    ``_inverse``: the first column of C^{-1} in closed form, for the library's own subclasses only
    (the noise uses it, the accounting uses ``coefficients``: nothing checks that they agree --
    found in review as a public keyword, where an inconsistent pair had the plain Toeplitz's
    fingerprint).
    """

    kind = "toeplitz"

    def __init__(self, coefficients: np.ndarray, n: int, *, _inverse: np.ndarray | None = None):
        self.n = check_int("n", n, minimum=1)
        c = check_finite_array("coefficients", coefficients, ndim=1)
        if c.size == 0 or c[0] == 0.0:
            raise CorrnoiseError("coefficients", "c_0 must be non-zero (otherwise C is singular)")
        length = max(tp.effective_length(c), 1)
        self._c = c[: min(length, self.n)].copy()
        self._given_inverse = _inverse

    @property
    def label(self) -> str:
        return "toeplitz" if self.bands == self.n else f"banded-toeplitz:{self.bands}"

    @property
    def bands(self) -> int:
        return int(self._c.size)

    @cached_property
    def coefficients(self) -> np.ndarray:
        """First column of C, length n."""
        return tp._pad(self._c, self.n)

    @property
    def toeplitz_coefficients(self) -> np.ndarray:
        return self.coefficients

    @cached_property
    def inverse_coefficients(self) -> np.ndarray:
        """First column of C^{-1}, length n (C^{-1} is Toeplitz too)."""
        if self._given_inverse is not None:
            return tp._pad(np.asarray(self._given_inverse, dtype=np.float64), self.n)
        return tp.series_inverse(self._c, self.n)

    def is_nonnegative(self) -> bool:
        return bool(np.all(self._c >= 0.0))

    def is_nonnegative_monotone(self) -> bool:
        """c_0 >= c_1 >= ... >= 0: the condition of tutorial Lemma 3.16(c) / Eq. 3.25."""
        c = self._c
        return bool(np.all(c >= 0.0) and np.all(np.diff(c) <= 0.0))

    def matrix(self) -> np.ndarray:
        return tp.toeplitz_matrix(self._c, self.n)

    def noising_matrix(self) -> np.ndarray:
        return tp.toeplitz_matrix(self.inverse_coefficients, self.n)

    def column_norms_squared(self) -> np.ndarray:
        return tp.column_norms_squared(self._c, self.n)

    def multiply(self, x):
        return tp.toeplitz_matmul(self._c, self._check_rows("x", x, self.n))

    def inverse_multiply(self, z):
        z = self._check_rows("z", z, self.n)
        if self.bands <= 64 and self._given_inverse is None:
            return tp.toeplitz_solve(self._c, z)
        return tp.toeplitz_matmul(self.inverse_coefficients, z)

    def multiply_stream(self):
        return ToeplitzStream(self._c, self.n)

    def inverse_stream(self):
        return ToeplitzStream(self._c, self.n, inverse=True)

    def noise_stream(self) -> NoiseStream:
        """Banded (fewer than n bands): forward substitution over the last b - 1 rows (Alg. 2.1);
        otherwise regeneration with the first column of C^{-1}."""
        if self.bands == 1 or self.bands < self.n:
            return NoiseStream.banded(self.coefficients[: self.bands])
        return self.regeneration_stream()

    def regeneration_stream(self) -> NoiseStream:
        return NoiseStream.regenerate(inverse_toeplitz=self.inverse_coefficients)

    def params(self) -> dict[str, Any]:
        if self._c.size <= INLINE_MAX:
            return {"coefficients": self._c.tolist()}
        return {}

    def arrays(self) -> dict[str, np.ndarray]:
        return {} if self._c.size <= INLINE_MAX else {"coefficients": self._c}

    @classmethod
    def from_params(cls, n, params, arrays):
        c = params.get("coefficients")
        if c is None:
            c = arrays["coefficients"]
        return cls(np.asarray(c, dtype=np.float64), n)

    def with_n(self, n: int) -> Strategy:
        n = check_int("n", n, minimum=1)
        if n <= self.n or self.bands < self.n:
            return Toeplitz(self._c[:n], n)
        return super().with_n(n)


class _ParameterFree(Toeplitz):
    """A Toeplitz strategy fully determined by its kind and n (nothing to store in files)."""

    @property
    def label(self) -> str:
        return self.kind

    def params(self):
        return {}

    def arrays(self):
        return {}

    @classmethod
    def from_params(cls, n, params, arrays):
        return cls(n)

    def with_n(self, n):
        return type(self)(n)


class Identity(_ParameterFree):
    """C = I: DP-SGD's independent noise (input perturbation, tutorial Sec. 2.1.3)."""

    kind = "identity"

    def __init__(self, n: int):
        super().__init__(np.ones(1), n, _inverse=np.ones(1))

    def noise_stream(self) -> NoiseStream:
        """DP-SGD: Z[t] itself, no state."""
        return NoiseStream.iid()



class Prefix(_ParameterFree):
    """C = A_pre (output perturbation, tutorial Sec. 2.1.3); C^{-1} = I - S."""

    kind = "prefix"

    def __init__(self, n: int):
        n = check_int("n", n, minimum=1)
        super().__init__(np.ones(n), n, _inverse=np.array([1.0, -1.0]))



class ToeplitzSqrt(_ParameterFree):
    """C = A_pre^{1/2}, the max-loss-optimal Toeplitz strategy (tutorial Thm 2.5, Remark 2.6)."""

    kind = "toeplitz-sqrt"

    def __init__(self, n: int):
        n = check_int("n", n, minimum=1)
        super().__init__(tp.prefix_sqrt_coefficients(n), n, _inverse=tp.prefix_sqrt_inverse_coefficients(n))



def _check_bands(n, bands) -> tuple[int, int]:
    """(n, bands) checked: 1 <= bands <= n (bsr:B, bisr:P)."""
    n = check_int("n", n, minimum=1)
    bands = check_int("bands", bands, minimum=1)
    if bands > n:
        raise CorrnoiseError("bands", f"must be <= n = {n} (the number of steps), got {bands}")
    return n, bands


class BandedSqrt(Toeplitz):
    """``bsr:B``: banded Toeplitz with the first B coefficients of A_pre^{1/2} (tutorial Thm 2.13)."""

    kind = "bsr"

    def __init__(self, n: int, bands: int):
        n, bands = _check_bands(n, bands)
        self._bands = bands
        super().__init__(tp.prefix_sqrt_coefficients(bands), n)

    @property
    def label(self):
        return f"bsr:{self._bands}"

    def params(self):
        return {"bands": self._bands}

    def arrays(self):
        return {}

    @classmethod
    def from_params(cls, n, params, arrays):
        return cls(n, int(params["bands"]))

    def with_n(self, n):
        n = check_int("n", n, minimum=1)
        return type(self)(n, min(self._bands, n))


class BandedInverse(Toeplitz):
    """A Toeplitz C whose inverse has P bands: C^{-1} = T_q for given q = (q_0, ..., q_{P-1})
    (``bandinv:P`` optimizes q, :mod:`corrnoise.optimize.banded_inverse`; Kalinin et al. 2025).

    C is dense (its coefficients are the power-series inverse of q, tutorial Sec. 2.9) and is
    never needed for the noise: (C^{-1} Z)[t] = sum_{j < P} q_j Z[t - j] is regenerated from
    the key, P seed-noise rows per step and no buffers (seed 003 Sec. 4). Products and streams
    use the P taps of C^{-1} (FIR for C^{-1}, IIR for C), never C's n coefficients.
    ``_coefficients``: C's first column in closed form, for the library's own subclasses only (the
    accounting uses it, the noise q: an inconsistent pair is not checked).
    """

    kind = "bandinv"

    def __init__(self, n: int, inverse_coefficients, *, _coefficients: np.ndarray | None = None):
        n = check_int("n", n, minimum=1)
        q = check_finite_array("inverse_coefficients", inverse_coefficients, ndim=1)
        if q.size == 0 or q[0] == 0.0:
            raise CorrnoiseError("inverse_coefficients", "q_0 must be non-zero (otherwise C^-1 is singular)")
        q = q[: max(tp.effective_length(q), 1)]
        if q.size > n:
            raise CorrnoiseError("bands", f"C^-1 has {q.size} bands, more than n = {n}")
        self._q = q.copy()
        c = tp.series_inverse(q, n) if _coefficients is None else _coefficients
        if not np.all(np.isfinite(c)):
            raise CorrnoiseError("inverse_coefficients", "C = T_q^-1 overflows (q has a root inside the unit disk)")
        super().__init__(c, n, _inverse=q)

    @property
    def label(self):
        return f"bandinv:{self.inverse_bands}"

    @property
    def inverse_bands(self) -> int:
        """P: the number of bands of C^{-1}."""
        return int(self._q.size)

    @property
    def bands(self) -> int:
        """Bands of C: 1 when C^{-1} is diagonal, else n (C = T_q^{-1} is dense in exact
        arithmetic even where a coefficient underflows to 0 in float64)."""
        return 1 if self.inverse_bands == 1 else self.n

    def multiply(self, x):
        """C x as the IIR filter with the P taps of C^{-1} (tutorial Alg. 2.1)."""
        return tp.toeplitz_solve(self._q, self._check_rows("x", x, self.n))

    def inverse_multiply(self, z):
        """C^{-1} z as the FIR filter with the P taps of C^{-1}."""
        return tp.toeplitz_matmul(self._q, self._check_rows("z", z, self.n))

    def multiply_stream(self):
        return ToeplitzStream(self._q, self.n, inverse=True)

    def inverse_stream(self):
        return ToeplitzStream(self._q, self.n)

    def noise_stream(self) -> NoiseStream:
        """Regeneration of the P non-zero taps of C^{-1}: O(P m) time per step, O(1) extra rows."""
        return self.regeneration_stream()

    def regeneration_stream(self) -> NoiseStream:
        return NoiseStream.regenerate(inverse_toeplitz=self._q.copy())

    def params(self):
        return {"inverse_coefficients": self._q.tolist()}

    def arrays(self):
        return {}

    @classmethod
    def from_params(cls, n, params, arrays):
        return cls(n, np.asarray(params["inverse_coefficients"], dtype=np.float64))

    def with_n(self, n):
        """The same taps for n steps (truncated to n bands when n is smaller)."""
        n = check_int("n", n, minimum=1)
        return BandedInverse(n, self._q[:n])


class BandedInverseSqrt(BandedInverse):
    """``bisr:P``: Banded Inverse Square Root (Kalinin et al. 2025, cited in seed 003 Sec. 5).

    C^{-1} is the lower-triangular Toeplitz matrix of the first P coefficients of A_pre^{-1/2}
    (:func:`~corrnoise.linalg.toeplitz.bisr_inverse_coefficients`); C is its power-series
    inverse (:func:`~corrnoise.linalg.toeplitz.bisr_coefficients`), dense with all coefficients
    >= 0. P = n gives A_pre^{1/2}. Noise, products and streams as :class:`BandedInverse`.
    """

    kind = "bisr"

    def __init__(self, n: int, bands: int):
        n, bands = _check_bands(n, bands)
        super().__init__(n, tp.bisr_inverse_coefficients(bands), _coefficients=tp.bisr_coefficients(bands, n))

    @property
    def label(self):
        return f"bisr:{self.inverse_bands}"

    def params(self):
        return {"bands": self.inverse_bands}

    @classmethod
    def from_params(cls, n, params, arrays):
        return cls(n, int(params["bands"]))

    def with_n(self, n):
        n = check_int("n", n, minimum=1)
        return type(self)(n, min(self.inverse_bands, n))


class BLT(Toeplitz):
    """Buffered linear Toeplitz C = BLT(alpha, lambda) (tutorial Sec. 2.5, Eq. 2.16).

    Coefficients are generated only when something needs them; losses for the prefix
    workload use the O(d^2) closed forms of Lemma 2.29, so n can be 10^9.
    """

    kind = "blt"

    def __init__(self, alpha, lam, n: int):
        self.n = check_int("n", n, minimum=1)
        self.alpha, self.lam = bltmath.validate_blt(alpha, lam)
        self._given_inverse = None

    @property
    def label(self):
        return f"blt(d={self.alpha.size})"

    @property
    def bands(self) -> int:
        return self.n

    @cached_property
    def _c(self) -> np.ndarray:  # type: ignore[override]
        return bltmath.blt_coefficients(self.alpha, self.lam, self.n)

    def is_nonnegative(self) -> bool:
        return bool(np.all(self._c >= 0.0))

    def is_nonnegative_monotone(self) -> bool:
        if bltmath.blt_is_nonnegative_monotone(self.alpha, self.lam):
            return True
        return super().is_nonnegative_monotone()

    def column_norms_squared(self) -> np.ndarray:
        return tp.column_norms_squared(self._c, self.n)

    def max_column_norm_squared(self) -> float:
        """||C||_col^2 in O(d^2) (tutorial Lemma 2.29(a))."""
        return float(bltmath.blt_sensitivity_squared(self.alpha, self.lam, self.n))

    def multiply(self, x):
        return bltmath.blt_multiply(self.alpha, self.lam, self._check_rows("x", x, self.n))

    def inverse_multiply(self, z):
        return bltmath.blt_inverse_multiply(self.alpha, self.lam, self._check_rows("z", z, self.n))

    def multiply_stream(self):
        return bltmath.BLTStream(self.alpha, self.lam, self.n, inverse=False)

    def inverse_stream(self):
        return bltmath.BLTStream(self.alpha, self.lam, self.n, inverse=True)

    def noise_stream(self) -> NoiseStream:
        """Alg. 2.2 with the parameters of C: d buffers."""
        return NoiseStream.blt(self.alpha, self.lam)

    def closed_form_sensitivity_squared(self) -> tuple[float, str]:
        return self.max_column_norm_squared(), "blt-closed-form"

    def closed_form_prefix_errors_squared(self) -> tuple[float, float] | None:
        """Lemma 2.29 in O(d^2); None when the inverse parameters are defective."""
        try:
            mean_sq = bltmath.blt_mean_error_squared(self.alpha, self.lam, self.n)
            max_sq = bltmath.blt_max_error_squared(self.alpha, self.lam, self.n)
        except CorrnoiseError:
            return None
        return mean_sq, max_sq

    def params(self):
        return {"alpha": self.alpha.tolist(), "lambda": self.lam.tolist()}

    def arrays(self):
        return {}

    @classmethod
    def from_params(cls, n, params, arrays):
        return cls(params["alpha"], params["lambda"], n)

    def with_n(self, n):
        return type(self)(self.alpha, self.lam, n)


@register_family("dpcgd")
class DPCGD(BLT):
    """DP-CGD (seed 003 Eq. 8-9): C^{-1} = I - beta S, so c_t = beta^t = BLT([beta], [beta]).

    The noise at step t is z_t - beta z_{t-1}: one regenerated previous row, no extra memory.
    Registered in its own module (:func:`~corrnoise.strategies.base.register_family`): its kind
    for mechanism files and its name ``dpcgd:BETA``.
    """

    kind = "dpcgd"

    @classmethod
    def from_name(cls, args: str, n: int) -> "DPCGD":
        """``dpcgd:BETA``."""
        return cls(parse_float("beta", args), n)

    def __init__(self, beta: float, n: int):
        self.beta = check_real("beta", beta, 0.0, 1.0, high_open=True)
        super().__init__([self.beta], [self.beta], n)
        self._given_inverse = np.array([1.0, -self.beta])

    @property
    def label(self):
        return f"dpcgd:{self.beta:g}"

    @cached_property
    def inverse_coefficients(self) -> np.ndarray:
        return tp._pad(np.array([1.0, -self.beta]), self.n)

    def inverse_multiply(self, z):
        z = self._check_rows("z", z, self.n)
        out = z.copy()
        out[1:] -= self.beta * z[:-1]
        return out

    def noise_stream(self) -> NoiseStream:
        """Z[t] - beta Z[t-1] with Z[t-1] regenerated: no buffers (not BLT's d = 1 recurrence)."""
        return NoiseStream.dpcgd(self.beta)

    def params(self):
        return {"beta": self.beta}

    @classmethod
    def from_params(cls, n, params, arrays):
        return cls(params["beta"], n)

    def with_n(self, n):
        return type(self)(self.beta, n)
