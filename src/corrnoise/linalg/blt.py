"""Buffered linear Toeplitz (BLT) matrices (tutorial Sec. 2.5 and Sec. 2.10).

``BLT(alpha, lam)`` is the n x n lower-triangular Toeplitz matrix whose first column is
c_0 = 1 and c_t = sum_i alpha_i lam_i^(t-1) for t >= 1 (tutorial Eq. 2.16). Rows are time
steps. For the prefix-sum workload A = tril(ones) the decoder is B = A C^{-1}.

Everything here is numpy only and never materializes an n x n matrix:

* :func:`blt_coefficients` -- the first column of C (Eq. 2.16);
* :func:`blt_inverse_parameters` -- C^{-1} = BLT(alpha_hat, lam_hat) (Lemma 2.16);
* :class:`BLTStream`, :func:`blt_multiply`, :func:`blt_inverse_multiply` -- C x with d buffers
  (Eq. 2.18) and C^{-1} z with d buffers (Alg. 2.2);
* :func:`blt_sensitivity_squared`, :func:`blt_max_error_squared`,
  :func:`blt_mean_error_squared` -- O(d^2) closed forms of Lemma 2.29 for the prefix workload,
  valid for n up to 10^9 and beyond.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import CorrnoiseError, check_finite_array, check_int

__all__ = [
    "validate_blt",
    "blt_is_nonnegative_monotone",
    "blt_coefficients",
    "blt_inverse_parameters",
    "BLTStream",
    "blt_multiply",
    "blt_inverse_multiply",
    "blt_sensitivity_squared",
    "blt_max_error_squared",
    "blt_mean_error_squared",
]


# ---------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------
def _as_vector(name: str, value: Any) -> np.ndarray:
    arr = check_finite_array(name, value)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise CorrnoiseError(name, f"must be a 1-dimensional vector, got shape {arr.shape}")
    return arr.copy()


def validate_blt(alpha: Any, lam: Any) -> tuple[np.ndarray, np.ndarray]:
    """Check BLT parameters (tutorial Eq. 2.16) and return them as float64 vectors.

    ``alpha`` (scales) and ``lam`` (decays) must be finite vectors of the same length d >= 1
    with every lam_i in [0, 1). The sign of alpha is not restricted here (Problem 2.17 uses
    alpha >= 0; see :func:`blt_is_nonnegative_monotone`).
    """
    alpha = _as_vector("alpha", alpha)
    lam = _as_vector("lambda", lam)
    if alpha.size == 0:
        raise CorrnoiseError("alpha", "needs at least one entry (the BLT order d must be >= 1)")
    if lam.size != alpha.size:
        raise CorrnoiseError(
            "lambda", f"has {lam.size} entries but alpha has {alpha.size}; they must match"
        )
    bad = (lam < 0.0) | (lam >= 1.0)
    if np.any(bad):
        raise CorrnoiseError(
            "lambda", f"every decay must lie in [0, 1), got {float(lam[bad][0])!r}"
        )
    return alpha, lam


def blt_is_nonnegative_monotone(alpha: Any, lam: Any) -> bool:
    """True when all alpha_i >= 0 and sum(alpha) <= 1.

    Then the Toeplitz coefficients c_0 = 1 >= c_1 = sum(alpha) >= c_2 >= ... >= 0 are
    non-negative and non-increasing (each alpha_i lam_i^(t-1) is, as lam_i in [0, 1)), which
    is what the multi-epoch sensitivity shortcut (tutorial Eq. 3.25) needs. The test is
    exact: sum(alpha) = 1 + 1e-16 returns False.
    """
    alpha, lam = validate_blt(alpha, lam)
    return bool(np.all(alpha >= 0.0) and float(np.sum(alpha)) <= 1.0)


def blt_coefficients(alpha: Any, lam: Any, n: int) -> np.ndarray:
    """First column (c_0, ..., c_{n-1}) of C = BLT(alpha, lam) (tutorial Eq. 2.16).

    Each power lam_i^k is computed with ``pow`` directly (no running product, so no error
    build-up for n ~ 10^7; lam_i = 0 gives 0^0 = 1 and 0 afterwards; tiny values underflow
    gracefully to 0).
    """
    alpha, lam = validate_blt(alpha, lam)
    n = check_int("n", n, minimum=1)
    c = np.zeros(n, dtype=np.float64)
    c[0] = 1.0
    if n == 1:
        return c
    k = np.arange(n - 1, dtype=np.float64)
    acc = c[1:]
    buf = np.empty(n - 1, dtype=np.float64)
    with np.errstate(under="ignore"):
        for a, l in zip(alpha, lam):
            if a == 0.0:
                continue
            np.power(l, k, out=buf)
            buf *= a
            acc += buf
    return c


# ---------------------------------------------------------------------------------------
# Inverse parameters (Lemma 2.16)
# ---------------------------------------------------------------------------------------
def _series_inverse_head(c: np.ndarray) -> np.ndarray:
    """First len(c) coefficients of 1 / (sum_t c_t z^t) for c_0 = 1 (forward substitution)."""
    out = np.zeros(c.size, dtype=np.float64)
    out[0] = 1.0
    for t in range(1, c.size):
        out[t] = -np.dot(c[1 : t + 1], out[t - 1 :: -1])
    return out


def _inverse_modes(alpha: np.ndarray, lam: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (alpha_hat, lam_hat) modes of C^{-1} after merging equal decays and dropping
    zero scales; possibly fewer than d of them (none when C = I). Complex when needed."""
    # BLT(alpha, lam) only depends on sum of alpha over equal lam: merge those exactly.
    lam_u, inv = np.unique(lam, return_inverse=True)
    alpha_u = np.zeros(lam_u.size)
    np.add.at(alpha_u, inv, alpha)
    keep = alpha_u != 0.0
    a, l = alpha_u[keep], lam_u[keep]
    k = a.size
    if k == 0:
        return np.zeros(0), np.zeros(0)

    # C is the impulse response of m_{t+1} = Lam m_t + 1 x_t, y_t = x_t + a^T m_t. The inverse
    # system has state matrix M = Lam - 1 a^T (input 1, output -a^T), so the lam_hat are the
    # eigenvalues of M. They are the roots of the secular equation
    #     f(w) = 1 + sum_i a_i / (w - l_i) = 0
    # (the generating function of C is f(1/z)), and alpha_hat_k is the residue of 1/f at the
    # root mu_k, i.e. 1 / f'(mu_k) = -1 / sum_i a_i / (mu_k - l_i)^2. This equals the
    # eigenvector formula -(a^T V)_k (V^{-1} 1)_k without forming V^{-1}.
    mat = np.diag(l) - np.outer(np.ones(k), a)
    mu = np.linalg.eigvals(mat)
    scale = max(1.0, float(np.max(np.abs(mu))))
    if np.iscomplexobj(mu):
        if np.all(np.abs(mu.imag) <= 1e-13 * scale):
            mu = mu.real.copy()
        else:
            mu = mu.astype(np.complex128)

    def f_and_df(w):
        diff = w[:, None] - l[None, :]
        q = a[None, :] / diff
        return 1.0 + q.sum(axis=1), -(q / diff).sum(axis=1)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # A few guarded Newton steps on f polish the LAPACK eigenvalues.
        fv, dfv = f_and_df(mu)
        for _ in range(3):
            cand = mu - fv / dfv
            fc, dfc = f_and_df(cand)
            better = np.isfinite(fc) & np.isfinite(cand) & (np.abs(fc) < np.abs(fv))
            if not np.any(better):
                break
            mu = np.where(better, cand, mu)
            fv = np.where(better, fc, fv)
            dfv = np.where(better, dfc, dfv)
        a_hat = 1.0 / dfv

    if k > 1 and not np.all(a > 0.0):
        # With all a_i > 0 the roots interlace the distinct l_i and are simple; otherwise a
        # (nearly) repeated root makes M defective and the residues meaningless.
        gaps = np.abs(mu[:, None] - mu[None, :]) + np.diag(np.full(k, np.inf))
        if float(np.min(gaps)) <= 1e-7 * scale:
            raise CorrnoiseError(
                "lambda",
                "the inverse BLT has a repeated (or nearly repeated) decay: Lam - 1 alpha^T is "
                "not diagonalizable, so C^{-1} is not a BLT with distinct decays; use the "
                "Toeplitz coefficients (or Alg. 2.2 streaming) instead",
            )

    # Check the first 2k + 1 coefficients of C^{-1} against forward substitution. Both
    # sequences satisfy the same order-k linear recurrence, so agreement here means the
    # parameters are right (up to round-off).
    terms = 2 * k + 2
    c_head = np.zeros(terms)
    c_head[0] = 1.0
    u = np.arange(terms - 1, dtype=np.float64)
    c_head[1:] = (a[None, :] * np.power(l[None, :], u[:, None])).sum(axis=1)
    want = _series_inverse_head(c_head)
    with np.errstate(all="ignore"):
        got = (a_hat[None, :] * np.power(mu[None, :], u[:, None])).sum(axis=1)
        err = float(np.max(np.abs(got - want[1:])))
    if not (np.all(np.isfinite(a_hat)) and np.all(np.isfinite(mu))) or not (
        err <= 1e-8 * max(1.0, float(np.max(np.abs(want))))
    ):
        raise CorrnoiseError(
            "lambda",
            "could not compute stable inverse BLT parameters (the d x d eigenproblem is "
            "ill-conditioned or defective, e.g. nearly repeated inverse decays); use the "
            "Toeplitz coefficients (or Alg. 2.2 streaming) instead",
        )
    return a_hat, mu


