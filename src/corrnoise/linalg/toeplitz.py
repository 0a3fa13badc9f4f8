"""Lower-triangular Toeplitz matrices represented by their first column (a power series).

A lower-triangular Toeplitz matrix T with first column c is the truncated power series
f_c(x) = sum_t c_t x^t (tutorial Sec. 2.9): products of such matrices are products of series,
and T^{-1} has the reciprocal series. Everything here works on coefficient vectors and never
builds an n x n matrix unless asked (:func:`toeplitz_matrix`).
"""

from __future__ import annotations

import numpy as np
from scipy import linalg as sla

from ..errors import CorrnoiseError, check_finite_array, check_int


def _signal():
    """scipy.signal, imported on first use: the import takes ~1 s (scipy's array-API backends pull in
    scipy.stats), which every ``import corrnoise`` paid before."""
    from scipy import signal

    return signal

# Below this many non-zero coefficients we use direct (FIR/IIR) filtering, above it FFTs.
_SHORT = 64


def _pad(c: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.float64)
    m = min(n, c.shape[0])
    out[:m] = c[:m]
    return out


def effective_length(c: np.ndarray) -> int:
    """Index of the last non-zero coefficient plus one (the number of bands, Def. 2.12)."""
    nz = np.flatnonzero(c)
    return int(nz[-1]) + 1 if nz.size else 0


def prefix_sqrt_coefficients(n: int) -> np.ndarray:
    """First column of A_pre^{1/2}: c_t = (-1)^t binom(-1/2, t) = 4^-t binom(2t, t).

    Tutorial Thm 2.5 (Eq. 2.10) with the overflow-free recursion of Remark 2.6:
    c_0 = 1, c_t = c_{t-1} (2t - 1) / (2t). Accurate to a few ulp for n up to 10^7 and beyond.
    """
    n = check_int("n", n, minimum=1)
    t = np.arange(1, n, dtype=np.float64)
    c = np.empty(n)
    c[0] = 1.0
    c[1:] = np.cumprod((2.0 * t - 1.0) / (2.0 * t))
    return c


def prefix_sqrt_inverse_coefficients(n: int) -> np.ndarray:
    """First column of A_pre^{-1/2}: c'_t = (-1)^t binom(1/2, t) (tutorial Eq. 2.11).

    Uses C^{-1} = A_pre^{-1} C (Remark 2.6), i.e. c'_t = c_t - c_{t-1} = -c_{t-1} / (2t),
    written without the subtraction so there is no cancellation at large t.
    """
    c = prefix_sqrt_coefficients(n)
    out = np.empty(n)
    out[0] = 1.0
    t = np.arange(1, n, dtype=np.float64)
    out[1:] = -c[:-1] / (2.0 * t)
    return out


def bisr_inverse_coefficients(bands: int) -> np.ndarray:
    """First column of the banded C^{-1} of BISR (Banded Inverse Square Root, Kalinin et al. 2025,
    cited in seed 003 Sec. 5): the first ``bands`` coefficients of A_pre^{-1/2}, zeros after.

    c'_0 = 1 and c'_t = (-1)^t binom(1/2, t) < 0 for t >= 1 (tutorial Eq. 2.11 and Remark 2.6).
    """
    bands = check_int("bands", bands, minimum=1)
    return prefix_sqrt_inverse_coefficients(bands)


def bisr_coefficients(bands: int, n: int) -> np.ndarray:
    """First column of BISR's C, length n: the power-series inverse (tutorial Sec. 2.9) of the
    truncated A_pre^{-1/2} series q(x) = sum_{t < bands} c'_t x^t (Kalinin et al. 2025).

    Every coefficient is >= 0 in exact arithmetic: q(x) = 1 - a(x) with a_t = -c'_t > 0 and
    a(1) = 1 - q(1) < 1 (the partial sums of sqrt(1 - x) at x = 1 stay positive, tutorial
    Eq. 2.11), so 1 / q = sum_j a(x)^j has non-negative coefficients. The short-series path of
    :func:`series_inverse` (an IIR filter of positive terms) keeps that sign exactly; the FFT
    (Newton) path for many bands can leave round-off of either sign (|.| ~ 1e-16) where the true
    value is below it, and those entries are set to 0 (closer to the exact value than a negative).
    """
    n = check_int("n", n, minimum=1)
    c = series_inverse(bisr_inverse_coefficients(bands), n)
    return np.maximum(c, 0.0)


