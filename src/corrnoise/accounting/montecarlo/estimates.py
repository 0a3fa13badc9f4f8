"""Monte Carlo estimates of delta(eps) = E[(1 - e^(eps - Y))_+] and of eps(delta) (seed 000 Sec. 2)
under the dominating pairs of Lemma 3.2 (informal: not verified)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...progress import Progress
from .inputs import (_STREAM_ESTIMATE, DEFAULT_SAMPLES, _check_delta, _check_epsilon, _check_noise, _check_samples,
                     resolve_seed)
from .sampling import ReducedPair, _hockey, _Losses, _map_chunks, reduce_balls_in_bins


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

    def fn(u, sums):
        # only rows whose loss may exceed epsilon are evaluated (the others contribute exactly 0)
        rows_add, f_add, f_rem = losses.hockey_screened(u, epsilon, sums)
        m = u.shape[0]
        ids = rows_add % b
        return (np.bincount(ids, weights=f_add, minlength=b), np.bincount(ids, weights=f_add * f_add, minlength=b),
                m // b, float(f_rem.sum()), float((f_rem * f_rem).sum()), m)

    mom = _Moments(b)
    for a1, a2, rows, r1, r2, m in _map_chunks(red, seed, stream, samples, fn, workers, progress, label,
                                               with_sums=True):
        mom.add1 += a1
        mom.add2 += a2
        mom.add_n += rows
        mom.rem1 += r1
        mom.rem2 += r2
        mom.rem_n += m
    return mom


def estimate_delta(C: Any, bins: int, noise_std: float, epsilon: float, samples: int = DEFAULT_SAMPLES,
                   seed: int | None = None, workers: int | None = None, progress: Progress | bool | None = None,
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
                     seed: int | None = None, workers: int | None = None, progress: Progress | bool | None = None,
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

