"""The dominating pair of balls-in-bins batching (seed 000 Lemma 3.2, proof in App. C)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import logsumexp

from ...errors import CorrnoiseError
from .inputs import _as_matrix, _check_bins, _check_noise


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

