"""FROZEN copy of the pre-#8 seed-noise generator -- for comparison only, never for training.

Kept so benchmarks/bench_noise.py can time the old generator against the new one in the same
process, and so tests/test_noise_counters.py can show the breach it had: torch's CPU
generator keeps only the low 32 bits of ``manual_seed``, so the 63-bit per-chunk seeds below
collide with probability 2^-32 per pair of (step, chunk), giving identical noise rows
(issue #8 item 1). This is the code of src/corrnoise/noise/seeds.py at commit 0242a91,
trimmed to what the comparisons call.
"""

from __future__ import annotations

import hashlib
import struct

import torch

OLD_CHUNK = 1 << 16
_PERSON = b"corrnoise-Z-v1"
_MASK63 = (1 << 63) - 1


def old_step_seed(seed: int, t: int, chunk: int) -> int:
    """The old 63-bit seed of chunk ``chunk`` of row ``t``: BLAKE2b(seed, t, chunk)."""
    data = struct.pack("<QQQ", seed & ((1 << 64) - 1), t, chunk)
    digest = hashlib.blake2b(data, digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "little") & _MASK63


def old_fill_seed_noise(out: torch.Tensor, seed: int, t: int, m: int, chunk_size: int = OLD_CHUNK,
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """The old Z[t] (whole row): one torch.randn per chunk from a re-seeded torch.Generator."""
    if generator is None:
        generator = torch.Generator(device=out.device)
    for k in range(-(-m // chunk_size)):
        a, b = k * chunk_size, min((k + 1) * chunk_size, m)
        generator.manual_seed(old_step_seed(seed, t, k))
        torch.randn(b - a, generator=generator, out=out[a:b])
    return out


def old_dpcgd_step(out: torch.Tensor, seed: int, t: int, m: int, beta: float, generator: torch.Generator,
                   scratch: torch.Tensor, chunk_size: int = OLD_CHUNK) -> torch.Tensor:
    """The old DP-CGD step: Z[t] into out, then Z[t-1] regenerated chunk by chunk and subtracted."""
    old_fill_seed_noise(out, seed, t, m, chunk_size, generator)
    if t > 0:
        for k in range(-(-m // chunk_size)):
            a, b = k * chunk_size, min((k + 1) * chunk_size, m)
            generator.manual_seed(old_step_seed(seed, t - 1, k))
            piece = scratch[: b - a]
            torch.randn(b - a, generator=generator, out=piece)
            out[a:b].add_(piece, alpha=-beta)
    return out
