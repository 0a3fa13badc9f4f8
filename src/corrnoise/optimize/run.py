"""Run one strategy optimization by kind (the core behind ``corrnoise optimize``).

:func:`run_optimize` optimizes, validates the result (:func:`validate_strategy`) and recomputes
its losses with :func:`corrnoise.losses.loss_report` (never the optimizer's own number).
Progress is reported through the two callbacks the caller passes (no display code here).
"""

from __future__ import annotations

import math
import time

from ..errors import CorrnoiseError, check_int

__all__ = ["KINDS", "run_optimize", "validate_strategy"]

KINDS = ("dense", "banded", "banded-toeplitz", "blt", "bandinv")


def validate_strategy(strategy) -> None:
    """Refuse an invalid mechanism (not lower-triangular, non-positive diagonal, non-finite)."""
    import numpy as np

    from ..strategies import Banded, ColumnNormalized, Dense
    from .common import check_band, check_strategy_matrix

    base = strategy.base if isinstance(strategy, ColumnNormalized) else strategy
    if isinstance(base, Dense):
        check_strategy_matrix(base.matrix())
    elif isinstance(base, Banded):
        check_band(base.band)
    else:
        coef = base.toeplitz_coefficients
        if coef is None:
            raise CorrnoiseError("strategy", f"unexpected optimizer result {type(base).__name__}")
        coef = np.asarray(coef, dtype=np.float64)
        if not np.all(np.isfinite(coef)) or coef.size == 0 or coef[0] <= 0.0:
            raise CorrnoiseError("strategy", "optimizer produced invalid Toeplitz coefficients")
    if isinstance(strategy, ColumnNormalized):
        norms = np.sqrt(base.column_norms_squared())
        if not np.all(np.isfinite(norms)) or np.any(norms <= 0.0):
            raise CorrnoiseError("strategy", "optimizer produced a zero or non-finite column")


def run_optimize(kind: str, n: int, bands=None, buffers=None, participation: str = "single",
                 objective: str = "rms", workload: str = "prefix", colnorm: bool = False,
                 progress=None):
    """Optimize and return ``(strategy, LossReport, seconds)``; ``progress`` is a pair of callbacks
    ``(on_fraction(fraction, message), on_iteration(iteration, loss))`` or None."""
    from ..losses import loss_report
    from ..participation import parse_participation
    from .common import check_bands, check_objective, check_workload

    if not isinstance(kind, str) or kind.strip().lower() not in KINDS:
        raise CorrnoiseError("kind", f"must be one of {', '.join(KINDS)}, got {kind!r}")
    kind = kind.strip().lower()
    n = check_int("n", n, minimum=1)
    schema = parse_participation(participation)
    schema.validate(n)
    objective = check_objective(objective)
    wl = check_workload(workload)
    on_fraction, on_iteration = progress or (None, None)
    if kind in ("banded", "banded-toeplitz", "bandinv"):
        if bands is None:
            raise CorrnoiseError("bands", f"is required for {kind} (e.g. --bands 32)")
        bands = check_int("bands", bands, minimum=1)
        if bands > n:
            raise CorrnoiseError("bands", f"must be <= n = {n}, got {bands}")
        if kind == "banded":
            bands = check_bands(bands, n, schema)
    elif bands is not None:
        raise CorrnoiseError("bands", f"does not apply to {kind}" + (
            "; min-sep dense strategies are banded by the separation b" if kind == "dense" else ""))
    if buffers is not None:
        if kind != "blt":
            raise CorrnoiseError("buffers", f"only applies to blt, not {kind}")
        buffers = check_int("buffers", buffers, minimum=1, maximum=10)
    if colnorm and kind not in ("banded-toeplitz", "bandinv"):
        raise CorrnoiseError("colnorm", f"only applies to banded-toeplitz and bandinv ({kind} strategies are already column-normalized or need not be)")

    t0 = time.perf_counter()
    if kind == "dense":
        from .dense import optimize_dense

        strategy = optimize_dense(n, schema, objective, wl, progress=on_fraction)
    elif kind == "banded":
        from .banded import optimize_banded

        strategy = optimize_banded(n, bands, schema, objective, wl, progress=on_fraction)
    elif kind == "banded-toeplitz":
        from .toeplitz import optimize_banded_toeplitz

        strategy = optimize_banded_toeplitz(n, bands, participation=schema, objective=objective, workload=wl,
                                            column_normalize=bool(colnorm), progress=on_iteration)
    elif kind == "bandinv":
        from ..strategies.toeplitz import BandedInverse
        from .banded_inverse import optimize_banded_inverse

        strategy = BandedInverse(n, optimize_banded_inverse(n, bands, schema, objective, wl, bool(colnorm)))
        if colnorm:
            from ..strategies import ColumnNormalized

            strategy = ColumnNormalized(strategy)
    else:
        from .blt import optimize_blt

        strategy = optimize_blt(n, buffers=buffers, participation=schema, objective=objective, workload=wl,
                                progress=on_iteration)
    seconds = time.perf_counter() - t0
    validate_strategy(strategy)
    report = loss_report(strategy, schema, wl)
    for name in ("rms_loss", "max_loss", "sensitivity"):
        if not math.isfinite(getattr(report, name)):
            raise CorrnoiseError("strategy", f"the optimized strategy has a non-finite {name}")
    return strategy, report, seconds
