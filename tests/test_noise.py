"""Streaming noise generators against the materialized nu * C^{-1} Z, on any machine.

What is pinned, and how (docs/design.md, "What is reproducible, and where"):

* bit-exactly on every machine: the integer Philox words behind a counter-based draw Z[t, j] and
  the uniforms made from them (IEEE-exact conversions), and the generator kind of every
  strategy / method / dtype;
* up to rounding, with a bound derived from the arithmetic: a draw (the log / cos / sin of
  numpy's SIMD or libm loops differ by a few ulps between CPUs), and every generated row against
  nu * C^{-1} Z computed in float64 by numpy (:func:`noise_bounds.stream_tolerance`, shown tight
  enough to catch a changed stream by :func:`test_stream_tolerance_catches_a_changed_stream`);
* bit-exactly on one machine in one process: resuming (seek, state_dict, a checkpoint) gives the
  rows of the uninterrupted run.
"""

from __future__ import annotations

import io
import math
import warnings
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import random_strategies
from noise_bounds import stream_mismatch, unit_roundoff
from corrnoise.errors import CorrnoiseError
from corrnoise.noise.generators import GENERATORS
from corrnoise.noise.seeds import DEFAULT_CHUNK, block_counter, block_words, derive_key, scratch_bytes
from corrnoise.noise import RegenerateGenerator, make_generator, seed_noise
from corrnoise.strategies import (
    BLT, DPCGD, Banded, BandedInverse, BandedSqrt, ColumnNormalized, Identity, Prefix, ToeplitzSqrt,
)
from corrnoise.strategies.kinds import KINDS

N, M, CHUNK, SEED, NU = 9, 70, 16, 1234, 1.7
DTYPES = [torch.float64, torch.float32]
DTYPE_IDS = ["float64", "float32"]


def seed_rows(rows, m=M, seed=SEED, chunk=CHUNK, dtype=torch.float64):
    """Z[0..rows-1] = seed_noise(seed, tau, m) in ``dtype``, as float64 numpy (exact widening)."""
    return np.stack([seed_noise(seed, tau, m, dtype=dtype, chunk_size=chunk).double().numpy() for tau in range(rows)])


def materialized(strategy, m=M, seed=SEED, nu=NU, chunk=CHUNK, start=0, stop=None, dtype=torch.float64):
    """nu * C^{-1} Z in float64, Z[tau] = seed_noise(seed, tau, m, dtype) built row by row (an
    independent path: numpy's product with the materialized C^{-1})."""
    noise = nu * strategy.noising_matrix() @ seed_rows(strategy.rows, m, seed, chunk, dtype)
    return noise[:, start:stop]


def run(gen, steps):
    rows = [gen.next_flat().double().numpy() for _ in range(steps)]
    return np.stack(rows) if rows else np.zeros((0, gen.size))


def within_stream_tolerance(got, strategy, z, dtype, nu=NU) -> bool:
    """Is ``got`` (n x m rows) nu C^{-1} z up to :func:`noise_bounds.stream_tolerance`?"""
    return stream_mismatch(got, strategy, z, nu, dtype) is None


def assert_stream(got, strategy, dtype, nu=NU):
    """Assert ``got`` equals nu C^{-1} Z, Z = the seed rows in ``dtype``, within the bound."""
    mismatch = stream_mismatch(got, strategy, seed_rows(strategy.rows, dtype=dtype), nu, dtype)
    assert mismatch is None, mismatch


# Every kind of strategy: conftest's random instances, and a general BandedInverse (bisr is one).
ALL = random_strategies(N, seed=3) + [BandedInverse(N, [1.0, -0.45, 0.2])]

# The generator kind of every strategy: (method auto, method regenerate), the same for both dtypes.
# Not arithmetic, so pinned exactly (the dispatch lives in Strategy.noise_stream, issue #9 item 5).
STREAM_KINDS = {
    "identity": ("iid", "regenerate"),
    "prefix": ("regenerate", "regenerate"),
    "toeplitz-sqrt": ("regenerate", "regenerate"),
    "bsr:4": ("banded", "regenerate"),
    "bisr:3": ("regenerate", "regenerate"),
    "dpcgd:0.6": ("dpcgd", "regenerate"),
    "blt(d=2)": ("blt", "regenerate"),
    "toeplitz": ("regenerate", "regenerate"),
    "dense": ("regenerate", "regenerate"),
    "banded": ("banded", "regenerate"),
    "tree:full": ("regenerate", "regenerate"),
    "tree": ("tree", "tree"),  # plain decoding regenerates its nodes: its stream is already memoryless
    "tree:ls": ("tree", "regenerate"),
    "bandinv:3": ("regenerate", "regenerate"),
    "toeplitz-sqrt+colnorm": ("regenerate", "regenerate"),
    "banded+colnorm": ("banded", "regenerate"),
    "blt(d=1)+colnorm": ("blt", "regenerate"),
    "dense+colnorm": ("regenerate", "regenerate"),
}
METHODS = ["auto", "regenerate"]


