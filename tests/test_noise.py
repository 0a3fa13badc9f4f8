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
    TreeGenerator,
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
    "bsr": BandedGenerator, "bisr": RegenerateGenerator, "dpcgd": DPCGDGenerator, "blt": BLTGenerator, "toeplitz": RegenerateGenerator,
    "dense": RegenerateGenerator, "banded": BandedGenerator, "tree": RegenerateGenerator,
    "online-tree": TreeGenerator,
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


# --- the noise stream each strategy states (Strategy.noise_stream, issue #9 item 5) -------------
# Computed on main before the dispatch moved into Strategy.noise_stream(), with the
# isinstance-chain make_generator: the refactor must leave every stream bit-identical.
# (Exact bits of the banded/BLT rows come from torch's CPU addmv; re-pin only on purpose.)
PINNED = {  # label|method|dtype: (generator kind, sha256[:24] of the n x m rows, float.hex of row n-1, col 5)
    'identity|auto|float64': ('iid', '4a84ba6303388e64fa5b7bdf', '-0x1.2737f5e432ef9p-4'),
    'identity|auto|float32': ('iid', 'f651e3907ffc1974cedee070', '-0x1.f6c6da0000000p-2'),
    'identity|regenerate|float64': ('regenerate', '4a84ba6303388e64fa5b7bdf', '-0x1.2737f5e432ef9p-4'),
    'identity|regenerate|float32': ('regenerate', 'f651e3907ffc1974cedee070', '-0x1.f6c6da0000000p-2'),
    'prefix|auto|float64': ('regenerate', 'd3f189e7025aa9dd85de8cb0', '0x1.e091efaf81107p+1'),
    'prefix|auto|float32': ('regenerate', '7964ba49f2c4dc53c044efe1', '-0x1.d615060000000p+0'),
    'prefix|regenerate|float64': ('regenerate', 'd3f189e7025aa9dd85de8cb0', '0x1.e091efaf81107p+1'),
    'prefix|regenerate|float32': ('regenerate', '7964ba49f2c4dc53c044efe1', '-0x1.d615060000000p+0'),
    'toeplitz-sqrt|auto|float64': ('regenerate', '5eb2b051cedb2f13e64016ad', '0x1.07729e8c9c13dp+1'),
    'toeplitz-sqrt|auto|float32': ('regenerate', 'f2c38da59172b727536ef3e0', '-0x1.89f7dc0000000p+0'),
    'toeplitz-sqrt|regenerate|float64': ('regenerate', '5eb2b051cedb2f13e64016ad', '0x1.07729e8c9c13dp+1'),
    'toeplitz-sqrt|regenerate|float32': ('regenerate', 'f2c38da59172b727536ef3e0', '-0x1.89f7dc0000000p+0'),
    'bsr:4|auto|float64': ('banded', '42855301de969e9dcb59e9a6', '0x1.15f310dc0f15cp+1'),
    'bsr:4|auto|float32': ('banded', 'bf2a21f6a09346d066c1b121', '-0x1.e61fdc0000000p+0'),
    'bsr:4|regenerate|float64': ('regenerate', 'd97c99d15efd8e40f8dafe6b', '0x1.15f310dc0f15cp+1'),
    'bsr:4|regenerate|float32': ('regenerate', 'e70b88d6340e3cb1a14cd21d', '-0x1.e61fdc0000000p+0'),
    'bisr:3|auto|float64': ('regenerate', '510a6310bde13e33b5584df2', '0x1.067b32d24a62cp+1'),
    'bisr:3|auto|float32': ('regenerate', '26c62d72d271ea71917ed194', '-0x1.84b8f80000000p+0'),
    'bisr:3|regenerate|float64': ('regenerate', '510a6310bde13e33b5584df2', '0x1.067b32d24a62cp+1'),
    'bisr:3|regenerate|float32': ('regenerate', '26c62d72d271ea71917ed194', '-0x1.84b8f80000000p+0'),
    'dpcgd:0.6|auto|float64': ('dpcgd', '208a8d6e6832d064a4ea5a5e', '0x1.1ca6dcbcd99a1p+1'),
    'dpcgd:0.6|auto|float32': ('dpcgd', '49cee5724137bb0d4e1274b6', '-0x1.4c53b20000000p+0'),
    'dpcgd:0.6|regenerate|float64': ('regenerate', '208a8d6e6832d064a4ea5a5e', '0x1.1ca6dcbcd99a1p+1'),
    'dpcgd:0.6|regenerate|float32': ('regenerate', '49cee5724137bb0d4e1274b6', '-0x1.4c53b20000000p+0'),
    'blt(d=2)|auto|float64': ('blt', '28ed2e046e8b6a8a06e6bbd4', '0x1.899c88feaaab8p-1'),
    'blt(d=2)|auto|float32': ('blt', 'dcb66d7137edad3f2eead2ec', '-0x1.d347960000000p-1'),
    'blt(d=2)|regenerate|float64': ('regenerate', '8bfde2b482a603b8dcf54cf7', '0x1.899c88feaaab7p-1'),
    'blt(d=2)|regenerate|float32': ('regenerate', '1d30dd976263980340a445e7', '-0x1.d347920000000p-1'),
    'toeplitz|auto|float64': ('regenerate', 'cca4cc0943631b7f2fc6a0d6', '-0x1.a10bdb999ffc0p-4'),
    'toeplitz|auto|float32': ('regenerate', 'f38ab389431ad827ab38b59e', '-0x1.1baf880000000p+1'),
    'toeplitz|regenerate|float64': ('regenerate', 'cca4cc0943631b7f2fc6a0d6', '-0x1.a10bdb999ffc0p-4'),
    'toeplitz|regenerate|float32': ('regenerate', 'f38ab389431ad827ab38b59e', '-0x1.1baf880000000p+1'),
    'dense|auto|float64': ('regenerate', '9308dec5151ff5e27dd246e6', '-0x1.3588a38fef727p+4'),
    'dense|auto|float32': ('regenerate', '8e9a9457e6ba756ac7cdda21', '-0x1.eeb8580000000p+3'),
    'dense|regenerate|float64': ('regenerate', '9308dec5151ff5e27dd246e6', '-0x1.3588a38fef727p+4'),
    'dense|regenerate|float32': ('regenerate', '8e9a9457e6ba756ac7cdda21', '-0x1.eeb8580000000p+3'),
    'banded|auto|float64': ('banded', '3e88aa74f292226d6f5ff525', '0x1.7eb9aa1021e6cp+0'),
    'banded|auto|float32': ('banded', 'fc8ec0e7e64d6a7889233b3b', '-0x1.ab4a3e0000000p+0'),
    'banded|regenerate|float64': ('regenerate', '90ee7388d52cf7e0b3e8d8e8', '0x1.7eb9aa1021e72p+0'),
    'banded|regenerate|float32': ('regenerate', '4b780b0567f0fcaa2806eff6', '-0x1.ab4a4c0000000p+0'),
    'tree:full|auto|float64': ('regenerate', 'b1993a1c1c6ac19105c39ae1', '-0x1.5912ed2b87298p-3'),
    'tree:full|auto|float32': ('regenerate', '5d3d1bd14c7fde6f506f686e', '0x1.b147080000000p-1'),
    'tree:full|regenerate|float64': ('regenerate', 'b1993a1c1c6ac19105c39ae1', '-0x1.5912ed2b87298p-3'),
    'tree:full|regenerate|float32': ('regenerate', '5d3d1bd14c7fde6f506f686e', '0x1.b147080000000p-1'),
    'tree|auto|float64': ('tree', 'b58861e258c087021da07adc', '0x1.e4e9384d5e8a0p-2'),
    'tree|auto|float32': ('tree', '8edb2c7df16785a9a028a8fa', '0x1.2a7e8c0000000p+1'),
    'tree|regenerate|float64': ('tree', 'b58861e258c087021da07adc', '0x1.e4e9384d5e8a0p-2'),
    'tree|regenerate|float32': ('tree', '8edb2c7df16785a9a028a8fa', '0x1.2a7e8c0000000p+1'),
    'tree:ls|auto|float64': ('tree', 'be7e5bf832ac9b78972c34c6', '0x1.e4e9384d5e8a0p-2'),
    'tree:ls|auto|float32': ('tree', 'f9af70b2928703e9e75e3a76', '0x1.2a7e8c0000000p+1'),
    'tree:ls|regenerate|float64': ('regenerate', 'db40c302a6fc51d8392d06eb', '0x1.e4e9384d5e8a0p-2'),
    'tree:ls|regenerate|float32': ('regenerate', 'a24b44d693ba5bb109e01f64', '0x1.2a7e8c0000000p+1'),
    'toeplitz-sqrt+colnorm|auto|float64': ('regenerate', 'ad625bd95eb3ca196cbaef90', '0x1.07729e8c9c13dp+1'),
    'toeplitz-sqrt+colnorm|auto|float32': ('regenerate', '8753ea92a80b23f3b078827d', '-0x1.89f7dc0000000p+0'),
    'toeplitz-sqrt+colnorm|regenerate|float64': ('regenerate', 'ad625bd95eb3ca196cbaef90', '0x1.07729e8c9c13dp+1'),
    'toeplitz-sqrt+colnorm|regenerate|float32': ('regenerate', '8753ea92a80b23f3b078827d', '-0x1.89f7dc0000000p+0'),
    'banded+colnorm|auto|float64': ('banded', 'a578a5b2f106f1eeef954602', '0x1.559edb79c272bp+0'),
    'banded+colnorm|auto|float32': ('banded', '8653f6f28cc7f56c09d17adf', '-0x1.7d66280000000p+0'),
    'banded+colnorm|regenerate|float64': ('regenerate', '9c84de6ab01e9441899a8048', '0x1.559edb79c2731p+0'),
    'banded+colnorm|regenerate|float32': ('regenerate', 'b7fa27ec1911172a4100289c', '-0x1.7d66340000000p+0'),
    'blt(d=1)+colnorm|auto|float64': ('blt', '172a160ed653e315184c23f7', '0x1.561c6bcf82a10p+0'),
    'blt(d=1)+colnorm|auto|float32': ('blt', 'ec0edd556de97d689872f643', '-0x1.3f608c0000000p+0'),
    'blt(d=1)+colnorm|regenerate|float64': ('regenerate', '633474683acfdc6a6dacc6a6', '0x1.561c6bcf82a10p+0'),
    'blt(d=1)+colnorm|regenerate|float32': ('regenerate', '39d0423c90800a1deee7a55b', '-0x1.3f608a0000000p+0'),
    'dense+colnorm|auto|float64': ('regenerate', '9d22b7c0ed0e3ce44ce84f3e', '-0x1.ac90a9236a7d8p+4'),
    'dense+colnorm|auto|float32': ('regenerate', 'c7b3ab9265e3fdfee3fd0b6b', '-0x1.567b820000000p+4'),
    'dense+colnorm|regenerate|float64': ('regenerate', '9d22b7c0ed0e3ce44ce84f3e', '-0x1.ac90a9236a7d8p+4'),
    'dense+colnorm|regenerate|float32': ('regenerate', 'c7b3ab9265e3fdfee3fd0b6b', '-0x1.567b820000000p+4'),
}


