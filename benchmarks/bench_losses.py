"""Timing of `corrnoise loss` fast paths (issue #2 acceptance): A^{1/2} at n = 10^6, BLT at n = 10^9.

Run: .venv/bin/python benchmarks/bench_losses.py   (prints a Markdown table to paste in RESULTS.md)
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from corrnoise.losses import loss_report
from corrnoise.strategies import BLT, parse_strategy

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, repeat=5):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    rows = []
    cli = [str(ROOT / ".venv/bin/corrnoise"), "loss", "toeplitz-sqrt", "--n", "1000000", "--json"]
    t0 = time.perf_counter()
    subprocess.run(cli, check=True, capture_output=True)
    rows.append(("`corrnoise loss toeplitz-sqrt --n 1000000 --json` (whole process)", time.perf_counter() - t0, ""))
    sec, r = timed(lambda: loss_report(parse_strategy("toeplitz-sqrt", 10**6)))
    rows.append(("loss_report(toeplitz-sqrt, n=10^6)", sec, f"max_loss={r.max_loss:.4f}"))
    sec, r = timed(lambda: loss_report(parse_strategy("bsr:64", 10**6), "minsep:16:62500"))
    rows.append(("loss_report(bsr:64, n=10^6, minsep:16:62500)", sec, f"rms_loss={r.rms_loss:.4f}"))
    blt = BLT([0.3, 0.1, 0.05], [0.999, 0.9, 0.5], 10**9)
    sec, r = timed(lambda: loss_report(blt), repeat=20)
    rows.append(("loss_report(BLT d=3, n=10^9)", sec, f"rms_loss={r.rms_loss:.2f}"))
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}")
    print("| what | seconds (best) | result |\n|---|---|---|")
    for what, sec, res in rows:
        print(f"| {what} | {sec:.4f} | {res} |")


if __name__ == "__main__":
    main()
