"""Training-time noise (layer 6): counter-seeded noise Z and streaming generators of C^{-1} Z."""

from .generators import (
    BandedGenerator,
    BLTGenerator,
    DPCGDGenerator,
    IidGenerator,
    NoiseGenerator,
    RegenerateGenerator,
    make_generator,
    resolve_dim,
)
from .seeds import DEFAULT_CHUNK, fill_seed_noise, seed_noise, step_seed

__all__ = [
    "BLTGenerator", "BandedGenerator", "DEFAULT_CHUNK", "DPCGDGenerator", "IidGenerator",
    "NoiseGenerator", "RegenerateGenerator", "fill_seed_noise", "make_generator", "resolve_dim",
    "seed_noise", "step_seed",
]
