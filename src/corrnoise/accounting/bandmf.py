"""Amplified banded matrix factorization with block-cyclic Poisson sampling (method ``bandmf``).

Tutorial Def. 3.20 / Thm 3.21 (Choquette-Choo et al. 2023a): split the data into ``blocks``
parts; step t Poisson-samples part t mod blocks with rate p.  If C is lower-triangular with
at most ``blocks`` bands, the batch of step t only touches rows t .. t + blocks - 1 of C G, so
the mechanism is an adaptive composition of one Poisson-subsampled Gaussian mechanism per visit
of a block, each with sensitivity <= ||C||_col.  Hence C G + Z with noise_std nu satisfies every
guarantee of DP-SGD with

    steps' = ceil(n / blocks),   sampling probability p,   noise multiplier nu / ||C||_col.   (Thm 3.21)

(``ceil``: when blocks does not divide n, block 0 is visited ceil(n / blocks) times.)  The sign of
C's entries does not matter here.  Poisson sampling every step is the case blocks = 1, which
needs a diagonal C (DP-SGD).  A C with more bands than blocks is refused (MMCC, seed 001 App. D,
handles it when available).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import CorrnoiseError
from .base import BlockCyclic, Poisson, PrivacyResult, column_norm, register_method
from .dpsgd import ACCOUNTANTS, DEFAULT_DISCRETIZATION, dpsgd_epsilon

__all__ = ["DpsgdEquivalent", "dpsgd_equivalent", "account_bandmf"]


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

    Raises CorrnoiseError if C has more bands than blocks or is not square.
    """
    blocks = batching.blocks if isinstance(batching, BlockCyclic) else 1
    if strategy.rows != strategy.n:
        raise CorrnoiseError("mechanism", f"{strategy.label} has {strategy.rows} rows for {strategy.n} steps; "
                             "block-cyclic amplification needs a square lower-triangular C")
    bands = int(strategy.bands)
    if bands > blocks:
        raise CorrnoiseError(
            "batching",
            f"{strategy.label} has {bands} bands > {blocks} blocks; block-cyclic amplification (tutorial Thm 3.21) "
            f"needs bands <= blocks: use block-cyclic:{bands}:P or more blocks, or --method mmcc",
        )
    norm = column_norm(strategy)
    return DpsgdEquivalent(
        steps=-(-strategy.n // blocks),
        sampling_probability=float(batching.p),
        noise_multiplier=float(noise_std) / norm,
        column_norm=norm,
        blocks=blocks,
        bands=bands,
    )


@register_method("bandmf", batchings=(BlockCyclic, Poisson),
                 description="banded MF with block-cyclic Poisson sampling (tutorial Thm 3.21) via DP-SGD accounting")
def account_bandmf(strategy, batching, noise_std: float, delta: float, accountant: str = "pld",
                   discretization: float = DEFAULT_DISCRETIZATION) -> PrivacyResult:
    """Amplified banded MF: DP-SGD accounting of the Thm 3.21 equivalent (PLD by default)."""
    if accountant not in ACCOUNTANTS:
        raise CorrnoiseError("accountant", f"expected one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
    eq = dpsgd_equivalent(strategy, batching, noise_std)
    eps = dpsgd_epsilon(eq.noise_multiplier, eq.sampling_probability, eq.steps, delta, accountant, discretization)
    if math.isnan(eps):  # pragma: no cover - defensive
        raise RuntimeError(f"dp_accounting returned epsilon {eps!r}")
    return PrivacyResult(eps, delta, float(noise_std), eq.noise_multiplier, "bandmf",
                         {**eq.to_extras(), "accountant": accountant})