def blt_inverse_parameters(alpha: Any, lam: Any) -> tuple[np.ndarray, np.ndarray]:
    """Parameters with C^{-1} = BLT(alpha_hat, lam_hat) for C = BLT(alpha, lam) (Lemma 2.16).

    lam_hat are the eigenvalues of Lam - 1 alpha^T and alpha_hat_k = -(alpha^T V)_k (V^{-1} 1)_k
    for its eigenvectors V, computed as residues of the secular equation (see the source).
    The arrays have length d; entries with equal input decays are merged and zero scales
    dropped first, and each freed slot is returned as alpha_hat = 0 with one of the input
    decays, which leaves the matrix unchanged. They are float64 when all eigenvalues are
    real (e.g. alpha > 0: then lam_hat interlace lam, alpha_hat < 0, and lam_hat lies in
    [-1, 1] when sum(alpha) <= 1) and complex128 otherwise. lam_hat may be negative, and
    outside [-1, 1] when the scales are large.

    Raises CorrnoiseError("lambda", ...) when the inverse system is (numerically) defective,
    e.g. a repeated inverse decay; callers should then fall back to Toeplitz coefficients.
    """
    alpha, lam = validate_blt(alpha, lam)
    a_hat, mu = _inverse_modes(alpha, lam)
    d, k = alpha.size, a_hat.size
    if k == d:
        return a_hat, mu
    # Pad with zero scales (the decay of a zero-scale term is irrelevant; reuse input ones).
    spare = lam[: d - k]
    dtype = mu.dtype if k else np.float64
    a_out = np.zeros(d, dtype=dtype)
    m_out = np.zeros(d, dtype=dtype)
    a_out[:k], m_out[:k] = a_hat, mu
    m_out[k:] = spare
    return a_out, m_out


