"""MMCC speed and tightness (issue #4 item 4, seed 001).

Times ``mmcc_epsilon`` (full delta-split search) and its lower-bound variant (p~ = p, seed 001
"Tightness") on the issue's two targets, at noise levels giving epsilon in a realistic range,
and prints a markdown table for benchmarks/RESULTS.md:

* ``toeplitz-sqrt``, n = 512, Poisson p = 1/16 (target: under 2 minutes);
* ``bsr:64``, n = 2048, Poisson p = 1/128 (target: under 10 minutes; the paper reports hours
  for n >= 2000).

Plus one generalized-MMCC row (block-cyclic, bands <= blocks) against the tutorial Thm 3.21
reduction.  Usage: ``.venv/bin/python benchmarks/bench_mmcc.py [--quick]``.

``--sweep`` (issue #12) instead tabulates tightness across noise multipliers {1, 2, 4, 8, 16} for
``toeplitz-sqrt``, n = 512, Poisson p = 1/16, delta = 1e-6: the reported guarantee (the smallest
of MMCC, the Renyi mixture bound and the unamplified analysis), MMCC alone, the Renyi bound, the
p~ = p lower bound, the ratios, the unamplified Gaussian epsilon, and the same for block-cyclic sampling
(``--blocks``, default 16 blocks at rate 1/2) where the unamplified analysis of that schedule is a
competing guarantee.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from corrnoise.accounting.mmcc import mmcc_epsilon
from corrnoise.strategies import parse_strategy

DELTA = 1e-6
CASES = [
    # (mechanism, n, p, noise_std, blocks)
    ("toeplitz-sqrt", 512, 1 / 16, 24.0, 1),
    ("toeplitz-sqrt", 512, 1 / 16, 36.0, 1),
    ("bsr:64", 2048, 1 / 128, 10.0, 1),
    ("bsr:64", 2048, 1 / 128, 20.0, 1),
    ("bsr:64", 2048, 1 / 2, 4.0, 64),  # block-cyclic, 64 blocks at rate 1/2: = Thm 3.21
]


def _load() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "n/a"


SWEEP_MULTIPLIERS = (1.0, 2.0, 4.0, 8.0, 16.0)


def _sweep_discretization(mult: float) -> float:
    """Loss-grid step for the sweep: the default 1e-4 from multiplier 4 up; coarser below, where
    epsilon is in the hundreds (pessimistic rounding costs at most rows x step in epsilon)."""
    return 1e-4 if mult >= 4 else (1e-3 if mult >= 2 else 1e-2)


def sweep(multipliers, blocks: int, block_p: float, batchings: str) -> None:
    """MMCC / lower-bound ratios across noise multipliers (issue #12), Poisson and block-cyclic."""
    n, p = 512, 1 / 16
    strat = parse_strategy("toeplitz-sqrt", n)
    col = float(strat.column_norms_squared().max()) ** 0.5
    print("| batching | sigma | noise_std | loss step | eps reported (guarantee) | eps MMCC alone | eps Renyi mixture "
          "| eps lower (p~=p) | reported / lower | MMCC alone / lower | eps unamplified | binding | max p~/p "
          "| delta_1/delta | s MMCC | s lower | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|")
    schedules = [("poisson:1/16", 1, p), (f"block-cyclic:{blocks}:{block_p:g}", blocks, block_p)]
    schedules = [sc for sc, keep in zip(schedules, ("poisson" in batchings, "block" in batchings)) if keep]
    for label, bl, pp in schedules:
        for mult in sorted(multipliers, reverse=True):
            nu = mult * col
            step = _sweep_discretization(mult)
            load = _load()
            t0 = time.perf_counter()
            res = mmcc_epsilon(strat, n, pp, nu, DELTA, blocks=bl, loss_discretization=step)
            t_up = time.perf_counter() - t0
            t0 = time.perf_counter()
            low = mmcc_epsilon(strat, n, pp, nu, DELTA, blocks=bl, lower_bound=True, loss_discretization=step)
            t_low = time.perf_counter() - t0
            x = res.extras
            print(f"| {label} | {mult:g} | {nu:.4f} | {step:g} | {res.epsilon:.4g} | {x['epsilon_mmcc']:.4g} "
                  f"| {x['epsilon_renyi']:.4g} | {low.epsilon:.4g} | {res.epsilon / low.epsilon:.2f} "
                  f"| {x['epsilon_mmcc'] / low.epsilon:.2f} | {x['epsilon_unamplified']:.4g} | {x['binding']} "
                  f"| {x['max_p_tilde_ratio']:.2f} | {x.get('delta_split', 0):g} | {t_up:.1f} | {t_low:.1f} "
                  f"| {load} |", flush=True)
    print(f"\ndelta = {DELTA:g}; load after: {_load()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="only the first case of each mechanism")
    parser.add_argument("--no-lower", action="store_true", help="skip the lower-bound variant")
    parser.add_argument("--sweep", action="store_true", help="issue #12 tightness sweep over noise multipliers")
    parser.add_argument("--multipliers", type=float, nargs="+", default=list(SWEEP_MULTIPLIERS))
    parser.add_argument("--blocks", type=int, default=16, help="block-cyclic blocks in the sweep")
    parser.add_argument("--block-p", type=float, default=0.5, help="block-cyclic sampling rate in the sweep")
    parser.add_argument("--batchings", default="poisson,block", help="which schedules the sweep runs")
    args = parser.parse_args()
    if args.sweep:
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
        sweep(args.multipliers, args.blocks, args.block_p, args.batchings)
        return
    cases = CASES[::2] if args.quick else CASES
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    rows = []
    for name, n, p, nu, blocks in cases:
        strat = parse_strategy(name, n)
        load_before = _load()
        t0 = time.perf_counter()
        res = mmcc_epsilon(strat, n, p, nu, DELTA, blocks=blocks)
        t_upper = time.perf_counter() - t0
        lower = None
        t_lower = float("nan")
        if not args.no_lower:
            t0 = time.perf_counter()
            lower = mmcc_epsilon(strat, n, p, nu, DELTA, blocks=blocks, lower_bound=True)
            t_lower = time.perf_counter() - t0
        ref = ""
        if blocks > 1 and strat.bands <= blocks:
            from corrnoise.accounting import account

            ref_res = account(strat, f"block-cyclic:{blocks}:{p}", noise_std=nu, delta=DELTA, method="bandmf")
            ref = f"bandmf {ref_res.epsilon:.4f}"
        x = res.extras
        rows.append(
            f"| `{name}` | {n} | {'poisson' if blocks == 1 else f'block-cyclic:{blocks}'}:{p:g} | {nu:g} "
            f"| {res.noise_multiplier:.3f} | {res.epsilon:.4f} | {x['epsilon_mmcc']:.4f} | {x['epsilon_renyi']:.4f} "
            f"| {x['binding']} | {lower.epsilon if lower else float('nan'):.4f} "
            f"| {x['epsilon_unamplified']:.1f} | {x['max_p_tilde_ratio']:.2f} | {x.get('delta_split', 0):g} "
            f"| {x['unique_rows']}/{x['rows']} | {t_upper:.1f} | {t_lower:.1f} | {load_before} | {ref} |"
        )
        print(rows[-1], flush=True)
    print()
    print("| mechanism | n | batching | noise_std | sigma | eps reported | eps MMCC alone | eps Renyi | binding "
          "| eps lower (p~=p) | eps unamplified "
          "| max p~/p | delta_1/delta | unique/rows | s MMCC | s lower | load (1/5/15 min) | reference |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for row in rows:
        print(row)
    print(f"\ndelta = {DELTA:g}; load after: {_load()}")


if __name__ == "__main__":
    main()
