"""The first private step against the second: what the engine's one-time work costs.

    PYTHONPATH=src python benchmarks/bench_first_step.py [--models gpt2,bert] [--runs 3] [--threads 1]

bench_hf_step's models and batch (width 128, 2 layers, batch 32, seq 64), a ClippingEngine attached
without the attribution check, so that the first forward probes the shared position ids
(``ClippingEngine._probe_shared_indices``: two vector-Jacobian products, rows 0 and B - 1) and the
first clipped sum checks itself against autograd's gradient. Per run, a fresh model: the first and
the second forward (ms), and the first and the second step (forward, backward, clipped sum).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hf_step  # noqa: E402


def one_run(name: str, batch: int, seq: int) -> tuple[float, float, float, float]:
    from corrnoise.torch.clipping import ClippingEngine

    model = bench_hf_step.make_model(name, False)
    data, loss = bench_hf_step.make_batch(name, batch, seq), bench_hf_step.loss_fn(name)
    engine = ClippingEngine(model, "mean", 1.0)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        value = loss(model, data)
        t1 = time.perf_counter()
        value.backward()
        engine.clipped_sum(batch)
        engine.clear()
        times.append((t1 - t0, time.perf_counter() - t0))
    (f1, s1), (f2, s2) = times
    return f1, f2, s1, s2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2,bert")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.runs < 1 or args.threads < 1:
        raise SystemExit("--runs and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    bench_hf_step.RUN["seq"] = 64
    print("uptime:", os.popen("uptime").read().strip(), f"| torch threads: {args.threads}", flush=True)
    print("| model | first forward ms | second forward ms | first step ms | second step ms |")
    print("|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        for _ in range(args.runs):
            f1, f2, s1, s2 = one_run(name, 32, 64)
            print(f"| {name} | {f1 * 1e3:.1f} | {f2 * 1e3:.1f} | {s1 * 1e3:.1f} | {s2 * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
