"""The torch path's float32 seed noise Z as one Triton kernel (CUDA), where Triton is installed.

Why: the torch path (:func:`corrnoise.noise.seeds._torch_normals_eager`) writes Philox4x32-10
with int64 torch ops, each 32-bit product from 16-bit halves because torch has no unsigned 32-bit
multiply; even compiled into one kernel that cost 8.8 ms per row of 1.24e8 coordinates on an H200,
28x torch's own ``normal_`` (benchmarks/RESULTS.md). Triton has 32-bit unsigned products and
their high halves (``umulhi``), so a Philox round is the four products and four XORs of its
definition (Salmon et al., SC 2011; Random123 philox.h).

What it computes is the torch path's Z, the same definition word for word (module docstring of
:mod:`corrnoise.noise.seeds`, :func:`~corrnoise.noise.seeds.torch_coordinate_source`): coordinate
``pos`` of row t is Box-Muller pair p of its block, Philox call p // 2, words 2 (p % 2) and
2 (p % 2) + 1, counter (call, t, s0, s1), key (k0, k1). The integer words are bit-identical to the
torch ops'; log, sqrt, sin and cos are the GPU's float32 functions, so values agree with the eager
ops to float32 rounding (the same tolerance the compiled torch kernel is held to). The kernel
fuses the combination a generator asks for: ``out = coef * Z[t]`` or ``out += coef * Z[t]``.

It is used only for a contiguous float32 output on a device in :data:`TRITON_DEVICES`, and only
after it matched the eager ops on a probe (:func:`corrnoise.noise.seeds._fill_torch`); elsewhere
the compiled torch kernel runs as before. ``CORRNOISE_NO_TRITON=1`` turns it off.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fill_normals", "BLOCK"]

#: coordinates per Triton program
BLOCK = 1024

# Random123 philox.h: round multipliers and Weyl key increments (the same constants as seeds.py's);
# a kernel reads a global only as a tl.constexpr instance
_M0 = tl.constexpr(0xD2511F53)
_M1 = tl.constexpr(0xCD9E8D57)
_W0 = tl.constexpr(0x9E3779B9)
_W1 = tl.constexpr(0xBB67AE85)


@triton.jit(do_not_specialize=["n", "start", "t", "chunk", "m", "k0", "k1", "s0", "s1", "coef"])
def _normals_kernel(out_ptr, n, start, t, chunk, m, k0, k1, s0, s1, coef,
                    ACCUMULATE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    pos = offs + start.to(tl.int64)
    chunk64 = chunk.to(tl.int64)
    # where the coordinate's normal comes from (seeds.torch_coordinate_source, float32)
    block = pos // chunk64
    local = pos - block * chunk64
    length = tl.minimum(m.to(tl.int64) - block * chunk64, chunk64)
    half = (length + 1) // 2
    is_sin = local >= half
    pair = block * ((chunk64 + 1) // 2) + tl.where(is_sin, local - half, local)
    odd = (pair % 2) == 1
    # Philox4x32-10 of the counter (pair // 2, t, s0, s1) under the key (k0, k1)
    c0 = (pair // 2).to(tl.uint32)
    zero = tl.zeros_like(c0)
    c1 = zero + t.to(tl.uint32)
    c2 = zero + s0.to(tl.uint32)
    c3 = zero + s1.to(tl.uint32)
    key0 = k0.to(tl.uint32)
    key1 = k1.to(tl.uint32)
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, _M0)
        lo0 = c0 * _M0
        hi1 = tl.umulhi(c2, _M1)
        lo1 = c2 * _M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ key0, lo1, hi0 ^ c3 ^ key1, lo0
        key0 = key0 + _W0
        key1 = key1 + _W1
    x = tl.where(odd, c2, c0)
    y = tl.where(odd, c3, c1)
    # u1 = (x + 1) 2^-32 in (0, 1], rounded once to float32; u2 = y 2^-32 (as the eager ops)
    u1 = ((x.to(tl.int64) + 1).to(tl.float64) * 2.3283064365386963e-10).to(tl.float32)
    u2 = y.to(tl.float32) * 2.3283064365386963e-10
    radius = tl.sqrt(-2.0 * tl.log(u1))
    angle = 6.283185307179586 * u2
    z = radius * tl.where(is_sin, tl.sin(angle), tl.cos(angle))
    if ACCUMULATE:
        z = tl.load(out_ptr + offs, mask=mask) + coef * z
    else:
        z = coef * z
    tl.store(out_ptr + offs, z, mask=mask)


def fill_normals(out, start: int, t: int, chunk: int, m: int, key, coef: float, accumulate: bool) -> None:
    """out (contiguous float32, 1-d) = coef * Z[t, start:start + len(out)] (``accumulate``: +=)
    on the torch path, ``key`` = (k0, k1, s0, s1). The caller checks the ranges (t < 2^31, fewer
    than 2^32 Philox calls per row)."""
    n = out.numel()
    k0, k1, s0, s1 = key
    grid = (triton.cdiv(n, BLOCK),)
    _normals_kernel[grid](out, n, start, t, chunk, m, k0, k1, s0, s1, float(coef),
                          ACCUMULATE=bool(accumulate), BLOCK_SIZE=BLOCK)
