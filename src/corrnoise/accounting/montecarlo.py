"""Balls-in-bins Monte Carlo accounting (method ``mc``; seed 000 Sec. 2-4, App. C, E).

Balls-in-bins batching (seed 000 Def. 3.1): every example lands in one of ``bins`` bins uniformly
at random; step t uses bin ``t mod bins``, for ``epochs = n / bins`` epochs.  For a non-negative
lower-triangular C the correlated noise mechanism C x + Z, Z ~ N(0, nu^2 I), is dominated by
(seed 000 Lemma 3.2, proof in App. C)

    P = (1/b) sum_i N(m_i, nu^2 I),   m_i = sum_{j < E} C[:, j b + i],   Q = N(0, nu^2 I)

-- (P, Q) for the add adjacency and (Q, P) for the remove adjacency.  delta(eps) is the hockey-
stick divergence, an expectation over the privacy loss Y (seed 000 Sec. 2):

    delta(eps) = E_Y[(1 - e^(eps - Y))_+].                                          (Sec. 2)

**Dimension reduction.**  With M = [m_0 .. m_{b-1}] (n x b) and G = M^T M, the privacy loss of a
point x depends on x only through w = M^T x:

    log P/Q(x) = logsumexp_k( w_k / nu^2 - G_kk / (2 nu^2) ) - log b.                (LR)

Under Q, M^T x = nu M^T z ~ N(0, nu^2 G); under the i-th component of P, it is G[:, i] + nu M^T z.
So we sample the b-dimensional vector u = L g (L L^T = G, g ~ N(0, I_b)) instead of n-dimensional
noise, and with t = 1/nu

    add:     Y = logsumexp_k( t u_k + t^2 (G_ki - G_kk/2) ) - log b,   i ~ Uni[b]     (Y-add)
    remove:  Y = log b - logsumexp_k( t u_k - t^2 G_kk / 2 )                          (Y-remove)

Both adjacencies reuse the same u (the two estimates are not independent of each other, which the
union bound of App. E does not need).  Cost per sample: b normals, one b x b triangular product,
b exponentials -- independent of n.

**Stratified bins.**  Instead of drawing i ~ Uni[b] we use every bin equally often (sample j uses
bin j mod b).  The estimator stays unbiased with no larger variance, and App. E's proof of Thm 2.2
goes through unchanged: Bernstein's inequality holds for independent, not identically distributed
terms in [0, 1], and Bhatia-Davis bounds the average variance by the mean.

**Randomness and reproducibility.**  Samples come in chunks; chunk k of stream s is drawn from
``SeedSequence(seed, spawn_key=(s, k))``, so results do not depend on how chunks are scheduled on
threads.  Streams: 0 estimation, 1 verification, 2/3 calibration.  Without an explicit ``seed``
the seed is 128 bits from the OS (:func:`fresh_entropy`), and every verification draws its own
fresh 128 bits, independent of everything that chose the candidate noise (seed 000 Thm 2.1 needs
the verifying sample independent of the candidate; a sample reused across retries would let
"retry until it verifies" select on it).  Results record the seeds used (``seed``,
``verify_seed``), so a run can be reproduced on request.  An explicit ``seed`` is for
reproducible experiments only: its verification stream is derived from it, so retrying other
targets or sample counts with the same seed re-uses one verification sample and voids the stated
failure probability.
"""

from __future__ import annotations

import math
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from scipy.special import logsumexp

from ..errors import CorrnoiseError, check_int, check_real

__all__ = [
    "balls_in_bins_modes",
    "DominatingPair",
    "dominating_pair",
    "ReducedPair",
    "reduce_balls_in_bins",
    "DeltaEstimate",
    "EpsilonEstimate",
    "Calibration",
    "Verification",
    "MonteCarloResult",
    "estimate_delta",
    "estimate_epsilon",
    "calibrate_noise_std",
    "verify_privacy",
    "failure_probability",
    "verification_samples",
    "account_balls_in_bins",
    "DEFAULT_SAMPLES",
    "DEFAULT_CALIBRATION_SAMPLES",
    "DEFAULT_TAU",
    "DEFAULT_PRE_VERIFY_SAMPLES",
    "fresh_entropy",
    "resolve_seed",
    "verification_seed",
    "release_verified",
]

#: Samples for an (informal) estimate of delta(eps) or eps(delta).
DEFAULT_SAMPLES = 1 << 20
#: Samples for Algorithm 2 (noise calibration on common random numbers).
DEFAULT_CALIBRATION_SAMPLES = 1 << 22
#: Samples for the estimate / calibration that precedes a verification: the upper confidence
#: bound of a rare-event estimate needs many samples to be reliable (one pass costs ~5% of the
#: default verification).
DEFAULT_PRE_VERIFY_SAMPLES = 1 << 24
#: Slack between the verified threshold and the claimed delta (seed 000 App. E uses 1.25).
DEFAULT_TAU = 1.25
#: Default cap on the verification failure probability, relative to delta.
DEFAULT_FAILURE_FRACTION = 1e-3
#: Calibrating for verification aims the upper confidence bound delta_hat + z * se at delta / tau.
DEFAULT_MARGIN_Z = 3.0

_STREAM_ESTIMATE, _STREAM_VERIFY, _STREAM_PILOT, _STREAM_CALIBRATE = 0, 1, 2, 3
_CHUNK_ELEMENTS = 1 << 18  # ~2 MB of float64 per chunk: stays in cache
_PILOT_SAMPLES = 1 << 16
_TINY = 1e-250  # below this a fast-path sum may have lost its dominant term to underflow


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------
def _as_matrix(C: Any) -> np.ndarray:
    """C as a float64 square, lower-triangular, non-negative matrix, or a one-line error."""
    if hasattr(C, "matrix") and callable(C.matrix):
        C = C.matrix()
    try:
        arr = np.asarray(C, dtype=np.float64)
    except (TypeError, ValueError):
        raise CorrnoiseError("C", "must be a matrix of numbers (or a Strategy)") from None
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1] or arr.shape[0] == 0:
        raise CorrnoiseError("C", f"must be a square n x n matrix, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise CorrnoiseError("C", "contains NaN or infinite entries")
    if np.any(np.triu(arr, 1) != 0.0):
        raise CorrnoiseError("C", "must be lower-triangular (balls-in-bins accounting, seed 000 Lemma 3.2)")
    if np.any(arr < 0.0):
        raise CorrnoiseError("C", f"has negative entries (min {arr.min():.3g}); balls-in-bins Monte Carlo "
                             "accounting (seed 000 Lemma 3.2) needs a non-negative C")
    return arr


def _check_bins(n: int, bins: Any) -> int:
    bins = check_int("bins", bins, minimum=1)
    if n % bins:
        raise CorrnoiseError("bins", f"must divide the number of steps n = {n} (n = bins * epochs), got {bins}")
    return bins


def _check_noise(noise_std: Any) -> float:
    return check_real("noise_std", noise_std, low=0.0, low_open=True)


def _check_delta(delta: Any) -> float:
    return check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)


