"""Materialize or ghost norm: a private step's time against a plain step for several values of the
engine's ``GHOST_RATIO`` (:func:`corrnoise.torch.clipping.formulas.use_ghost`).

    PYTHONPATH=src python benchmarks/bench_ghost_ratio.py [--configs bert:128:64,gpt2:512:64] [--ratios 2,16,32,48,64,128]

For each config ``model:width:seq`` (bench_hf_step's GPT-2 / BERT, 2 layers, batch 32, make_private
with bsr:4) one private step and one plain step are built; in each of ``--rounds`` rounds the plain
step and then the private step under every ratio run ``--reps`` timed steps (after one untimed
step, so a change of rule is warm). Printed: the median private step over the median plain step,
per ratio, as a markdown row. The ratio only chooses which exact method computes each per-example
norm (both are tested exact in tests/test_engine.py), so every column computes the same update.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hf_step as H  # noqa: E402

DEFAULT_CONFIGS = "gpt2:128:64,bert:128:64,gpt2:256:64,bert:256:64,bert:512:64,gpt2:512:64,bert:128:128,bert:768:128"


def run_config(model: str, width: int, seq: int, ratios: list[int], rounds: int, reps: int) -> dict:
    from corrnoise.torch.clipping import formulas

    H.SIZE["width"] = width
    plain, private = H.make_step(model, "plain", 32, seq), H.make_step(model, "private", 32, seq)
    for _ in range(2):
        plain()
        private()
    times: dict = {r: [] for r in ["plain", *ratios]}
    saved = formulas.GHOST_RATIO
    try:
        for _ in range(rounds):
            for r in ["plain", *ratios]:
                step = plain if r == "plain" else private
                if r != "plain":
                    formulas.GHOST_RATIO = r
                step()
                for _ in range(reps):
                    t = time.perf_counter()
                    step()
                    times[r].append(time.perf_counter() - t)
    finally:
        formulas.GHOST_RATIO = saved
    base = statistics.median(times["plain"])
    return {"plain_ms": base * 1e3, **{r: statistics.median(times[r]) / base for r in ratios}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="model:width:seq, comma-separated")
    ap.add_argument("--ratios", default="2,16,32,48,64,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    try:
        ratios = [int(r) for r in args.ratios.split(",")]
        configs = [(m, int(w), int(t)) for m, w, t in (cfg.split(":") for cfg in args.configs.split(","))]
    except ValueError:
        raise SystemExit("bench_ghost_ratio: --ratios are integers, --configs model:width:seq (comma-separated)") from None
    bad = [m for m, _, _ in configs if m not in ("gpt2", "bert")]
    if bad:
        raise SystemExit(f"bench_ghost_ratio: --configs: unknown model {bad[0]!r} (gpt2 or bert)")
    print("uptime:", os.popen("uptime").read().strip(), f"| torch threads: {args.threads}", flush=True)
    print("| model | width | seq | plain ms | " + " | ".join(f"ratio {r}" for r in ratios) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(ratios), flush=True)
    for model, width, seq in configs:
        row = run_config(model, width, seq, ratios, args.rounds, args.reps)
        best = min(ratios, key=lambda r: row[r])
        cells = [f"**{row[r]:.2f}**" if r == best else f"{row[r]:.2f}" for r in ratios]
        print(f"| {model} | {width} | {seq} | {row['plain_ms']:.0f} | " + " | ".join(cells) + " |", flush=True)
    print("uptime:", os.popen("uptime").read().strip(), flush=True)


if __name__ == "__main__":
    main()
