"""corrnoise: differentially private training with correlated noise (matrix-factorization mechanisms).

The names a user needs, importable from the top level (loaded on first use, so ``import
corrnoise`` pulls in neither torch nor dp_accounting):

- mechanisms: :func:`parse_strategy` (the one name grammar: ``identity``, ``bsr:4``,
  ``dpcgd:0.9``, ``blt:A:L``, ``toeplitz-sqrt``, a mechanism file ...), :class:`Strategy`,
  :func:`save_mechanism`, :func:`load_mechanism`;
- losses and design: :func:`loss_report`, :func:`optimize_banded_toeplitz`, :func:`optimize_blt`,
  :func:`optimize_dense`;
- privacy: :class:`MechanismEvent`, :func:`account`, :func:`calibrate`, :class:`PrivacyResult`,
  :func:`parse_batching`;
- planning: :func:`plan` (the planner), :func:`plan_run` -> :class:`RunPlan` (a whole private run,
  decided once, reviewable as a file before any privacy is spent);
- training: :func:`make_private` (PyTorch), the samplers :class:`PoissonSampler`,
  :class:`BlockCyclicPoissonSampler`, :class:`BallsInBinsSampler`, :class:`CyclicSampler`.
"""

from importlib import import_module

__version__ = "0.2.0"

_LAZY = {
    "Strategy": "corrnoise.strategies",
    "parse_strategy": "corrnoise.strategies",
    "save_mechanism": "corrnoise.strategies",
    "load_mechanism": "corrnoise.strategies",
    "loss_report": "corrnoise.losses",
    "optimize_banded_toeplitz": "corrnoise.optimize",
    "optimize_blt": "corrnoise.optimize",
    "optimize_dense": "corrnoise.optimize",
    "MechanismEvent": "corrnoise.accounting",
    "account": "corrnoise.accounting",
    "calibrate": "corrnoise.accounting",
    "PrivacyResult": "corrnoise.accounting",
    "parse_batching": "corrnoise.accounting",
    "plan": "corrnoise.planner",
    "plan_run": "corrnoise.runplan",
    "RunPlan": "corrnoise.runplan",
    "make_private": "corrnoise.torch",
    "PoissonSampler": "corrnoise.sampling",
    "BlockCyclicPoissonSampler": "corrnoise.sampling",
    "BallsInBinsSampler": "corrnoise.sampling",
    "CyclicSampler": "corrnoise.sampling",
    "CorrnoiseError": "corrnoise.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'corrnoise' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
