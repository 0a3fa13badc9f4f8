"""Diagnostic for issue #12 (NOT a guarantee): how small could MMCC's epsilon get with *any* valid
fixed-threshold probability tail bound?

Any valid set of thresholds b_gj (seed 001 Thm 4.3 step 3) must put each pair's threshold at
least at that pair's own (1 - delta_1) quantile of <theta, v_gj>, because the bad event contains
every single pair's event.  This script runs ``mmcc_epsilon`` with every pair at its own
(1 - delta_1) tail bound (``mixture_tail_threshold``, no union bound, no peeling), delta split
searched as usual: the floor of MMCC's framework (fixed p~ per pair from Lemma C.3 + conditional
composition), up to the tail bound's own slack (within a factor 3 in probability of the exact
quantile).  It monkeypatches the tails module, so it is a benchmark script, not library code.

Usage: ``PYTHONPATH=src .venv/bin/python benchmarks/mmcc_floor.py 16 8 4`` (noise multipliers;
toeplitz-sqrt, n = 512, Poisson p = 1/16, delta = 1e-6).
"""

from __future__ import annotations

import sys
import time

import numpy as np

import corrnoise.accounting.mmcc.driver as driver
import corrnoise.accounting.mmcc.tails as tails
from corrnoise.accounting.mmcc import mmcc_epsilon
from corrnoise.strategies import parse_strategy


def main() -> None:
    state: dict[str, float] = {}
    tail_threshold = tails.mixture_tail_threshold
    tail_bounds = tails.probability_tail_bounds
    tails.peeling_blocks = lambda off, last: (np.asarray(off), np.asarray(off))  # one block per pair
    tails.mixture_tail_threshold = lambda w, q, scale, delta: tail_threshold(w, q, scale, state["delta1"])

    def per_pair(cp, p, nu, delta1, starts=None):
        state["delta1"] = delta1  # each pair gets all of delta_1: no union bound
        return tail_bounds(cp, p, nu, delta1, starts)

    driver.probability_tail_bounds = per_pair
    n, p = 512, 1 / 16
    strat = parse_strategy("toeplitz-sqrt", n)
    col = float(strat.column_norms_squared().max()) ** 0.5
    for mult in map(float, sys.argv[1:] or ["8"]):
        t0 = time.perf_counter()
        res = mmcc_epsilon(strat, n, p, mult * col, 1e-6)
        print(f"sigma {mult:g}: floor eps {res.extras['epsilon_mmcc']:.4g} (delta split "
              f"{res.extras['delta_split']:g}, max p~/p {res.extras['max_p_tilde_ratio']:.2f}, "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