# ---------------------------------------------------------------------------------------
# Streaming (Eq. 2.18 and Alg. 2.2)
# ---------------------------------------------------------------------------------------
class BLTStream:
    """C x (``inverse=False``, Eq. 2.18) or C^{-1} z (``inverse=True``, Alg. 2.2), one row a step.

    ``state = op.init(shape)`` then ``y_t, state = op.step(state, x_t)``. The state is the
    step count and d buffers of the row shape (O(d m) memory); ``step`` does not modify the
    state it is given. With ``n`` set, stepping past row n - 1 raises.

    Multiply: y_t = x_t + sum_i alpha_i m_{t,i}, m_{t+1,i} = x_t + lam_i m_{t,i}.
    Inverse:  y_t = z_t - sum_i alpha_i m_{t,i}, m_{t+1,i} = lam_i m_{t,i} + y_t.
    """

    def __init__(self, alpha: Any, lam: Any, n: int | None = None, inverse: bool = False):
        self.alpha, self.lam = validate_blt(alpha, lam)
        self.n = None if n is None else check_int("n", n, minimum=1)
        self.inverse = bool(inverse)

    def init(self, shape: int | tuple[int, ...] | None = ()) -> tuple[int, np.ndarray]:
        """Zero buffers for rows of the given shape (an int m means rows of length m)."""
        if shape is None:
            shape = ()
        elif isinstance(shape, (int, np.integer)):
            shape = (int(shape),)
        return 0, np.zeros((self.alpha.size, *tuple(shape)), dtype=np.float64)

    def step(self, state: tuple[int, np.ndarray], x: Any) -> tuple[np.ndarray, tuple[int, np.ndarray]]:
        """Return (row t of the product, next state)."""
        t, buf = state
        if self.n is not None and t >= self.n:
            raise CorrnoiseError(
                "steps", f"the mechanism has n = {self.n} steps; step {t} is past its end"
            )
        x = np.asarray(x, dtype=np.float64)
        lam = self.lam.reshape((-1,) + (1,) * (buf.ndim - 1))
        mixed = np.tensordot(self.alpha, buf, axes=1)
        if self.inverse:
            y = x - mixed
            new = lam * buf + y
        else:
            y = x + mixed
            new = lam * buf + x
        return y, (t + 1, new)


