"""Streaming noise generators against the materialized nu * C^{-1} Z (float64, 1e-10)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import random_strategies
from corrnoise.errors import CorrnoiseError
from corrnoise.noise.seeds import DEFAULT_CHUNK, scratch_bytes
from corrnoise.noise import (
    BandedGenerator,
    BLTGenerator,
    DPCGDGenerator,
    IidGenerator,
    RegenerateGenerator,
    make_generator,
    seed_noise,
)
from corrnoise.strategies import (
    BLT, DPCGD, Banded, BandedSqrt, ColumnNormalized, Identity, Prefix, ToeplitzSqrt,
)

N, M, CHUNK, SEED, NU = 9, 70, 16, 1234, 1.7


def materialized(strategy, m=M, seed=SEED, nu=NU, chunk=CHUNK, start=0, stop=None):
    """nu * C^{-1} Z with Z[tau] = seed_noise(seed, tau, m) built row by row (independent path)."""
    z = np.stack([seed_noise(seed, tau, m, chunk_size=chunk).numpy() for tau in range(strategy.rows)])
    noise = nu * strategy.noising_matrix() @ z
    return noise[:, start:stop]


def run(gen, steps):
    rows = [gen.next_flat().numpy() for _ in range(steps)]
    return np.stack(rows) if rows else np.zeros((0, gen.size))


ALL = random_strategies(N, seed=3)
EXPECTED_KIND = {
    "identity": IidGenerator, "prefix": RegenerateGenerator, "toeplitz-sqrt": RegenerateGenerator,
    "bsr": BandedGenerator, "dpcgd": DPCGDGenerator, "blt": BLTGenerator, "toeplitz": RegenerateGenerator,
    "dense": RegenerateGenerator, "banded": BandedGenerator, "tree": RegenerateGenerator,
}


@pytest.mark.parametrize("strategy", ALL, ids=[s.label for s in ALL])
@pytest.mark.parametrize("method", ["auto", "regenerate"])
def test_generator_equals_materialized(strategy, method):
    gen = make_generator(strategy, M, noise_std=NU, seed=SEED, dtype=torch.float64,
                         chunk_size=CHUNK, method=method)
    if method == "auto" and not strategy.column_normalized:
        assert isinstance(gen, EXPECTED_KIND[strategy.kind])
    got = run(gen, N)
    want = materialized(strategy)
    assert np.max(np.abs(got - want)) <= 1e-10 * max(1.0, np.max(np.abs(want)))
    # The generator refuses step n, naming the steps.
    with pytest.raises(CorrnoiseError) as err:
        gen.next()
    assert err.value.param == "steps"


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


@given(st.integers(0, N), st.sampled_from(range(len(ALL))))
def test_seek_and_state_dict_reproduce(t, idx):
    strategy = ALL[idx]
    want = materialized(strategy)
    # fast-forward a fresh generator
    gen = make_generator(strategy, M, noise_std=NU, seed=SEED, dtype=torch.float64, chunk_size=CHUNK)
    gen.seek(t)
    rest = run(gen, N - t)
    np.testing.assert_allclose(rest, want[t:], atol=1e-10)
    # checkpoint at step t and restore into a generator built with another seed
    gen = make_generator(strategy, M, noise_std=NU, seed=SEED, dtype=torch.float64, chunk_size=CHUNK)
    run(gen, t)
    state = gen.state_dict()
    other = make_generator(strategy, M, noise_std=NU, seed=99, dtype=torch.float64, chunk_size=CHUNK)
    other.next_flat()
    other.load_state_dict(state)
    assert other.t == t and other.seed == SEED
    rest2 = run(other, N - t)
    np.testing.assert_allclose(rest2, want[t:], atol=1e-10)


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
    want = materialized(strategy)
    pieces = []
    for start, stop in [(0, 13), (13, 40), (40, 41), (41, M)]:  # cut inside chunks on purpose
        gen = make_generator(strategy, M, noise_std=NU, seed=SEED, dtype=torch.float64,
                             chunk_size=CHUNK, shard=(start, stop))
        pieces.append(run(gen, N))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), want, atol=1e-10)


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


def test_extra_memory_accounting():
    m = 1 << 18
    per_thread = scratch_bytes(DEFAULT_CHUNK, torch.float32, threads=1)
    assert per_thread == 5 * 4 * DEFAULT_CHUNK // 2 + 8 * DEFAULT_CHUNK // 2  # block + 3 half blocks + words
    big = 1 << 22
    dp = make_generator(DPCGD(0.9, 100), big, seed=0)
    dp.next_flat(), dp.next_flat()
    # O(block) scratch per thread, nothing of size m
    assert dp.extra_memory_bytes() <= scratch_bytes(DEFAULT_CHUNK, torch.float32) < 4 * big // 2
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
    assert list(rows) == ["dpsgd", "banded:4", "banded:16", "banded:64", "blt:4", "dpcgd", "toeplitz"]
    assert all(r["seconds_per_step"] > 0 for r in rows.values())
    assert rows["dpsgd"]["extra_memory_bytes"] == scratch_bytes(3000, torch.float32)  # one block of seed noise
    assert rows["banded:16"]["extra_memory_bytes"] >= 15 * 3000 * 4
    assert rows["blt:4"]["extra_memory_bytes"] >= 4 * 3000 * 4
    assert rows["dpcgd"]["generator"] == "dpcgd" and rows["toeplitz"]["generator"] == "regenerate"
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
