"""DP-SGD with Poisson sampling (methods ``pld`` and ``rdp``).

DP-SGD (C = I, or any diagonal C) with Poisson sampling at rate p for ``steps`` steps is the
adaptive composition of ``steps`` Poisson-subsampled Gaussian mechanisms with noise multiplier
sigma = noise_std / ||C||_col (tutorial Sec. 1.2 and 3.4; each step's sensitivity is
|C[t, t]| <= ||C||_col).  Its (epsilon, delta) comes from dp_accounting (installed from the
registry): the privacy-loss-distribution accountant (``pld``, pessimistic discretization, the
default) or the Renyi accountant (``rdp``, looser, for comparison).  Add/remove adjacency.

The methods ``pld`` and ``rdp`` are registered in :mod:`corrnoise.accounting.bandmf`, next to the
reduction of block-cyclic sampling to DP-SGD with fewer steps (tutorial Thm 3.21) they share;
this module holds the DP-SGD numbers themselves.
"""

from __future__ import annotations

import contextlib
import logging
import math

from ..errors import CorrnoiseError, check_int, check_real
from .preconditions import require_bands_within_blocks, require_diagonal_for_poisson, require_square

#: Hypotheses of DP-SGD accounting (Poisson: diagonal C) and of its block-cyclic reduction
#: (tutorial Thm 3.21: square C, bands <= blocks), checked by the gate before these methods run.
DPSGD_PRECONDITIONS = (require_square, require_diagonal_for_poisson, require_bands_within_blocks)

__all__ = ["ACCOUNTANTS", "DEFAULT_DISCRETIZATION", "DPSGD_PRECONDITIONS", "dpsgd_event", "dpsgd_epsilon", "event_epsilon"]

ACCOUNTANTS = ("pld", "rdp")
#: dp_accounting's PLD value discretization interval (its default): pessimistic, ~1e-4 in epsilon.
DEFAULT_DISCRETIZATION = 1e-4


def dpsgd_event(noise_multiplier: float, sampling_probability: float, steps: int):
    """The dp_accounting event of DP-SGD: ``steps`` x PoissonSampled(p, Gaussian(sigma))."""
    import dp_accounting

    sigma = check_real("sigma", noise_multiplier, low=0.0, low_open=True)
    p = check_real("p", sampling_probability, low=0.0, high=1.0, low_open=True)
    steps = check_int("steps", steps, minimum=1)
    step = dp_accounting.GaussianDpEvent(sigma)
    if p < 1.0:
        step = dp_accounting.PoissonSampledDpEvent(p, step)
    return dp_accounting.SelfComposedDpEvent(step, steps)


@contextlib.contextmanager
def _quiet_absl():
    """dp_accounting's RDP code logs convergence warnings through absl; keep stderr to one line."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def dpsgd_epsilon(
    noise_multiplier: float,
    sampling_probability: float,
    steps: int,
    delta: float,
    accountant: str = "pld",
    discretization: float = DEFAULT_DISCRETIZATION,
) -> float:
    """epsilon of DP-SGD (noise multiplier sigma, Poisson rate p, ``steps`` steps) at ``delta``.

    ``accountant="pld"``: dp_accounting ``PLDAccountant`` (add/remove, pessimistic,
    ``value_discretization_interval=discretization``); at p = 1 the composition of Gaussians is
    exactly sqrt(steps)/sigma-GDP (tutorial Lemma 3.19) and the exact GDP profile is used instead.
    ``accountant="rdp"``: dp_accounting ``RdpAccountant`` with its default orders.
    """
    delta = check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    event = dpsgd_event(noise_multiplier, sampling_probability, steps)
    if accountant == "pld" and sampling_probability == 1.0:
        from .gaussian import gaussian_epsilon

        return gaussian_epsilon(delta, math.sqrt(steps) / noise_multiplier)
    return event_epsilon(event, delta, accountant, discretization)


def event_epsilon(event, delta: float, accountant: str = "pld",
                  discretization: float = DEFAULT_DISCRETIZATION) -> float:
    """epsilon at ``delta`` of a dp_accounting ``event`` (add/remove adjacency) by the PLD
    accountant (pessimistic, ``value_discretization_interval=discretization``) or the RDP one."""
    import dp_accounting
    from dp_accounting import pld, rdp

    delta = check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    if accountant == "pld":
        discretization = check_real("discretization", discretization, low=0.0, low_open=True)
        acc = pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                value_discretization_interval=discretization)
    elif accountant == "rdp":
        acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    else:
        raise CorrnoiseError("accountant", f"expected one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
    with _quiet_absl():
        acc.compose(event)
        eps = float(acc.get_epsilon(delta))
    return max(eps, 0.0)
