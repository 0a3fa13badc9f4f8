"""MMCC: amplified privacy accounting for any non-negative lower-triangular C (method ``mmcc``).

Matrix Mechanism Conditional Composition (seed 001, Fig. 1 / Thm 4.3): with Poisson sampling
at rate p every round, the output of round i *conditioned on rounds 1..i-1* is a mixture of
Gaussians whose sensitivity is dominated (w.h.p.) by the product mixture

    S_i = sum_j C[i, j] * Bernoulli(p~[i, j]),      p~[i, j] = p e^eps_ij / (p e^eps_ij + 1 - p),

where eps_ij is a tail bound on the privacy loss of a participation in round j given the first
i - 1 outputs (Probability Tail Bounds, seed 001 Fig. 5; issue #12 replaced the paper's
per-pair union bound by Levy peeling along each column and the joint tail of the inner product,
see :func:`.tails.probability_tail_bounds`).  The bad events have total probability delta_1
(Thm 3.1 / C.2); the composition of the per-row PMoG privacy loss distributions is
(eps, delta_2)-DP, so the mechanism is (eps, delta_1 + delta_2)-DP.  ``delta_1`` is chosen to
minimize eps.  The reported epsilon is the smallest of this, the Renyi mixture bound
(:mod:`.renyi`, issue #12: joint convexity over the participation patterns, which wins at low
noise for strongly correlated C) and the unamplified Gaussian mechanism's (worst participation
pattern of the schedule); all are (eps, delta)-DP guarantees for the same mechanism at the same
delta, so their minimum is one too (``binding`` in the extras says which).

Generalized MMCC (seed 001 App. D, Alg. 3) analyses block-cyclic sampling (tutorial Def. 3.20:
step t samples block t mod BLOCKS with rate p): keep the columns of one block's rounds, compose
one vector mixture per *visit of the block* (rows of a visit reduced to their column norms,
Cor. B.6), with tail bounds conditioned on all earlier rows.  For C with bands <= BLOCKS the
history of every kept column is empty, every p~ = p and the analysis is exactly DP-SGD with
ceil(n / BLOCKS) steps (tutorial Thm 3.21, ``bandmf``).

Implementation (seed 001 App. F, re-derived for speed; everything pessimistic):

* PMF of S_i: entries rounded *up* to a power-of-two grid (Lemma B.4), exact sequential
  convolution of the Bernoullis, the tail beyond a Chernoff cap counted as infinite loss.
* PLD of the mixture P = sum_k w_k N(s_k, nu^2) against Q = N(0, nu^2), both adjacencies: the
  loss l(x) = log(P(x)/Q(x)) is convex and increasing in x (a log-sum-exp of affine functions),
  so it is evaluated exactly (separable log-sum-exp with BLAS) on a coarse grid and bounded on a
  fine grid by chords (from above, remove) and tangents (from below, add); interval masses of P
  come from one FFT convolution of w with Gaussian-CDF increments, those of Q in closed form.
  Each interval's mass goes to the largest loss on it, rounded up to the loss grid.
* Composition: FFT convolutions in a balanced tree, identical rows (banded Toeplitz: every row
  from 2b-1 on) computed once and self-composed by repeated squaring; tails truncated
  pessimistically (low tail moved up, high tail to infinity).

Plain functions: :func:`mmcc_epsilon`, :func:`mmcc_delta`, :func:`probability_tail_bounds`,
:func:`pmog_pld`, :func:`compose`, ...; :func:`account_mmcc` is the registry adapter.

Layout: :mod:`.pld` (discrete PLD algebra), :mod:`.tails` (Probability Tail Bounds),
:mod:`.pmog` (PMoG discretization), :mod:`.renyi` (the Renyi mixture bound), :mod:`.driver`
(MMCC / Generalized MMCC and the minimum); the registration is
here, so importing this package registers method ``mmcc``.
"""

from __future__ import annotations

from typing import Any

