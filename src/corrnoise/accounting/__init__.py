"""Privacy accounting (layer 5): mechanism + batching + noise -> (epsilon, delta), and back.

    >>> from corrnoise.accounting import account, calibrate, BlockCyclic
    >>> from corrnoise.strategies import parse_strategy
    >>> C = parse_strategy("bsr:4", 2000)
    >>> account(C, BlockCyclic(4, 0.04), noise_multiplier=3.48, delta=1e-5).epsilon  # doctest: +SKIP
    >>> calibrate(C, "block-cyclic:4:0.04", epsilon=1.0, delta=1e-5).noise_std        # doctest: +SKIP

Methods (``method=``; ``auto`` chooses, see :func:`choose_method`):

``gaussian``  no amplification (``batching="none"`` + participation): exact mu-GDP
``pld``/``rdp``  DP-SGD (diagonal C) with Poisson sampling, dp_accounting accountants
``bandmf``    banded C with block-cyclic Poisson sampling (tutorial Thm 3.21)
``mmcc``      any non-negative C with Poisson / block-cyclic sampling (seed 001), if present
``mc``        balls-in-bins Monte Carlo accounting (seed 000), if present

What ran is a :class:`MechanismEvent` (mechanism, batching, noise, steps); ``account`` and
``calibrate`` take one (or, as before, a strategy and a batching).  Every event passes one gate,
:func:`prepare` (:mod:`.gate`), which runs the named preconditions (:mod:`.preconditions`) the
method registered.  New methods register themselves with :func:`register_method` (see
:mod:`.base`); the ``mmcc`` and ``mc`` modules are imported on first use.
"""

from .base import (
    KNOWN_METHODS,
    BallsInBins,
    Batching,
    BlockCyclic,
    MethodSpec,
    NoBatching,
    Poisson,
    PrivacyResult,
    column_norm,
    get_method,
    method_available,
    parse_batching,
    register_method,
    registered_methods,
    resolve_noise_std,
)
from .event import MechanismEvent
from .account import account
from .gate import RUN_IDENTITY_KEYS, choose_method, prepare, run_identity, run_mismatch
from .calibrate import calibrate, calibrate_noise
from .gaussian import gaussian_delta, gaussian_epsilon, gaussian_mu
from .dpsgd import dpsgd_epsilon, dpsgd_event  # noqa: E402  (the DP-SGD numbers)
from .bandmf import DpsgdEquivalent, dpsgd_equivalent  # noqa: E402  (registers bandmf, pld, rdp)

__all__ = [
    "KNOWN_METHODS", "BallsInBins", "Batching", "BlockCyclic", "DpsgdEquivalent", "MechanismEvent", "MethodSpec",
    "NoBatching", "Poisson", "PrivacyResult", "account", "calibrate", "calibrate_noise", "choose_method", "column_norm",
    "dpsgd_epsilon", "dpsgd_equivalent", "dpsgd_event", "gaussian_delta", "gaussian_epsilon", "gaussian_mu",
    "get_method", "method_available", "parse_batching", "prepare", "register_method", "registered_methods",
    "resolve_noise_std", "RUN_IDENTITY_KEYS", "run_identity", "run_mismatch",
]
