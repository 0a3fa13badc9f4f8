"""Strategy optimization (layer 4): dense, general banded, banded Toeplitz and BLT.

Every optimizer returns a valid :class:`corrnoise.strategies.Strategy` (lower-triangular, positive
diagonal, finite) or raises :class:`corrnoise.errors.CorrnoiseError`; report losses with
:func:`corrnoise.losses.loss_report` on the returned strategy, never an optimizer's internal number.

- :func:`optimize_dense` (``dense.py``): tutorial Problems 4.3 / 4.6 / 4.8, certified optimum.
- :func:`optimize_banded`, :func:`sweep_bands` (``banded.py``): general column-normalized banded.
- ``optimize_banded_toeplitz`` (``toeplitz.py``) and ``optimize_blt`` (``blt.py``).

Attributes are imported on first use so that ``import corrnoise.optimize`` does not load torch.
"""

from importlib import import_module

_LAZY = {
    "optimize_dense": ".dense",
    "optimize_banded": ".banded",
    "sweep_bands": ".banded",
    "optimize_banded_toeplitz": ".toeplitz",
    "optimize_blt": ".blt",
    "optimize_blt_each": ".blt",
    "OBJECTIVES": ".common",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
