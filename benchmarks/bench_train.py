"""Private training on digits (issue #5 acceptance): every mechanism at (epsilon, delta) = (8, 1e-5).

Runs ``corrnoise train --dataset digits --mechanism M --epsilon 8 --delta 1e-5 --json`` for each
mechanism (one process each, sequentially, whole-process wall time incl. imports), prints a
markdown table and the load average. Usage:

    .venv/bin/python benchmarks/bench_train.py [--epochs 5] [--seeds 0,1,2] [--mechanisms dpsgd,bandmf,blt,dpcgd,auto]

``--seed`` of the command line fixes the model init and cyclic batches only: an amplified sampler
(Poisson, block-cyclic, balls-in-bins) draws a secret seed from the OS, so those runs are not
repeatable batch for batch (the Python API's ``train(sampler_seed=...)`` is, for experiments).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXE = ROOT / ".venv" / "bin" / "corrnoise"


def run(mechanism: str, epochs: float, seed: int, extra: list[str]) -> dict:
    cmd = [str(EXE), "train", "--dataset", "digits", "--mechanism", mechanism, "--epsilon", "8", "--delta", "1e-5",
           "--epochs", str(epochs), "--seed", str(seed), "--json", *extra]
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t
    out = json.loads(res.stdout)
    out["wall_seconds"] = wall
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=float, default=5)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--mechanisms", default="dpsgd,bandmf,blt,dpcgd,auto")
    ap.add_argument("extra", nargs="*", help="extra corrnoise train options (after --)")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    rows = []
    for mech in args.mechanisms.split(","):
        outs = [run(mech, args.epochs, s, args.extra) for s in seeds]
        accs = [o["test_accuracy"] for o in outs]
        rows.append((mech, outs[0]["strategy"], outs[0]["batching"], outs[0]["accounting_method"], outs[0]["steps"],
                     outs[0]["noise_std"], outs[0]["noise_multiplier"], max(o["epsilon"] for o in outs),
                     statistics.mean(accs), min(accs), max(accs), statistics.mean(o["wall_seconds"] for o in outs),
                     statistics.mean(o["plan_seconds"] for o in outs), statistics.mean(o["train_seconds"] for o in outs)))
        print(f"{mech}: {accs}", file=sys.stderr)
    print("| mechanism | strategy | batching | accounting | steps | noise_std | sigma | max epsilon | "
          "test acc mean (min-max) | wall s | plan s | train s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.3f} | {r[6]:.3f} | {r[7]:.4f} | "
              f"{r[8]:.3f} ({r[9]:.3f}-{r[10]:.3f}) | {r[11]:.1f} | {r[12]:.1f} | {r[13]:.1f} |")
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
