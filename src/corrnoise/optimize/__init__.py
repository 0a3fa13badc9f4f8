"""Strategy optimization (layer 4): dense, general banded, banded Toeplitz and BLT.

Every optimizer returns a valid :class:`corrnoise.strategies.Strategy` (lower-triangular, positive
diagonal, finite) or raises :class:`corrnoise.errors.CorrnoiseError`; report losses with
:func:`corrnoise.losses.loss_report` on the returned strategy, never an optimizer's internal number.
The banded Toeplitz and BLT optimizers live in ``toeplitz.py`` / ``blt.py`` and are imported
lazily (they pull in heavier dependencies).
"""

from .banded import optimize_banded, sweep_bands
from .common import OBJECTIVES
from .dense import optimize_dense


__all__ = ["OBJECTIVES", "optimize_banded", "optimize_dense", "sweep_bands"]
