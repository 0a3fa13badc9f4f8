"""Per-query errors of a banded strategy in O(n s^2) (s ~ number of bands), no n x n matrix.

For B = A C^{-1} with a b-banded C and a workload whose inverse is banded (taps a_0..a_{r-1},
see workloads.py), L = C A^{-1} is lower-triangular with w = b + r - 2 sub-diagonals and
B = L^{-1}. Cutting L into s x s blocks (s >= w) makes it block lower-bidiagonal with diagonal
blocks D_k and sub-diagonal blocks E_k; block row k of L B = I gives
B_k = D_k^{-1}(I_k - E_k B_{k-1}), and since B is lower-triangular the diagonal blocks of B B^T obey

    G_0 = D_0^{-1} D_0^{-T},   G_k = P_k G_{k-1} P_k^T + D_k^{-1} D_k^{-T},   P_k = D_k^{-1} E_k,

so ||B[t]||^2 = diag(G_k) (the same recursion the banded optimizer differentiates; seed 002
Sec. 3 computes these errors row by row in O(n^2 b) instead).
"""

from __future__ import annotations

import numpy as np

MIN_BLOCK = 16


def gram_recurrence(pk: np.ndarray, qk: np.ndarray) -> np.ndarray:
    """All diagonal blocks G_k of B B^T: G_0 = Q_0, G_k = P_k G_{k-1} P_k^T + Q_k (shape (K, s, s))."""
    g = np.empty_like(qk)
    g[0] = qk[0]
    for k in range(1, qk.shape[0]):
        g[k] = pk[k] @ g[k - 1] @ pk[k].T + qk[k]
    return g


def workload_band(band: np.ndarray, taps: np.ndarray) -> np.ndarray:
    """Band of L = C A^{-1}: lband[j, i] = L[j + i, j] = sum_m a_m C[j + i, j + m].

    ``band[t, d] = C[t, t - d]`` (Banded storage), ``taps`` = first column of A^{-1}.
    """
    n, b = band.shape
    taps = np.asarray(taps, dtype=np.float64)
    w = b + taps.size - 2
    lband = np.zeros((n, w + 1))
    for m, a in enumerate(taps):
        for d in range(b):  # C[t, t - d] with t - d = j + m contributes to i = d + m
            i = d + m
            rows = np.arange(n - i)  # j with j + i < n
            lband[rows, i] += a * band[rows + i, d]
    return lband


def banded_errors_squared(band: np.ndarray, taps: np.ndarray) -> np.ndarray:
    """||B[t]||^2 for t = 0..n-1 where B = A C^{-1}, C given by its band (see module docstring)."""
    band = np.asarray(band, dtype=np.float64)
    n = band.shape[0]
    lband = workload_band(band, taps)
    w = lband.shape[1] - 1
    s = min(max(w, MIN_BLOCK, 1), n)
    K = -(-n // s)
    N = K * s
    L_d = np.zeros((K, s, s))
    L_e = np.zeros((K, s, s))
    j, i = np.meshgrid(np.arange(n), np.arange(w + 1), indexing="ij")
    keep = (j + i) < n
    j, i = j[keep], i[keep]
    vals = lband[j, i]
    row = j + i
    kb, kc = row // s, j // s
    diag = kb == kc
    L_d[kb[diag], row[diag] % s, j[diag] % s] = vals[diag]
    L_e[kb[~diag], row[~diag] % s, j[~diag] % s] = vals[~diag]
    for t in range(n, N):  # identity padding beyond the last step
        L_d[t // s, t % s, t % s] = 1.0
    dinv = np.linalg.solve(L_d, np.broadcast_to(np.eye(s), (K, s, s)))
    p = dinv @ L_e
    q = dinv @ np.swapaxes(dinv, 1, 2)
    return np.diagonal(gram_recurrence(p, q), axis1=1, axis2=2).reshape(-1)[:n]
