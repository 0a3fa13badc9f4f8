"""Sharded noise across 2 gloo processes equals single-process noise (tutorial Sec. 4.4.5), up to the
rounding of kernels run over each rank's shard (tests/noise_bounds.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from corrnoise.errors import CorrnoiseError
from corrnoise.noise import make_generator, seed_noise
from corrnoise.strategies import BLT, DPCGD, Identity, parse_strategy
from corrnoise.torch.distributed import shard_bounds
from conftest import free_port, spawn_ranks
from noise_bounds import stream_mismatch

M, STEPS, CHUNK, SEED = 37, 5, 8, 1234  # shards cut seed chunks: 37 = 19 + 18, chunks of 8


def _strategies():
    return {
        "identity": Identity(STEPS),
        "bsr:3": parse_strategy("bsr:3", STEPS),
        "blt": BLT([0.3, 0.1], [0.8, 0.4], STEPS),
        "dpcgd": DPCGD(0.7, STEPS),
        "toeplitz-sqrt": parse_strategy("toeplitz-sqrt", STEPS),  # regeneration
    }


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from corrnoise.torch.distributed import DistributedPrivatizer, ShardedNoise

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = {}
        for name, strategy in _strategies().items():
            gen = ShardedNoise(strategy, M, noise_std=1.5, seed=SEED, dtype=torch.float64, chunk_size=CHUNK)
            rows[name] = torch.stack([gen.next_flat() for _ in range(STEPS)])
        # data parallel: each rank sums its own examples; all ranks end with the same g_hat
        shapes = [torch.empty(5, 3), torch.empty(22)]
        priv = DistributedPrivatizer.for_parameters(parse_strategy("bsr:3", STEPS), shapes, noise_std=2.0, clip_norm=0.5,
                                                    expected_batch_size=8.0, seed=SEED, chunk_size=CHUNK)
        sums = [torch.full((5, 3), float(rank + 1)), torch.full((22,), -float(rank + 1))]
        ghat = priv.privatize(sums)
        torch.save({"rows": rows, "ghat": [g.clone() for g in ghat]}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_shard_bounds_partition():
    for m in (1, 7, 37, 100):
        for world in range(1, min(m, 6) + 1):
            bounds = [shard_bounds(m, world, r) for r in range(world)]
            assert bounds[0][0] == 0 and bounds[-1][1] == m
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [b - a for a, b in bounds]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(CorrnoiseError, match="rank"):
        shard_bounds(10, 2, 2)


def test_local_batches_partition_the_global_batch():
    from corrnoise.torch.distributed import local_batch

    batch = [3, 9, 11, 20, 21]
    parts = [local_batch(batch, r, 3) for r in range(3)]
    assert sorted(sum(parts, [])) == batch and parts[0] == [3, 20]


def test_sharded_noise_needs_process_group():
    from corrnoise.torch.distributed import ShardedNoise

    with pytest.raises(CorrnoiseError, match="distributed"):
        ShardedNoise(Identity(3), 10, seed=1)


def test_two_gloo_processes_gather_single_process_noise(tmp_path):
    spawn_ranks(_worker, (2, free_port(), str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, strategy in _strategies().items():
        single = make_generator(strategy, M, noise_std=1.5, seed=SEED, dtype=torch.float64, chunk_size=CHUNK)
        expected = torch.stack([single.next_flat() for _ in range(STEPS)])
        # independent: the materialized C^{-1} times the seed noise rows. A rank runs its kernels
        # over its own shard (another length, one thread), so the assembled rows equal the
        # single-process ones up to rounding: both within the arithmetic's bound of nu C^{-1} Z.
        z = torch.stack([seed_noise(SEED, t, M, chunk_size=CHUNK) for t in range(STEPS)]).numpy()
        assert stream_mismatch(expected.numpy(), strategy, z, 1.5, torch.float64) is None
        for r in range(2):
            got = results[r]["rows"][name]
            assert got.shape == (STEPS, M) and got.dtype == torch.float64
            mismatch = stream_mismatch(got.numpy(), strategy, z, 1.5, torch.float64)
            assert mismatch is None, f"rank {r}: {mismatch}"
        # every rank holds the same assembled rows, bit for bit (all_gather copies the shards)
        assert torch.equal(results[0]["rows"][name], results[1]["rows"][name]), name
    # every rank has the same privatized gradient: (sum over ranks + clip * noise) / B
    noise = make_generator(parse_strategy("bsr:3", STEPS), [(5, 3), (22,)], noise_std=2.0, seed=SEED,
                           chunk_size=CHUNK).next()
    want = [(torch.full((5, 3), 3.0) + 0.5 * noise[0]) / 8.0, (torch.full((22,), -3.0) + 0.5 * noise[1]) / 8.0]
    for r in range(2):
        for got, w in zip(results[r]["ghat"], want):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)
    for a, b in zip(results[0]["ghat"], results[1]["ghat"]):
        assert torch.equal(a, b)  # one all-reduced sum, one gathered noise row: the same bits on every rank


def _fsdp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    from corrnoise.errors import CorrnoiseError
    from corrnoise.torch import make_private

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
        try:
            make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=16),
                         mechanism="bsr:2", batching="cyclic", noise_std=1.0, delta=1e-5, epochs=1, max_grad_norm=1.0)
            outcome = "accepted"
        except CorrnoiseError as exc:
            outcome = f"{exc.param}|{exc}"
        (Path(out_dir) / f"fsdp{rank}.txt").write_text(outcome)
    finally:
        dist.destroy_process_group()


def test_fsdp_sharded_parameters_are_refused_in_one_line(tmp_path):
    """FSDP's fully_shard works on CPU/gloo, but the clipping engine needs each layer's full
    weight and would have to reduce-scatter the clipped sum: refused, naming module."""
    spawn_ranks(_fsdp_worker, (2, free_port(), str(tmp_path)), nprocs=2)
    for r in range(2):
        param, message = (tmp_path / f"fsdp{r}.txt").read_text().split("|", 1)
        assert param == "module" and "FSDP" in message and "\n" not in message