def series_multiply(a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    """First n coefficients of the product series a(x) b(x): the first column of T_a T_b."""
    a = np.asarray(a, dtype=np.float64)[:n]
    b = np.asarray(b, dtype=np.float64)[:n]
    if min(a.size, b.size) <= _SHORT:
        out = np.convolve(a, b)[:n]
    else:
        out = _signal().fftconvolve(a, b)[:n]
    return _pad(out, n)


def series_inverse(c: np.ndarray, n: int) -> np.ndarray:
    """First n coefficients of 1 / c(x): the first column of T_c^{-1} (c_0 != 0).

    Short series (few bands) use the exact recurrence c'_t = -(1/c_0) sum_j c_j c'_{t-j}
    (an IIR filter, O(n b)); long ones use Newton's iteration g <- g (2 - c g), doubling the
    number of correct coefficients each round with FFT products (O(n log n)).
    """
    c = np.asarray(c, dtype=np.float64)
    if c.size == 0 or c[0] == 0.0:
        raise CorrnoiseError("strategy", "Toeplitz coefficient c_0 must be non-zero (the matrix is singular)")
    length = effective_length(c[:n])
    impulse = np.zeros(n)
    impulse[0] = 1.0
    if length <= _SHORT:
        return _signal().lfilter([1.0], c[:length], impulse)
    g = np.array([1.0 / c[0]])
    k = 1
    while k < n:
        k2 = min(2 * k, n)
        e = -series_multiply(c[:k2], g, k2)
        e[0] += 2.0
        g = series_multiply(g, e, k2)
        k = k2
    return g


def toeplitz_matrix(c: np.ndarray, n: int | None = None) -> np.ndarray:
    """Materialize the n x n lower-triangular Toeplitz matrix with first column c."""
    c = np.asarray(c, dtype=np.float64)
    n = c.size if n is None else n
    col = _pad(c, n)
    return sla.toeplitz(col, np.zeros(n))


def toeplitz_matmul(c: np.ndarray, x: np.ndarray) -> np.ndarray:
    """T_c @ x for x of shape (n,) or (n, m), without materializing T_c (FIR filter or FFT)."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[0]
    c = _pad(np.asarray(c, dtype=np.float64), n)
    length = max(effective_length(c), 1)
    if length <= _SHORT:
        return _signal().lfilter(c[:length], [1.0], x, axis=0)
    cc = c.reshape((n,) + (1,) * (x.ndim - 1))
    return _signal().fftconvolve(cc, x, axes=0)[:n]


def toeplitz_solve(c: np.ndarray, y: np.ndarray, inverse_coefficients: np.ndarray | None = None) -> np.ndarray:
    """T_c^{-1} @ y: an IIR filter for banded T_c, else a product with the inverse series."""
    y = np.asarray(y, dtype=np.float64)
    n = y.shape[0]
    c = _pad(np.asarray(c, dtype=np.float64), n)
    length = max(effective_length(c), 1)
    if inverse_coefficients is None and length <= _SHORT:
        return _signal().lfilter([1.0], c[:length], y, axis=0)
    inv = series_inverse(c, n) if inverse_coefficients is None else inverse_coefficients
    return toeplitz_matmul(inv, y)


def column_norms_squared(c: np.ndarray, n: int) -> np.ndarray:
    """Squared column norms of the n x n lower-triangular Toeplitz T_c.

    Column j holds c_0..c_{n-1-j}, so ||T_c[:, j]||^2 = sum_{t < n-j} c_t^2 (non-increasing in j).
    """
    sq = np.cumsum(_pad(np.asarray(c, dtype=np.float64), n) ** 2)
    return sq[::-1].copy()


def check_lower_triangular(name: str, m: np.ndarray) -> np.ndarray:
    """Validate a square, finite, lower-triangular, invertible matrix (used for dense C)."""
    m = check_finite_array(name, m, ndim=2)
    if m.shape[0] != m.shape[1]:
        raise CorrnoiseError(name, f"must be square, got shape {m.shape}")
    upper = np.triu(m, 1)
    if np.any(upper != 0.0):
        i, j = np.argwhere(upper != 0.0)[0]
        raise CorrnoiseError(name, f"must be lower-triangular (entry ({i}, {j}) above the diagonal is {m[i, j]:g})")
    d = np.diag(m)
    if np.any(d == 0.0):
        raise CorrnoiseError(name, f"is singular (zero on the diagonal at row {int(np.argmax(d == 0.0))})")
    return m