def _run(op: BLTStream, x: Any, name: str) -> np.ndarray:
    x = check_finite_array(name, x)
    if x.ndim not in (1, 2):
        raise CorrnoiseError(name, f"must have shape (n,) or (n, m), got {x.shape}")
    state = op.init(x.shape[1:])
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        out[t], state = op.step(state, x[t])
    return out


def blt_multiply(alpha: Any, lam: Any, x: Any) -> np.ndarray:
    """C @ x for C = BLT(alpha, lam), row by row with d buffers (tutorial Eq. 2.18).

    ``x`` has shape (n,) or (n, m); n is taken from x.
    """
    return _run(BLTStream(alpha, lam), x, "x")


def blt_inverse_multiply(alpha: Any, lam: Any, z: Any) -> np.ndarray:
    """C^{-1} @ z for C = BLT(alpha, lam) by tutorial Alg. 2.2 (d buffers; no inverse
    parameters needed). ``z`` has shape (n,) or (n, m)."""
    return _run(BLTStream(alpha, lam, inverse=True), z, "z")


# ---------------------------------------------------------------------------------------
# Closed forms (Lemma 2.29)
# ---------------------------------------------------------------------------------------
# All sums below are evaluated for complex w (with L a logarithm of w, exp(L) = w) by one
# of two formulas: far from w = 1 the plain geometric formulas are accurate; near w = 1 they
# cancel catastrophically, and we use phi1(z) = expm1(z)/z, phi2(z) = (expm1(z) - z)/z^2,
# which are smooth at z = 0 and accurate for every n.
_NEAR_ONE = 0.5
_PHI2_TAYLOR = [1.0 / math.factorial(j + 2) for j in range(18)]


def _log(w: np.ndarray) -> np.ndarray:
    """Principal log, accurate near w = 1 (log|w| via log1p)."""
    re, im = w.real, w.imag
    with np.errstate(divide="ignore"):
        logabs = 0.5 * np.log1p((re - 1.0) * (re + 1.0) + im * im)
    return logabs + 1j * np.arctan2(im, re)


