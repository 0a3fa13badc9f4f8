"""``corrnoise plan --plot``: error vs epsilon of the leading families, and the recommended C.

Matplotlib (Agg) is imported only here.  The curves are screening numbers (coarse PLD, Monte Carlo
estimates) of each leading family's best candidate (its strategy and batching kept fixed) at a
few epsilons around the target: a picture of the trade-off, never a calibration to train with.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import CorrnoiseError
from .core import PlanResult, error_curve

#: Epsilons of the curves, relative to the target.
EPSILON_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
LEADING_FAMILIES = 4


def plot_plan(result: PlanResult, path: str | Path, seed: int | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setup = result.setup
    best: dict[str, object] = {}
    for cand in result.candidates:  # sorted by rms_error, feasible first
        if cand.feasible and cand.calibrated and cand.family not in best:
            best[cand.family] = cand
    leaders = list(best.values())[:LEADING_FAMILIES]
    epsilons = [setup.epsilon * f for f in EPSILON_FACTORS]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for cand in leaders:
        pts = [(e, r) for e, r in error_curve(cand, setup, epsilons, seed=seed) if r is not None]
        if pts:
            xs, ys = zip(*pts)
            ax1.plot(xs, ys, marker="o", label=f"{cand.mechanism} / {cand.batching}")
    ax1.axvline(setup.epsilon, color="gray", lw=0.8, ls=":")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("epsilon")
    ax1.set_ylabel("rms_error (screening)")
    ax1.set_title(f"n = {setup.n}, delta = {setup.delta:g}")
    ax1.legend(fontsize=8)

    rec = result.recommended
    strat = rec.strategy
    coeffs = getattr(strat, "toeplitz_coefficients", None)
    if coeffs is not None:
        c = np.asarray(coeffs)[: strat.n]
        inv = np.asarray(getattr(strat, "inverse_coefficients", np.zeros(0)))[: strat.n]
        label_c, label_i = "C (Toeplitz coefficients)", "C^-1 (Toeplitz coefficients)"
    else:
        label_c, label_i = "C first column", "C^-1 last row (reversed)"
        try:
            c = strat.matrix()[:, 0]
            inv = strat.noising_matrix()[-1][::-1]
        except CorrnoiseError:  # not materialized at this n (e.g. the online tree at n > 8192)
            c, inv = np.zeros(0), np.zeros(0)
    k = min(len(c), 128)
    ax2.plot(np.arange(k), c[:k], marker=".", label=label_c)
    if len(inv):
        ax2.plot(np.arange(min(k, len(inv))), inv[:k], marker=".", label=label_i)
    ax2.axhline(0.0, color="gray", lw=0.6)
    ax2.set_xlabel("lag")
    ax2.set_title(f"recommended: {rec.mechanism} / {rec.batching}")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
