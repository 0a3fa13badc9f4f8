"""Private training on Fashion-MNIST (issue #16): test accuracy per pipeline, mechanism and epsilon.

    make data
    PYTHONPATH=src python benchmarks/bench_fashion_mnist.py --runs dpsgd:poisson:2.93:0 auto:cyclic:2.93:0 \
        --out benchmarks/fashion_mnist_runs.jsonl

Each run is ``corrnoise.training.train("fashion-mnist", MECHANISM, batching=PIPELINE, epsilon=EPS,
delta=1e-5, seed=SEED)`` with the dataset's defaults (Papernot et al. 2021 tanh CNN, batch 2048,
40 epochs, SGD lr 4 momentum 0.9, clip 0.1, standardized inputs): ``dpsgd`` is the planner's
DP-SGD for the pipeline, ``auto`` the planner's recommendation for it. One JSON line per run
(mechanism, batching, accounting, kind, epsilon, test accuracy, seconds) is appended to ``--out``;
``--table`` prints a markdown table of a results file (mean and range over seeds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def run(spec: str) -> dict:
    from corrnoise.training import train

    mechanism, pipeline, eps, seed = spec.split(":")
    t0 = time.perf_counter()
    res = train("fashion-mnist", mechanism, batching=pipeline, epsilon=float(eps), delta=1e-5, seed=int(seed),
                device="cpu")
    out = {k: res[k] for k in ("mechanism", "strategy", "batching", "pipeline", "accounting", "kind", "epsilon",
                               "epsilon_target", "noise_std", "noise_multiplier", "steps", "test_accuracy",
                               "seconds_planning", "seconds_training")}
    out.update(requested=mechanism, seed=int(seed), seconds=time.perf_counter() - t0,
               load=os.getloadavg()[0], history=res["history"])
    return out


def table(path: str) -> None:
    rows: dict[tuple, list] = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            rows.setdefault((r["pipeline"], r["epsilon_target"], r["requested"]), []).append(r)
    print("| pipeline | epsilon | requested | trained (batching, accounting) | test accuracy % (mean, range) | "
          "epsilon reported | seeds | minutes per run |")
    print("|---|---:|---|---|---|---:|---:|---:|")
    for (pipe, eps, req), rs in sorted(rows.items()):
        accs = [100 * r["test_accuracy"] for r in rs]
        trained = ", ".join(sorted({f"{r['mechanism']} ({r['batching'].split(':')[0]}, {r['accounting']})" for r in rs}))
        rng = f"{min(accs):.1f}-{max(accs):.1f}" if len(accs) > 1 else "-"
        print(f"| {pipe} | {eps:g} | {req} | {trained} | {statistics.mean(accs):.1f} ({rng}) | "
              f"{max(r['epsilon'] for r in rs):.4g} | {len(rs)} | {statistics.mean(r['seconds'] for r in rs) / 60:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="*", default=[], help="MECHANISM:PIPELINE:EPSILON:SEED")
    ap.add_argument("--out", default="benchmarks/fashion_mnist_runs.jsonl")
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args()
    for spec in args.runs:
        r = run(spec)
        print(json.dumps({k: v for k, v in r.items() if k != "history"}), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(r) + "\n")
    if args.table:
        table(args.out)


if __name__ == "__main__":
    sys.exit(main())
