"""Throughput of the balls-in-bins Monte Carlo verification pass against this machine's limit for
its arithmetic (seed 000 Thm 2.2: ~1.02e8 samples at delta 1e-5, tau 1.25).

Per reduced sample (b bins) the verification draws b standard normals, forms u = L g (a b x b
product: b^2 multiply-adds as a triangular product, 2 b^2 flops as the general product dgemm
that runs twice as fast here) and evaluates the two privacy losses (Y-add), (Y-remove). The limit
below counts only what cannot be avoided -- the normals and the product -- each timed alone (CPU
time, one thread) on the same element counts with the same generator (SFC64) and BLAS, then
divided by the worker count; "exp" is what b exponentials per sample add (the loss evaluation
before the screen of :func:`screen_rows` needed them for every sample). The strategy is the
planner's optimized banded Toeplitz C (min(b, 64) bands, 10 epochs) at its (4, 1e-5) noise.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_mc_throughput.py [--samples 4194304] [--bins 8 10 100 128]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def _time(fn, repeat: int = 1, clock=time.perf_counter) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def measure(b: int, samples: int, workers: int) -> dict:
    from threadpoolctl import threadpool_limits

    from corrnoise.accounting import montecarlo as mc
    from corrnoise.accounting.montecarlo.estimates import _delta_moments
    from corrnoise.accounting.montecarlo.sampling import _chunks
    from corrnoise.optimize import optimize_banded_toeplitz

    n = 10 * b
    strategy = optimize_banded_toeplitz(n, min(b, 64), participation=f"cyclic:10:{b}")
    red = mc.reduce_balls_in_bins(strategy.matrix(), b)
    samples = -(-samples // b) * b
    sizes = _chunks(b, samples)
    # about the noise at which this C is (4, 1e-5)-DP (a short calibration at delta / tau), where
    # the verification runs (calibrate_noise_std: also in the code before the planner work, so
    # this script times either version)
    nu = mc.calibrate_noise_std(red, b, 4.0, 8e-6, samples=1 << 18, seed=3, _reduced=red).noise_std
    out = {"bins": b, "samples": samples, "chunks": len(sizes), "noise_std": nu, "strategy": strategy.label}
    clock = time.process_time
    with threadpool_limits(1):
        def normals():
            for k, size in enumerate(sizes):
                rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence(1, spawn_key=(1, k))))
                rng.standard_normal((size, b))

        g = np.random.default_rng(0).standard_normal((sizes[0], b))
        Lt = red.factor.T

        def gemm():
            for _ in sizes:
                g @ Lt

        u = red.draw(1, 1, 0, sizes[0])

        def exps():
            for _ in sizes:
                np.exp(u)

        t_norm, t_gemm, t_exp = _time(normals, clock=clock), _time(gemm, clock=clock), _time(exps, clock=clock)
    limit = (t_norm + t_gemm) / workers
    out.update(ns_normals=t_norm / samples * 1e9, ns_product=t_gemm / samples * 1e9, ns_exp=t_exp / samples * 1e9)
    t0, c0 = time.perf_counter(), time.process_time()
    _delta_moments(red, nu, 4.0, samples, 11, 1, workers=workers)
    t_pass, c_pass = time.perf_counter() - t0, time.process_time() - c0
    out.update(workers=workers, seconds=t_pass, cpu_seconds=c_pass, samples_per_s=samples / t_pass,
               cpu_ns_per_sample=c_pass / samples * 1e9, limit_samples_per_s=samples / limit,
               fraction_of_limit_cpu=(t_norm + t_gemm) / c_pass,
               verification_1e5_s=mc.verification_samples(1e-5) / (samples / t_pass),
               verification_1e5_limit_s=mc.verification_samples(1e-5) / (samples / limit))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1 << 22)
    ap.add_argument("--bins", type=int, nargs="+", default=[8, 10, 100, 128])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    print(json.dumps({"load": os.getloadavg(), "cpus": os.cpu_count()}))
    for b in args.bins:
        for w in args.workers:
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in measure(b, args.samples, w).items()}),
                  flush=True)
    print(json.dumps({"load": os.getloadavg()}))


if __name__ == "__main__":
    main()
