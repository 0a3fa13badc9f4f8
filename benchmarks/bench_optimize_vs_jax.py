"""Strategy optimization: corrnoise vs jax-privacy 2.0.0, side by side in one run (issue #3).

Cases (issue #3 acceptance):
  dense            n = 1024, RMS loss, single participation
  banded-toeplitz  n = 10^5, 64 bands, RMS loss
  blt              n = 10^6, max loss (number of buffers chosen automatically by both)

Each side is timed end to end (ours in this process; jax-privacy in a subprocess running the
separate venv's python, timed inside the worker, JIT compilation included). Both results are
then evaluated by OUR loss code (corrnoise.losses.loss_report) on the returned parameters.
Acceptance: our loss <= jax's loss * 1.001 and jax_seconds / our_seconds >= 5.

Setup (once): python3 -m venv .venv-jax && .venv-jax/bin/pip install jax-privacy==2.0.0
Run:          .venv/bin/python benchmarks/bench_optimize_vs_jax.py [--cases dense,banded-toeplitz,blt]
              [--tables] [--no-jax]
Prints a Markdown section for benchmarks/RESULTS.md.

The script is also its own jax worker: ``--jax-worker CASE --out FILE`` (stdlib + jax only).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JAX_PYTHON = ROOT / ".venv-jax" / "bin" / "python"

CASES = {
    "dense": {"n": 1024, "objective": "rms"},
    "banded-toeplitz": {"n": 100_000, "bands": 64, "objective": "rms"},
    "blt": {"n": 1_000_000, "objective": "max"},
}
# jax-privacy seconds measured on this 2-core machine when the issue was written.
ISSUE_JAX_SECONDS = {"dense": 76.0, "banded-toeplitz": 193.0, "blt": 34.0}


# ----------------------------------------------------------------------------- jax worker
def jax_worker(case: str, out: str) -> None:
    import numpy as np

    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from jax_privacy.matrix_factorization import buffered_toeplitz, dense, toeplitz

    spec = CASES[case]
    t0 = time.perf_counter()
    if case == "dense":
        c = np.asarray(dense.optimize(spec["n"], reduction_fn=jnp.mean))
        arrays = {"matrix": c}
    elif case == "banded-toeplitz":
        coef = toeplitz.optimize_banded_toeplitz(spec["n"], spec["bands"], reduction_fn=jnp.mean)
        arrays = {"coefficients": np.asarray(coef)}
    elif case == "blt":
        blt = buffered_toeplitz.optimize(n=spec["n"], error="max")
        arrays = {"alpha": np.asarray(blt.output_scale), "lam": np.asarray(blt.buf_decay)}
    else:  # pragma: no cover
        raise SystemExit(f"unknown case {case}")
    for v in arrays.values():
        np.asarray(v).sum()  # make sure everything is computed before stopping the clock
    seconds = time.perf_counter() - t0
    np.savez(out, seconds=seconds, **arrays)


# ----------------------------------------------------------------------------- ours
def run_ours(case: str):
    """(strategy, seconds) or (None, reason) when our optimizer is not available."""
    spec = CASES[case]
    if case == "dense":
        try:
            from corrnoise.optimize.dense import optimize_dense
        except ImportError:
            return None, "pending: corrnoise.optimize.dense not available yet"
        t0 = time.perf_counter()
        strategy = optimize_dense(spec["n"], objective=spec["objective"])
        return strategy, time.perf_counter() - t0
    if case == "banded-toeplitz":
        from corrnoise.optimize.toeplitz import optimize_banded_toeplitz

        t0 = time.perf_counter()
        strategy = optimize_banded_toeplitz(spec["n"], spec["bands"], objective=spec["objective"])
        return strategy, time.perf_counter() - t0
    from corrnoise.optimize.blt import optimize_blt

    t0 = time.perf_counter()
    strategy = optimize_blt(spec["n"], objective=spec["objective"])
    return strategy, time.perf_counter() - t0


def run_jax(case: str):
    """(strategy, seconds) from the jax-privacy worker, or (None, reason)."""
    import numpy as np

    from corrnoise.strategies import BLT, Dense, Toeplitz

    if not JAX_PYTHON.exists():
        return None, f"no {JAX_PYTHON.relative_to(ROOT)} (see the module docstring for the setup)"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.npz")
        proc = subprocess.run(
            [str(JAX_PYTHON), str(Path(__file__).resolve()), "--jax-worker", case, "--out", out],
            capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        if proc.returncode != 0:
            return None, "jax worker failed: " + proc.stderr.strip().splitlines()[-1]
        data = dict(np.load(out))
    n = CASES[case]["n"]
    seconds = float(data["seconds"])
    if case == "dense":
        return Dense(np.tril(data["matrix"])), seconds
    if case == "banded-toeplitz":
        c = data["coefficients"]
        return Toeplitz(c / c[0], n), seconds
    return BLT(data["alpha"], data["lam"], n), seconds


def loss_of(strategy, case: str) -> float:
    from corrnoise.losses import loss_report

    r = loss_report(strategy)
    return r.rms_loss if CASES[case]["objective"] == "rms" else r.max_loss


def describe(strategy) -> str:
    kind = type(strategy).__name__
    if kind == "BLT":
        return f"d={strategy.alpha.size}"
    if kind == "Toeplitz":
        return f"bands={strategy.bands}"
    return kind.lower()


# ----------------------------------------------------------------------------- tables
TABLE_22_BLT = {8: 1.723, 16: 1.944, 32: 2.168, 64: 2.391, 128: 2.61, 256: 2.832, 512: 3.054,
                1024: 3.273, 2048: 3.494, 4096: 3.716, 8192: 3.939}
TABLE_23_BLT = {8: 1.544, 16: 1.751, 32: 1.964, 64: 2.18, 128: 2.398, 256: 2.617, 512: 2.837,
                1024: 3.057, 2048: 3.278, 4096: 3.499, 8192: 3.72}
TABLE_23_TOEPLITZ = {8: 1.544, 16: 1.75, 32: 1.963, 64: 2.179, 128: 2.397, 256: 2.616, 512: 2.836,
                     1024: 3.057, 2048: 3.277, 4096: 3.498, 8192: 3.718}


def tables() -> list[str]:
    from corrnoise.losses import loss_report
    from corrnoise.optimize.blt import optimize_blt
    from corrnoise.optimize.toeplitz import optimize_banded_toeplitz

    lines = ["| table | n | published | ours | slack | ok | seconds | params |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    jobs = [("2.3 Toeplitz (rms)", TABLE_23_TOEPLITZ, "rms", 0.002, "toeplitz"),
            ("2.2 BLT (max)", TABLE_22_BLT, "max", 0.003, "blt"),
            ("2.3 BLT (rms)", TABLE_23_BLT, "rms", 0.003, "blt")]
    for name, table, objective, slack, kind in jobs:
        for n, published in table.items():
            t0 = time.perf_counter()
            if kind == "toeplitz":
                s = optimize_banded_toeplitz(n, n, objective=objective)
            else:
                s = optimize_blt(n, objective=objective)
            sec = time.perf_counter() - t0
            r = loss_report(s)
            val = r.rms_loss if objective == "rms" else r.max_loss
            ok = "yes" if val <= published + slack else "**NO**"
            lines.append(f"| {name} | {n} | {published} | {val:.4f} | +{slack} | {ok} | {sec:.2f} | {describe(s)} |")
            print(lines[-1], flush=True)
    return lines


# ----------------------------------------------------------------------------- main
def machine() -> str:
    load = os.getloadavg()
    return f"nproc={os.cpu_count()}, load average at start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jax-worker", choices=sorted(CASES))
    ap.add_argument("--out")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--no-jax", action="store_true", help="time ours only")
    ap.add_argument("--tables", action="store_true", help="also reproduce tutorial Tables 2.2/2.3 (BLT, Toeplitz)")
    args = ap.parse_args()
    if args.jax_worker:
        jax_worker(args.jax_worker, args.out)
        return

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    print(f"machine: {machine()}", flush=True)
    lines = [
        "| case | ours (s) | jax-privacy 2.0.0 (s) | speed-up | our loss | jax loss (our code) | loss ratio | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        ours, our_sec = run_ours(case)
        if ours is None:
            lines.append(f"| {case} | {our_sec} | | | | | | pending |")
            print(lines[-1], flush=True)
            continue
        our_loss = loss_of(ours, case)
        if args.no_jax:
            jax, jax_sec = None, "skipped"
        else:
            jax, jax_sec = run_jax(case)
        if jax is None:
            lines.append(f"| {case} | {our_sec:.2f} | {jax_sec} | | {our_loss:.5f} ({describe(ours)}) | | | |")
            print(lines[-1], flush=True)
            continue
        jax_loss = loss_of(jax, case)
        speed = jax_sec / our_sec
        ratio = our_loss / jax_loss
        ok = "yes" if (ratio <= 1.001 and speed >= 5.0) else "**NO**"
        lines.append(
            f"| {case} | {our_sec:.2f} | {jax_sec:.2f} | {speed:.1f}x | {our_loss:.5f} ({describe(ours)}) "
            f"| {jax_loss:.5f} ({describe(jax)}) | {ratio:.5f} | {ok} |"
        )
        print(lines[-1], flush=True)
    print(f"machine at end: {machine()}", flush=True)
    print("\n".join(lines))
    if args.tables:
        tables()  # prints its Markdown rows as it goes


if __name__ == "__main__":
    main()
