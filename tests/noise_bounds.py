"""How close generated noise must be to nu * C^{-1} Z: bounds derived from the floating-point
arithmetic, for tests that compare across kernels, shards, processes or machines (bit-exact
comparisons belong to one code path on one machine: resume, checkpoints, copies)."""

from __future__ import annotations

import numpy as np
import torch

U64, U32 = 2.0 ** -53, 2.0 ** -24  # unit roundoff of float64 and float32


def unit_roundoff(dtype) -> float:
    return U64 if dtype == torch.float64 else U32


def gamma(k: int, u: float) -> float:
    """gamma_k = k u / (1 - k u): |prod_{i<=k} (1 + d_i) - 1| <= gamma_k for |d_i| <= u (Higham,
    Accuracy and Stability of Numerical Algorithms, 2nd ed., Lemma 3.1)."""
    return k * u / (1.0 - k * u)


def rounding_chain(n: int) -> int:
    """k = 3n + 6 roundings bound the longest chain into one generated entry: 4 for a draw with
    its coefficient folded into the Box-Muller radius (coefficient to working precision, coef * R,
    then * cos, against the reference's R * cos), n for a sum of at most n regenerated terms or a
    substitution row with its division, 2n for a buffer updated (a product and a sum) at each of
    n steps (BLT, tree), 1 for the column-normalization scale, 1 to spare."""
    return 3 * n + 6


def stream_tolerance(cmat, noising, z, nu, dtype):
    """Elementwise bound on |generated - nu (C^{-1} Z)| for a generator in ``dtype`` against the
    float64 reference nu * noising @ z (noising = C^{-1}, shape (n, rows); cmat = C).

    A dot product of length k computed with unit roundoff u, in any order, with or without FMA,
    has |fl(a . b) - a . b| <= gamma_k sum_i |a_i| |b_i| (Higham, Eq. 3.5), gamma_k = k u + O(u^2).
    Every generator builds Y = nu C^{-1} Z from such dot products -- the regenerated
    sum_tau C^{-1}[t, tau] Z[tau], a banded forward-substitution row, the BLT buffers
    M_{t+1} = M_t diag(lam) + out_t with out_t = nu z_t - M_t alpha, the online tree's node
    estimates -- so the computed rows solve a perturbed recurrence (C + dC) Y^ = nu Z with
    |dC| <= gamma_k |C| (Higham Thm. 8.5 for substitution; the BLT buffers perturb each
    coefficient sum_i alpha_i lam_i^(j-1) of C by at most gamma_k sum_i |alpha_i| |lam_i|^(j-1), which
    is |C| for nonnegative alpha, lam (asserted by test_noise.py's test_checks_cover_every_kind); the tree's stored node
    estimates are sums of its outputs over the node's leaves, rows of C Y^). Hence

        |Y^ - Y| = |C^{-1} dC Y^| <= gamma_k |C^{-1}| |C| |Y^| <= gamma_k nu |C^{-1}| |C| |C^{-1}| |Z|  (+ O(u^2)),

    k = :func:`rounding_chain`. The reference adds the same bound in float64 (u = 2^-53): the
    strategy's float64 C^{-1} (substitution again; tree:full's pinv(C) is shared with the
    regenerating generator, so only products count) and numpy's product with Z
    (gamma_rows |C^{-1}| |Z| <= gamma_k |C^{-1}| |C| |C^{-1}| |Z|, as C^{-1} C C^{-1} = C^{-1}).
    Z is the generator's own draws in its dtype, so their rounding does not enter. For row 0
    the bound is (gamma_k(u) + gamma_k(2^-53)) |Y[0]|: 2.0e-6 relative in float32, 7.3e-15 in
    float64 at n = 9.
    """
    k = rounding_chain(noising.shape[0])
    spread = np.abs(noising) @ np.abs(cmat) @ np.abs(noising)
    return (gamma(k, unit_roundoff(dtype)) + gamma(k, U64)) * nu * (spread @ np.abs(z))


def stream_mismatch(got, strategy, z, nu, dtype, cols=slice(None)) -> str | None:
    """None when ``got`` (n rows, columns ``cols`` of m) equals nu C^{-1} z (z: the rows of Z as
    float64, in the generator's dtype) within :func:`stream_tolerance`, else where and by how much
    it is not."""
    noising = strategy.noising_matrix()
    want = (nu * noising @ z)[:, cols]
    tol = stream_tolerance(strategy.matrix(), noising, z, nu, dtype)[:, cols]
    err = np.abs(np.asarray(got, dtype=np.float64) - want)
    if np.all(err <= tol):
        return None
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    return (f"{strategy.label} {dtype}: |got - nu C^-1 Z| = {err[worst]:.3e} > tolerance {tol[worst]:.3e} "
            f"at (row, column) {worst}")
