"""A/B of the embedding tables' norms in one process: T x T Gram matrices against rows summed by token.

    PYTHONPATH=src python benchmarks/bench_one_hot_norm.py OLD_FORMULAS [--model bert] [--seq 64]
        [--batch 32] [--vocab 500]

OLD_FORMULAS: an earlier ``corrnoise/torch/clipping/formulas.py`` (``git archive <commit> src``). The
script builds ``bench_hf_step``'s private step (make_private, bsr:4, 2 threads) once and swaps the
engine's ``use_ghost``, ``ghost_norm_sq`` and ``bookkeeping_sum`` between that module and the current
one every 8 steps, 8 rounds in alternating order. Printed: medians of the whole step and of
``ClippingEngine.clipped_sum`` for each. Both variants train the same model on the same batch, in
the same process, so they see the same load.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hf_step as hf  # noqa: E402

import corrnoise.torch.clipping.engine as engine_mod  # noqa: E402
import corrnoise.torch.clipping.formulas as current  # noqa: E402

SWAPPED = ("use_ghost", "ghost_norm_sq", "bookkeeping_sum")


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("corrnoise.torch.clipping.formulas_old", path)
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old
    spec.loader.exec_module(old)
    old.OneHot = current.OneHot  # the layer rules build the current module's OneHot
    return old


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("--model", default="bert")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=500)
    args = ap.parse_args()
    torch.set_num_threads(2)
    variants = {"old": load_old(args.old), "new": current}
    timed: list[float] = []
    clipped_sum = engine_mod.ClippingEngine.clipped_sum

    def timed_clipped_sum(*a, **k):
        start = time.perf_counter()
        out = clipped_sum(*a, **k)
        timed.append(time.perf_counter() - start)
        return out

    engine_mod.ClippingEngine.clipped_sum = timed_clipped_sum
    hf.RUN.update(vocab=args.vocab, seq=args.seq, device="cpu", opacus=False)
    step = hf.make_step(args.model, "private", args.batch, args.seq)

    def use(name):
        for fn in SWAPPED:
            setattr(engine_mod, fn, getattr(variants[name], fn))

    steps = {k: [] for k in variants}
    sums = {k: [] for k in variants}
    for name in variants:
        use(name)
        for _ in range(3):
            step()
    for rnd in range(8):
        for name in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
            use(name)
            for _ in range(8):
                timed.clear()
                start = time.perf_counter()
                step()
                steps[name].append(time.perf_counter() - start)
                sums[name].append(timed[0])
    print(f"{args.model}, batch {args.batch} x {args.seq}, vocab {args.vocab}: ms, medians of 64 steps each")
    for name in variants:
        print(f"  {name}: step {statistics.median(steps[name]) * 1e3:.2f}, "
              f"clipped_sum {statistics.median(sums[name]) * 1e3:.2f}")


if __name__ == "__main__":
    main()