def _check_epsilon(epsilon: Any) -> float:
    return check_real("epsilon", epsilon, low=0.0)


def fresh_entropy() -> int:
    """128 bits of OS randomness (``secrets``) seeding a Monte Carlo sample: the default whenever no
    seed is given, so no two runs share a sample unless asked to (seed 000 Thm 2.1, 2.2 hold for
    one sample drawn independently of the candidate being verified)."""
    return secrets.randbits(128)


def resolve_seed(seed: Any, name: str = "seed") -> tuple[int, bool]:
    """(seed, explicit): ``seed`` checked, or :func:`fresh_entropy` when it is None."""
    if seed is None:
        return fresh_entropy(), False
    return check_int(name, seed, minimum=0), True


def verification_seed(seed: int, explicit: bool, verify_seed: Any = None) -> tuple[int, str]:
    """Seed of the verification sample of Estimate-Verify-Release (seed 000 Algorithm 1, Thm 2.1),
    and where it came from (``"given"``, ``"derived"``, ``"os"``).

    Thm 2.1 needs the verifying sample independent of everything that chose the candidate noise:
    without an explicit seed it is fresh OS entropy, never derived from the estimation seed.  An
    explicit ``verify_seed`` reproduces a recorded run.  With only an explicit ``seed`` the
    verification uses its own stream (1) of that seed -- reproducible, but a retry with the same
    seed re-uses the verification sample, voiding the failure probability (experiments only).
    """
    if verify_seed is not None:
        return check_int("verify_seed", verify_seed, minimum=0), "given"
    if explicit:
        return seed, "derived"
    return fresh_entropy(), "os"


def _check_samples(samples: Any, bins: int, name: str = "samples") -> int:
    samples = check_int(name, samples, minimum=1)
    return -(-samples // bins) * bins  # a whole number of rounds over the bins


# ----------------------------------------------------------------------------------------------
# Lemma 3.2: the dominating pair
# ----------------------------------------------------------------------------------------------
def balls_in_bins_modes(C: Any, bins: int) -> np.ndarray:
    """The modes of P (seed 000 Lemma 3.2): column i of the result is
    m_i = sum_{j=0}^{E-1} |C|[:, j * bins + i], shape (n, bins)."""
    C = _as_matrix(C)
    n = C.shape[0]
    bins = _check_bins(n, bins)
    # column t = j * bins + i  ->  reshape (n, E, bins) and sum the epochs
    return np.abs(C).reshape(n, n // bins, bins).sum(axis=1)


@dataclass(frozen=True)
class DominatingPair:
    """A dominating pair (seed 000 Lemma 3.2) in the full n-dimensional space.

    ``adjacency == "add"``: (P, Q); ``"remove"``: (Q, P), with P = (1/b) sum_i N(m_i, nu^2 I) and
    Q = N(0, nu^2 I).  ``first`` is the distribution the privacy loss is sampled under.
    This is the direct (slow) form, used for checking; the fast sampler is :class:`ReducedPair`.
    """

    modes: np.ndarray  # (n, bins)
    noise_std: float
    adjacency: str

    @property
    def bins(self) -> int:
        return self.modes.shape[1]

    def log_mixture_ratio(self, x: np.ndarray) -> np.ndarray:
        """log P(x) / Q(x) for points x of shape (..., n), Eq. (LR) evaluated without reduction."""
        x = np.asarray(x, dtype=np.float64)
        nu2 = self.noise_std ** 2
        quad = x @ self.modes / nu2 - 0.5 * np.sum(self.modes ** 2, axis=0) / nu2
        return logsumexp(quad, axis=-1) - math.log(self.bins)

    def privacy_loss(self, x: np.ndarray) -> np.ndarray:
        """log first(x) / second(x): log P/Q for add, log Q/P for remove."""
        lr = self.log_mixture_ratio(x)
        return lr if self.adjacency == "add" else -lr

    def sample(self, size: int, rng: np.random.Generator) -> np.ndarray:
        """``size`` points from the first distribution (P for add, Q for remove), shape (size, n)."""
        n = self.modes.shape[0]
        x = self.noise_std * rng.standard_normal((size, n))
        if self.adjacency == "add":
            x += self.modes[:, rng.integers(0, self.bins, size)].T
        return x


def dominating_pair(C: Any, bins: int, noise_std: float, adjacency: str = "add") -> DominatingPair:
    """The dominating pair of seed 000 Lemma 3.2 for ``adjacency`` in {"add", "remove"}."""
    if adjacency not in ("add", "remove"):
        raise CorrnoiseError("adjacency", f"must be 'add' or 'remove', got {adjacency!r}")
    return DominatingPair(balls_in_bins_modes(C, bins), _check_noise(noise_std), adjacency)


# ----------------------------------------------------------------------------------------------
# The reduced (b-dimensional) sampler
# ----------------------------------------------------------------------------------------------
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
        rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence(seed, spawn_key=(stream, chunk))))
        g = rng.standard_normal((size, self.bins))
        if self.triangular:
            from scipy.linalg.blas import dtrmm

            # g L^T = (L g^T)^T with the triangular BLAS product (half the flops of a full
            # product); g^T is Fortran-ordered, so the product is in place and its transpose is
            # C-ordered again (no copies)
            return dtrmm(1.0, self._factor_f, g.T, side=0, lower=1, trans_a=0, overwrite_b=1).T
        return g @ self.factor.T

    @property
    def _factor_f(self) -> np.ndarray:
        cached = self.__dict__.get("_ff")
        if cached is None:
            cached = np.asfortranarray(self.factor)
            object.__setattr__(self, "_ff", cached)
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
    c = V.max(axis=1)
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