def _pinned_rows(strategy, method, dtype):
    import hashlib

    gen = make_generator(strategy, M, noise_std=NU, seed=SEED, dtype=dtype, chunk_size=CHUNK, method=method)
    rows = run(gen, N)
    return gen.kind, hashlib.sha256(rows.tobytes()).hexdigest()[:24], float(rows[N - 1, 5]).hex()


@pytest.mark.parametrize("strategy", ALL, ids=[s.label for s in ALL])
@pytest.mark.parametrize("method", ["auto", "regenerate"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_noise_streams_are_bit_identical_to_the_pinned_ones(strategy, method, dtype):
    key = f"{strategy.label}|{method}|{str(dtype)[6:]}"
    assert _pinned_rows(strategy, method, dtype) == PINNED[key]


def test_pins_cover_every_kind():
    labels = {k.split("|")[0] for k in PINNED}
    assert labels == {s.label for s in ALL} and len(PINNED) == 4 * len(ALL)
    for name in ("identity", "bsr:4", "blt(d=2)", "dpcgd:0.6", "toeplitz-sqrt", "dense", "tree", "tree:ls", "tree:full",
                 "banded+colnorm", "blt(d=1)+colnorm", "dense+colnorm", "toeplitz-sqrt+colnorm"):
        assert name in labels, name


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
