"""Timings and losses of the dense and general banded optimizers (issue #3).

    .venv/bin/python benchmarks/bench_optimize_dense.py [--dense 512 1024 2048] [--banded 10000:32]

Dense: RMS loss (single participation) against tutorial Table 2.3's dense column, with the
certified duality gap. Banded: general column-normalized banded vs the optimized banded Toeplitz
strategy (column-normalized afterwards) at the same n and b. Losses are recomputed with
corrnoise.losses.loss_report. Prints a markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np

from corrnoise.losses import loss_report
from corrnoise.optimize.banded import optimize_banded
from corrnoise.optimize.dense import optimize_dense

TABLE = Path(__file__).resolve().parents[1] / "tests" / "data" / "tutorial_table_2_3_rms_loss.csv"


def published(n: int) -> float | None:
    rows = np.genfromtxt(TABLE, delimiter=",", names=True)
    for r in rows:
        if int(r["n"]) == n and np.isfinite(r["dense"]):
            return float(r["dense"])
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dense", type=int, nargs="*", default=[512, 1024, 2048])
    ap.add_argument("--banded", nargs="*", default=["10000:32"], help="N:B pairs")
    ap.add_argument("--threads", type=int, default=1, help="BLAS/torch threads (0 = library default)")
    args = ap.parse_args()
    threads = None if args.threads == 0 else args.threads
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}, threads={threads}")
    print()
    print("| optimizer | n | b | loss (rms) | reference | wall s | CPU s | iterations (fixed point / L-BFGS) | certified gap |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.dense:
        info: dict = {}
        t0, c0 = time.perf_counter(), time.process_time()
        s = optimize_dense(n, info=info, threads=threads)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        r = loss_report(s)
        ref = published(n)
        ref_s = f"Table 2.3: {ref}" if ref is not None else "-"
        print(f"| dense | {n} | {n} | {r.rms_loss:.5f} | {ref_s} | {dt:.1f} | {dc:.1f} | "
              f"{info['fixed_point_iterations']} / {info['iterations']} | {info['gap']:.1e} |", flush=True)
    for spec in args.banded:
        n, b = (int(v) for v in spec.split(":"))
        from corrnoise.optimize.toeplitz import optimize_banded_toeplitz

        t0, c0 = time.perf_counter(), time.process_time()
        toep = optimize_banded_toeplitz(n, b, column_normalize=True)
        dt_t, dc_t = time.perf_counter() - t0, time.process_time() - c0
        rt = loss_report(toep)
        info = {}
        t0, c0 = time.perf_counter(), time.process_time()
        s = optimize_banded(n, b, info=info, threads=threads)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        r = loss_report(s)
        rel = (r.rms_loss / rt.rms_loss - 1) * 100
        print(f"| banded-toeplitz+colnorm | {n} | {b} | {rt.rms_loss:.5f} | - | {dt_t:.1f} | {dc_t:.1f} | - | - |")
        print(f"| banded (general) | {n} | {b} | {r.rms_loss:.5f} | {rel:+.2f}% vs banded-toeplitz | {dt:.1f} | {dc:.1f} | "
              f"- / {info['iterations']} | - |", flush=True)


if __name__ == "__main__":
    main()
