"""Balls-in-bins Monte Carlo accounting benchmark (issue #4 item 5, seed 000).

Calibrates and formally verifies (epsilon = 4, delta = 1e-5) for ``bsr:64``, n = 2048, 128 bins
(16 epochs), and measures the cost per sample of our reduced (bins-dimensional) sampler next to
jax-privacy 2.0.0's ``experimental.monte_carlo`` sampler (n-dimensional), run in the same session
from the side venv ``.venv-jax`` (git-ignored; ``python3 -m venv .venv-jax &&
.venv-jax/bin/pip install jax-privacy==2.0.0``).  Both samplers are also cross-checked: their
delta estimates at a moderate epsilon must agree within 4 combined standard errors.

    .venv/bin/python benchmarks/bench_montecarlo.py            # full run (~5-15 min on 2 cores)
    .venv/bin/python benchmarks/bench_montecarlo.py --quick    # smaller sample sizes, no verification

Prints a markdown section for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from corrnoise.accounting import montecarlo as mc
from corrnoise.strategies import parse_strategy

ROOT = Path(__file__).resolve().parents[1]
JAX_PYTHON = ROOT / ".venv-jax" / "bin" / "python"

JAX_SCRIPT = r"""
import json, sys, time, os
import numpy as np
from jax_privacy import batch_selection
from jax_privacy.experimental.monte_carlo import sample_generation as sg
args = json.loads(sys.argv[1])
c_col = np.asarray(args["c_col"], dtype=np.float64)
strategy = batch_selection.BallsInBinsSampling(iterations=args["n"], cycle_length=args["bins"])
out = {}
# cost per sample (one adjacency per sample), timed on the add side and the remove side
for name, positive in (("add", True), ("remove", False)):
    k = args["timing_samples"]
    t = time.perf_counter()
    sg.get_privacy_loss_sample(strategy, args["nu"], c_col, seed=1, positive_sample=positive, num_samples=k)
    out[f"seconds_per_sample_{name}"] = (time.perf_counter() - t) / k
# cross-check: delta at a moderate epsilon
eps = args["check_epsilon"]
for name, positive in (("add", True), ("remove", False)):
    y, _ = sg.get_privacy_loss_sample(strategy, args["check_nu"], c_col, seed=2, positive_sample=positive,
                                      num_samples=args["check_samples"])
    f = np.clip(1.0 - np.exp(eps - y), 0.0, None)
    out[f"check_delta_{name}"] = float(f.mean())
    out[f"check_se_{name}"] = float(f.std(ddof=1) / np.sqrt(f.size))
