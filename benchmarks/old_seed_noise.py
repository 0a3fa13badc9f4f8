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


# torch runs an element-wise op on one thread below 32768 elements; the old regeneration added
# each chunk in such serial pieces (old generators._axpy).
_SERIAL_PIECE = 16384


def _old_axpy(dst: torch.Tensor, src: torch.Tensor, alpha: float) -> None:
    size = dst.numel()
    if dst.device.type != "cpu" or size < 2 * _SERIAL_PIECE:
        dst.add_(src, alpha=alpha)
        return
    for i in range(0, size, _SERIAL_PIECE):
        dst[i: i + _SERIAL_PIECE].add_(src[i: i + _SERIAL_PIECE], alpha=alpha)


def make_old_generator(strategy, m: int, seed: int = 1, dtype=torch.float32, noise_std: float = 1.0):
    """A current generator with its seed noise replaced by the old chunk loop and its buffered
    updates by the old whole-row torch ops: what one old step cost, for timing only."""
    from corrnoise.noise import make_generator

    gen = make_generator(strategy, m, noise_std=noise_std, seed=seed, dtype=dtype, chunk_size=OLD_CHUNK)
    gen._fused = False
    torch_gen = torch.Generator()
    scratch = torch.empty(min(OLD_CHUNK, m), dtype=dtype)

    def old_combination(terms, out=None, post=None):
        if out is None:
            out = torch.empty(m, dtype=dtype)
        (tau0, c0), rest = terms[0], terms[1:]
        old_fill_seed_noise(out, seed, tau0, m, OLD_CHUNK, torch_gen)
        if gen.noise_std * c0 != 1.0:
            out.mul_(gen.noise_std * c0)
        for tau, c in rest:
            for k in range(-(-m // OLD_CHUNK)):
                a, b = k * OLD_CHUNK, min((k + 1) * OLD_CHUNK, m)
                torch_gen.manual_seed(old_step_seed(seed, tau, k))
                piece = scratch[: b - a]
                torch.randn(b - a, generator=torch_gen, out=piece)
                _old_axpy(out[a:b], piece, gen.noise_std * c)
        return out

    gen._combination = old_combination
    return gen
