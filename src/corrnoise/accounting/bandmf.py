"""Amplified banded matrix factorization with block-cyclic Poisson sampling (method ``bandmf``).

Tutorial Def. 3.20 / Thm 3.21 (Choquette-Choo et al. 2023a): split the data into ``blocks``
parts; step t Poisson-samples part t mod blocks with rate p.  If C is lower-triangular with
at most ``blocks`` bands, the batch of step t only touches rows t .. t + blocks - 1 of C G, so
the mechanism is an adaptive composition of one Poisson-subsampled Gaussian mechanism per visit
of a block, each with sensitivity <= ||C||_col.  Hence C G + Z with noise_std nu satisfies every
guarantee of DP-SGD with

    steps' = ceil(n / blocks),   sampling probability p,   noise multiplier nu / ||C||_col.   (Thm 3.21)

That is the worst case.  Exactly, visit t of an example's block adds the Poisson-subsampled
Gaussian mechanism with sensitivity ||C[:, t]|| (rows t .. t + blocks - 1 of C G, disjoint for
successive visits), so block k's examples get the composition over t = k (mod blocks) of
PoissonSampled(p, Gaussian(nu / ||C[:, t]||)), and epsilon is the largest over blocks
(:func:`block_visit_norms`, :func:`bandmf_epsilon`).  This matters when blocks does not divide n
(blocks visited ceil(n / blocks) or floor(n / blocks) times, the last columns of a banded C cut
short) and for C with unequal column norms; with equal norms and blocks | n it is the DP-SGD run
above.  The sign of C's entries does not matter here.  Poisson sampling every step is the case blocks = 1, which
needs a diagonal C (DP-SGD).

Preconditions (square C, bands <= blocks, diagonal C for Poisson) are registered with the method
(:data:`~corrnoise.accounting.dpsgd.DPSGD_PRECONDITIONS`) and checked once, by the gate
(:func:`corrnoise.accounting.gate.prepare`), before any function here runs: the math below
assumes them (a C with more bands than blocks goes to MMCC, seed 001 App. D, when available).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..errors import CorrnoiseError
from .base import BlockCyclic, Poisson, PrivacyResult, column_norm, register_method
from .dpsgd import ACCOUNTANTS, DEFAULT_DISCRETIZATION, DPSGD_PRECONDITIONS, dpsgd_epsilon, event_epsilon

__all__ = ["DpsgdEquivalent", "dpsgd_equivalent", "block_visit_norms", "bandmf_epsilon", "account_bandmf", "account_pld",
           "account_rdp"]

#: Most distinct per-visit sensitivities composed per block; beyond it visits are grouped and each
#: group takes its largest sensitivity (an upper bound; ``exact_visit_norms`` False in the result).
MAX_VISIT_GROUPS = 64


@dataclass(frozen=True)
class DpsgdEquivalent:
    """The DP-SGD run whose guarantee a block-cyclic banded mechanism inherits (Thm 3.21)."""

    steps: int
    sampling_probability: float
    noise_multiplier: float
    column_norm: float
    blocks: int
    bands: int

    def to_extras(self) -> dict:
        return {
            "dpsgd_steps": self.steps,
            "sampling_probability": self.sampling_probability,
            "column_norm": self.column_norm,
            "blocks": self.blocks,
            "bands": self.bands,
        }


def dpsgd_equivalent(strategy, batching: BlockCyclic | Poisson, noise_std: float) -> DpsgdEquivalent:
    """Tutorial Thm 3.21: (steps', p, sigma) = (ceil(n / blocks), p, noise_std / ||C||_col).

    A public entry point, so the event passes the gate first (method ``bandmf``): a C that is not
    square or has more bands than blocks raises the gate's one-line CorrnoiseError.
    """
    from .event import MechanismEvent
    from .gate import prepare

    prepare(MechanismEvent(strategy, batching, noise_std), "bandmf")
    return _dpsgd_equivalent(strategy, batching, noise_std)


def _dpsgd_equivalent(strategy, batching: BlockCyclic | Poisson, noise_std: float) -> DpsgdEquivalent:
    """:func:`dpsgd_equivalent` for an event the gate has passed: assumes the theorem's hypotheses
    (square C with bands <= blocks; blocks = 1 for Poisson,
    :data:`~corrnoise.accounting.dpsgd.DPSGD_PRECONDITIONS`)."""
    blocks = batching.blocks if isinstance(batching, BlockCyclic) else 1
    bands = int(strategy.bands)
    norm = column_norm(strategy)
    return DpsgdEquivalent(
        steps=-(-strategy.n // blocks),
        sampling_probability=float(batching.p),
        noise_multiplier=float(noise_std) / norm,
        column_norm=norm,
        blocks=blocks,
        bands=bands,
    )


def block_visit_norms(strategy, blocks: int) -> list[np.ndarray]:
    """Tutorial Thm 3.21, per block: block k is visited at the steps t = k (mod ``blocks``), and
    visit t reaches the output only through column t of C (rows t .. t + blocks - 1, disjoint
    across visits since bands <= blocks), so its sensitivity is ||C[:, t]||.  Returns, per block
    with at least one visit, those norms (blocks of unequal lengths when blocks does not divide n)."""
    norms = np.sqrt(np.maximum(np.asarray(strategy.column_norms_squared(), dtype=np.float64), 0.0))
    return [norms[k::blocks] for k in range(min(blocks, norms.size))]


def _visit_groups(norms: np.ndarray) -> tuple[list[tuple[float, int]], bool]:
    """(norm, count) groups of one block's non-zero visit sensitivities, largest first, and whether
    they are exact: beyond :data:`MAX_VISIT_GROUPS` distinct values, contiguous runs of the sorted
    norms share their largest (valid: more sensitivity never helps privacy)."""
    vals = np.sort(norms[norms > 0.0])[::-1]
    counts = Counter(vals.tolist())
    if len(counts) <= MAX_VISIT_GROUPS:
        return sorted(counts.items(), reverse=True), True
    groups = np.array_split(vals, MAX_VISIT_GROUPS)
    return [(float(g[0]), int(g.size)) for g in groups if g.size], False


def _dominated(a: list[tuple[float, int]], b: list[tuple[float, int]]) -> bool:
    """Whether block ``a``'s visits are pointwise no more sensitive than ``b``'s (sorted largest
    first, ``a`` no longer): then a's composition is no less private and need not be accounted."""
    xa = [v for v, c in a for _ in range(c)]
    xb = [v for v, c in b for _ in range(c)]
    return len(xa) <= len(xb) and all(u <= w for u, w in zip(xa, xb))


def _block_epsilon(groups: list[tuple[float, int]], p: float, noise_std: float, delta: float, accountant: str,
                   discretization: float) -> float:
    """epsilon of one block (Thm 3.21 per visit): the composition over its visits of
    PoissonSampled(p, Gaussian(nu / ||C[:, t]||)) in dp_accounting; at p = 1 (PLD) the exact
    Gaussian composition, sqrt(sum_t ||C[:, t]||^2) / nu - GDP (tutorial Lemma 3.19)."""
    import dp_accounting

    if not groups:
        return 0.0
    if len(groups) == 1:  # one sensitivity: exactly the DP-SGD run (same numbers as dpsgd_epsilon)
        (norm, count), = groups
        return dpsgd_epsilon(noise_std / norm, p, count, delta, accountant, discretization)
    if accountant == "pld" and p == 1.0:
        from .gaussian import gaussian_epsilon

        return gaussian_epsilon(delta, math.sqrt(sum(c * v * v for v, c in groups)) / noise_std)
    events = []
    for norm, count in groups:
        step = dp_accounting.GaussianDpEvent(noise_std / norm)
        if p < 1.0:
            step = dp_accounting.PoissonSampledDpEvent(p, step)
        events.append(dp_accounting.SelfComposedDpEvent(step, count))
    return event_epsilon(dp_accounting.ComposedDpEvent(events), delta, accountant, discretization)


def bandmf_epsilon(strategy, batching, noise_std: float, delta: float, accountant: str = "pld",
                   discretization: float = DEFAULT_DISCRETIZATION) -> tuple[float, dict]:
    """epsilon of amplified BandMF (tutorial Thm 3.21) from each block's actual visits: the largest
    over blocks of :func:`_block_epsilon` (an example sits in one block; the guarantee is the worst
    block's).  Blocks whose visits are dominated by another block's are skipped.  Returns
    (epsilon, extras)."""
    blocks = batching.blocks if isinstance(batching, BlockCyclic) else 1
    per_block = [_visit_groups(v) for v in block_visit_norms(strategy, blocks)]
    exact = all(ok for _, ok in per_block)
    groups = [g for g, _ in per_block]
    keep = []
    for i, g in enumerate(groups):
        if any(j != i and _dominated(g, h) and (g != h or j < i) for j, h in enumerate(groups)):
            continue
        keep.append(i)
    eps = {i: _block_epsilon(groups[i], float(batching.p), noise_std, delta, accountant, discretization)
           for i in keep}
    worst = max(eps, key=eps.get) if eps else 0
    return max(max(eps.values(), default=0.0), 0.0), {"worst_block": int(worst),
                                                       "worst_block_visits": int(sum(c for _, c in groups[worst]))
                                                       if groups else 0,
                                                       "exact_visit_norms": bool(exact)}


@register_method("bandmf", batchings=(BlockCyclic, Poisson), preconditions=DPSGD_PRECONDITIONS,
                 description="banded MF with block-cyclic Poisson sampling (tutorial Thm 3.21) via DP-SGD accounting")
def account_bandmf(strategy, batching, noise_std: float, delta: float, accountant: str = "pld",
                   discretization: float = DEFAULT_DISCRETIZATION) -> PrivacyResult:
    """Amplified banded MF: each block's visits composed exactly in dp_accounting (PLD by default)."""
    if accountant not in ACCOUNTANTS:
        raise CorrnoiseError("accountant", f"expected one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
    eq = _dpsgd_equivalent(strategy, batching, noise_std)  # the gate has checked Thm 3.21's hypotheses
    eps, info = bandmf_epsilon(strategy, batching, float(noise_std), delta, accountant, discretization)
    if math.isnan(eps):  # pragma: no cover - defensive
        raise RuntimeError(f"dp_accounting returned epsilon {eps!r}")
    return PrivacyResult(eps, delta, float(noise_std), eq.noise_multiplier, "bandmf",
                         {**eq.to_extras(), **info, "accountant": accountant})


# ----------------------------------------------------------------------------------------------
# Methods pld and rdp: DP-SGD with Poisson sampling, and block-cyclic sampling by the reduction
# ----------------------------------------------------------------------------------------------
def _account_dpsgd(strategy, batching, noise_std, delta, accountant, discretization) -> PrivacyResult:
    if isinstance(batching, BlockCyclic):  # DP-SGD accounting of block-cyclic sampling = Thm 3.21
        result = account_bandmf(strategy, batching, noise_std, delta, accountant=accountant,
                                discretization=discretization)
        return PrivacyResult(result.epsilon, result.delta, result.noise_std, result.noise_multiplier, accountant,
                             result.extras, result.kind)
    # Poisson: C is diagonal (require_diagonal_for_poisson, checked by the gate)
    eq = _dpsgd_equivalent(strategy, batching, noise_std)
    eps = dpsgd_epsilon(eq.noise_multiplier, eq.sampling_probability, eq.steps, delta, accountant, discretization)
    return PrivacyResult(eps, delta, noise_std, eq.noise_multiplier, accountant,
                         {**eq.to_extras(), "accountant": accountant})


@register_method("pld", batchings=(Poisson, BlockCyclic), preconditions=DPSGD_PRECONDITIONS,
                 description="DP-SGD with Poisson sampling: dp_accounting PLD accountant")
def account_pld(strategy, batching, noise_std, delta, discretization: float = DEFAULT_DISCRETIZATION):
    """DP-SGD (diagonal C) with Poisson sampling, privacy loss distributions (dp_accounting)."""
    return _account_dpsgd(strategy, batching, noise_std, delta, "pld", discretization)


@register_method("rdp", batchings=(Poisson, BlockCyclic), preconditions=DPSGD_PRECONDITIONS,
                 description="DP-SGD with Poisson sampling: dp_accounting RDP accountant")
def account_rdp(strategy, batching, noise_std, delta):
    """DP-SGD (diagonal C) with Poisson sampling, Renyi DP (dp_accounting; looser than PLD)."""
    return _account_dpsgd(strategy, batching, noise_std, delta, "rdp", DEFAULT_DISCRETIZATION)