from ...errors import CorrnoiseError
from ..base import BlockCyclic, Poisson, PrivacyResult, register_method
# re-exports
from .driver import mmcc_delta, mmcc_epsilon, mmcc_plds, unamplified_sensitivity
from .pld import (DEFAULT_LOSS_DISCRETIZATION, DiscretePLD, compose, compose_all, pld_delta, pld_epsilon,
                  self_compose)
from .pmog import DEFAULT_SENSITIVITY_TOLERANCE, pmog_pld, sensitivity_pmf
from .tails import binomial_tail_count, mixture_tail_threshold, peeling_blocks, probability_tail_bounds

__all__ = [
    "DiscretePLD",
    "DEFAULT_LOSS_DISCRETIZATION",
    "binomial_tail_count",
    "probability_tail_bounds",
    "mixture_tail_threshold",
    "peeling_blocks",
    "sensitivity_pmf",
    "pmog_pld",
    "compose",
    "self_compose",
    "pld_epsilon",
    "pld_delta",
    "mmcc_plds",
    "mmcc_epsilon",
    "mmcc_delta",
    "unamplified_sensitivity",
    "account_mmcc",
]


# ----------------------------------------------------------------------------------------------
# Registry adapter (corrnoise.accounting.base imports this module on first use of "mmcc")
# ----------------------------------------------------------------------------------------------
def delta_mmcc(strategy, batching, noise_std: float, epsilon: float, lower_bound: bool = False,
               delta_split: Any = "auto", discretization: float = DEFAULT_LOSS_DISCRETIZATION,
               workers: int | None = None, progress: Any = None) -> PrivacyResult:
    """delta(epsilon) directly (:func:`mmcc_delta`: delta_1 searched for this epsilon), instead of
    bisecting epsilon(delta): toeplitz-sqrt n = 512 at noise 36, epsilon 2: delta 0.00927 in 24 s
    against the bisection's 0.00933 in 6 min (benchmarks/RESULTS.md)."""
    if lower_bound:
        raise CorrnoiseError("lower_bound", "delta(epsilon) needs a formal (epsilon, delta) guarantee; MMCC's "
                             "p~ = p reference is for epsilon at a given delta: drop lower_bound=True")
    if delta_split != "auto":
        raise CorrnoiseError("delta_split", "is for epsilon(delta); delta(epsilon) searches delta_1 for its epsilon")
    blocks = batching.blocks if isinstance(batching, BlockCyclic) else 1
    return mmcc_delta(strategy, strategy.n, batching.p, noise_std, epsilon, blocks=blocks,
                      loss_discretization=discretization, workers=workers, progress=progress)


@register_method(
    "mmcc",
    batchings=(Poisson, BlockCyclic),
    delta_of=delta_mmcc,
    requires_nonnegative=True,
    options=("lower_bound", "delta_split", "discretization", "workers"),
    description="matrix mechanism conditional composition (seed 001) and the Renyi mixture bound, the smaller: "
                "any non-negative C, Poisson or block-cyclic",
)
def account_mmcc(strategy, batching, noise_std: float, delta: float, lower_bound: bool = False,
                 delta_split: Any = "auto", discretization: float = DEFAULT_LOSS_DISCRETIZATION,
                 workers: int | None = None, progress: Any = None) -> PrivacyResult:
    """MMCC (seed 001 Thm 4.3) for Poisson sampling, Generalized MMCC (Thm D.1) for block-cyclic,
    or the Renyi mixture bound (:mod:`.renyi`) where it is smaller.

    ``discretization`` is the loss-grid step (the name the PLD methods use, so that generic
    calibration can search on a coarse grid first)."""
    blocks = batching.blocks if isinstance(batching, BlockCyclic) else 1
    return mmcc_epsilon(strategy, strategy.n, batching.p, noise_std, delta, lower_bound=bool(lower_bound),
                        blocks=blocks, delta_split=delta_split, loss_discretization=discretization,
                        workers=workers, progress=progress)
