"""make_private over 2 gloo processes equals the single-process run (issue #15 item 4).

The released value of a data-parallel step must be (sum of every rank's CLIPPED gradients + one
noise row) / global B: one global sampler split across the ranks, the clipped sums all-reduced,
the noise added once. Any slip -- unclipped gradients in the sum, a rank's share missing, the
noise added per rank (world_size copies) or different on each rank, a local batch size as the
divisor -- moves the parameters away from the single-process run's, which is what is compared.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from corrnoise.errors import CorrnoiseError
from conftest import free_port, spawn_ranks

WORLD = 2
N, B, STEPS, CLIP, NOISE_SEED, SAMPLER_SEED = 15, 5, 4, 0.3, 4321, 7  # local shares of 3 and 2
# (name, mechanism, DDP-wrapped, max_physical_batch_size): micro-batches of 2 give rank 0 two
# micro-batches per step and rank 1 one -- the all-reduce must still pair up once per step
RUNS = [("ddp-dpcgd", "dpcgd:0.5", True, 2), ("plain-bsr", "bsr:2", False, None)]
HUGE = 1e6


def _data(huge_at: int | None = None, zero_at: int | None = None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=g, dtype=torch.float64)
    y = torch.randn(N, 1, generator=g, dtype=torch.float64)
    if huge_at is not None:
        x[huge_at], y[huge_at] = HUGE, -HUGE
    if zero_at is not None:  # zero gradient for a bias-free linear model: the example removed
        x[zero_at], y[zero_at] = 0.0, 0.0
    return TensorDataset(x, y)


def _huge_index() -> int:
    """Index 1 of step 0's global batch: rank 1's share (every WORLD-th index from rank)."""
    from corrnoise.sampling import CyclicSampler

    return CyclicSampler(N, B, steps=STEPS, seed=SAMPLER_SEED).batch(0)[1]


def _train(mechanism, ddp, physical, dataset, *, bias=True, seed=SAMPLER_SEED, stop_after=STEPS):
    from corrnoise.torch import front

    torch.manual_seed(123)
    model = nn.Sequential(nn.Linear(3, 4, bias=bias), nn.Tanh(), nn.Linear(4, 1, bias=bias)).double()
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    model, opt, loader = front.make_private(
        model, opt, DataLoader(dataset, batch_size=B), mechanism=mechanism, noise_std=0.7, delta=1e-5,
        max_grad_norm=CLIP, steps=STEPS, batching="cyclic", seed=seed, noise_seed=NOISE_SEED,
        max_physical_batch_size=physical)
    counts = []
    while len(counts) < stop_after:  # passes of N // B steps
        for x, y in loader:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if opt.context.current_step is None:
                counts.append(opt.last_stats["count"])
                if len(counts) == stop_after:
                    break
    assert opt.steps_taken == stop_after
    inner = model.module if ddp else model
    return [p.detach().clone() for p in inner.parameters()], counts, opt


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        out = {}
        for name, mechanism, ddp, physical in RUNS:
            params, counts, opt = _train(mechanism, ddp, physical, _data())
            out[name] = {"params": params, "counts": counts, "expected": opt.expected_batch_size,
                         "seeded_state": "seed" in str(opt.state_dict()["noise"]["generator"])}
            opt.load_state_dict(opt.state_dict())  # resumes with the seed the run already holds
            out[name]["reloaded_step"] = opt.privatizer.step
        # one example with a huge gradient, in rank 1's share of step 0; the same run without it
        huge = _huge_index()
        out["huge"] = _train("bsr:2", True, None, _data(huge_at=huge), bias=False)[0]
        out["huge1"] = _train("bsr:2", True, None, _data(huge_at=huge), bias=False, stop_after=1)[0]
        out["removed1"] = _train("bsr:2", True, None, _data(zero_at=huge), bias=False, stop_after=1)[0]
        # with no seeds given: rank 0's sampler seed and 256-bit noise seed on every rank
        from corrnoise.torch import front

        m = nn.parallel.DistributedDataParallel(nn.Linear(3, 1).double())
        _, o, _ = front.make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), DataLoader(_data(), batch_size=B),
                                     mechanism="bsr:2", noise_std=1.0, delta=1e-5, max_grad_norm=1.0, steps=2,
                                     batching="cyclic")
        out["seeds"] = (o.sampler.seed, o.noise_seed)
        # an amplified sampler with no seed: rank 0's secret one from the OS on every rank, no warning
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = nn.Linear(3, 1).double()
            _, o, _ = front.make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), DataLoader(_data(), batch_size=B),
                                         mechanism="identity", noise_std=1.0, delta=1e-5, max_grad_norm=1.0, steps=2,
                                         batching="poisson")
        out["poisson"] = (o.sampler.seed, [o.sampler.batch(t) for t in range(2)],
                          any("sampler seed" in str(w.message) for w in caught))
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    spawn_ranks(_worker, (free_port(), str(out)), nprocs=WORLD)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("name,mechanism,ddp,physical", RUNS)
def test_two_ranks_equal_single_process(ranks, name, mechanism, ddp, physical):
    single, counts, opt = _train(mechanism, False, None, _data())
    assert counts == [B] * STEPS
    for r in range(WORLD):
        got = ranks[r][name]
        assert got["expected"] == opt.expected_batch_size == B  # the global expected batch size
        assert got["counts"] == counts  # statistics of the global batch
        assert not got["seeded_state"]  # the sharded noise state leaves the secret seed out too
        assert got["reloaded_step"] == STEPS
        for p, q in zip(got["params"], single):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-10)
    moved = max(float((p - q).abs().max()) for p, q in zip(single, _train(mechanism, False, None, _data(),
                                                                           seed=SAMPLER_SEED + 1)[0]))
    assert moved > 1e-3  # the comparison can tell runs apart


def test_huge_gradient_on_one_rank_moves_the_sum_by_at_most_the_clip_norm(ranks):
    huge = _huge_index()
    single = _train("bsr:2", False, None, _data(huge_at=huge), bias=False)[0]
    for r in range(WORLD):
        for p, q in zip(ranks[r]["huge"], single):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-10)
        # same noise, same other examples: after one step (SGD's first momentum step is lr * g)
        # the parameters differ by lr * clip(g_huge) / B, whose norm is the clip norm * lr / B:
        # rank 1 clipped its example and the all-reduce carried it to rank 0 exactly once
        diff = torch.cat([(a - b).reshape(-1) for a, b in zip(ranks[r]["huge1"], ranks[r]["removed1"])])
        assert diff.norm().item() * B / 0.5 == pytest.approx(CLIP, rel=1e-9)


def test_rank_zero_seeds_on_every_rank(ranks):
    assert ranks[0]["seeds"] == ranks[1]["seeds"]
    assert ranks[0]["poisson"] == ranks[1]["poisson"]  # one global Poisson sampler, from rank 0's seed
    assert not ranks[0]["poisson"][2] and ranks[0]["poisson"][0] != ranks[0]["seeds"][0]
    assert ranks[0]["seeds"][1].bit_length() > 64  # the 256-bit secret, all bits broadcast


def test_distributed_needs_a_process_group():
    from corrnoise.torch import front

    m = nn.Linear(3, 1)
    with pytest.raises(CorrnoiseError, match="distributed"):
        front.make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), DataLoader(_data(), batch_size=B),
                           mechanism="bsr:2", noise_std=1.0, delta=1e-5, max_grad_norm=1.0, steps=2,
                           batching="cyclic", distributed=True)


def test_planned_mechanisms_are_refused_in_distributed_runs():
    """The planner screens with fresh Monte Carlo samples: every rank planning for itself could pick
    a different mechanism, so auto / families are refused once a process group is up."""
    import torch.distributed as dist

    from corrnoise.torch import front

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        m = nn.Linear(3, 1)
        with pytest.raises(CorrnoiseError, match="^mechanism: 'auto' would be planned on every rank"):
            front.make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), DataLoader(_data(), batch_size=B),
                               mechanism="auto", epsilon=4.0, delta=1e-5, max_grad_norm=1.0, epochs=1)
        # a family that names one mechanism, with a given noise, plans nothing: DP-SGD on every rank alike
        _, opt, _ = front.make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), DataLoader(_data(), batch_size=B),
                                       mechanism="dpsgd", noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, epochs=1)
        assert opt.plan.label == "dpsgd"
    finally:
        dist.destroy_process_group()


def _mismatch_worker(rank: int, port: int, out_dir: str) -> None:
    """Each case: rank 1 makes another make_private call than rank 0 (a clip norm, a mechanism, a
    batch size, a dataset); what each rank raised."""
    import torch.distributed as dist

    from corrnoise.sampling import CyclicSampler
    from corrnoise.torch import front

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        base = dict(mechanism="bsr:2", noise_std=1.0, delta=1e-5, max_grad_norm=1.0, steps=2, batching="cyclic",
                    seed=SAMPLER_SEED, noise_seed=NOISE_SEED)
        cases = {"max_grad_norm": dict(max_grad_norm=10.0), "mechanism": dict(mechanism="dpcgd:0.5"),
                 "batch_size": dict(batch=2 * B), "dataset_size": dict(n=N - 1), "same": {},
                 "seed": {}, "same_ready": {}}
        out = {}
        for name, change in cases.items():
            kw = {**base, **(change if rank == 1 else {})}
            if name == "seed":  # a ready sampler left to draw its seed from the OS: another on each rank
                kw.update(batching=CyclicSampler(N, B, steps=2), seed=None)
            elif name == "same_ready":
                kw.update(batching=CyclicSampler(N, B, steps=2, seed=SAMPLER_SEED), seed=None)
            data = TensorDataset(*_data().tensors) if "n" not in kw else TensorDataset(*(t[:kw["n"]] for t in _data().tensors))
            loader = DataLoader(data, batch_size=kw.pop("batch", B))
            kw.pop("n", None)
            m = nn.parallel.DistributedDataParallel(nn.Linear(3, 1).double())
            try:
                front.make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), loader, **kw)
                out[name] = None
            except CorrnoiseError as err:
                out[name] = (err.param, str(err))
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ranks_that_make_another_make_private_call_are_refused_on_every_rank(tmp_path):
    """Found in review: each rank clips with its own max_grad_norm and cuts its share of the batch,
    and the noise row is assembled from every rank's shard, so rank 1 with a clip norm of 10 (rank 0
    accounted 1: a released sum of 10.9 from 8 examples), another mechanism or another batch size
    was accepted; so was a ready sampler whose seed each rank drew from the OS (each rank's share
    then came from another global batch: an example used on two ranks in one step). The ranks now compare what the guarantee is of; each refuses in one line naming
    the field. The same call on both ranks is accepted."""
    spawn_ranks(_mismatch_worker, (free_port(), str(tmp_path)), nprocs=WORLD)
    for rank in range(WORLD):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert out["same"] is None and out["same_ready"] is None
        for field in ("max_grad_norm", "mechanism", "batch_size", "dataset_size", "seed"):
            param, message = out[field]
            assert param == field and "differs between the data-parallel ranks" in message, (rank, field, message)
            assert "\n" not in message
