"""Host-side operator calls per training step: plain against make_private's, full and LoRA.

    PYTHONPATH=src python benchmarks/bench_step_ops.py [--models bert,gpt2] [--width 768] [--layers 12] \
        [--batch 16] [--seq 128]

On a GPU, a step whose kernels are small waits for the host: each top-level aten call costs the
CPU some microseconds of Python and dispatch, whether or not it launches a kernel. This counts
the top-level aten calls (those not called from another aten op) of one step of
bench_hf_step's models and methods with torch.profiler on the CPU, and the most frequent ones of
each private step: the overhead to cut where the GPU step is host-bound (benchmarks/RESULTS.md,
"GPU: GPT-2 small", BERT-base). The defaults are the GPU run's sizes (BERT-base, GPT-2 small
without its vocabulary: the count depends on the layers and the engine's per-layer choices, not
on the vocabulary; width 64 gives nearly the same counts).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hf_step as hf  # noqa: E402


def top_level_ops(step) -> collections.Counter:
    """aten calls of one ``step()`` that no other aten call made, by name."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::")
                               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="bert,gpt2")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(2)
    hf.SIZE.update(width=args.width, layers=args.layers, bert_ffn=4)
    hf.RUN.update(vocab=500, seq=args.seq)
    print(f"| model ({args.layers} layers, width {args.width}, {args.batch} x {args.seq}) | method | top-level aten calls | added by privacy | most frequent |")
    print("|---|---|---:|---:|---|")
    for name in args.models.split(","):
        counts = {}
        for method in hf.METHODS:
            step = hf.make_step(name, method, args.batch, args.seq)
            for _ in range(3):  # past the first steps (attribution, probes, compiled noise)
                step()
            counts[method] = top_level_ops(step)
            total = sum(counts[method].values())
            base = sum(counts["lora_plain" if method.startswith("lora") else "plain"].values())
            common = ", ".join(f"{k[6:]} {v}" for k, v in counts[method].most_common(6)) if "private" in method else ""
            print(f"| {name} | {method} | {total} | {total - base} | {common} |", flush=True)


if __name__ == "__main__":
    main()