def _phi1(z: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        out = np.expm1(z) / z
    return np.where(z == 0, 1.0 + 0j, out)


def _phi2(z: np.ndarray) -> np.ndarray:
    small = np.abs(z) < 0.5
    zs = np.where(small, z, 0.0)
    series = np.zeros_like(z)
    for coef in reversed(_PHI2_TAYLOR):
        series = series * zs + coef
    with np.errstate(all="ignore"):
        direct = (np.expm1(z) - z) / (z * z)
    return np.where(small, series, direct)


def _power(w: np.ndarray, n: int) -> np.ndarray:
    """w**n for complex w and integer n >= 0, as |w|^n e^{i n arg w} (w = 0 gives 0)."""
    with np.errstate(all="ignore"):
        mag = np.power(np.abs(w), float(n))
        return mag * np.exp(1j * (float(n) * np.angle(w)))


def _geom(n: int, w: np.ndarray, L: np.ndarray) -> np.ndarray:
    """gamma_n(w) = sum_{t=0}^{n-1} w^t = (1 - w^n) / (1 - w)."""
    near = np.abs(w - 1.0) < _NEAR_ONE
    with np.errstate(all="ignore"):
        far = (1.0 - _power(w, n)) / np.where(near, 1.0, 1.0 - w)
        close = n * _phi1(n * np.where(near, L, 0.0)) / _phi1(np.where(near, L, 0.0))
    return np.where(near, close, far)


def _geom_sum(n: int, w: np.ndarray, L: np.ndarray) -> np.ndarray:
    """sum_{s=0}^{n-1} gamma_s(w) = sum_{s=0}^{n-1} (n - 1 - s) w^s = (n - gamma_n(w)) / (1 - w).

    Near w = 1 with x = log w: = (expm1(n x) - n expm1(x)) / expm1(x)^2
    = (n^2 phi2(n x) - n phi2(x)) / phi1(x)^2, which has no cancellation beyond a factor 2.
    """
    near = np.abs(w - 1.0) < _NEAR_ONE
    x = np.where(near, L, 0.0)
    with np.errstate(all="ignore"):
        far = (n - _geom(n, w, L)) / np.where(near, 1.0, 1.0 - w)
        nf = float(n)
        close = (nf * nf * _phi2(nf * x) - nf * _phi2(x)) / _phi1(x) ** 2
    return np.where(near, close, far)


def _pair_logs(L: np.ndarray) -> np.ndarray:
    """log(w_k w_l) = L_k + L_l with the imaginary part wrapped to (-pi, pi]."""
    s = L[:, None] + L[None, :]
    im = np.mod(s.imag + np.pi, 2.0 * np.pi) - np.pi
    im = np.where(im == -np.pi, np.pi, im)
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(s.real), s.real + 1j * im, s)


def blt_sensitivity_squared(alpha: Any, lam: Any, n: int) -> float:
    """||C||_col^2 for C = BLT(alpha, lam) of size n, in O(d^2) (tutorial Lemma 2.29(a)).

    For any lower-triangular Toeplitz matrix the first column has the largest norm, so
    ||C||_col^2 = 1 + sum_{t=1}^{n-1} c_t^2 = 1 + sum_{i,j} alpha_i alpha_j gamma_{n-1}(lam_i lam_j).
    (The printed formula (a) is correct.)
    """
    alpha, lam = validate_blt(alpha, lam)
    n = check_int("n", n, minimum=1)
    w = np.outer(lam, lam).astype(np.complex128)
    L = _pair_logs(_log(lam.astype(np.complex128)))
    g = _geom(n - 1, w, L).real
    return float(1.0 + alpha @ g @ alpha)


def _decoder_modes(alpha: np.ndarray, lam: np.ndarray):
    """b_s = beta + sum_k e_k mu_k^s: the coefficients of B = A C^{-1} (prefix workload).

    b_s = 1 + sum_{u=1}^s c'_u with c'_u = sum_k a_k mu_k^(u-1) (the inverse BLT), so
    b_s = 1 + sum_k a_k gamma_s(mu_k) = beta + sum_k e_k mu_k^s with e_k = -a_k / (1 - mu_k) and
    beta = 1 + sum_k a_k / (1 - mu_k) = sum_u c'_u = 1 / C(1) = 1 / (1 + sum_i alpha_i / (1 - lam_i)).
    beta is taken from the last expression (no cancellation; lam_i < 1).
    """
    a, mu = _inverse_modes(alpha, lam)
    denom = 1.0 + float(np.sum(alpha / (1.0 - lam)))
    if denom == 0.0 or np.any(mu == 1.0):
        raise CorrnoiseError(
            "alpha",
            "C^{-1} has a unit decay (1 + sum alpha_i / (1 - lambda_i) = 0): the prefix-sum "
            "error grows without bound and has no closed form here",
        )
    beta = 1.0 / denom
    mu = mu.astype(np.complex128)
    e = -a.astype(np.complex128) / (1.0 - mu)
    L = _log(mu)
    return beta, e, mu, L


def _finite_or_inf(value: Any, mu: np.ndarray) -> float:
    """A sum of squares that came out non-finite only because mu_k^n overflowed is +inf."""
    value = float(value)
    if not math.isfinite(value) and float(np.max(np.abs(mu))) > 1.0:
        return math.inf
    return value