class _Losses:
    """Privacy losses (Y-add), (Y-remove) for one noise level, from reduced samples u."""

    def __init__(self, red: ReducedPair, noise_std: float):
        t = 1.0 / noise_std
        diag = np.diag(red.gram)
        self.t = t
        self.log_b = math.log(red.bins)
        # add: exponent t u_k + t^2 A[k, i], A[k, i] = G[k, i] - G[k, k] / 2
        self.add_off = _Offsets((t * t) * (red.gram - 0.5 * diag[:, None]))
        # remove: exponent t u_k - t^2 G[k, k] / 2
        self.d = -(t * t) * 0.5 * diag

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


# ----------------------------------------------------------------------------------------------
# Chunked, threaded sampling
# ----------------------------------------------------------------------------------------------
def _chunks(bins: int, samples: int) -> list[int]:
    rows = max(1, _CHUNK_ELEMENTS // (bins * bins))
    size = rows * bins
    full, rest = divmod(samples, size)
    return [size] * full + ([rest] if rest else [])


def _workers(workers: int | None) -> int:
    if workers is None:
        return max(1, min(2, os.cpu_count() or 1))
    return check_int("workers", workers, minimum=1)


def _map_chunks(red: ReducedPair, seed: int, stream: int, samples: int, fn: Callable[[np.ndarray], Any],
                workers: int | None = None, progress: bool = False, label: str = "sampling") -> list[Any]:
    """``fn(u)`` for every chunk of ``samples`` reduced samples, results in chunk order."""
    sizes = _chunks(red.bins, samples)
    workers = _workers(workers)

    def work(k: int) -> Any:
        return fn(red.draw(seed, stream, k, sizes[k]))

    from threadpoolctl import threadpool_limits

    bar = _progress(progress, label, len(sizes))
    try:
        # one BLAS thread per worker: parallelism comes from the chunks
        with threadpool_limits(1 if workers > 1 else None):
            if workers == 1:
                results = []
                for k in range(len(sizes)):
                    results.append(work(k))
                    bar.advance()
            else:
                with ThreadPoolExecutor(workers) as pool:
                    results = []
                    for r in pool.map(work, range(len(sizes))):
                        results.append(r)
                        bar.advance()
    finally:
        bar.close()
    return results


class _NoBar:
    def advance(self) -> None:
        pass

    def close(self) -> None:
        pass


class _RichBar:
    def __init__(self, label: str, total: int):
        from rich.console import Console
        from rich.progress import Progress

        self._p = Progress(console=Console(stderr=True), transient=True)
        self._p.start()
        self._task = self._p.add_task(label, total=total)

    def advance(self) -> None:
        self._p.advance(self._task)

    def close(self) -> None:
        self._p.stop()


def _progress(enabled: bool, label: str, total: int):
    return _RichBar(label, total) if enabled and total > 1 else _NoBar()


# ----------------------------------------------------------------------------------------------
# Estimates of delta(eps) and eps(delta)
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeltaEstimate:
    """Monte Carlo estimate of delta(eps) for both adjacencies (informal: not verified)."""

    epsilon: float
    noise_std: float
    delta_add: float
    delta_remove: float
    std_error_add: float
    std_error_remove: float
    samples: int
    seed: int | None = None  # the sample's seed (OS entropy unless one was given)

    @property
    def delta(self) -> float:
        return max(self.delta_add, self.delta_remove)


class _Moments:
    """Running sums of f per bin (add, stratified) and overall (remove)."""

    def __init__(self, bins: int):
        self.add1 = np.zeros(bins)
        self.add2 = np.zeros(bins)
        self.add_n = np.zeros(bins)
        self.rem1 = 0.0
        self.rem2 = 0.0
        self.rem_n = 0

    def update_add(self, f: np.ndarray, bin_ids: np.ndarray, counts: np.ndarray) -> None:
        b = self.add1.size
        self.add1 += np.bincount(bin_ids, weights=f, minlength=b)
        self.add2 += np.bincount(bin_ids, weights=f * f, minlength=b)
        self.add_n += counts

    def update_remove(self, f: np.ndarray, count: int) -> None:
        self.rem1 += float(f.sum())
        self.rem2 += float((f * f).sum())
        self.rem_n += count

    def add(self) -> tuple[float, float]:
        """(mean, standard error) of the stratified estimator (1/b) sum_i mean_i."""
        b = self.add1.size
        r = self.add_n
        mean_i = self.add1 / r
        if np.all(r > 1):
            var_i = np.maximum(self.add2 - r * mean_i ** 2, 0.0) / (r - 1)
            se = math.sqrt(float(np.sum(var_i / r))) / b
        else:  # one sample per bin: the plain (conservative) iid formula
            se = _iid_se(float(self.add1.sum()), float(self.add2.sum()), int(r.sum()))
        return float(mean_i.mean()), se

    def remove(self) -> tuple[float, float]:
        return self.rem1 / self.rem_n, _iid_se(self.rem1, self.rem2, self.rem_n)


def _iid_se(s1: float, s2: float, m: int) -> float:
    if m < 2:
        return math.inf
    mean = s1 / m
    return math.sqrt(max(s2 - m * mean * mean, 0.0) / (m - 1) / m)


def _stratified_ids(m: int, b: int) -> np.ndarray:
    return np.tile(np.arange(b), m // b)


def _delta_moments(red: ReducedPair, noise_std: float, epsilon: float, samples: int, seed: int, stream: int,
                   workers=None, progress=False, label="estimating delta") -> _Moments:
    losses = _Losses(red, noise_std)
    b = red.bins

    def fn(u):
        y_add, y_rem = losses.both(u)
        f_add, f_rem = _hockey(y_add, epsilon), _hockey(y_rem, epsilon)
        m = u.shape[0]
        fa = f_add.reshape(m // b, b)
        return fa.sum(0), (fa * fa).sum(0), m // b, float(f_rem.sum()), float((f_rem * f_rem).sum()), m

    mom = _Moments(b)
    for a1, a2, rows, r1, r2, m in _map_chunks(red, seed, stream, samples, fn, workers, progress, label):
        mom.add1 += a1
        mom.add2 += a2
        mom.add_n += rows
        mom.rem1 += r1
        mom.rem2 += r2
        mom.rem_n += m
    return mom


def estimate_delta(C: Any, bins: int, noise_std: float, epsilon: float, samples: int = DEFAULT_SAMPLES,
                   seed: int | None = None, workers: int | None = None, progress: bool = False,
                   _reduced: ReducedPair | None = None, _stream: int = _STREAM_ESTIMATE) -> DeltaEstimate:
    """Monte Carlo estimate of delta(eps) = E[(1 - e^(eps - Y))_+] (seed 000 Sec. 2) under the
    dominating pairs of Lemma 3.2, add and remove adjacency, with standard errors."""
    red = _reduced if _reduced is not None else reduce_balls_in_bins(C, bins)
    noise_std = _check_noise(noise_std)
    epsilon = _check_epsilon(epsilon)
    samples = _check_samples(samples, red.bins)
    seed, _ = resolve_seed(seed)
    mom = _delta_moments(red, noise_std, epsilon, samples, seed, _stream, workers, progress)
    (da, sa), (dr, sr) = mom.add(), mom.remove()
    return DeltaEstimate(epsilon, noise_std, da, dr, sa, sr, samples, seed)


@dataclass(frozen=True)
class EpsilonEstimate:
    """Monte Carlo estimate of eps(delta): the smallest eps with delta_hat(eps) <= delta for both
    adjacencies, its standard error (delta method), and delta_hat at that eps."""

    epsilon: float
    epsilon_add: float
    epsilon_remove: float
    epsilon_std_error: float
    delta: float
    noise_std: float
    delta_add: float
    delta_remove: float
    std_error_add: float
    std_error_remove: float
    samples: int
    seed: int | None = None


class _Tail:
    """The positive privacy losses of a sample (all that delta_hat(eps >= 0) depends on)."""

    def __init__(self, y_add, ids_add, y_rem, bins: int, samples: int):
        self.y_add, self.ids_add, self.y_rem = y_add, ids_add, y_rem
        self.bins, self.samples = bins, samples

    def moments(self, epsilon: float) -> _Moments:
        mom = _Moments(self.bins)
        r = self.samples // self.bins
        mom.update_add(_hockey(self.y_add, epsilon), self.ids_add, np.full(self.bins, r))
        mom.update_remove(_hockey(self.y_rem, epsilon), self.samples)
        return mom

    def solve(self, delta: float, z: float = 0.0) -> tuple[float, float, float]:
        """(eps_add, eps_remove, eps_std_error): smallest eps with delta_hat + z * se <= delta."""
        out = []
        for which in ("add", "remove"):
            y = self.y_add if which == "add" else self.y_rem

            def g(eps, which=which):
                d, s = getattr(self.moments(eps), which)()
                return d + z * s - delta

            if y.size == 0 or g(0.0) <= 0.0:
                out.append(0.0)
                continue
            lo, hi = 0.0, float(y.max())
            for _ in range(200):  # bisection on the common sample (delta_hat is monotone in eps)
                mid = 0.5 * (lo + hi)
                if g(mid) > 0.0:
                    lo = mid
                else:
                    hi = mid
                if hi - lo <= 1e-12 * max(1.0, hi):
                    break
            out.append(hi)
        eps = max(out)
        which = "add" if out[0] >= out[1] else "remove"
        y = self.y_add if which == "add" else self.y_rem
        _, se = getattr(self.moments(eps), which)()
        slope = float(np.sum(np.exp(eps - y[y > eps]))) / self.samples  # -d delta_hat / d eps
        eps_se = se / slope if slope > 0 else math.inf
        return out[0], out[1], eps_se


def _tail(red: ReducedPair, noise_std: float, samples: int, seed: int, stream: int, workers=None,
          progress=False) -> _Tail:
    losses = _Losses(red, noise_std)
    b = red.bins

    def fn(u):
        y_add, y_rem = losses.both(u)
        keep = np.flatnonzero(y_add > 0.0)
        return y_add[keep], (keep % b), y_rem[y_rem > 0.0]

    parts = _map_chunks(red, seed, stream, samples, fn, workers, progress, "estimating epsilon")
    return _Tail(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                 np.concatenate([p[2] for p in parts]), b, samples)


def estimate_epsilon(C: Any, bins: int, noise_std: float, delta: float, samples: int = DEFAULT_SAMPLES,
                     seed: int | None = None, workers: int | None = None, progress: bool = False,
                     _reduced: ReducedPair | None = None) -> EpsilonEstimate:
    """Monte Carlo estimate of eps(delta) (inverse of Sec. 2's delta(eps) on one sample), the
    larger of the add and remove adjacencies (seed 000 Sec. 3: the worse of the two)."""
    red = _reduced if _reduced is not None else reduce_balls_in_bins(C, bins)
    noise_std = _check_noise(noise_std)
    delta = _check_delta(delta)
    samples = _check_samples(samples, red.bins)
    seed, _ = resolve_seed(seed)
    tail = _tail(red, noise_std, samples, seed, _STREAM_ESTIMATE, workers, progress)
    ea, er, ese = tail.solve(delta)
    eps = max(ea, er)
    mom = tail.moments(eps)
    (da, sa), (dr, sr) = mom.add(), mom.remove()
    return EpsilonEstimate(eps, ea, er, ese, delta, noise_std, da, dr, sa, sr, samples, seed)


# ----------------------------------------------------------------------------------------------
# Algorithm 2: noise calibration by bisection on common random numbers
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    """Result of seed 000 Algorithm 2: the noise at which max_adj (delta_hat + z se) = target."""

    noise_std: float
    epsilon: float
    target_delta: float
    margin_z: float
    delta_add: float
    delta_remove: float
    std_error_add: float
    std_error_remove: float
    samples: int
    evaluations: int
    seed: int | None = None


class _Kept:
    """Reduced samples that can contribute for some noise in [lo, hi] (the rest give f = 0 there)."""

    def __init__(self, u_add, ids_add, u_rem, bins, samples, lo, hi):
        self.u_add, self.ids_add, self.u_rem = u_add, ids_add, u_rem
        self.bins, self.samples, self.lo, self.hi = bins, samples, lo, hi

    def objective(self, red: ReducedPair, noise_std: float, epsilon: float, z: float) -> tuple[float, _Moments]:
        losses = _Losses(red, noise_std)
        mom = _Moments(self.bins)
        r = self.samples // self.bins
        f_add = _hockey(losses.add(self.u_add, self.ids_add), epsilon) if self.ids_add.size else np.zeros(0)
        f_rem = _hockey(losses.remove(self.u_rem), epsilon) if self.u_rem.shape[0] else np.zeros(0)
        mom.update_add(f_add, self.ids_add, np.full(self.bins, r))
        mom.update_remove(f_rem, self.samples)
        (da, sa), (dr, sr) = mom.add(), mom.remove()
        return max(da + z * sa, dr + z * sr), mom


def _keep_bounds(red: ReducedPair, u: np.ndarray, bin_ids: np.ndarray | None, lo: float, hi: float,
                 epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows of u whose privacy loss can exceed eps for some noise in [lo, hi] (add, remove).

    With t = 1/nu in [t1, t2], every exponent is bounded termwise: t u_k <= max(t1 u_k, t2 u_k),
    t^2 A_ki <= max(t1^2 A_ki, t2^2 A_ki), and -t^2 G_kk/2 >= -t2^2 G_kk/2, t u_k >=
    min(t1 u_k, t2 u_k).  log-sum-exp is increasing in every argument, so (Y-add) and (Y-remove)
    are bounded by the log-sum-exp of the termwise bounds -- equal to them when t1 = t2.
    """
    t1, t2 = 1.0 / hi, 1.0 / lo
    log_b = math.log(red.bins)
    diag = np.diag(red.gram)
    A = red.gram - 0.5 * diag[:, None]  # (k, i)
    off = _Offsets(np.maximum(t1 * t1 * A, t2 * t2 * A))
    lin = u * t1
    extra = np.maximum(u, 0.0)
    extra *= t2 - t1
    lin += extra  # max(t1 u, t2 u)
    bound_add = _lse_bins(lin, off, bin_ids) - log_b
    lin = u * t1
    extra = np.minimum(u, 0.0)
    extra *= t2 - t1
    lin += extra  # min(t1 u, t2 u)
    bound_rem = log_b - _lse_shift(lin, -(t2 * t2 * 0.5) * diag)
    return bound_add > epsilon, bound_rem > epsilon


def _bisect(f: Callable[[float], float], lo: float, hi: float, rtol: float) -> tuple[float, int]:
    """Bisection in log(noise) for f(lo) > 0 >= f(hi); returns the upper end (f <= 0 there)."""
    evaluations = 0
    while hi / lo - 1.0 > rtol:
        mid = math.sqrt(lo * hi)
        evaluations += 1
        if f(mid) > 0.0:
            lo = mid
        else:
            hi = mid
    return hi, evaluations


def _unamplified_noise(red: ReducedPair, epsilon: float, delta: float) -> float:
    """Noise that makes the Gaussian mechanism with sensitivity max_i ||m_i|| (epsilon, delta)-DP:
    by joint convexity of the hockey-stick divergence an upper bound on the noise needed."""
    from .gaussian import gaussian_mu

    return red.sensitivity / gaussian_mu(max(epsilon, 1e-9), delta)


def calibrate_noise_std(C: Any, bins: int, epsilon: float, delta: float,
                        samples: int = DEFAULT_CALIBRATION_SAMPLES, seed: int | None = None, margin_z: float = 0.0,
                        rtol: float = 1e-4, workers: int | None = None, progress: bool = False,
                        _reduced: ReducedPair | None = None) -> Calibration:
    """Seed 000 Algorithm 2: the noise_std nu* with max_adj delta_hat(nu*) (+ margin_z * se) = delta,
    by bisection on one fixed sample (i_j, Z_j) (common random numbers).

    A pilot of 2^16 samples (held in memory) brackets nu*; then the main sample is drawn once and
    only the samples whose privacy loss can exceed eps anywhere in the bracket are kept
    (:func:`_keep_bounds`), so each bisection step costs a fraction of a pass.  The answer is the
    upper end of the final bracket (delta_hat there is <= the target).
    """
    red = _reduced if _reduced is not None else reduce_balls_in_bins(C, bins)
    epsilon = _check_epsilon(epsilon)
    delta = _check_delta(delta)
    samples = _check_samples(samples, red.bins)
    seed, _ = resolve_seed(seed)
    margin_z = check_real("margin_z", margin_z, low=0.0)
    b = red.bins
    evaluations = 0

    def draw_kept(stream: int, m: int, lo: float, hi: float) -> _Kept:
        def fn(u):
            ids = _stratified_ids(u.shape[0], b)
            ka, kr = _keep_bounds(red, u, None, lo, hi, epsilon)
            return u[ka], ids[ka], u[kr]

        parts = _map_chunks(red, seed, stream, m, fn, workers, progress, "calibrating noise")
        return _Kept(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                     np.concatenate([p[2] for p in parts]), b, m, lo, hi)

    def excess(kept: _Kept) -> Callable[[float], float]:
        def f(nu: float) -> float:
            nonlocal evaluations
            evaluations += 1
            return kept.objective(red, nu, epsilon, margin_z)[0] - delta

        return f

    def bracket(stream: int, m: int, lo: float, hi: float, grow: float) -> tuple[_Kept, float, float]:
        """Widen [lo, hi] until f(lo) > 0 >= f(hi) on the kept sample (redrawn per bracket)."""
        for _ in range(80):
            kept = draw_kept(stream, m, lo, hi)
            f = excess(kept)
            if f(hi) > 0.0:  # the estimate (plus margin) still exceeds the target at the upper end
                lo, hi = hi, hi * grow
            elif f(lo) <= 0.0:
                if lo < 1e-12 * red.sensitivity:
                    return kept, lo, lo  # (almost) no noise is needed
                lo, hi = lo / grow, lo
            else:
                return kept, lo, hi
        raise CorrnoiseError("epsilon", f"could not bracket the noise for ({epsilon:g}, {delta:g})")

    # --- pilot (2^16 samples): bracket between a low guess and the unamplified noise ------------
    hi = _unamplified_noise(red, epsilon, delta)
    pilot_m = min(samples, _check_samples(_PILOT_SAMPLES, b))
    final = pilot_m == samples
    kept, lo, hi = bracket(_STREAM_CALIBRATE if final else _STREAM_PILOT, pilot_m, hi / 16.0, hi, 16.0)
    nu = _bisect(excess(kept), lo, hi, rtol if final else 1e-3)[0] if lo < hi else hi
    if not final:
        # --- main sample: a narrow bracket around the pilot's answer, drawn once ------------------
        kept, lo, hi = bracket(_STREAM_CALIBRATE, samples, nu / 1.1, nu * 1.1, 1.2)
        nu = _bisect(excess(kept), lo, hi, rtol)[0] if lo < hi else hi
    obj, mom = kept.objective(red, nu, epsilon, margin_z)
    (da, sa), (dr, sr) = mom.add(), mom.remove()
    return Calibration(nu, epsilon, delta, margin_z, da, dr, sa, sr, samples, evaluations, seed)


# ----------------------------------------------------------------------------------------------
# Estimate-Verify-Release (Thm 2.1, 2.2)
# ----------------------------------------------------------------------------------------------
def failure_probability(samples: int, delta: float, tau: float = DEFAULT_TAU) -> float:
    """Seed 000 Thm 2.2: if H_{e^eps}(P, Q) >= tau * delta, then
    Pr[delta_hat < delta] <= exp(-s (tau - 1)^2 delta / (8 tau / 3 - 2 / 3)) with s samples."""
    samples = check_int("samples", samples, minimum=1)
    delta = _check_delta(delta)
    tau = check_real("tau", tau, low=1.0, low_open=True)
    return math.exp(-samples * (tau - 1.0) ** 2 * delta / (8.0 * tau / 3.0 - 2.0 / 3.0))


def verification_samples(delta: float, tau: float = DEFAULT_TAU,
                         failure: float | None = None) -> int:
    """Fewest samples for which verifying delta_hat <= delta / tau for both adjacencies fails with
    total probability (Thm 2.2, union bound over the two) at most ``failure`` (default
    1e-3 * delta), when the mechanism is not (eps, delta)-DP."""
    delta = _check_delta(delta)
    tau = check_real("tau", tau, low=1.0, low_open=True)
    failure = DEFAULT_FAILURE_FRACTION * delta if failure is None else check_real(
        "failure", failure, low=0.0, high=1.0, low_open=True, high_open=True)
    d_v = delta / tau
    rate = (tau - 1.0) ** 2 * d_v / (8.0 * tau / 3.0 - 2.0 / 3.0)
    return int(math.ceil(math.log(2.0 / failure) / rate))


@dataclass(frozen=True)
class Verification:
    """Estimate-Verify-Release (seed 000 Algorithm 1, Thm 2.1, 2.2) on a fresh sample.

    ``verified``: delta_hat <= delta / tau for both adjacencies, with a total failure probability
    (Thm 2.2 for each adjacency, union bound) <= delta, so releasing is (epsilon, delta)-DP.
    """

    epsilon: float
    delta: float
    noise_std: float
    tau: float
    threshold: float  # delta / tau
    delta_add: float
    delta_remove: float
    std_error_add: float
    std_error_remove: float
    samples: int
    failure_probability: float
    verified: bool
    seed: int | None = None  # the verification sample's seed (fresh OS entropy unless given)


def verify_privacy(C: Any, bins: int, noise_std: float, epsilon: float, delta: float,
                   samples: int | None = None, seed: int | None = None, tau: float = DEFAULT_TAU,
                   workers: int | None = None, progress: bool = False,
                   _reduced: ReducedPair | None = None) -> Verification:
    """Verify (epsilon, delta)-DP at ``noise_std`` with a fresh, independent sample (stream 1 of
    ``seed``; without a seed, 128 fresh bits from the OS): estimate delta_hat for both adjacencies
    and check delta_hat <= delta / tau (Thm 2.1).  Only the flag is returned: releasing is
    :func:`release_verified`'s job."""
    red = _reduced if _reduced is not None else reduce_balls_in_bins(C, bins)
    noise_std = _check_noise(noise_std)
    epsilon = _check_epsilon(epsilon)
    delta = _check_delta(delta)
    tau = check_real("tau", tau, low=1.0, low_open=True)
    samples = verification_samples(delta, tau) if samples is None else samples
    samples = _check_samples(samples, red.bins)
    seed, _ = resolve_seed(seed)
    threshold = delta / tau
    fp = min(1.0, 2.0 * failure_probability(samples, threshold, tau))
    mom = _delta_moments(red, noise_std, epsilon, samples, seed, _STREAM_VERIFY, workers, progress,
                         "verifying")
    (da, sa), (dr, sr) = mom.add(), mom.remove()
    ok = bool(da <= threshold and dr <= threshold and fp <= delta)
    return Verification(epsilon, delta, noise_std, tau, threshold, da, dr, sa, sr, samples, fp, ok, seed)


def release_verified(ver: Verification) -> Verification:
    """The Release step of Estimate-Verify-Release (seed 000 Algorithm 1, Thm 2.1): a candidate
    whose fresh-sample verification failed is never released -- one-line CorrnoiseError naming
    ``verify`` (increase the noise, the samples, or delta)."""
    if ver.verified:
        return ver
    why = []
    if max(ver.delta_add, ver.delta_remove) > ver.threshold:
        why.append(f"fresh-sample delta_hat (add {ver.delta_add:.3g}, remove {ver.delta_remove:.3g}) exceeds "
                   f"delta / tau = {ver.threshold:.3g}")
    if ver.failure_probability > ver.delta:
        why.append(f"{ver.samples} verification samples give failure probability {ver.failure_probability:.3g} "
                   f"> delta = {ver.delta:g} (Thm 2.2)")
    raise CorrnoiseError("verify", f"Monte Carlo verification of ({ver.epsilon:g}, {ver.delta:g})-DP at noise_std "
                         f"{ver.noise_std:.6g} failed ({'; '.join(why)}); nothing is released: increase the noise "
                         "or the (verification) samples")


# ----------------------------------------------------------------------------------------------
# One call: estimate / calibrate, then (optionally) verify
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MonteCarloResult:
    """What balls-in-bins Monte Carlo accounting found.

    Unverified (``verified`` None), (epsilon, delta) is an estimate (``delta_*`` +-
    ``std_error_*``).  Verified (True) it is a formal guarantee (seed 000 Thm 2.1) and
    ``delta_*``/``std_error_*``/``samples`` are those of the fresh verification sample; a failed
    verification raises instead of returning.  ``seed`` is the estimation sample's seed (OS
    entropy unless given); ``extras["verify_seed"]`` the verification sample's.
    """

    epsilon: float
    delta: float
    noise_std: float
    noise_multiplier: float
    delta_add: float
    delta_remove: float
    std_error_add: float
    std_error_remove: float
    samples: int
    bins: int
    epochs: int
    seed: int
    verified: bool | None = None
    failure_probability: float | None = None
    extras: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in (
            "epsilon", "delta", "noise_std", "noise_multiplier", "delta_add", "delta_remove", "std_error_add",
            "std_error_remove", "samples", "bins", "epochs", "seed", "verified", "failure_probability")}
        out.update(self.extras)
        return out


def delta_candidate(delta_add: float, delta_remove: float, se_add: float, se_remove: float, samples: int,
                    tau: float, margin_z: float) -> float:
    """The delta to verify for delta(eps) by Estimate-Verify-Release (seed 000 Algorithm 1): tau
    times the larger upper confidence bound delta_hat + z * se of the estimation sample, so that a
    fresh sample's delta_hat is likely <= candidate / tau (Thm 2.1); at least tau * 3 / samples
    when no sampled loss exceeded eps.  Chosen from the estimation sample only."""
    upper = max(delta_add + margin_z * se_add, delta_remove + margin_z * se_remove, 3.0 / samples)
    return min(tau * upper, 0.5)


def account_balls_in_bins(C: Any, bins: int, *, delta: float | None = None, noise_std: float | None = None,
                          epsilon: float | None = None, verify: bool = True, samples: int | None = None,
                          verify_samples: int | None = None, seed: int | None = None,
                          verify_seed: int | None = None, tau: float = DEFAULT_TAU,
                          margin_z: float = DEFAULT_MARGIN_Z, workers: int | None = None,
                          progress: bool = False) -> MonteCarloResult:
    """Balls-in-bins Monte Carlo accounting of C (seed 000).

    - ``noise_std`` only: eps(delta);
    - ``epsilon`` only: calibrate the noise (Algorithm 2);
    - both (``delta`` None): delta(eps); verified, delta is :func:`delta_candidate`.

    By default (``verify=True``) the estimate / calibration aims at delta / tau with an upper
    confidence bound (``margin_z`` standard errors) and a fresh, independent sample verifies the
    formal (epsilon, delta) guarantee (Estimate-Verify-Release, Thm 2.1, 2.2); a failed
    verification raises (:func:`release_verified`).  ``verify=False`` returns an informal
    estimate.  Seeds: see :func:`verification_seed` (``seed`` None: OS entropy).
    """
    red = reduce_balls_in_bins(C, bins)
    given_both = noise_std is not None and epsilon is not None
    if given_both and delta is not None:
        raise CorrnoiseError("delta", "give two of noise_std, epsilon and delta (delta(eps) needs no delta)")
    if delta is None and not given_both:
        raise CorrnoiseError("delta", "give delta (or noise_std and epsilon for delta(eps))")
    delta = _check_delta(delta) if delta is not None else None
    seed, explicit = resolve_seed(seed)
    tau = check_real("tau", tau, low=1.0, low_open=True)
    if noise_std is None and epsilon is None:
        raise CorrnoiseError("noise", "give noise_std (to account) or epsilon (to calibrate)")
    if not verify and (verify_samples is not None or verify_seed is not None):
        raise CorrnoiseError("verify_samples" if verify_samples is not None else "verify_seed",
                             "only applies to a verified result (an estimate is not verified)")
    target = None if delta is None else (delta / tau if verify else delta)
    z = margin_z if verify else 0.0
    extras: dict[str, Any] = {"seed_source": "explicit" if explicit else "os"}
    if noise_std is None:
        epsilon = check_real("epsilon", epsilon, low=0.0, low_open=True)
        m = (DEFAULT_PRE_VERIFY_SAMPLES if verify else DEFAULT_CALIBRATION_SAMPLES) if samples is None else samples
        cal = calibrate_noise_std(red, bins, epsilon, target, m, seed, z, workers=workers, progress=progress,
                                  _reduced=red)
        noise_std = cal.noise_std
        est = (cal.delta_add, cal.delta_remove, cal.std_error_add, cal.std_error_remove, cal.samples)
        extras.update(calibration_samples=cal.samples, calibration_evaluations=cal.evaluations)
    else:
        noise_std = _check_noise(noise_std)
        m = (DEFAULT_PRE_VERIFY_SAMPLES if verify else DEFAULT_SAMPLES) if samples is None else samples
        if epsilon is None:
            m = _check_samples(m, red.bins)
            tail = _tail(red, noise_std, m, seed, _STREAM_ESTIMATE, workers, progress)
            ea, er, ese = tail.solve(target, z)
            epsilon = max(ea, er)
            mom = tail.moments(epsilon)
            (da, sa), (dr, sr) = mom.add(), mom.remove()
            est = (da, dr, sa, sr, m)
            extras.update(epsilon_std_error=ese)
        else:
            epsilon = _check_epsilon(epsilon)
            d = estimate_delta(red, bins, noise_std, epsilon, m, seed, workers, progress, _reduced=red)
            est = (d.delta_add, d.delta_remove, d.std_error_add, d.std_error_remove, d.samples)
    nm = noise_std / red.column_norm
    da, dr, sa, sr, m = est
    if not verify:
        # calibrated or eps-from-delta: delta is the target; delta given eps: the estimate
        reported_delta = max(da, dr) if given_both else delta
        return MonteCarloResult(epsilon, reported_delta, noise_std, nm, da, dr, sa, sr, m, red.bins, red.epochs,
                                seed, None, None, extras)
    extras.update(estimate_delta_add=est[0], estimate_delta_remove=est[1], estimate_samples=est[4])
    if delta is None:
        delta = delta_candidate(da, dr, sa, sr, m, tau, z)
    vseed, vsource = verification_seed(seed, explicit, verify_seed)
    ver = release_verified(verify_privacy(red, bins, noise_std, epsilon, delta, verify_samples, vseed, tau, workers,
                                          progress, _reduced=red))
    extras.update(tau=tau, verify_threshold=ver.threshold, verify_seed=vseed, verify_seed_source=vsource)
    return MonteCarloResult(epsilon, delta, noise_std, nm, ver.delta_add, ver.delta_remove, ver.std_error_add,
                            ver.std_error_remove, ver.samples, red.bins, red.epochs, seed, ver.verified,
                            ver.failure_probability, extras)


# ----------------------------------------------------------------------------------------------
# Registration as method "mc" (corrnoise.accounting.base registry)
# ----------------------------------------------------------------------------------------------
def _result(res: MonteCarloResult, strategy) -> "Any":
    """A verified result is a guarantee (seed 000 Thm 2.1); an unverified one an estimate."""
    from .base import PrivacyResult

    extras = {k: v for k, v in res.to_dict().items()
              if k not in ("epsilon", "delta", "noise_std", "noise_multiplier")}
    return PrivacyResult(float(res.epsilon), float(res.delta), float(res.noise_std),
                         float(res.noise_multiplier), "mc", extras,
                         kind="guarantee" if res.verified else "estimate")


def _options(samples, seed, progress, verify, verify_samples, tau, estimate, verify_seed) -> dict[str, Any]:
    """The options of :func:`account_balls_in_bins`: a verified guarantee unless ``estimate`` is
    explicitly True (``verify=False`` alone is refused: an estimate must be asked for by name)."""
    estimate = bool(estimate)
    if estimate and verify:
        raise CorrnoiseError("estimate", "estimate=True asks for an unverified estimate; it cannot be combined "
                             "with verify=True")
    if verify is not None and not verify and not estimate:
        raise CorrnoiseError("verify", "verify=False would release an unverified Monte Carlo estimate; ask for "
                             "one explicitly with estimate=True")
    return {"samples": samples, "seed": seed, "progress": bool(progress), "verify": not estimate,
            "verify_samples": verify_samples, "verify_seed": verify_seed,
            "tau": DEFAULT_TAU if tau is None else tau}


def _single_bin_gaussian(strategy, delta: float, noise_std: float | None = None,
                         epsilon: float | None = None):
    """Balls-in-bins with one bin (seed 000 Lemma 3.2 with b = 1): every example is in every step,
    so P = N(m_0, nu^2 I) with m_0 = C 1 is a single Gaussian and no sampling randomness is left
    to amplify.  The mechanism is exactly the Gaussian mechanism with sensitivity
    sens(C, every step) (tutorial Lemma 1.13; = ||C 1|| for a non-negative C), accounted exactly
    as mu-GDP by :mod:`.gaussian` -- no Monte Carlo, no verification needed."""
    from ..participation import Cyclic
    from .base import NoBatching
    from .gaussian import account_gaussian, calibrate_gaussian

    every_step = NoBatching(Cyclic(int(strategy.n), 1))
    if epsilon is not None and noise_std is not None:
        from .gaussian import delta_gaussian

        res = delta_gaussian(strategy, every_step, noise_std, epsilon)
    elif epsilon is not None:
        res = calibrate_gaussian(strategy, every_step, epsilon, delta)
    else:
        res = account_gaussian(strategy, every_step, noise_std, delta)
    return res.with_extras(bins=1, epochs=int(strategy.n), exact=True,
                           note="balls-in-bins:1 puts every example in every step: exact Gaussian mechanism "
                                "accounting (no Monte Carlo)")


def _calibrate_mc(strategy, batching, epsilon: float, delta: float, samples=None, seed=None, progress=False,
                  verify=None, verify_samples=None, tau=None, estimate=None, verify_seed=None):
    """Calibrate the noise for balls-in-bins batching (seed 000 Algorithm 2; verified with EVR)."""
    opts = _options(samples, seed, progress, verify, verify_samples, tau, estimate, verify_seed)
    if batching.bins == 1:
        return _single_bin_gaussian(strategy, delta, epsilon=epsilon)
    res = account_balls_in_bins(strategy, batching.bins, delta=delta, epsilon=epsilon, **opts)
    return _result(res, strategy)


def _delta_mc(strategy, batching, noise_std: float, epsilon: float, samples=None, seed=None, progress=False,
              verify=None, verify_samples=None, tau=None, estimate=None, verify_seed=None):
    """delta(eps) for balls-in-bins batching: estimate, then verify tau times the upper confidence
    bound on a fresh sample (:func:`delta_candidate`, seed 000 Thm 2.1)."""
    opts = _options(samples, seed, progress, verify, verify_samples, tau, estimate, verify_seed)
    if batching.bins == 1:
        return _single_bin_gaussian(strategy, None, noise_std=noise_std, epsilon=epsilon)
    res = account_balls_in_bins(strategy, batching.bins, noise_std=noise_std, epsilon=epsilon, **opts)
    return _result(res, strategy)


def _register() -> None:
    from .base import BallsInBins, register_method

    @register_method("mc", batchings=(BallsInBins,), requires_nonnegative=True, calibrate=_calibrate_mc,
                     delta_of=_delta_mc,
                     description="balls-in-bins Monte Carlo accounting (seed 000), verified by default")
    def account_mc(strategy, batching, noise_std: float, delta: float, samples=None, seed=None, progress=False,
                   verify=None, verify_samples=None, tau=None, estimate=None, verify_seed=None):
        """eps(delta) of C under balls-in-bins batching by Monte Carlo (seed 000 Lemma 3.2, Sec. 2),
        released only after Estimate-Verify-Release (Thm 2.1) unless ``estimate=True``."""
        opts = _options(samples, seed, progress, verify, verify_samples, tau, estimate, verify_seed)
        if batching.bins == 1:
            return _single_bin_gaussian(strategy, delta, noise_std=noise_std)
        res = account_balls_in_bins(strategy, batching.bins, delta=delta, noise_std=noise_std, **opts)
        return _result(res, strategy)


try:  # the accounting interface may be absent in a partial build; the functions above still work
    _register()
except ImportError:  # pragma: no cover
    pass