@pytest.mark.parametrize("strategy", ALL, ids=[s.label for s in ALL])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_generator_equals_materialized(strategy, method, dtype):
    gen = make_generator(strategy, M, noise_std=NU, seed=SEED, dtype=dtype, chunk_size=CHUNK, method=method)
    kind = STREAM_KINDS[strategy.label][METHODS.index(method)]
    assert gen.kind == kind and type(gen) is GENERATORS[kind]
    got = run(gen, N)
    assert_stream(got, strategy, dtype)
    # The generator refuses step n, naming the steps.
    with pytest.raises(CorrnoiseError) as err:
        gen.next()
    assert err.value.param == "steps"


@pytest.mark.parametrize("strategy", ALL, ids=[s.label for s in ALL])
@pytest.mark.parametrize("method", METHODS)
def test_a_returned_row_is_the_callers(strategy, method):
    """The privatizer writes each step's update into the row the generator returned (issue #27):
    overwriting every returned row must leave the later rows as they were, for every kind (a
    generator that returned one of its own buffers would feed the overwrite into its recurrence).
    Same code, same process: compared exactly."""
    kw = dict(noise_std=NU, seed=SEED, dtype=torch.float64, chunk_size=CHUNK, method=method)
    kept, spoiled = make_generator(strategy, M, **kw), make_generator(strategy, M, **kw)
    for t in range(N):
        want = kept.next()
        row = spoiled.next()
        assert torch.equal(row, want), f"row {t}"
        row.fill_(float("nan"))


@pytest.mark.parametrize("strategy", ALL, ids=[s.label for s in ALL])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_stream_tolerance_catches_a_changed_stream(strategy, method, dtype):
    """The tolerance cannot pass vacuously: the generated rows are outside it for another seed,
    for the first two rows of Z swapped, and for any one row of Z that the noise reads scaled by
    1 + delta, delta = 1e-3 in float32 and 1e-11 in float64 (the first row: 1e-4 / 1e-12; the bound
    is 2.0e-6 / 7.3e-15 relative there)."""
    gen = make_generator(strategy, M, noise_std=NU, seed=SEED, dtype=dtype, chunk_size=CHUNK, method=method)
    got = run(gen, N)
    z = seed_rows(strategy.rows, dtype=dtype)
    assert within_stream_tolerance(got, strategy, z, dtype)
    assert not within_stream_tolerance(got, strategy, seed_rows(strategy.rows, seed=SEED + 1, dtype=dtype), dtype)
    swapped = z.copy()
    swapped[[0, 1]] = z[[1, 0]]
    assert not within_stream_tolerance(got, strategy, swapped, dtype)
    delta, first = (1e-11, 1e-12) if dtype == torch.float64 else (1e-3, 1e-4)
    used = np.flatnonzero(np.any(strategy.noising_matrix() != 0.0, axis=0))  # rows of Z the noise reads
    assert used[0] == 0 and len(used) >= N
    for tau in used:
        scaled = z.copy()
        scaled[tau] *= 1.0 + (first if tau == 0 else delta)
        assert not within_stream_tolerance(got, strategy, scaled, dtype), f"draw row {tau} scaled by 1 + {delta}"


def test_checks_cover_every_kind():
    """The generator checks above run every strategy kind (conftest's random_strategies and every
    kind a mechanism file can name, column-normalized ones too) and every generator kind."""
    labels = [s.label for s in ALL]
    assert set(STREAM_KINDS) == set(labels) and len(labels) == len(set(labels))
    assert {s.kind for s in random_strategies(N, seed=3)} <= {s.kind for s in ALL}
    assert {s.kind for s in ALL} == set(KINDS) | {"colnorm"}
    assert {s.base.kind for s in ALL if isinstance(s, ColumnNormalized)} >= {"toeplitz-sqrt", "banded", "blt", "dense"}
    assert {kind for pair in STREAM_KINDS.values() for kind in pair} == set(GENERATORS)
    # stream_tolerance's BLT argument needs nonnegative alpha and lambda
    for s in ALL:
        base = s.base if isinstance(s, ColumnNormalized) else s
        if isinstance(base, BLT):
            assert np.all(base.alpha >= 0.0) and np.all(base.lam >= 0.0), s.label


