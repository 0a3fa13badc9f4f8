"""The reduced (b-dimensional) sampler of Lemma 3.2's pair (seed 000 Sec. 3; the dimension
reduction in :mod:`corrnoise.accounting.montecarlo`), the privacy losses (Y-add), (Y-remove) and the
chunked sampling: chunk k of stream s is drawn from ``SeedSequence(seed, spawn_key=(s, k))`` and
results are combined in chunk order, so no number depends on the worker count."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from scipy.special import logsumexp

from ...errors import CorrnoiseError
from ...progress import Progress
from .._common import blas_threads, map_ordered, resolve_workers
from .inputs import _CHUNK_ELEMENTS, _TINY, _as_matrix
from .pair import balls_in_bins_modes


@dataclass(frozen=True)
class ReducedPair:
    """The sufficient statistic of Lemma 3.2's pair: G = M^T M and a factor L with L L^T = G.

    Built once per (C, bins); independent of the noise (Algorithm 2's common random numbers).
    """

    gram: np.ndarray  # (b, b)
    factor: np.ndarray  # (b, b), L L^T = gram
    triangular: bool  # whether factor is lower-triangular (Cholesky)
    n: int
    column_norm: float  # max_t ||C[:, t]||: noise_std -> noise_multiplier
    sensitivity: float  # max_i ||m_i||: the unamplified sensitivity of one bin's participations

    @property
    def bins(self) -> int:
        return self.gram.shape[0]

    @property
    def epochs(self) -> int:
        return self.n // self.bins

    def draw(self, seed: int, stream: int, chunk: int, size: int) -> np.ndarray:
        """u = L g for ``size`` samples (rows), g ~ N(0, I_b), from chunk ``chunk`` of ``stream``."""
        return self.draw_with_sums(seed, stream, chunk, size)[0]

    def draw_with_sums(self, seed: int, stream: int, chunk: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """(u, sum_k u_k per row) for :meth:`draw`'s sample: one BLAS product g [L^T | L^T 1] gives
        the row sums with 1/b more flops (the remove screen of :func:`screen_rows` uses them)."""
        rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence(seed, spawn_key=(stream, chunk))))
        g = rng.standard_normal((size, self.bins))
        # the general BLAS product: twice the flops of the triangular product (dtrmm) but about
        # twice as fast for these shapes (k = b small; OpenBLAS's trmm is not blocked for them)
        W = g @ self._factor_ext
        return W[:, :-1], W[:, -1]

    @property
    def _factor_ext(self) -> np.ndarray:
        cached = self.__dict__.get("_fx")
        if cached is None:
            lt = self.factor.T
            cached = np.ascontiguousarray(np.hstack([lt, lt.sum(axis=1, keepdims=True)]))
            object.__setattr__(self, "_fx", cached)
        return cached


def reduce_balls_in_bins(C: Any, bins: int) -> ReducedPair:
    """Gram matrix G = M^T M of the Lemma 3.2 modes and its factor (the dimension reduction)."""
    C = _as_matrix(C)
    M = balls_in_bins_modes(C, bins)
    gram = M.T @ M
    gram = 0.5 * (gram + gram.T)
    try:
        factor, triangular = np.linalg.cholesky(gram), True
    except np.linalg.LinAlgError:  # singular G (linearly dependent modes): symmetric square root
        lam, vec = np.linalg.eigh(gram)
        factor, triangular = vec * np.sqrt(np.clip(lam, 0.0, None)), False
    col = math.sqrt(float(np.max(np.sum(C * C, axis=0))))
    if col <= 0.0:
        raise CorrnoiseError("C", "is zero; there is nothing to account")
    sens = math.sqrt(float(np.max(np.diag(gram))))
    return ReducedPair(gram, np.ascontiguousarray(factor), triangular, C.shape[0], col, sens)


class _Offsets:
    """Per-bin offsets O[k, i] of a row-wise log-sum-exp, factored for speed:
    exp(O[k, i]) = exp(alpha_i) * H[i, k] with H in (0, 1]."""

    def __init__(self, offsets: np.ndarray):
        self.O = offsets  # (k, i)
        self.alpha = offsets.max(axis=0)
        self.H = np.ascontiguousarray(np.exp(offsets - self.alpha).T)  # (i, k)


def _exp_rows(V: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(exp(V - c), c) with c the row maxima: entries in (0, 1], shared by both adjacencies."""
    c = _row_max(V)
    E = V - c[:, None]
    np.exp(E, out=E)
    return E, c


def _lse_bins(V: np.ndarray, off: _Offsets, bin_ids: np.ndarray | None = None, Ec=None) -> np.ndarray:
    """logsumexp_k(V[j, k] + O[k, i_j]) for every row j (i_j = bin_ids[j], default j mod b).

    Stabilized by the row maximum c_j of V and the column maximum alpha_i of O: the sum
    sum_k exp(V_jk - c_j) H[i_j, k] has terms in (0, 1]; where it is tiny (< 1e-250) its dominant
    term may have underflowed, and that row is recomputed with a plain log-sum-exp.
    """
    m, b = V.shape
    E, c = _exp_rows(V) if Ec is None else Ec
    if bin_ids is None:  # stratified layout: row j uses bin j mod b
        S = np.einsum("rik,ik->ri", E.reshape(m // b, b, b), off.H).reshape(m)
        shift = c + np.tile(off.alpha, m // b)
    else:
        S = np.einsum("jk,jk->j", E, off.H[bin_ids])
        shift = c + off.alpha[bin_ids]
    with np.errstate(divide="ignore"):
        out = shift + np.log(S)
    bad = np.flatnonzero(S < _TINY)
    if bad.size:
        ids = (bad % b) if bin_ids is None else bin_ids[bad]
        out[bad] = logsumexp(V[bad] + off.O[:, ids].T, axis=1)
    return out


def _lse_shift(V: np.ndarray, d: np.ndarray, Ec=None) -> np.ndarray:
    """logsumexp_k(V[j, k] + d[k]) for every row j (stabilized as :func:`_lse_bins`)."""
    beta = float(d.max())
    h = np.exp(d - beta)
    E, c = _exp_rows(V) if Ec is None else Ec
    S = E @ h
    with np.errstate(divide="ignore"):
        out = c + beta + np.log(S)
    bad = np.flatnonzero(S < _TINY)
    if bad.size:
        out[bad] = logsumexp(V[bad] + d, axis=1)
    return out


def _row_max(u: np.ndarray) -> np.ndarray:
    """max over each row of u: numpy's reduction over a short last axis is slow (51 ns per row of
    8 against 11 ns for a running maximum over the columns), so narrow rows use the columns."""
    if u.shape[1] > 24:
        return u.max(axis=1)
    out = u[:, 0].copy()
    for k in range(1, u.shape[1]):
        np.maximum(out, u[:, k], out=out)
    return out


def _screen_stats(red: ReducedPair) -> tuple[np.ndarray, np.ndarray, float]:
    """(A[i, i], max_{k != i} A[k, i], max_k G_kk) with A[k, i] = G[k, i] - G[k, k] / 2, cached
    on ``red``: the constants of :func:`screen_rows`."""
    cached = red.__dict__.get("_screen")
    if cached is None:
        G = red.gram
        diag = np.diag(G)
        A = G - 0.5 * diag[:, None]
        others = A.copy()
        np.fill_diagonal(others, -np.inf)
        other = others.max(axis=0) if red.bins > 1 else np.full(1, -np.inf)
        cached = (np.diag(A).copy(), other, float(diag.max()))
        object.__setattr__(red, "_screen", cached)
    return cached


def screen_rows(red: ReducedPair, u: np.ndarray, t1: float, t2: float, epsilon: float,
                sums: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows of u (stratified: row j uses bin j mod b; whole rounds over the bins) whose (Y-add)
    resp. (Y-remove) may exceed ``epsilon`` for some t = 1/nu in [t1, t2]; at every such t the
    other rows have Y <= epsilon, so their (1 - e^(eps - Y))_+ is exactly 0.

    With x_k = t u_k and logsumexp <= max + log b (the log b cancels in Y-add):

        Y-add(j)    <= max_k (x_k + t^2 A[k, i])
                    <= max(x_i + t^2 A[i, i],  max_k x_k + t^2 max_{k != i} A[k, i]),         (S-add)
        Y-remove(j) =  log b - logsumexp_k (x_k - t^2 G_kk / 2)
                    <= log b - max_k x_k + t^2 max_k G_kk / 2                                (S-remove)

    (the last: the term of the largest x_k is at least max_k x_k - t^2 max_k G_kk / 2), and with
    the row sums of u (``sums``), by Jensen (log of a mean of exponentials >= the mean exponent),

        Y-remove(j) <= -(t / b) sum_k u_k + t^2 mean_k G_kk / 2,                           (S-remove')

    which is far tighter when the modes overlap (banded, BLT: 0.015% of rows kept instead of
    22-29% at a calibrated noise). Over
    t in [t1, t2] each term is bounded by its larger end (t u, t^2 c are monotone in t; A[i, i] =
    G_ii / 2 >= 0, max_k G_kk >= 0) and -max_k x_k by -min(t1, t2 applied to max_k u_k). One pass
    for the row maxima and a gather of the own coordinate, instead of b exponentials per row: at
    a calibrated noise most rows are far below epsilon. A row is dropped only if its bound is
    :data:`_SCREEN_SLACK` below epsilon (rounding in the bound never drops a counted row)."""
    own_a, other_a, gmax = _screen_stats(red)
    m, b = u.shape
    r = m // b
    umax = _row_max(u)
    own = u.reshape(r, b, b).diagonal(axis1=1, axis2=2)  # (r, i): u_i of row r b + i
    hi_umax = np.maximum(t1 * umax, t2 * umax)
    lo_umax = np.minimum(t1 * umax, t2 * umax)
    s1, s2 = t1 * t1, t2 * t2
    limit = epsilon - _SCREEN_SLACK
    bound_add = np.maximum(np.maximum(t1 * own, t2 * own) + s2 * own_a,
                           hi_umax.reshape(r, b) + np.maximum(s1 * other_a, s2 * other_a))
    rows_add = np.flatnonzero(bound_add.reshape(m) > limit)
    bound_rem = math.log(b) + s2 * 0.5 * gmax - lo_umax
    if sums is not None:
        mean_g = float(np.mean(np.diag(red.gram)))
        jensen = -np.minimum(t1 * sums, t2 * sums) / b + s2 * 0.5 * mean_g
        np.minimum(bound_rem, jensen, out=bound_rem)
    rows_rem = np.flatnonzero(bound_rem > limit)
    return rows_add, rows_rem


#: A row is skipped by :func:`screen_rows` only if its bound is this far below epsilon, so
#: rounding in the bound can never drop a row the exact loss would count.
_SCREEN_SLACK = 1e-7


class _Losses:
    """Privacy losses (Y-add), (Y-remove) for one noise level, from reduced samples u."""

    def __init__(self, red: ReducedPair, noise_std: float):
        t = 1.0 / noise_std
        diag = np.diag(red.gram)
        self.t = t
        self.log_b = math.log(red.bins)
        A = red.gram - 0.5 * diag[:, None]  # (k, i)
        # add: exponent t u_k + t^2 A[k, i], A[k, i] = G[k, i] - G[k, k] / 2
        self.add_off = _Offsets((t * t) * A)
        # remove: exponent t u_k - t^2 G[k, k] / 2
        self.d = -(t * t) * 0.5 * diag
        self._red = red

    def screen(self, u: np.ndarray, epsilon: float, sums: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows of u whose (Y-add) resp. (Y-remove) may exceed ``epsilon`` at this noise
        (:func:`screen_rows` with t1 = t2 = t); every other row has (1 - e^(eps - Y))_+ = 0."""
        return screen_rows(self._red, u, self.t, self.t, epsilon, sums)

    def hockey_screened(self, u: np.ndarray, epsilon: float, sums: np.ndarray | None = None
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows_add, f_add, f_remove_nonzero): (1 - e^(eps - Y))_+ of the rows :meth:`screen`
        keeps (stratified layout; the add rows' bins are rows_add mod b) -- every other row's
        value is exactly 0, so sums over the chunk equal those of the unscreened losses."""
        b = u.shape[1]
        rows_add, rows_rem = self.screen(u, epsilon, sums)
        f_add = _hockey(self.add(u[rows_add], rows_add % b), epsilon) if rows_add.size else np.zeros(0)
        f_rem = _hockey(self.remove(u[rows_rem]), epsilon) if rows_rem.size else np.zeros(0)
        return rows_add, f_add, f_rem

    def both(self, u: np.ndarray, bin_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(Y_add, Y_remove) per row of u; row j uses bin ``bin_ids[j]`` (default j mod b)."""
        V = u * self.t
        Ec = _exp_rows(V)  # one set of exponentials serves both adjacencies
        return (_lse_bins(V, self.add_off, bin_ids, Ec) - self.log_b,
                self.log_b - _lse_shift(V, self.d, Ec))

    def add(self, u: np.ndarray, bin_ids: np.ndarray | None = None) -> np.ndarray:
        return _lse_bins(u * self.t, self.add_off, bin_ids) - self.log_b

    def remove(self, u: np.ndarray) -> np.ndarray:
        return self.log_b - _lse_shift(u * self.t, self.d)


def _hockey(Y: np.ndarray, epsilon: float) -> np.ndarray:
    """(1 - e^(eps - Y))_+ per sample (Sec. 2)."""
    out = np.zeros_like(Y)
    pos = Y > epsilon
    out[pos] = -np.expm1(epsilon - Y[pos])
    return out


def _chunks(bins: int, samples: int) -> list[int]:
    rows = max(1, _CHUNK_ELEMENTS // (bins * bins))
    size = rows * bins
    full, rest = divmod(samples, size)
    return [size] * full + ([rest] if rest else [])


#: wall seconds per sample of the last pass of at least 2^16 samples, per number of bins
_SECONDS_PER_SAMPLE: dict[int, float] = {}


def seconds_per_sample(bins: int) -> float | None:
    """Wall seconds per reduced sample of the last large pass over ``bins`` bins in this process
    (None before any): what a progress estimate of a coming pass can go by."""
    return _SECONDS_PER_SAMPLE.get(int(bins))


def _map_chunks(red: ReducedPair, seed: int, stream: int, samples: int, fn: Callable[..., Any],
                workers: int | None = None, progress: Progress | bool | None = None,
                label: str = "sampling", with_sums: bool = False) -> list[Any]:
    """``fn(u)`` (``fn(u, row sums of u)`` with ``with_sums``) for every chunk of ``samples``
    reduced samples, results in chunk order (chunk k is seeded by (seed, stream, k): the results
    do not depend on ``workers``)."""
    sizes = _chunks(red.bins, samples)
    workers = resolve_workers(workers)

    def work(k: int) -> Any:
        u, sums = red.draw_with_sums(seed, stream, k, sizes[k])
        return fn(u, sums) if with_sums else fn(u)

    # one BLAS thread per worker, also with one worker: parallelism comes from the chunks, and a
    # threaded BLAS on these small products spins (2.4x the CPU time of one thread, measured)
    t0 = time.perf_counter()
    with blas_threads(1):
        out = map_ordered(work, range(len(sizes)), workers, progress, label)
    if samples >= 1 << 16:
        _SECONDS_PER_SAMPLE[red.bins] = (time.perf_counter() - t0) / samples
    return out
