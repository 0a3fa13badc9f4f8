"""Banded-inverse mechanisms (bisr:P, bandinv:P) next to the baselines of seed 003's Table 4, and
next to the peer library opake (issue #13).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_banded_inverse.py [--n 2000] [--epochs 20]
        [--epsilon 8] [--delta 1e-5] [--bands 2,4,8] [--samples 32768] [--seed 0] [--no-opake]

Part 1 (the Table-4-style table): n steps in ``epochs`` epochs of b = n / epochs steps. For every
mechanism, ``rms_error = noise_std * ||A C^-1||_F / sqrt(n)`` (docs/design.md, as the planner
reports it) with noise_std calibrated to (epsilon, delta):

* w/o amplification: cyclic:K:B participation, exact Gaussian accounting (a guarantee);
* balls-in-bins:b: the planner's screening Monte Carlo *estimate* (2^15 samples by default, aimed
  at delta / 1.25, seed 000; only for C >= 0), not a guarantee;
* block-cyclic Poisson (tutorial Thm 3.21) for banded C with bands <= b, a guarantee with the
  planner's screening PLD discretization (pessimistic); DP-SGD: Poisson sampling (PLD).

Every C is designed for the unamplified cyclic participation (as the planner does) and reused.

Part 2 (opake): ``benchmarks/.venv-opake`` (see RESULTS.md for how it was installed) runs opake's
BISR and lambda-CGD sensitivity (``BisrStrategy.sensitivity``, ``LambdaCgdStrategy.sensitivity``)
and Toeplitz error (``opake.api.dpftrl.noise._toeplitz.mean_error``) in a child process; we print
its numbers next to ours (:func:`corrnoise.losses.loss_report`) and the relative difference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import time
from pathlib import Path

OPAKE_PY = Path(__file__).resolve().parent / ".venv-opake" / "bin" / "python"

# seed 003 Table 4 (rows whose bandwidth is identifiable; the header with the settings of each
# column was lost in the text conversion): first column "w/o Amp", second column the first
# amplified one. BISR's first two rows are bandwidths 2 and 4 (they equal ours in ratio to DP-SGD).
SEED_TABLE4 = {
    "dpsgd": (83.85, 21.82), "bisr:2": (48.45, 30.52), "bisr:4": (33.47, 21.00),
    "dpcgd (row 1)": (12.73, 9.33), "dpcgd (row 2)": (14.74, 10.27), "dpcgd (row 3)": (19.72, 13.25),
    "bandinv (row 1)": (12.69, 9.70), "bandinv (row 2)": (10.27, 8.07), "bandinv (row 3)": (8.54, 6.56),
}


def mechanisms(n: int, part: str, bands: list[int], b: int):
    """(label, strategy, banded bands or None) of every row of the table."""
    from corrnoise.optimize import optimize_banded_toeplitz, optimize_blt
    from corrnoise.optimize.banded_inverse import optimize_banded_inverse
    from corrnoise.strategies import DPCGD, BandedInverseSqrt, BandedSqrt, Identity
    from corrnoise.strategies.toeplitz import BandedInverse

    rows = [("dpsgd", lambda: Identity(n), 1)]
    for beta in (0.8, 0.9, 0.95):
        rows.append((f"dpcgd:{beta:g}", lambda beta=beta: DPCGD(beta, n), None))
    for p in bands:
        rows.append((f"bandinv:{p}", lambda p=p: BandedInverse(n, optimize_banded_inverse(n, p, part)), None))
    for p in bands:
        rows.append((f"bisr:{p}", lambda p=p: BandedInverseSqrt(n, p), None))
    rows.append(("blt", lambda: optimize_blt(n, participation=part), None))
    for p in bands:
        rows.append((f"bsr:{p}", lambda p=p: BandedSqrt(n, p), p if p <= b else None))
    for p in bands:
        rows.append((f"bandmf:{p}", lambda p=p: optimize_banded_toeplitz(n, p, participation=part), p if p <= b else None))
    return rows


def table(n: int, epochs: int, epsilon: float, delta: float, bands: list[int], samples: int, seed: int) -> list[dict]:
    from corrnoise.losses import error_summary, loss_report
    from corrnoise.planner.core import _calibrate

    b = n // epochs
    part = f"cyclic:{epochs}:{b}"
    p_step = 1.0 / b
    out = []
    for label, build, banded in mechanisms(n, part, bands, b):
        t0 = time.perf_counter()
        s = build()
        mean_error, _ = error_summary(s)
        row = {"mechanism": label, "strategy": s.label, "nonnegative": bool(s.is_nonnegative()),
               "rms_loss": loss_report(s, part).rms_loss}
        res, _ = _calibrate(s, "none", part, epsilon, delta, screen=False)
        row["none"] = res.noise_std * mean_error
        if row["nonnegative"]:
            res, _ = _calibrate(s, f"balls-in-bins:{b}", None, epsilon, delta, screen=True, seed=seed,
                                screen_samples=samples)
            row["bnb"], row["bnb_kind"] = res.noise_std * mean_error, res.kind
        if label == "dpsgd":
            res, _ = _calibrate(s, f"poisson:{p_step!r}", None, epsilon, delta, screen=True)
            row["poisson"] = res.noise_std * mean_error
        elif banded is not None:
            res, _ = _calibrate(s, f"block-cyclic:{banded}:{min(1.0, p_step * banded)!r}", None, epsilon, delta,
                                screen=True)
            row["poisson"] = res.noise_std * mean_error
        row["seconds"] = time.perf_counter() - t0
        out.append(row)
    return out


def print_table(rows: list[dict], n: int, epochs: int, epsilon: float, delta: float, samples: int) -> None:
    dp = next(r for r in rows if r["mechanism"] == "dpsgd")
    print(f"n = {n} ({epochs} epochs of {n // epochs} steps), epsilon {epsilon:g}, delta {delta:g}; rms_error = "
          f"noise_std * ||A C^-1||_F / sqrt(n); balls-in-bins: Monte Carlo estimate ({samples} samples)\n")
    print("| mechanism | C >= 0 | rms_loss (cyclic) | w/o amp (Gaussian) | / DP-SGD | balls-in-bins (estimate) "
          "| block-cyclic Poisson | seconds |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        bnb = f"{r['bnb']:.2f}" if "bnb" in r else "-"
        poi = f"{r['poisson']:.2f}" if "poisson" in r else "-"
        if r["mechanism"] == "dpsgd" and "poisson" in r:
            poi += " (Poisson)"
        print(f"| {r['mechanism']} ({r['strategy']}) | {'yes' if r['nonnegative'] else 'no'} | {r['rms_loss']:.3f} | "
              f"{r['none']:.2f} | {r['none'] / dp['none']:.4f} | {bnb} | {poi} | {r['seconds']:.1f} |")
    print("\nseed 003 Table 4 (ratio of the w/o-amp column to its DP-SGD entry 83.85):\n")
    print("| seed row | w/o amp | / DP-SGD | first amplified column |")
    print("|---|---:|---:|---:|")
    for name, (plain, amp) in SEED_TABLE4.items():
        print(f"| {name} | {plain:.2f} | {plain / SEED_TABLE4['dpsgd'][0]:.4f} | {amp:.2f} |")


# ------------------------------------------------------------------------------ opake
_OPAKE_CHILD = r"""
import json, sys, torch
from opake.api.dpftrl.noise._bisr import bisr_strategy
from opake.api.dpftrl.noise._lambda_cgd import lambda_cgd_strategy
from opake.api.dpftrl.noise import _toeplitz as T
n, b, k = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
bands = [int(x) for x in sys.argv[4].split(",")]
betas = [float(x) for x in sys.argv[5].split(",")]
def err(inv):
    inv = torch.nn.functional.pad(torch.tensor(inv, dtype=torch.float64), (0, n - len(inv)))
    return float(T.mean_error(noising_coef=inv, n=n)) ** 0.5
