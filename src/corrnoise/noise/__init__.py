"""Training-time noise (layer 6): counter-seeded noise Z and streaming generators of C^{-1} Z.

Names are loaded on first use, so importing ``corrnoise.noise.bench`` for the command line
does not import torch until a benchmark runs.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BLTGenerator": "generators", "BandedGenerator": "generators", "DPCGDGenerator": "generators",
    "IidGenerator": "generators", "NoiseGenerator": "generators", "RegenerateGenerator": "generators",
    "TreeGenerator": "generators",
    "make_generator": "generators", "resolve_dim": "generators",
    "DEFAULT_CHUNK": "seeds", "fill_seed_noise": "seeds", "seed_noise": "seeds", "new_secret_seed": "seeds",
    "fill_noise_combination": "seeds", "derive_key": "seeds", "check_seed": "seeds",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