def blt_max_error_squared(alpha: Any, lam: Any, n: int) -> float:
    """max_t ||B[t, :]||^2 for B = A_pre C^{-1} in O(d^2) (tutorial Lemma 2.29(b)).

    B is lower-triangular Toeplitz with coefficients b_s (see :func:`_decoder_modes`), so the
    maximum is the last row: sum_{s=0}^{n-1} b_s^2
        = n beta^2 + 2 beta sum_k e_k gamma_n(mu_k) + sum_{k,l} e_k e_l gamma_n(mu_k mu_l),
    evaluated in complex arithmetic (lam_hat may be negative or complex), real part returned.
    Valid for every n >= 1. Returns inf when the true value overflows (|lam_hat| > 1, n huge).

    Printed formula (b) vs. the materialized B: Gamma_i^(n) and Gamma_{i,j}^(n) are right,
    but the lemma states C^{-1} = BLT(-alpha~, lambda~) with alpha~ >= 0, and with that
    convention the linear term is wrong in sign. Correct:
        ||B||_row^2 = n - 2 sum_i alpha~_i Gamma_i + sum_{i,j} alpha~_i alpha~_j Gamma_{i,j}.
    (The printed "+2" is right only if alpha~ denotes the signed inverse scales alpha_hat,
    C^{-1} = BLT(alpha_hat, lambda~).) Also lambda~ need not lie in [0, 1): the smallest
    inverse decay is negative whenever sum_i alpha_i / lambda_i > 1. The restriction n >= 2
    is unnecessary. We do not use the printed arrangement n + 2 sum + sum: when lam is near
    1, beta = 1/C(1) is small and those three terms cancel (about 1e-8 relative error at
    n = 1e9 for lam ~ 1 - 1e-6); the beta/e form sums terms of one sign for alpha > 0.
    """
    alpha, lam = validate_blt(alpha, lam)
    n = check_int("n", n, minimum=1)
    beta, e, mu, L = _decoder_modes(alpha, lam)
    if e.size == 0:
        return float(n)
    g1 = _geom(n, mu, L)
    g2 = _geom(n, np.outer(mu, mu), _pair_logs(L))
    total = n * beta * beta + 2.0 * beta * np.sum(e * g1) + e @ g2 @ e
    return _finite_or_inf(total.real, mu)


def blt_mean_error_squared(alpha: Any, lam: Any, n: int) -> float:
    """||B||_F^2 / n for B = A_pre C^{-1} in O(d^2) (tutorial Lemma 2.29(c)).

    ||B||_F^2 = sum_{s=0}^{n-1} (n - s) b_s^2
        = beta^2 n(n+1)/2 + 2 beta sum_k e_k H_n(mu_k) + sum_{k,l} e_k e_l H_n(mu_k mu_l),
    with H_n(w) = sum_{s=0}^{n-1} (n - s) w^s = (n - w gamma_n(w)) / (1 - w)
               = (n - gamma_n(w)) / (1 - w) + gamma_n(w)   (the second form is the stable one).
    Complex arithmetic, real part returned; inf when the true value overflows.

    Printed formula (c) vs. the materialized B: S_i, S_{i,j}, Gamma-hat_i and
    Gamma-hat_{i,j} are right, but (i) the last term is missing its sum over j, and
    (ii) as in (b), with the stated convention C^{-1} = BLT(-alpha~, lambda~) the linear
    term has the wrong sign. Correct:
        ||B||_F^2 / n = (n+1)/2 - (2/n) sum_i alpha~_i Gamma-hat_i
                        + (1/n) sum_i sum_j alpha~_i alpha~_j Gamma-hat_{i,j}
    (or "+ (2/n)" with alpha~ read as the signed inverse scales alpha_hat).
    """
    alpha, lam = validate_blt(alpha, lam)
    n = check_int("n", n, minimum=1)
    beta, e, mu, L = _decoder_modes(alpha, lam)
    nf = float(n)
    if e.size == 0:
        return (nf + 1.0) / 2.0
    h1 = _geom_sum(n, mu, L) + _geom(n, mu, L)
    w2 = np.outer(mu, mu)
    L2 = _pair_logs(L)
    h2 = _geom_sum(n, w2, L2) + _geom(n, w2, L2)
    total = beta * beta * nf * (nf + 1.0) / 2.0 + 2.0 * beta * np.sum(e * h1) + e @ h2 @ e
    return _finite_or_inf(total.real, mu) / nf