# --- the counter-based draws: bit-exact words, Gaussians within a few ulps ------------------------
# (dtype, seed, t, m, chunk, (start, stop), j, Philox4x64 words feeding Z[t, j], sine?, Z[t, j]
# correctly rounded). The words are integer arithmetic, the same on every machine; Z[t, j] is the
# exact Box-Muller transform of their uniforms (computed once with mpmath at 200 bits), which
# seed_noise reproduces within draw_tolerance: its log / cos / sin are numpy's SIMD or libm loops,
# which differ between CPUs by a few ulps (e.g. AVX-512 vs AVX2 vs SSE numpy dispatch).
DRAW_PINS = [
    ("float64", 1234, 0, 70, 16, (0, 70), 5, (0x5954d3d3fa6099f7, 0xe9ac11aa30bc0109), False, "0x1.3d14882f50e91p+0"),
    ("float64", 1234, 8, 70, 16, (0, 70), 69, (0x5e488677f6e40282, 0xb9fad0861ffb2d58), True, "-0x1.65e45490a942fp+0"),
    ("float64", 7, 3, 1000, 64, (100, 333), 100, (0xb587b4a49c910942, 0xc941d06183e8a215), True, "-0x1.9d9f0ca42100cp-1"),
    ("float64", 7, 3, 1000, 64, (100, 333), 332, (0xa3b43244a9d1df8f, 0x2f6e893bb20fa68a), False, "0x1.7f01a06db5224p-2"),
    ("float64", 2**200 + 7, 2**40, 5, 5, (0, 5), 4, (0x79d27ac3d2c25540, 0x75070192e515463b), True, "0x1.4c09326ede1b9p-2"),
    ("float64", 0, 1, 300_000, DEFAULT_CHUNK, (262_100, 300_000), 299_999, (0xef2249ef342feade, 0x5485616ea114fd31), True,
     "0x1.4b1cabece1f3dp-2"),
    ("float32", 1234, 0, 70, 16, (0, 70), 5, (0xe3fa8b8b01c995cf,), False, "0x1.37a48cp+1"),
    ("float32", 1234, 8, 70, 16, (0, 70), 69, (0xaf7e450d46abe7da,), True, "-0x1.797d72p+0"),
    ("float32", 7, 3, 1000, 64, (100, 333), 100, (0xbfd80d7c58f9722b,), True, "-0x1.742e5p+0"),
    ("float32", 7, 3, 1000, 64, (100, 333), 332, (0x56779f57ec76afcc,), False, "-0x1.ab8688p-3"),
    ("float32", 2**200 + 7, 2**40, 5, 5, (0, 5), 4, (0x1c53a4c8f0a3f2dd,), True, "0x1.cd7e54p-3"),
    ("float32", 0, 1, 300_000, DEFAULT_CHUNK, (262_100, 300_000), 299_999, (0xf26f3828c60ddfe9,), True,
     "-0x1.df8b08p-3"),
]

#: Accuracy assumed of every log, cos and sin loop, in ulps of the result: numpy's accuracy tests
#: (numpy/_core/tests/data/umath-validation-set-*.csv) allow 4 ulps for its float32 log, 2 for
#: float32 sin / cos and 1 for float64, whichever SIMD loop runs; glibc's are below 1 ulp.
TRANSCENDENTAL_ULPS = 4


