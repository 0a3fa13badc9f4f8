"""Timings of representative `corrnoise account` commands (issue #4, methods gaussian/pld/rdp/bandmf).

Times each command in-process (best of ``--repeat``, imports excluded) and once as a whole
process (imports included), and prints a markdown table for benchmarks/RESULTS.md.  Usage: .venv/bin/python benchmarks/bench_accounting.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = str(ROOT / ".venv" / "bin" / "corrnoise")

COMMANDS = [
    # DP-SGD, 1000 steps at p = 0.01 (PLD and RDP)
    "account identity --n 1000 --batching poisson:0.01 --sigma 1.1 --delta 1e-5",
    "account identity --n 1000 --batching poisson:0.01 --sigma 1.1 --delta 1e-5 --method rdp",
    # seed 000 Fig. 28 "BandMF + Poisson": eps = 1 and eps = 8 (sigma_fig * sqrt(20) as noise_std)
    "account bsr:4+colnorm --n 2000 --batching block-cyclic:4:0.04 --noise-std 3.479321 --delta 1e-5",
    "account bsr:32+colnorm --n 2000 --batching block-cyclic:32:0.32 --noise-std 1.735189 --delta 1e-5",
    # calibration
    "account bsr:4+colnorm --n 2000 --batching block-cyclic:4:0.04 --epsilon 1 --delta 1e-5",
    "account identity --n 2048 --batching poisson:0.0078125 --epsilon 4 --delta 1e-5",
    # unamplified, 16 epochs of 128 steps
    "account toeplitz-sqrt --n 2048 --batching none --participation cyclic:16:128 --epsilon 4 --delta 1e-5",
    "account bsr:64 --n 2048 --batching none --participation cyclic:16:128 --sigma 1 --delta 1e-5",
]


def _in_process(command: str) -> tuple[float, dict]:
    import contextlib
    import io

    from corrnoise.cli import main as cli_main

    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        code = cli_main([*command.split(), "--json"])
    elapsed = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"{command} exited {code}")
    return elapsed, json.loads(buf.getvalue())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"python {platform.python_version()}")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import corrnoise.cli"], check=True)
    print(f"`python -c 'import corrnoise.cli'` (the fixed start-up cost of every command): "
          f"{time.perf_counter() - t0:.2f} s")
    print()
    print("| command | in-process s (best) | whole process s | epsilon | noise_std | noise_multiplier | method |")
    print("|---|---|---|---|---|---|---|")
    for command in COMMANDS:
        best, data = float("inf"), None
        for _ in range(args.repeat):
            elapsed, data = _in_process(command)
            best = min(best, elapsed)
        t0 = time.perf_counter()
        subprocess.run([CLI, *command.split(), "--json"], capture_output=True, text=True, check=True)
        whole = time.perf_counter() - t0
        print(f"| `corrnoise {command}` | {best:.2f} | {whole:.2f} | {data['epsilon']:.4f} | "
              f"{data['noise_std']:.4f} | {data['noise_multiplier']:.4f} | {data['method']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