out["check_samples"] = args["check_samples"]
print(json.dumps(out))
"""


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:  # pragma: no cover
        return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_jax(args: dict) -> dict | None:
    if not JAX_PYTHON.exists():
        print(f"(jax-privacy side venv {JAX_PYTHON} missing; skipping the comparison)", file=sys.stderr)
        return None
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([str(JAX_PYTHON), "-c", JAX_SCRIPT, json.dumps(args)], capture_output=True, text=True,
                          env=env, cwd=str(ROOT / "benchmarks"))
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small sample sizes, no formal verification")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--bins", type=int, default=128)
    ap.add_argument("--bands", type=int, default=64)
    ap.add_argument("--epsilon", type=float, default=4.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    opts = ap.parse_args()
    n, bins = opts.n, opts.bins
    lines = []
    load_start = uptime()
    strategy = parse_strategy(f"bsr:{opts.bands}", n)

    # --- the whole pipeline: calibrate (Algorithm 2), then verify on a fresh sample (EVR) -----------
    t0 = time.perf_counter()
    red = mc.reduce_balls_in_bins(strategy, bins)
    t_reduce = time.perf_counter() - t0
    progress = sys.stderr.isatty()
    t0 = time.perf_counter()
    if opts.quick:
        res = mc.account_balls_in_bins(strategy, bins, delta=opts.delta, epsilon=opts.epsilon, verify=False,
                                       samples=1 << 20, seed=opts.seed, progress=progress)
    else:
        res = mc.account_balls_in_bins(strategy, bins, delta=opts.delta, epsilon=opts.epsilon, verify=True,
                                       seed=opts.seed, progress=progress)
    t_total = time.perf_counter() - t0 + t_reduce
    load_after_account = uptime()

    # --- cost per sample of our sampler (both adjacencies from one reduced draw) ---------------------
    timing_samples = 1 << (19 if opts.quick else 21)
    t0 = time.perf_counter()
    mc.estimate_delta(strategy, bins, res.noise_std, opts.epsilon, samples=timing_samples, seed=99, _reduced=red)
    ours = (time.perf_counter() - t0) / timing_samples
    t0 = time.perf_counter()
    mc.estimate_delta(strategy, bins, res.noise_std, opts.epsilon, samples=timing_samples // 4, seed=98,
                      workers=1, _reduced=red)
    ours_1 = (time.perf_counter() - t0) / (timing_samples // 4)

    # --- cross-check with jax-privacy at a moderate epsilon (delta ~ 1e-2: resolvable by both) -------
    check_eps = 1.0
    check_nu = res.noise_std
    e = mc.estimate_epsilon(strategy, bins, check_nu, 2e-2, samples=1 << 18, seed=5, _reduced=red)
    check_eps = round(e.epsilon, 2)
    ref = mc.estimate_delta(strategy, bins, check_nu, check_eps, samples=1 << 21, seed=6, _reduced=red)
    coeffs = strategy.matrix()[: opts.bands, 0]
    jax_args = {"n": n, "bins": bins, "nu": res.noise_std, "c_col": coeffs.tolist(),
                "timing_samples": 100 if opts.quick else 300, "check_nu": check_nu, "check_epsilon": check_eps,
                "check_samples": 500 if opts.quick else 4000}
    load_before_jax = uptime()
    jax = run_jax(jax_args)
    load_end = uptime()

    # --- report -------------------------------------------------------------------------------------
    d = res.to_dict()
    lines.append("## Balls-in-bins Monte Carlo accounting (issue #4 item 5) — `benchmarks/bench_montecarlo.py`")
    lines.append("")
    lines.append(f"Command: `.venv/bin/python benchmarks/bench_montecarlo.py{' --quick' if opts.quick else ''}` "
                 f"({platform.machine()}, {os.cpu_count()} cores, numpy {np.__version__}).")
    lines.append(f"Load: start `{load_start}`; after accounting `{load_after_account}`; "
                 f"before jax-privacy `{load_before_jax}`; end `{load_end}`.")
    lines.append("")
    lines.append(f"`bsr:{opts.bands}`, n = {n}, balls-in-bins with {bins} bins ({n // bins} epochs), target "
                 f"(epsilon = {opts.epsilon:g}, delta = {opts.delta:g}), seed {opts.seed}:")
    lines.append("")
    lines.append("| what | value |")
    lines.append("|---|---|")
    lines.append(f"| total wall time (reduce + Algorithm 2 + verification) | {t_total:.1f} s |")
    lines.append(f"| reduction to the {bins}x{bins} Gram matrix + Cholesky | {t_reduce:.2f} s |")
    lines.append(f"| calibrated noise_std (nu) / noise_multiplier (nu / max col norm) | "
                 f"{res.noise_std:.5f} / {res.noise_multiplier:.5f} |")
    if "calibration_samples" in d:
        lines.append(f"| calibration samples / delta_hat evaluations | {d['calibration_samples']} / "
                     f"{d['calibration_evaluations']} |")
    if res.verified is not None:
        lines.append(f"| verification (fresh sample): samples | {res.samples} |")
        lines.append(f"| delta_add +- se / delta_remove +- se | {res.delta_add:.3e} +- {res.std_error_add:.1e} / "
                     f"{res.delta_remove:.3e} +- {res.std_error_remove:.1e} (threshold delta/tau = "
                     f"{d['verify_threshold']:.1e}) |")
        lines.append(f"| verified / failure probability (Thm 2.2, both adjacencies) | {res.verified} / "
                     f"{res.failure_probability:.2e} |")
        lines.append(f"| formal guarantee | ({res.epsilon:g}, {res.delta:g})-DP |" if res.verified else
                     "| formal guarantee | none (verification failed) |")
    else:
        lines.append(f"| delta_add / delta_remove (estimate) | {res.delta_add:.3e} / {res.delta_remove:.3e} |")
    lines.append(f"| ours: seconds per sample, 2 threads (one draw gives add and remove) | {ours * 1e6:.2f} us |")
    lines.append(f"| ours: seconds per sample, 1 thread | {ours_1 * 1e6:.2f} us |")
    if jax is not None:
        theirs = 0.5 * (jax["seconds_per_sample_add"] + jax["seconds_per_sample_remove"])
        lines.append(f"| jax-privacy 2.0.0 `experimental.monte_carlo`: seconds per sample (add / remove, one "
                     f"adjacency each) | {jax['seconds_per_sample_add'] * 1e3:.2f} ms / "
                     f"{jax['seconds_per_sample_remove'] * 1e3:.2f} ms |")
        lines.append(f"| speed-up per sample (theirs, one adjacency / ours, both) | {theirs / ours:.0f}x |")
        for name in ("add", "remove"):
            ours_d = ref.delta_add if name == "add" else ref.delta_remove
            ours_se = ref.std_error_add if name == "add" else ref.std_error_remove
            z = (jax[f"check_delta_{name}"] - ours_d) / math.hypot(jax[f"check_se_{name}"], ours_se)
            lines.append(f"| cross-check delta_{name}(eps = {check_eps:g}) at nu = {check_nu:.4f}: ours "
                         f"({ref.samples} samples) vs jax-privacy ({jax['check_samples']}) | {ours_d:.4e} +- "
                         f"{ours_se:.1e} vs {jax[f'check_delta_{name}']:.4e} +- {jax[f'check_se_{name}']:.1e} "
                         f"(z = {z:+.2f}) |")
    else:
        lines.append("| jax-privacy comparison | skipped (no .venv-jax) |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
