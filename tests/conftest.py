"""Shared test helpers: random instances of every strategy kind."""

from __future__ import annotations

import os
import socket
import sys

import numpy as np
import pytest
from hypothesis import settings

settings.register_profile("ci", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _guarantee_cache_off(monkeypatch):
    """No test reads or writes the user's on-disk cache of verified guarantees
    (corrnoise.accounting.cache); the cache's own tests point CORRNOISE_CACHE at a tmp dir."""
    monkeypatch.setenv("CORRNOISE_CACHE", "off")


@pytest.fixture(autouse=True)
def counted_entropy(request, monkeypatch):
    """In every test, the "OS entropy" of every Monte Carlo sample counted instead (128-bit sized
    values, distinct per call, from the same start in each test): a verification at the calibrated
    noise fails now and then by design (nothing is released, the candidate is ruled out; about 1 in
    400 at the default margin), which would fail a test that expects the verified outcome at random
    (test_planner's balls-in-bins test did, once in a CI run). Tests marked ``os_entropy`` draw
    from the OS as users do (the tests of that protocol itself)."""
    if request.node.get_closest_marker("os_entropy") is not None:
        return
    import itertools

    from corrnoise.accounting import montecarlo

    entropy = itertools.count(2 ** 127 + 12345)
    monkeypatch.setattr(montecarlo.inputs, "fresh_entropy", lambda: next(entropy))


def random_strategies(n: int, seed: int = 0):
    """One instance of every kind for n steps (deterministic for a seed)."""
    from corrnoise.strategies import (
        BLT, DPCGD, Banded, BandedInverseSqrt, BandedSqrt, ColumnNormalized, Dense, Identity, OnlineTree, Prefix, Toeplitz, ToeplitzSqrt,
        Tree,
    )

    rng = np.random.default_rng(seed)
    dense = np.tril(rng.normal(size=(n, n)))
    dense[np.diag_indices(n)] = rng.uniform(0.5, 2.0, size=n)
    b = min(3, n)
    band = rng.normal(size=(n, b))
    band[:, 0] = rng.uniform(0.5, 2.0, size=n)
    coeffs = np.concatenate([[1.0], rng.uniform(-0.5, 0.5, size=n - 1)])
    strategies = [
        Identity(n), Prefix(n), ToeplitzSqrt(n), BandedSqrt(n, min(4, n)), BandedInverseSqrt(n, min(3, n)), DPCGD(0.6, n),
        BLT(rng.uniform(0.05, 0.4, size=2), rng.uniform(0.1, 0.95, size=2), n),
        Toeplitz(coeffs, n), Dense(dense), Banded(band), Tree(n), OnlineTree(n), OnlineTree(n, "ls"),
    ]
    strategies += [ColumnNormalized(s) for s in (ToeplitzSqrt(n), Banded(band), BLT([0.3], [0.7], n), Dense(dense))]
    return strategies


@pytest.fixture
def strategies_8():
    return random_strategies(8)


def free_port() -> int:
    """A TCP port on localhost that is free now (for a test's torch.distributed rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn, args: tuple) -> None:
    """One rank of :func:`spawn_ranks`: ``fn(rank, *args)``, the process group destroyed, then the
    process ended without interpreter teardown. gloo's worker threads can abort a process that
    finalizes the interpreter after a run (SIGABRT, "terminate called without an active exception";
    seen once in this suite, pytorch/pytorch#179291 describes the race), which would fail a test
    whose ranks had finished and saved their results. A rank that raises still exits through the
    exception, so its failure is reported as before."""
    try:
        fn(rank, *args)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes (as torchrun would start them; start method
    ``$CORRNOISE_MP_START``, default spawn) and wait for all; raises if any rank failed."""
    import torch.multiprocessing as mp

    mp.start_processes(_rank_main, args=(fn, args), nprocs=nprocs, join=True,
                       start_method=os.environ.get("CORRNOISE_MP_START", "spawn"))