def block_uniforms(seed, t, m, block, dtype, chunk):
    """(raw words, u1, theta) of one block of Z[t] on the CPU path, by the layout of
    corrnoise/noise/seeds.py: the block draws Philox4x64-10 words with key = derive_key bytes
    0..15 and counters (i, block, t, domain); float64 takes two words per Box-Muller pair,
    u1 = (top 53 bits + 1) 2^-53 (exact) and theta = top 53 bits * fl(2 pi 2^-53) (one rounding);
    float32 one word, u1 = fl32(fl32(low 32 bits) + 1) 2^-32 and
    theta = fl32(fl32(high 32 bits) * fl32(2 pi 2^-32)). Integers and single IEEE operations
    only: the same bits on every machine."""
    raw_key = derive_key(seed)
    key = [int.from_bytes(raw_key[0:8], "little"), int.from_bytes(raw_key[8:16], "little")]
    length = min(chunk, m - block * chunk)
    raw = np.random.Philox(key=key, counter=list(block_counter(t, block, dtype))).random_raw(block_words(length, dtype))
    if dtype == torch.float64:
        u1 = ((raw[0::2] >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * 2.0 ** -53
        theta = (raw[1::2] >> np.uint64(11)).astype(np.float64) * (2.0 * math.pi * 2.0 ** -53)
    else:
        u1 = ((raw & np.uint64(0xFFFFFFFF)).astype(np.uint32).astype(np.float32) + np.float32(1.0)) * np.float32(2.0 ** -32)
        theta = (raw >> np.uint64(32)).astype(np.uint32).astype(np.float32) * np.float32(2.0 * math.pi * 2.0 ** -32)
    return raw, u1, theta


def draw_source(seed, t, m, j, dtype, chunk):
    """(words, sine?, u1, theta) behind Z[t, j]: in a block of length L with h = ceil(L / 2) pairs,
    coordinate i < h is pair i's cosine R cos(theta), i >= h pair i - h's sine R sin(theta),
    R = sqrt(-2 ln u1) (:func:`block_uniforms`)."""
    block, i = divmod(j, chunk)
    raw, u1, theta = block_uniforms(seed, t, m, block, dtype, chunk)
    half = u1.size
    pair, sine = (i - half, True) if i >= half else (i, False)
    words = tuple(int(w) for w in (raw[2 * pair: 2 * pair + 2] if dtype == torch.float64 else raw[pair: pair + 1]))
    return words, sine, float(u1[pair]), float(theta[pair])


class _Recorder:
    """A numpy ufunc that keeps a copy of every first argument it is called with."""

    def __init__(self, ufunc):
        self.ufunc, self.inputs = ufunc, []

    def __call__(self, x, *args, **kwargs):
        self.inputs.append(np.array(x, copy=True))
        return self.ufunc(x, *args, **kwargs)


def draw_tolerance(z: float, dtype) -> float:
    """|computed - exact| bound for z = sqrt(-2 ln u1) * cos(theta) (or sin) from exact inputs u1,
    theta, each of log / cos / sin within E = TRANSCENDENTAL_ULPS ulps (1 ulp <= 2u |x|), the
    factor -2 exact, sqrt and the product correctly rounded: ln u1 has relative error <= 2E u, the
    radius sqrt(-2 ln u1) <= (E + 1) u (sqrt halves it, and rounds), cos / sin <= 2E u, the
    product u: (3E + 2) u |z| to first order, one more u for the second-order terms (15 u |z|)."""
    return (3 * TRANSCENDENTAL_ULPS + 3) * unit_roundoff(dtype) * abs(z)


@pytest.mark.parametrize("pin", DRAW_PINS, ids=[f"{p[0]}-{i}" for i, p in enumerate(DRAW_PINS)])
def test_counter_based_draws_are_pinned(pin, monkeypatch):
    name, seed, t, m, chunk, (start, stop), j, words, sine, z_hex = pin
    dtype = getattr(torch, name)
    got_words, got_sine, u1, theta = draw_source(seed, t, m, j, dtype, chunk)
    assert (got_words, got_sine) == (words, sine)  # bit-exact on every machine
    exact = float.fromhex(z_hex)
    # the pin is the Box-Muller transform of these words' uniforms (independently: Python's libm)
    radius = math.sqrt(-2.0 * math.log(u1))
    assert abs(radius * (math.sin(theta) if sine else math.cos(theta)) - exact) <= draw_tolerance(exact, dtype)
    # seed_noise feeds log and cos exactly these uniforms (bit for bit) ...
    log, cos = _Recorder(np.log), _Recorder(np.cos)
    monkeypatch.setattr(np, "log", log)
    monkeypatch.setattr(np, "cos", cos)
    z = seed_noise(seed, t, m, dtype=dtype, start=start, stop=stop, chunk_size=chunk)
    monkeypatch.undo()
    _, block_u1, block_theta = block_uniforms(seed, t, m, j // chunk, dtype, chunk)
    assert any(x.dtype == block_u1.dtype and np.array_equal(x, block_u1) for x in log.inputs)
    assert any(x.dtype == block_theta.dtype and np.array_equal(x, block_theta) for x in cos.inputs)
    # ... and its Gaussian is the exact one up to the transcendental loops' rounding
    assert z.dtype == dtype and z.shape == (stop - start,)
    assert abs(z[j - start].item() - exact) <= draw_tolerance(exact, dtype), (z[j - start].item().hex(), z_hex)
    # whatever the kernels, a slice is the same slice of the whole row (one code path, one machine)
    assert torch.equal(z, seed_noise(seed, t, m, dtype=dtype, chunk_size=chunk)[start:stop])


def test_seed_noise_is_standard_normal_and_distinct_per_step():
    z = np.stack([seed_noise(7, t, 4000).numpy() for t in range(5)])
    assert abs(z.mean()) < 0.03 and abs(z.std() - 1.0) < 0.03
    # rows are different streams (no accidental reuse of a seed between steps or chunks)
    corr = np.corrcoef(z)
    assert np.max(np.abs(corr - np.eye(5))) < 0.06
    # a slice equals the same slice of the whole row, whatever the alignment
    full = seed_noise(7, 3, 1000, chunk_size=64)
    assert torch.equal(seed_noise(7, 3, 1000, start=100, stop=333, chunk_size=64), full[100:333])
    # different seeds give different noise
    assert not torch.equal(seed_noise(8, 3, 1000, chunk_size=64), full)


def test_blt_generator_independent_of_strategy_code():
    """Alg. 2.2 against an explicit Toeplitz C from Eq. 2.16 solved by numpy."""
    alpha, lam = np.array([0.4, 0.1, 0.05]), np.array([0.95, 0.6, 0.2])
    n = 12
    c = np.zeros(n)
    c[0] = 1.0
    for t in range(1, n):
        c[t] = np.sum(alpha * lam ** (t - 1))
    cmat = np.array([[c[i - j] if i >= j else 0.0 for j in range(n)] for i in range(n)])
    z = np.stack([seed_noise(3, t, 50, chunk_size=CHUNK).numpy() for t in range(n)])
    want = 0.5 * np.linalg.solve(cmat, z)
    gen = make_generator(BLT(alpha, lam, n), 50, noise_std=0.5, seed=3, dtype=torch.float64, chunk_size=CHUNK)
    assert np.max(np.abs(run(gen, n) - want)) < 1e-10


def test_dpcgd_generator_is_z_minus_beta_previous():
    gen = make_generator(DPCGD(0.8, 6), 40, noise_std=2.0, seed=11, dtype=torch.float64, chunk_size=CHUNK)
    got = run(gen, 6)
    z = np.stack([seed_noise(11, t, 40, chunk_size=CHUNK).numpy() for t in range(6)])
    want = 2.0 * (z - 0.8 * np.vstack([np.zeros((1, 40)), z[:-1]]))
    assert np.max(np.abs(got - want)) < 1e-12


def test_column_normalized_scales_rows_by_column_norms():
    base = BandedSqrt(N, 3)
    gen = make_generator(ColumnNormalized(base), M, noise_std=1.0, seed=2, dtype=torch.float64, chunk_size=CHUNK)
    plain = make_generator(base, M, noise_std=1.0, seed=2, dtype=torch.float64, chunk_size=CHUNK)
    got, ref = run(gen, N), run(plain, N)
    norms = np.sqrt((base.matrix() ** 2).sum(axis=0))
    np.testing.assert_allclose(got, norms[:, None] * ref, rtol=1e-13, atol=1e-13)


@given(st.integers(0, N), st.sampled_from(range(len(ALL))), st.sampled_from(DTYPES))
def test_seek_state_dict_and_checkpoint_resume_bit_exactly(t, idx, dtype):
    """On one machine, in one configuration, resuming is a promise of the same bits: seek(t), a
    state_dict loaded into another generator and a checkpoint written and read back all continue
    with exactly the rows of the uninterrupted run (which test_generator_equals_materialized
    checks against nu C^{-1} Z)."""
    strategy = ALL[idx]

    def fresh(seed=SEED):
        return make_generator(strategy, M, noise_std=NU, seed=seed, dtype=dtype, chunk_size=CHUNK)

    whole = run(fresh(), N)
    # fast-forward a fresh generator
    gen = fresh()
    gen.seek(t)
    np.testing.assert_array_equal(run(gen, N - t), whole[t:])
    # state at step t restored into a generator built with another seed that has already stepped
    gen = fresh()
    run(gen, t)
    state = gen.state_dict()
    other = fresh(seed=99)
    other.next_flat()
    other.load_state_dict(state)
    assert other.t == t and other.seed == SEED
    np.testing.assert_array_equal(run(other, N - t), whole[t:])
    # the same state through a checkpoint file (torch.save / torch.load)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restored = fresh(seed=5)
    restored.load_state_dict(torch.load(buf))
    np.testing.assert_array_equal(run(restored, N - t), whole[t:])
    # and the original keeps going as if nothing happened
    np.testing.assert_array_equal(run(gen, N - t), whole[t:])


def test_seek_backwards_replays():
    s = BLT([0.3, 0.1], [0.9, 0.4], N)
    gen = make_generator(s, M, seed=5, dtype=torch.float64, chunk_size=CHUNK)
    first = run(gen, 5)
    gen.seek(2)
    np.testing.assert_array_equal(run(gen, 3), first[2:5])


@pytest.mark.parametrize("strategy", [ToeplitzSqrt(N), BandedSqrt(N, 4), BLT([0.3], [0.8], N), DPCGD(0.5, N),
                                      ColumnNormalized(Banded(np.ones((N, 2))))],
                         ids=lambda s: s.label)
def test_shards_concatenate_to_full_noise(strategy):
    """Each shard is computed with kernels over its own length (vectorized bodies and tails cut
    elsewhere), so shards equal the unsharded noise up to rounding: both are nu C^{-1} Z."""
    pieces = []
    for start, stop in [(0, 13), (13, 40), (40, 41), (41, M)]:  # cut inside chunks on purpose
        gen = make_generator(strategy, M, noise_std=NU, seed=SEED, dtype=torch.float64,
                             chunk_size=CHUNK, shard=(start, stop))
        got = run(gen, N)
        assert got.shape == (N, stop - start)
        pieces.append(got)
    assert_stream(np.concatenate(pieces, axis=1), strategy, torch.float64)


def test_parameter_shapes_and_float32():
    shapes = [torch.empty(3, 4), (5,), torch.Size([2, 2, 2])]
    s = BandedSqrt(N, 3)
    gen = make_generator(s, shapes, noise_std=NU, seed=SEED, chunk_size=CHUNK)
    out = gen.next()
    assert [tuple(o.shape) for o in out] == [(3, 4), (5,), (2, 2, 2)]
    assert all(o.dtype == torch.float32 for o in out)
    # float32 noise is the float32 seed noise run through the same recursion
    z32 = seed_noise(SEED, 0, 25, dtype=torch.float32, chunk_size=CHUNK)
    flat = torch.cat([o.reshape(-1) for o in out])
    assert torch.allclose(flat, NU * z32, atol=1e-6)


@pytest.mark.parametrize("strategy", [BandedSqrt(N, 3), BLT([0.3], [0.8], N), Banded(np.ones((N, 3)))],
                         ids=lambda s: s.label)
def test_returned_tensor_is_not_retained(strategy):
    a = make_generator(strategy, M, seed=1, dtype=torch.float64, chunk_size=CHUNK)
    b = make_generator(strategy, M, seed=1, dtype=torch.float64, chunk_size=CHUNK)
    for _ in range(N):
        got = a.next_flat()
        kept = got.clone()
        got.mul_(0.0).add_(123.0)  # the caller scribbles over the noise it was given
        assert torch.equal(kept, b.next_flat())


@pytest.mark.parametrize("strategy", ALL, ids=[s.label for s in ALL])
@pytest.mark.parametrize("method", METHODS)
def test_a_row_is_written_again_only_once_nobody_holds_it(strategy, method):
    """A CPU generator writes a row it handed out again (no fresh model-size block per step: issue
    #27's BERT-base step), but only once nothing holds its memory. Rows the caller keeps -- the flat
    row of ``next_flat``, one parameter's view, a numpy array of another's, only its storage object
    or a weak reference to it (found in two reviews: the storage's own count did not see these;
    a typed storage: the next test) -- keep their
    values while later rows are drawn, and equal a generator's whose rows were each cloned at once
    (same code, same process: exactly); a row let go is the next row's memory, also after the rows
    kept for reuse were all held (the oldest is then forgotten)."""
    shapes = [(3, 5), (M - 15,)]
    kw = dict(noise_std=NU, seed=SEED, dtype=torch.float64, chunk_size=CHUNK, method=method)
    ref = make_generator(strategy, shapes, **kw)
    want = [[p.clone() for p in ref.next()] for _ in range(N)]
    gen, dropping = make_generator(strategy, shapes, **kw), make_generator(strategy, shapes, **kw)
    held, ptrs, dropped, weak = [], [], [], []
    for t in range(N):
        parts = gen.next() if t % 6 != 1 else gen.unflatten(flat := gen.next_flat())
        ptrs.append(parts[0].data_ptr())
        assert all(torch.equal(p, w) for p, w in zip(parts, want[t])), f"row {t}"
        if t % 6 == 1:
            held.append((t, None, flat))  # the flat row itself, written into the memory of row t - 1
            del flat
        elif t % 6 == 2:
            held.append((t, 1, parts[1]))  # a view of one parameter's part
        elif t % 6 == 3:
            held.append((t, 0, parts[0].numpy()))
        elif t % 6 == 4:
            weak.append((t, weakref.ref(parts[1].untyped_storage())))  # nothing else
        elif t % 6 == 5:
            held.append((t, None, parts[0].untyped_storage()))
        del parts  # t % 6 == 0: let go
        other = dropping.next()
        assert all(torch.equal(p, w) for p, w in zip(other, want[t])), f"row {t}, every row let go"
        dropped.append(other[0].data_ptr())
        del other
    whole = [torch.cat([w.reshape(-1) for w in row]) for row in want]
    for t, i, h in held:
        if i is not None:
            assert torch.equal(torch.as_tensor(h), want[t][i]), f"row {t} changed while held"
        elif isinstance(h, torch.Tensor):
            assert torch.equal(h, whole[t]), f"row {t} changed while held"
        else:
            storage = h.untyped() if hasattr(h, "untyped") else h
            values = torch.empty(0, dtype=torch.float64).set_(storage)[:M]
            assert torch.equal(values, whole[t]), f"row {t} changed while its storage was held"
    for t, ref_ in weak:  # a weak reference alone: the row it still reaches keeps its values
        storage = ref_()
        if storage is not None:
            values = torch.empty(0, dtype=torch.float64).set_(storage)[:M]
            assert torch.equal(values, whole[t]), f"row {t} changed while a weak reference reached it"
    if gen.kind != "tree":  # (the buffered tree returns a sum of its buffers: a fresh tensor)
        assert ptrs[1] == ptrs[0] and len(set(ptrs[1:7])) == 6 and ptrs[7] == ptrs[6], \
            "a row let go was not the next row's memory"
        assert len(set(dropped)) == 1


def test_a_row_held_by_its_typed_storage_is_not_written_again():
    """A typed ``storage()`` of a row (deprecated, but torch still hands it out) holds the row."""
    gen = make_generator(Identity(N), M, seed=SEED, dtype=torch.float64, chunk_size=CHUNK)
    row = gen.next_flat()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated
        typed = row.storage()
    want = row.clone()
    del row
    gen.next_flat()
    assert torch.equal(torch.empty(0, dtype=torch.float64).set_(typed.untyped())[:M], want)


def test_a_row_in_shared_memory_is_never_written_again():
    """A row moved to shared memory (torch.multiprocessing sends tensors that way) may be mapped by
    another process, whose holders the generator cannot count: it is let go, not written again."""
    gen = make_generator(Identity(N), M, seed=SEED, dtype=torch.float64, chunk_size=CHUNK)
    first = gen.next_flat()
    ptr = first.data_ptr()
    del first
    second = gen.next_flat()
    assert second.data_ptr() == ptr  # let go: written again
    second.share_memory_()
    shared = second.data_ptr()
    del second
    third = gen.next_flat()
    assert third.data_ptr() != shared and not third.is_shared()
    assert len(gen._rows) == 1 and gen._rows[0][0].data_ptr() != shared


def test_extra_memory_accounting():
    m = 1 << 18
    per_thread = scratch_bytes(DEFAULT_CHUNK, torch.float32, threads=1)
    assert per_thread == 5 * 4 * DEFAULT_CHUNK // 2 + 8 * DEFAULT_CHUNK // 2  # block + 3 half blocks + words
    big = 1 << 22
    dp = make_generator(DPCGD(0.9, 100), big, seed=0)
    dp.next_flat()
    dp.next_flat()
    # O(block) scratch per thread, nothing of size m (the row let go and written again is the row)
    assert dp.extra_memory_bytes() <= scratch_bytes(DEFAULT_CHUNK, torch.float32) < 4 * big // 2
    held = dp.next_flat()  # a row the caller holds: the next one is a second kept row, counted
    dp.next_flat()
    assert dp.extra_memory_bytes() == scratch_bytes(DEFAULT_CHUNK, torch.float32) + 4 * big
    del held
    band = make_generator(BandedSqrt(100, 16), m, seed=0)
    assert band.extra_memory_bytes() >= 15 * m * 4
    blt = make_generator(BLT([0.1] * 4, [0.9, 0.5, 0.3, 0.1], 100), m, seed=0)
    assert 4 * m * 4 <= blt.extra_memory_bytes() - scratch_bytes(DEFAULT_CHUNK, torch.float32) < 5 * m * 4
    assert make_generator(Identity(100), m, seed=0).extra_memory_bytes() == scratch_bytes(DEFAULT_CHUNK, torch.float32)


def test_bad_inputs_raise_corrnoise_errors():
    s = BandedSqrt(N, 3)
    with pytest.raises(CorrnoiseError, match="dim"):
        make_generator(s, 0)
    with pytest.raises(CorrnoiseError, match="noise_std"):
        make_generator(s, 10, noise_std=-1.0)
    with pytest.raises(CorrnoiseError, match="seed"):
        make_generator(s, 10, seed=-3)
    with pytest.raises(CorrnoiseError, match="shard"):
        make_generator(s, 10, shard=(5, 20))
    with pytest.raises(CorrnoiseError, match="method"):
        make_generator(s, 10, method="magic")
    with pytest.raises(CorrnoiseError, match="dtype"):
        make_generator(s, 10, dtype=torch.int32)
    with pytest.raises(CorrnoiseError, match="strategy"):
        make_generator("bsr:3", 10)
    gen = make_generator(s, 10, seed=1)
    state = gen.state_dict()
    other = make_generator(BandedSqrt(N, 4), 10, seed=1)
    with pytest.raises(CorrnoiseError, match="state"):
        other.load_state_dict(state)
    with pytest.raises(CorrnoiseError, match="state"):
        make_generator(s, 11, seed=1).load_state_dict(state)
    with pytest.raises(CorrnoiseError, match="t"):
        gen.seek(N + 1)


def test_bench_noise_command_json():
    import json

    from click.testing import CliRunner

    from corrnoise.cli import cli

    res = CliRunner().invoke(cli, ["bench", "noise", "--dim", "3000", "--steps", "3", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    rows = {r["mechanism"]: r for r in data["results"]}
    from corrnoise.noise.bench import REFERENCE_BLT4

    assert list(rows) == ["dpsgd", "bsr:4", "bsr:16", "bsr:64", REFERENCE_BLT4, "dpcgd:0.9", "bisr:8", "toeplitz-sqrt"]
    assert all(r["seconds_per_step"] > 0 for r in rows.values())
    assert rows["dpsgd"]["extra_memory_bytes"] == scratch_bytes(3000, torch.float32)  # one block of seed noise
    assert rows["bsr:16"]["extra_memory_bytes"] >= 15 * 3000 * 4
    assert rows[REFERENCE_BLT4]["extra_memory_bytes"] >= 4 * 3000 * 4
    assert rows["dpcgd:0.9"]["generator"] == "dpcgd" and rows["toeplitz-sqrt"]["generator"] == "regenerate"
    bad = CliRunner().invoke(cli, ["bench", "noise", "--dim", "10", "--mechanisms", "nope", "--json"])
    assert bad.exit_code != 0 and isinstance(bad.exception, CorrnoiseError)


@pytest.mark.parametrize("strategy", [DPCGD(0.6, 3), Prefix(3), ToeplitzSqrt(3)], ids=lambda s: s.label)
def test_large_rows_default_chunks(strategy):
    """m spanning several default chunks, cut into serial pieces by the regeneration adds."""
    m = 150_001
    gen = make_generator(strategy, m, noise_std=0.3, seed=8, dtype=torch.float64)
    got = run(gen, 3)
    z = np.stack([seed_noise(8, t, m).numpy() for t in range(3)])
    want = 0.3 * strategy.noising_matrix() @ z
    assert np.max(np.abs(got - want)) < 1e-10


@pytest.mark.parametrize("strategy", [s for s in ALL if s.rows == s.n], ids=[s.label for s in ALL if s.rows == s.n])
@pytest.mark.parametrize("method", ["auto", "regenerate"])
def test_numpy_operator_of_the_stream_equals_the_generator(strategy, method):
    """NoiseStream.operator (numpy, linalg) and the torch generator come from the same spec."""
    from corrnoise.linalg.streaming import run_stream

    stream = strategy.regeneration_stream() if method == "regenerate" else strategy.noise_stream()
    gen = make_generator(strategy, M, noise_std=NU, seed=SEED, dtype=torch.float64, chunk_size=CHUNK, method=method)
    assert gen.kind == stream.kind
    z = np.stack([seed_noise(SEED, tau, M, chunk_size=CHUNK).numpy() for tau in range(N)])
    want = NU * run_stream(stream.operator(N), z)
    np.testing.assert_allclose(run(gen, N), want, rtol=0, atol=1e-10 * max(1.0, np.max(np.abs(want))))
    np.testing.assert_allclose(want, materialized(strategy), rtol=0, atol=1e-10 * max(1.0, np.max(np.abs(want))))


def test_stream_kinds_follow_the_class_not_the_parent():
    """DPCGD subclasses BLT but states its own stream; column normalization wraps the base's."""
    assert DPCGD(0.5, N).noise_stream().kind == "dpcgd"
    assert BLT([0.3], [0.8], N).noise_stream().kind == "blt"
    assert Identity(N).noise_stream().kind == "iid"
    assert Identity(N).regeneration_stream().kind == "regenerate"
    cn = ColumnNormalized(DPCGD(0.5, N))
    stream = cn.noise_stream()
    assert stream.kind == "dpcgd" and stream.params == {"beta": 0.5}
    np.testing.assert_array_equal(stream.row_scale, cn.scale)
    assert BandedSqrt(N, 4).noise_stream().buffer_rows() == 3
    assert BLT([0.1, 0.2], [0.5, 0.6], N).noise_stream().buffer_rows() == 2
    with pytest.raises(CorrnoiseError, match="strategy"):
        cn.noise_stream().scaled(cn.scale)  # one level of scaling only


def test_new_strategy_subclass_falls_back_to_regeneration():
    """A Strategy subclass that does not override noise_stream gets memoryless regeneration of
    its own C^{-1}, and the noise is right (not some parent's recurrence)."""
    from corrnoise.linalg.streaming import DenseStream, run_stream
    from corrnoise.strategies import Strategy

    rng = np.random.default_rng(5)
    c = np.tril(rng.uniform(0.1, 0.5, size=(N, N))) + np.eye(N)

    class Custom(Strategy):
        kind = "custom"

        def __init__(self):
            self.n = N

        def matrix(self):
            return c.copy()

        def multiply_stream(self):
            return DenseStream(c)

        def inverse_stream(self):
            return DenseStream(c, inverse=True)

        @classmethod
        def from_params(cls, n, params, arrays):
            return cls()

    s = Custom()
    assert s.noise_stream().kind == "regenerate"
    assert s.closed_form_sensitivity_squared() is None and s.closed_form_prefix_errors_squared() is None
    for method in ("auto", "regenerate"):
        gen = make_generator(s, M, noise_std=NU, seed=SEED, dtype=torch.float64, chunk_size=CHUNK, method=method)
        assert isinstance(gen, RegenerateGenerator)
        got = run(gen, N)
        z = np.stack([seed_noise(SEED, tau, M, chunk_size=CHUNK).numpy() for tau in range(N)])
        want = NU * np.linalg.solve(c, z)
        assert np.max(np.abs(got - want)) <= 1e-10 * max(1.0, np.max(np.abs(want)))
        np.testing.assert_allclose(NU * run_stream(s.noise_stream().operator(N), z), want, atol=1e-10)
    # the same for a column-normalized wrapper around it
    gen = make_generator(ColumnNormalized(s), M, noise_std=NU, seed=SEED, dtype=torch.float64, chunk_size=CHUNK)
    assert isinstance(gen, RegenerateGenerator)
    np.testing.assert_allclose(run(gen, N), materialized(ColumnNormalized(s)), atol=1e-10)


def test_tree_stream_has_no_numpy_streaming_form():
    from corrnoise.strategies import Tree

    with pytest.raises(CorrnoiseError, match="streaming"):
        Tree(N).noise_stream().operator(N)


@pytest.mark.parametrize("mechanism, method", [("bsr:4", "regenerate"), ("toeplitz-sqrt", "auto"), ("tree", "auto"),
                                               ("dpcgd:0.9", "auto")])
def test_a_regenerating_generator_resumes_only_on_its_seed_stream(mechanism, method):
    """Review: a generator that regenerates earlier seed rows, resumed in another float width,
    rebuilt them from another stream (row 5 equalled a fresh float64 run's, not the float32 run's
    continuation; DP-CGD's z_{t-1} likewise): refused in one line. The same width resumes to the same rows; at step 0 no
    row was released, so any width is taken; a buffered generator (bsr:4's own recurrence) keeps
    what was released in its buffers and resumes in either."""
    from corrnoise.strategies import parse_strategy

    s = parse_strategy(mechanism, 10)
    gen = make_generator(s, 300, seed=7, dtype=torch.float32, method=method)
    assert gen.reads_past_seed_rows
    for _ in range(5):
        gen.next_flat()
    state = gen.state_dict()
    with pytest.raises(CorrnoiseError, match="noise dtype torch.float32, this generator's is torch.float64") as err:
        make_generator(s, 300, seed=7, dtype=torch.float64, method=method).load_state_dict(state)
    assert err.value.param == "state" and "\n" not in str(err.value)
    same = make_generator(s, 300, seed=7, dtype=torch.float32, method=method)
    same.load_state_dict(state)
    assert torch.equal(same.next_flat(), gen.next_flat())
    fresh = make_generator(s, 300, seed=7, dtype=torch.float32, method=method).state_dict()
    make_generator(s, 300, seed=7, dtype=torch.float64, method=method).load_state_dict(fresh)
    buffered = make_generator(parse_strategy("bsr:4", 10), 300, seed=7, dtype=torch.float32)
    assert not buffered.reads_past_seed_rows
    for _ in range(5):
        buffered.next_flat()
    make_generator(parse_strategy("bsr:4", 10), 300, seed=7, dtype=torch.float64).load_state_dict(
        buffered.state_dict())
