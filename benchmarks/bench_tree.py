"""The online binary tree at scale (issue #13): losses at n = 10^6 and noise per step vs DP-SGD.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_tree.py [--n 1000000] [--dim 1e7] [--rounds 16]

Losses: wall time and tracemalloc peak of building the strategy and ``loss_report`` for several
participations. Noise: one step of each generator (DP-SGD, tree, tree:ls, DP-CGD for reference)
timed round-robin, round after round (so other processes' load hits all alike), steps 1..rounds
of an n = 10^6 mechanism (16 rounds: the mean of k = trailing zeros of t + 1 is 15/16, its
long-run mean is 1); min, median and mean over the rounds (the mean is the cost of a run), extra memory of each generator.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import tracemalloc

import torch

from corrnoise.losses import loss_report
from corrnoise.noise import make_generator
from corrnoise.strategies import parse_strategy

PARTICIPATIONS = ("single", "cyclic:10:100000", "cyclic:1000:1000", "minsep:1000:1000")
MECHANISMS = ("dpsgd", "tree", "tree:ls", "dpcgd:0.9")


def losses(n: int) -> None:
    print("| strategy | participation | seconds | peak MiB | rms_loss | max_loss | sensitivity |")
    print("|---|---|---|---|---|---|---|")
    for name in ("tree", "tree:ls"):
        for part in PARTICIPATIONS:
            tracemalloc.start()
            t0 = time.perf_counter()
            r = loss_report(parse_strategy(name, n), part)
            dt = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
            kind = "exact" if r.sensitivity_exact else "upper bound"
            print(f"| {name} | {part} | {dt:.3f} | {peak:.1f} | {r.rms_loss:.4f} | {r.max_loss:.4f} | "
                  f"{r.sensitivity:.4f} ({kind}, {r.sensitivity_method}) |")


def noise(n: int, dim: int, rounds: int) -> None:
    gens = {}
    for name in MECHANISMS:
        gen = make_generator(parse_strategy(name, n), dim, seed=1)
        gen.next_flat()  # warm-up
        gens[name] = gen
    from bench_noise import interleaved_times

    times = interleaved_times(gens, rounds)
    base = statistics.mean(times["dpsgd"])
    print("| mechanism | stream buffers | extra MiB | min ms | median ms | mean ms | mean / DP-SGD mean |")
    print("|---|---|---|---|---|---|---|")
    for name, gen in gens.items():
        rows = parse_strategy(name, n).noise_stream().buffer_rows()
        print(f"| {name} | {rows} | {gen.extra_memory_bytes() / 2**20:.1f} | {1e3 * min(times[name]):.2f} | "
              f"{1e3 * statistics.median(times[name]):.2f} | {1e3 * statistics.mean(times[name]):.2f} | "
              f"{statistics.mean(times[name]) / base:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10**6)
    ap.add_argument("--dim", type=float, default=1e7)
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}, torch threads {torch.get_num_threads()}")
    losses(args.n)
    print()
    noise(args.n, int(args.dim), args.rounds)


if __name__ == "__main__":
    main()
