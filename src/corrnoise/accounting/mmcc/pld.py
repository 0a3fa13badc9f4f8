"""Discrete privacy loss distributions for MMCC (seed 001 App. C, F): pessimistic PLDs on a loss
grid, composition by FFT convolution (Lem. C.1), delta(eps) and eps(delta) of a PLD.

Tails are truncated pessimistically (low tail moved up, high tail to +infinity) by the one
helper :func:`cut_tails`, shared with the PMoG discretization (:mod:`.pmog`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import scipy.fft as sfft
from scipy.signal import lfilter

from ...errors import CorrnoiseError, check_int

__all__ = ["DiscretePLD", "DEFAULT_LOSS_DISCRETIZATION", "cut_tails", "compose", "self_compose", "compose_all",
           "pld_delta", "pld_epsilon"]

#: Loss-grid spacing of the discretized PLDs (as dp_accounting's default); each row's losses
#: are rounded up to it, so composing R rows costs at most R * step in epsilon (~R * step / 2).
DEFAULT_LOSS_DISCRETIZATION = 1e-4
#: Probability mass allowed to be pushed to infinite loss by one truncation.
_TAIL = 1e-14


@dataclass(frozen=True)
class DiscretePLD:
    """A pessimistic privacy loss distribution: mass ``probs[k]`` at loss (offset + k) * step,
    plus ``inf_mass`` at +infinity.  delta(eps) = inf_mass + sum_L m(L) (1 - e^(eps - L))_+."""

    offset: int
    probs: np.ndarray
    inf_mass: float
    step: float

    @property
    def losses(self) -> np.ndarray:
        return (self.offset + np.arange(self.probs.size)) * self.step

    @property
    def size(self) -> int:
        return int(self.probs.size)


def cut_tails(masses: np.ndarray, tail: float = _TAIL) -> tuple[int, int, float, float]:
    """Where to truncate non-negative ``masses`` (ordered by loss) pessimistically: keep
    [lo, hi); the lowest-loss mass <= tail (``moved_up``) goes to index lo, the highest-loss
    mass <= tail (``to_inf``) to +infinity.  Returns (lo, hi, moved_up, to_inf)."""
    cum = np.cumsum(masses)
    lo = int(np.searchsorted(cum, tail, side="right"))  # first index whose prefix sum exceeds tail
    rcum = np.cumsum(masses[::-1])
    cut = int(np.searchsorted(rcum, tail, side="right"))  # number of top entries with mass <= tail
    hi = masses.size - cut  # keep [lo, hi)
    if hi <= lo:  # everything is tail (tiny total mass): keep the top entry
        lo, hi = masses.size - 1, masses.size
        cut = 0
    moved_up = cum[lo - 1] if lo > 0 else 0.0
    to_inf = rcum[cut - 1] if cut > 0 else 0.0
    return lo, hi, moved_up, to_inf


def _truncate(offset: int, probs: np.ndarray, inf_mass: float, step: float, tail: float = _TAIL) -> DiscretePLD:
    """Drop tails pessimistically (:func:`cut_tails`).  Negative FFT round-off is clipped."""
    probs = np.maximum(probs, 0.0)
    if probs.size == 0:
        return DiscretePLD(0, np.zeros(1), float(min(1.0, inf_mass)), step)
    lo, hi, moved_up, to_inf = cut_tails(probs, tail)
    kept = probs[lo:hi].copy()
    kept[0] += moved_up
    return DiscretePLD(offset + lo, kept, float(min(1.0, inf_mass + to_inf)), step)


def _fft_convolve(a: np.ndarray, b: np.ndarray, workers: int = 1) -> np.ndarray:
    size = a.size + b.size - 1
    if min(a.size, b.size) <= 32:
        return np.convolve(a, b)
    nfft = sfft.next_fast_len(size, real=True)
    fa = sfft.rfft(a, nfft, workers=workers)
    fa *= sfft.rfft(b, nfft, workers=workers)
    return sfft.irfft(fa, nfft, workers=workers)[:size]


def compose(first: DiscretePLD, second: DiscretePLD, workers: int = 1, tail: float = _TAIL) -> DiscretePLD:
    """PLD of the composition (sum of independent losses; seed 001 Lem. C.1): FFT convolution."""
    if not math.isclose(first.step, second.step, rel_tol=0.0, abs_tol=0.0):
        raise CorrnoiseError("pld", f"cannot compose loss grids {first.step!r} and {second.step!r}")
    probs = _fft_convolve(first.probs, second.probs, workers)
    inf_mass = first.inf_mass + second.inf_mass - first.inf_mass * second.inf_mass
    return _truncate(first.offset + second.offset, probs, inf_mass, first.step, tail)


def self_compose(pld: DiscretePLD, times: int, workers: int = 1, tail: float = _TAIL) -> DiscretePLD:
    """``times``-fold composition of ``pld`` with itself by repeated squaring."""
    times = check_int("times", times, minimum=1)
    result: DiscretePLD | None = None
    power = pld
    while True:
        if times & 1:
            result = power if result is None else compose(result, power, workers, tail)
        times >>= 1
        if not times:
            break
        power = compose(power, power, workers, tail)
    assert result is not None
    return result


def compose_all(plds: Sequence[tuple[DiscretePLD, int]], workers: int = 1, tail: float = _TAIL) -> DiscretePLD:
    """Compose ``(pld, multiplicity)`` pairs: powers first, then smallest-first pairing."""
    heap: list[tuple[int, int, DiscretePLD]] = []
    for idx, (pld, times) in enumerate(plds):
        powered = self_compose(pld, times, workers, tail) if times > 1 else pld
        heap.append((powered.size, idx, powered))
    if not heap:
        raise CorrnoiseError("pld", "nothing to compose")
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        c = compose(a, b, workers, tail)
        heapq.heappush(heap, (c.size, counter, c))
        counter += 1
    return heap[0][2]


def _positive_part(pld: DiscretePLD) -> tuple[np.ndarray, np.ndarray]:
    losses = pld.losses
    keep = losses > 0.0
    return losses[keep], pld.probs[keep]


def pld_delta(pld: DiscretePLD, epsilon: float) -> float:
    """Hockey-stick divergence delta(eps) = inf_mass + sum_{L > eps} m(L) (1 - e^(eps - L))."""
    losses = pld.losses
    keep = losses > epsilon
    terms = pld.probs[keep] * -np.expm1(epsilon - losses[keep])
    return float(min(1.0, pld.inf_mass + terms.sum()))


def pld_epsilon(pld: DiscretePLD, delta: float) -> float:
    """Smallest eps >= 0 with delta(eps) <= delta (exact for the discrete distribution).

    On (L_{k-1}, L_k] the set {L > eps} is fixed, so delta(eps) = A_k - e^eps B_k is solved in
    closed form; A_k, B_k come from reverse cumulative sums (the e^(-L) sums by a stable
    first-order recursion, scipy.signal.lfilter)."""
    if pld.inf_mass > delta:
        return math.inf
    losses, m = _positive_part(pld)
    if losses.size == 0 or pld_delta(pld, 0.0) <= delta:
        return 0.0
    step = pld.step
    # S0[k] = sum_{j >= k} m_j;   W[k] = sum_{j >= k} m_j e^(L_k - L_j)  (<= S0[k])
    s0 = np.cumsum(m[::-1])[::-1]
    decay = math.exp(-step)
    w_rev = lfilter([1.0], [1.0, -decay], m[::-1])  # y[n] = x[n] + decay * y[n-1]
    w = w_rev[::-1]
    # delta at eps = L_k: sum over j > k  ->  A = inf + S0[k+1], B = W[k+1] e^{-step}
    s0_next = np.append(s0[1:], 0.0)
    w_next = np.append(w[1:], 0.0)
    delta_at = pld.inf_mass + s0_next - w_next * decay
    k = int(np.argmax(delta_at <= delta))  # first grid loss where the target holds
    if delta_at[k] > delta:  # pragma: no cover - delta_at[-1] = inf_mass <= delta
        return math.inf
    # on (L_{k-1}, L_k]: delta(eps) = inf + S0[k] - e^(eps - L_k) W[k]
    a = pld.inf_mass + s0[k] - delta
    lower = losses[k - 1] if k > 0 else 0.0
    if w[k] <= 0.0 or a <= 0.0:
        return float(lower)
    eps = losses[k] + math.log(a / w[k])
    return float(min(max(eps, lower), losses[k]))

