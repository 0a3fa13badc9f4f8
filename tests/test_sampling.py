"""Batch samplers: inclusion rates, participation patterns, fixed sizes, DataLoader use."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from corrnoise.errors import CorrnoiseError
from corrnoise.participation import parse_participation
from corrnoise.sampling import (
    BallsInBinsSampler,
    BlockCyclicPoissonSampler,
    CyclicSampler,
    MinSepSampler,
    PoissonSampler,
    make_sampler,
)


def membership(sampler):
    """(steps, N) 0/1 matrix of who is in which batch (padding entries ignored)."""
    x = np.zeros((sampler.steps, sampler.num_examples), dtype=np.int64)
    for t, batch in enumerate(sampler):
        real = [i for i in batch if i < sampler.num_examples]
        assert len(set(real)) == len(real), "an example appears twice in one batch"
        x[t, real] = 1
    return x


def binomial_z(count, trials, p):
    return (count - trials * p) / math.sqrt(trials * p * (1 - p))


def test_poisson_inclusion_rate_and_independence():
    s = PoissonSampler(500, 0.1, 400, seed=1)
    x = membership(s)
    assert abs(binomial_z(x.sum(), x.size, 0.1)) < 4.5
    # every example's rate, and independence across steps: P(in t and t+1) = p^2
    per_example = x.mean(axis=0)
    assert np.all(np.abs(per_example - 0.1) < 6 * math.sqrt(0.09 / 400))
    both = (x[1:] * x[:-1]).sum()
    assert abs(binomial_z(both, x[1:].size, 0.01)) < 4.5
    # batch sizes are Binomial(N, p): variance N p (1 - p)
    sizes = x.sum(axis=1)
    assert abs(sizes.var() / (500 * 0.09) - 1) < 0.25
    assert s.accounting == "poisson:0.1" and s.steps == len(s) == 400
    assert s.batching().spec == "poisson:0.1"


def test_poisson_reproducible_and_resumable():
    a = list(PoissonSampler(100, 0.2, 30, seed=9))
    b = PoissonSampler(100, 0.2, 30, seed=9)
    assert a == list(b)
    b.start_step = 12
    assert list(b) == a[12:] and len(b) == 18
    assert a != list(PoissonSampler(100, 0.2, 30, seed=10))


def test_block_cyclic_blocks_and_rates():
    N, blocks, p, n = 600, 3, 0.2, 300
    s = BlockCyclicPoissonSampler(N, blocks, p, n, seed=4)
    x = membership(s)
    sizes = [len(b) for b in s.block_indices]
    assert sorted(np.concatenate(s.block_indices).tolist()) == list(range(N))
    assert all(abs(binomial_z(size, N, 1 / blocks)) < 4.5 for size in sizes)  # each example's own uniform draw
    for t in range(n):
        outside = np.setdiff1d(np.arange(N), s.block_indices[t % blocks])
        assert x[t, outside].sum() == 0  # only the block of step t is sampled
    # within its block, every example has rate p in the steps of its block
    for k in range(blocks):
        rows = x[k::blocks][:, s.block_indices[k]]
        assert abs(binomial_z(rows.sum(), rows.size, p)) < 4.5
    assert s.accounting == "block-cyclic:3:0.2" and s.participation == "minsep:100:3"
    assert s.block_of(int(s.block_indices[2][5])) == 2
    assert s.batching().spec == "block-cyclic:3:0.2"


def test_block_cyclic_adding_an_example_moves_no_other_example():
    """The block-cyclic analyses assume neighbouring datasets differ only in the added example's
    rounds: its blocks must not depend on N (a split of one shuffle into equal blocks did)."""
    for n_examples in (4, 57, 600):
        before = BlockCyclicPoissonSampler(n_examples, 2 if n_examples == 4 else 5, 0.3, 10, seed=11)
        after = BlockCyclicPoissonSampler(n_examples + 1, before.blocks, 0.3, 10, seed=11)
        assert [after.block_of(j) for j in range(n_examples)] == [before.block_of(j) for j in range(n_examples)]


def test_cyclic_fixed_order():
    s = CyclicSampler(103, 10, epochs=3, seed=2)
    x = membership(s)
    assert s.steps == 30 and s.batches_per_epoch == 10 and s.unused == 3
    assert all(len(b) == 10 for b in s)
    epoch = [tuple(s.batch(t)) for t in range(10)]
    assert [tuple(s.batch(t)) for t in range(10, 20)] == epoch  # same batches, same order
    assert len(set(i for b in epoch for i in b)) == 100  # a partition of 100 of the 103 examples
    # every used example participates exactly once per epoch, at steps l, l + b, l + 2b
    pattern = parse_participation(s.participation)
    allowed = set(pattern.patterns(s.steps))
    for i in range(103):
        steps = tuple(np.flatnonzero(x[:, i]))
        assert steps == () or steps in allowed
    assert s.participation == "cyclic:3:10" and s.accounting == "none"
    assert s.batching().participation.spec == "cyclic:3:10"


@pytest.mark.parametrize("batch_size", [None, 7, 12])
def test_balls_in_bins(batch_size):
    N, bins, n = 90, 9, 27
    s = BallsInBinsSampler(N, bins, n, batch_size=batch_size, seed=3)
    x = membership(s)
    # each example sits in exactly one bin, the same for every epoch
    homes = [np.flatnonzero(x[:bins, i]) for i in range(N)]
    if batch_size is None:
        assert all(h.size == 1 for h in homes)
        for i in range(N):
            assert np.array_equal(np.flatnonzero(x[:, i]), np.arange(homes[i][0], n, bins))
    for t, batch in enumerate(s):
        if batch_size is not None:
            assert len(batch) == batch_size  # always exactly B
        assert set(i for i in batch if i < N) <= set(s.bin_indices[t % bins].tolist())
    rep = s.padding_report()
    if batch_size is not None:
        pads = sum(sum(1 for i in b if i >= N) for b in s)
        real = int(x.sum())
        assert rep["padded"] == pads
        assert rep["dropped"] == sum(s.bin_sizes[t % bins] for t in range(n)) - real
        assert rep["slots"] == n * batch_size == pads + real
    assert s.accounting == "balls-in-bins:9" and s.participation == "cyclic:3:9"


def test_balls_in_bins_uniform_bins():
    s = BallsInBinsSampler(20000, 8, 8, seed=0)
    counts = s.bin_sizes
    chi2 = float(((counts - 2500) ** 2 / 2500).sum())
    assert chi2 < 30  # chi^2 with 7 degrees of freedom: p < 1e-4 beyond 30


def test_fixed_size_balls_in_bins_with_dataloader():
    N = 40
    data = TensorDataset(torch.arange(N, dtype=torch.float64).reshape(N, 1))
    s = BallsInBinsSampler(N, 4, 8, batch_size=12, seed=5)
    loader = DataLoader(s.wrap_dataset(data), batch_sampler=s)
    seen = 0
    for (xb,), weight in loader:
        assert xb.shape == (12, 1) and weight.shape == (12,)
        seen += int(weight.sum())
        # padding rows carry weight 0, real rows weight 1
        assert set(weight.tolist()) <= {0.0, 1.0}
    assert seen == 8 * 12 - s.padding_report()["padded"]
    # a plain dataset cannot silently use padding entries
    if s.padding_report()["padded"]:
        with pytest.raises(IndexError):
            for _ in DataLoader(data, batch_sampler=s):
                pass


def test_minsep_patterns_are_in_the_schema():
    N, k, b, n = 300, 3, 5, 20
    s = MinSepSampler(N, k, b, n, jitter=3, seed=6)
    x = membership(s)
    for i in range(N):
        steps = np.flatnonzero(x[:, i])
        assert 1 <= steps.size <= k
        assert np.all(np.diff(steps) >= b)
        assert tuple(steps) == s.patterns[i]
    assert any(np.any(np.diff(p) > b) for p in s.patterns)  # the jitter is used
    assert s.participation == "minsep:3:5" and s.accounting == "none"
    cyc = MinSepSampler(50, 4, 5, 20, jitter=0, seed=1)
    assert all(np.all(np.diff(p) == 5) and len(p) == 4 for p in cyc.patterns)


def test_poisson_in_dataloader():
    data = TensorDataset(torch.arange(50.0))
    s = PoissonSampler.from_batch_size(50, 10, 5, seed=0)
    assert all(len(b) for b in s)  # this seed has no empty batch (default_collate rejects [])
    got = [sorted(xb.long().tolist()) for (xb,) in DataLoader(data, batch_sampler=s)]
    assert got == [list(b) for b in s]
    assert s.p == pytest.approx(0.2)


def test_bad_sampler_inputs():
    with pytest.raises(CorrnoiseError, match="p"):
        PoissonSampler(10, 1.5, 3)
    with pytest.raises(CorrnoiseError, match="num_examples"):
        PoissonSampler(0, 0.5, 3)
    with pytest.raises(CorrnoiseError, match="blocks"):
        BlockCyclicPoissonSampler(10, 11, 0.5, 3)
    with pytest.raises(CorrnoiseError, match="batch_size"):
        CyclicSampler(10, 11, steps=3)
    with pytest.raises(CorrnoiseError, match="bins"):
        BallsInBinsSampler(10, 5, 3)
    with pytest.raises(CorrnoiseError, match="participation"):
        MinSepSampler(10, 5, 5, 20)  # (k - 1) b >= n
    with pytest.raises(CorrnoiseError, match="step"):
        PoissonSampler(10, 0.5, 3).batch(3)


def _every_kind(seed):
    return [PoissonSampler(60, 0.2, 12, seed=seed), BlockCyclicPoissonSampler(60, 3, 0.3, 12, seed=seed),
            CyclicSampler(60, 8, steps=12, seed=seed), BallsInBinsSampler(60, 6, 12, seed=seed),
            BallsInBinsSampler(60, 6, 12, batch_size=9, seed=seed), MinSepSampler(60, 3, 4, 12, jitter=1, seed=seed)]


def test_seed_defaults_to_os_entropy_and_reseed_rebuilds_the_seeded_sampler():
    """An amplified guarantee assumes the sampler seed is secret: without a seed each sampler
    draws its own from the OS (two samplers differ); reseed(s) gives exactly the batches, and
    the state fixed at construction, of the sampler built with s (a resumed run continues them)."""
    a, b = _every_kind(None), _every_kind(None)
    for x, y in zip(a, b):
        assert x.seed != y.seed and 0 <= x.seed < 2 ** 63
        assert x.amplified == (x.accounting != "none")
        y.reseed(x.seed)
        assert [y.batch(t) for t in range(12)] == [x.batch(t) for t in range(12)], type(x).__name__
        assert {**y.describe(), "seed": y.seed} == {**x.describe(), "seed": x.seed}
    assert [s.amplified for s in a] == [True, True, False, True, True, False]
    with pytest.raises(CorrnoiseError, match="seed"):
        a[0].reseed(-1)


# --- the sampler of a batching name (make_sampler) ----------------------------------------------
def test_balls_in_bins_from_epochs_runs_whole_epochs_when_the_batch_does_not_divide_the_data():
    sampler = make_sampler("balls-in-bins", 1, 1437, 256, epochs=2)  # 1437 / 256 = 5.6: 5 bins
    assert (sampler.steps, sampler.bins) == (10, 5)
    with pytest.raises(CorrnoiseError) as e:
        make_sampler("balls-in-bins", 1, 1437, 256, epochs=1.5)
    assert e.value.param == "epochs"
