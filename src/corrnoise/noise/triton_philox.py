"""The torch path's float32 seed noise Z as one Triton kernel (CUDA), where Triton is installed.

Why: the torch path (:func:`corrnoise.noise.seeds._torch_normals_eager`) writes Philox4x32-10
with int64 torch ops, each 32-bit product from 16-bit halves because torch has no unsigned 32-bit
multiply; even compiled into one kernel that cost 8.8-10 ms per row of 1.24e8 coordinates on an
H200, ~30x torch's own ``normal_``. Triton has 32-bit unsigned products and their high halves
(``umulhi``), so a Philox round is the four products and four XORs of its definition (Salmon et
al., SC 2011; Random123 philox.h). This kernel: 1.0 ms for that row (benchmarks/RESULTS.md).

What it computes is the torch path's Z, the same definition word for word (module docstring of
:mod:`corrnoise.noise.seeds`, :func:`~corrnoise.noise.seeds.torch_coordinate_source`): coordinate
``pos`` of row t is Box-Muller pair p of its block, Philox call p // 2, words 2 (p % 2) and
2 (p % 2) + 1, counter (call, t, s0, s1), key (k0, k1). The integer words are bit-identical to the
torch ops'; log, sqrt, sin and cos are the GPU's float32 functions, so values agree with the eager
ops to float32 rounding (the same tolerance the compiled torch kernel is held to). One lane per
Box-Muller pair draws its words once for both of the pair's coordinates (the eager ops draw them
once per coordinate). The kernel fuses the combination a generator asks for: ``out = coef * Z[t]``
or ``out += coef * Z[t]``.

It is used only for a contiguous float32 output on a device in :data:`TRITON_DEVICES`, and only
after it matched the eager ops on a probe (:func:`corrnoise.noise.seeds._fill_torch`); elsewhere
the compiled torch kernel runs as before. ``CORRNOISE_NO_TRITON=1`` turns it off.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["fill_normals", "BLOCK"]

#: Box-Muller pairs (two coordinates each) per Triton program
BLOCK = 1024

# Random123 philox.h: round multipliers and Weyl key increments (the same constants as seeds.py's);
# a kernel reads a global only as a tl.constexpr instance
_M0 = tl.constexpr(0xD2511F53)
_M1 = tl.constexpr(0xCD9E8D57)
_W0 = tl.constexpr(0x9E3779B9)
_W1 = tl.constexpr(0xBB67AE85)


@triton.jit(do_not_specialize=["start", "stop", "first_block", "n_slots", "t", "chunk", "m", "k0", "k1", "s0",
                                "s1", "coef"])
def _pairs_kernel(out_ptr, start, stop, first_block, n_slots, t, chunk, m, k0, k1, s0, s1, coef,
                  ACCUMULATE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # one lane per Box-Muller pair slot of the blocks that meet [start, stop): its Philox words give
    # both of the pair's coordinates (the cosine i and the sine h + i of its block)
    slot = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    chunk64 = chunk.to(tl.int64)
    per_block = (chunk64 + 1) // 2
    k = slot // per_block
    i = slot - k * per_block
    k += first_block.to(tl.int64)
    base = k * chunk64
    length = tl.minimum(m.to(tl.int64) - base, chunk64)
    half = (length + 1) // 2
    live = (slot < n_slots) & (i < half)
    pair = k * per_block + i
    # Philox4x32-10 of the counter (pair // 2, t, s0, s1) under the key (k0, k1)
    c0 = (pair >> 1).to(tl.uint32)
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
    odd = (pair & 1) == 1
    x = tl.where(odd, c2, c0)
    y = tl.where(odd, c3, c1)
    # u1 = (x + 1) 2^-32 in (0, 1], rounded once to float32; u2 = y 2^-32 (as the eager ops)
    u1 = ((x.to(tl.int64) + 1).to(tl.float64) * 2.3283064365386963e-10).to(tl.float32)
    u2 = y.to(tl.float32) * 2.3283064365386963e-10
    radius = tl.sqrt(-2.0 * tl.log(u1))
    angle = 6.283185307179586 * u2
    lo = start.to(tl.int64)
    hi = stop.to(tl.int64)
    cos_at = base + i
    sin_at = base + half + i
    cos_ok = live & (cos_at >= lo) & (cos_at < hi)
    sin_ok = live & (half + i < length) & (sin_at >= lo) & (sin_at < hi)
    z_cos = coef * (radius * tl.cos(angle))
    z_sin = coef * (radius * tl.sin(angle))
    if ACCUMULATE:
        z_cos += tl.load(out_ptr + (cos_at - lo), mask=cos_ok)
        z_sin += tl.load(out_ptr + (sin_at - lo), mask=sin_ok)
    tl.store(out_ptr + (cos_at - lo), z_cos, mask=cos_ok)
    tl.store(out_ptr + (sin_at - lo), z_sin, mask=sin_ok)


def fill_normals(out, start: int, t: int, chunk: int, m: int, key, coef: float, accumulate: bool) -> None:
    """out (contiguous float32, 1-d) = coef * Z[t, start:start + len(out)] (``accumulate``: +=)
    on the torch path, ``key`` = (k0, k1, s0, s1). The caller checks the ranges (t < 2^31, fewer
    than 2^32 Philox calls per row). The lanes are the Box-Muller pairs of every block the range
    meets, so a range inside one block costs that block's pairs."""
    stop = start + out.numel()
    first, last = start // chunk, (stop - 1) // chunk
    n_slots = (last - first + 1) * ((chunk + 1) // 2)
    k0, k1, s0, s1 = key
    grid = (triton.cdiv(n_slots, BLOCK),)
    # Triton launches on the current device, which need not be the row's (cuda:1 under cuda:0)
    with torch.cuda.device(out.device) if out.device.type == "cuda" else contextlib.nullcontext():
        _pairs_kernel[grid](out, start, stop, first, n_slots, t, chunk, m, k0, k1, s0, s1, float(coef),
                            ACCUMULATE=bool(accumulate), BLOCK_SIZE=BLOCK)