out = []
for name, make, inv in ([(f"bisr:{p}", lambda norm, p=p: bisr_strategy(bandwidth=p, normalized=norm), None) for p in bands]
                        + [(f"dpcgd:{x:g}", lambda norm, x=x: lambda_cgd_strategy(lambda_=x, normalized=norm), [1.0, -x]) for x in betas]):
    for norm in (False, True):
        s = make(norm)
        q = list(s._inv_coefs()) if inv is None else inv
        row = {"name": name + ("+colnorm" if norm else ""), "mean_error_plain": err(q)}
        for part, ms, kk in (("single", 1, 1), ("cyclic", b, k)):
            row["sens_" + part] = s.sensitivity(n_steps=n, min_sep=ms, max_participations=kk)
        out.append(row)
print(json.dumps(out))
"""


def opake_numbers(n: int, epochs: int, bands: list[int], betas: list[float]) -> list[dict] | None:
    if not OPAKE_PY.exists():
        print(f"(no opake venv at {OPAKE_PY}; skipped)")
        return None
    out = subprocess.run([str(OPAKE_PY), "-c", _OPAKE_CHILD, str(n), str(n // epochs), str(epochs),
                          ",".join(map(str, bands)), ",".join(map(str, betas))],
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": ""})
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_opake(rows: list[dict], n: int, epochs: int) -> None:
    from corrnoise.losses import loss_report
    from corrnoise.strategies import parse_strategy

    part = f"cyclic:{epochs}:{n // epochs}"
    print(f"\nopake next to corrnoise, n = {n}; 'cyclic' = corrnoise {part} / opake min_sep = {n // epochs}, "
          f"max_participations = {epochs}. rms_loss = sens * mean_error (opake: sens from its strategy, "
          "mean_error from _toeplitz.mean_error of the unnormalized C^-1)\n")
    print("| mechanism | participation | sens opake | sens ours | rel. diff | rms_loss opake | rms_loss ours | rel. diff |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        s = parse_strategy(row["name"], n)
        for key, spec in (("single", "single"), ("cyclic", part)):
            r = loss_report(s, spec)
            theirs_sens = row["sens_" + key]
            theirs_loss = theirs_sens * row["mean_error_plain"]
            plain = "+colnorm" not in row["name"]
            loss_s = f"{theirs_loss:.6f}" if plain else "-"
            diff_l = f"{theirs_loss / r.rms_loss - 1:+.2e}" if plain else "-"
            print(f"| {row['name']} | {key} | {theirs_sens:.6f} | {r.sensitivity:.6f} | "
                  f"{theirs_sens / r.sensitivity - 1:+.2e} | {loss_s} | {r.rms_loss:.6f} | {diff_l} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--bands", default="2,4,8")
    ap.add_argument("--samples", type=int, default=1 << 15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-opake", action="store_true")
    ap.add_argument("--no-table", action="store_true")
    args = ap.parse_args()
    bands = [int(x) for x in args.bands.split(",")]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    if not args.no_table:
        rows = table(args.n, args.epochs, args.epsilon, args.delta, bands, args.samples, args.seed)
        print_table(rows, args.n, args.epochs, args.epsilon, args.delta, args.samples)
    if not args.no_opake:
        theirs = opake_numbers(args.n, args.epochs, bands, [0.5, 0.8, 0.9, 0.95])
        if theirs is not None:
            print_opake(theirs, args.n, args.epochs)
    print(f"\n{os.cpu_count()} cores, load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at end; "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
