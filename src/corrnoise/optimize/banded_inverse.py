"""``bandinv:P``: the Toeplitz C whose inverse has P bands, optimized for the RMS loss under
single participation and the prefix workload (the BandInvMF of Kalinin et al. 2025, cited in
seed 003 Sec. 5, restricted here to Toeplitz C^{-1}).

C^{-1} = T_q with q = (1, q_1, ..., q_{P-1}) (the loss is scale-free, so q_0 = 1), started from
BISR's q (the first P coefficients of A_pre^{-1/2}) and improved by L-BFGS with an exact O(n P)
gradient; never worse than bisr:P.
"""

from __future__ import annotations

import numpy as np
from scipy import signal

from ..errors import CorrnoiseError, check_int
from ..linalg import toeplitz as tp
from .common import lbfgs


def banded_inverse_rms_objective(q: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """log ||C||_col^2 + log(||A C^{-1}||_F^2 / n) and its gradient in q[1:], for C^{-1} = T_q.

    Single participation: sens^2 = the longest column of the Toeplitz C, sum_{t<n} c_t^2 with
    c = 1 / q (tutorial Sec. 2.9). Prefix workload: B = A_pre T_q is Toeplitz with first column
    b = cumsum(q) (padded), so ||B||_F^2 = sum_t (n - t) b_t^2 (docs/design.md: rms_loss =
    sens ||B||_F / sqrt(n)). The objective is 2 log rms_loss.
    Gradient of s = sum c^2: dc/dq_j = -T_q^{-1} S^j c, so ds/dq_j = -2 sum_t w_t c_{t-j} with
    w = T_q^{-T} c (an IIR filter run backwards).
    """
    q = np.asarray(q, dtype=np.float64)
    p = q.size
    impulse = np.zeros(n)
    impulse[0] = 1.0
    with np.errstate(all="ignore"):
        c = signal.lfilter([1.0], q, impulse)
        s = float(c @ c)
        if not np.isfinite(s) or s > 1e200:
            return float("inf"), np.zeros(p - 1)
        w = signal.lfilter([1.0], q, c[::-1])[::-1]
    weights = n - np.arange(n, dtype=np.float64)
    b = tp._pad(np.cumsum(q), n)
    b[p:] = b[p - 1] if p <= n else 0.0
    e = float(np.sum(weights * b**2)) / n
    ds = np.array([-2.0 * float(w[j:] @ c[: n - j]) for j in range(1, p)])
    tail = np.cumsum((weights * b)[::-1])[::-1]  # tail[j] = sum_{t >= j} (n - t) b_t
    de = 2.0 * tail[1:p] / n
    return float(np.log(s) + np.log(e)), ds / s + de / e


def optimize_banded_inverse(n: int, bands: int, max_iter: int = 500) -> np.ndarray:
    """q = (1, q_1, ..., q_{P-1}) minimizing the RMS loss of C = T_q^{-1} (single participation,
    prefix workload), from BISR's start (Kalinin et al. 2025); returns q."""
    n = check_int("n", n, minimum=1)
    bands = check_int("bands", bands, minimum=1)
    if bands > n:
        raise CorrnoiseError("bands", f"must be <= n = {n}, got {bands}")
    q0 = tp.bisr_inverse_coefficients(bands)
    if bands == 1:
        return q0

    def fun(x):
        return banded_inverse_rms_objective(np.concatenate([[1.0], x]), n)

    result = lbfgs(fun, q0[1:].copy(), max_iter=max_iter)
    q = np.concatenate([[1.0], result.x])
    if not fun(result.x)[0] <= fun(q0[1:])[0]:  # never worse than the start
        return q0
    return q
