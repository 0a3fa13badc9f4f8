"""Milliseconds of ``ClippingEngine.clipped_sum`` alone, after a real forward and backward, on the
Hugging Face models of bench_hf_step.py; several source trees side by side.

    PYTHONPATH=src python benchmarks/bench_clipped_sum.py [--src DIR,DIR] [--procs 3] [--threads 1]
        [--reps 80]

Configs (BERT of bench_hf_step, batch 32, 64 tokens): width 16 full fine-tuning (almost no
arithmetic: what the engine costs per parameter and per layer), width 128 LoRA (r = 8 on
query/key/value) and width 128 full fine-tuning. Each ``--src`` tree (default: this checkout's
``src``; give ``git archive``'s copy of an older commit to compare) runs in its own process, since
one process imports one corrnoise; the trees' processes alternate ``--procs`` times so that load
from other processes hits them alike. Each cell: the median of the processes' medians over
``reps`` clipped sums (the first 10 dropped). A separate process is needed per tree, so only a
difference larger than the processes' spread (printed) is a measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS = [(16, False), (128, True), (128, False)]


def child(reps: int) -> None:
    """Runs in the tree's process: prints {config: median ms} as JSON."""
    import time

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_hf_step as hf
    from corrnoise.torch.clipping import ClippingEngine

    out = {}
    for width, lora in CONFIGS:
        hf.SIZE.update(width=width, bert_ffn=2)
        batch, loss = hf.make_batch("bert", 32, 64), hf.loss_fn("bert")
        model = hf.make_model("bert", lora)
        eng = ClippingEngine(model, "mean", 1.0, parameters=[p for p in model.parameters() if p.requires_grad])
        times = []
        for _ in range(reps):
            loss(model, batch).backward()
            t0 = time.perf_counter()
            eng.clipped_sum(32)
            times.append(time.perf_counter() - t0)
            eng.clear()
            for p in model.parameters():
                p.grad = None
        eng.detach()
        out[f"bert width {width} {'LoRA' if lora else 'full'}"] = statistics.median(times[10:]) * 1e3
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"),
                    help="comma-separated source trees (directories holding corrnoise/)")
    ap.add_argument("--procs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=80)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        child(args.reps)
        return
    if args.procs < 1 or args.reps < 11 or args.threads < 1:
        raise SystemExit("--procs and --threads must be >= 1 and --reps >= 11")
    trees = args.src.split(",")
    for t in trees:
        if not os.path.isdir(os.path.join(t, "corrnoise")):
            raise SystemExit(f"--src: {t} holds no corrnoise/")
    print("uptime:", os.popen("uptime").read().strip(), f"| torch threads: {args.threads}", flush=True)
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for k in range(args.procs):
        for t in trees:
            env = {**os.environ, "PYTHONPATH": t}
            res = subprocess.run([sys.executable, __file__, "--child", "--threads", str(args.threads),
                                  "--reps", str(args.reps)], env=env, capture_output=True, text=True, check=True)
            runs[t].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"  process {k + 1}/{args.procs} {t}: {runs[t][-1]}", file=sys.stderr, flush=True)
    print("uptime:", os.popen("uptime").read().strip())
    names = list(runs[trees[0]][0])
    print("\n| tree | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for t in trees:
        cells = []
        for n in names:
            vals = [r[n] for r in runs[t]]
            cells.append(f"{statistics.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})")
        print(f"| {t} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
