"""Amplification-aware C for balls-in-bins vs the best BandMF + block-cyclic Poisson (issue #12).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_amplified.py --epsilons 1 2 4 8 16 \
        --out benchmarks/amplified_runs.jsonl
    PYTHONPATH=src .venv/bin/python benchmarks/bench_amplified.py --table benchmarks/amplified_runs.jsonl

Setup of seed 000 Sec. 5.1: n = 2048 steps = 16 epochs of 128 steps, delta = 1e-5.  Per epsilon:

* baseline: ``plan(steps=2048, epochs=16, only=bandmf)`` -- every bands count under block-cyclic
  Poisson (PLD, a guarantee), balls-in-bins and no amplification; the best block-cyclic one is
  finalized (full PLD) and is the number to beat;
* ours: :func:`corrnoise.planner.amplified.optimize_amplified` for each ``--kinds`` entry
  (``banded-toeplitz:128``: Toeplitz C with 128 bands = one epoch; ``blt:D``), from the family's
  best unamplified solution, finished by verified Estimate-Verify-Release (a guarantee).

One JSON line per (epsilon, method) with rms_error, noise_std, result kind and seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

N, EPOCHS, BINS, DELTA = 2048, 16, 128, 1e-5


def _emit(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def baseline(eps: float) -> dict:
    """The planner's --only bandmf number: the best bandmf + block-cyclic candidate, finalized."""
    from corrnoise.planner import best_final, plan

    t0 = time.perf_counter()
    planned = plan(steps=N, epochs=EPOCHS, epsilon=eps, delta=DELTA, only=("bandmf",))
    cand = best_final(planned.candidates, planned.setup, keep=lambda c: c.batching.startswith("block-cyclic"))
    rec = planned.recommended
    return {"method": "bandmf+block-cyclic", "mechanism": cand.mechanism, "batching": cand.batching,
            "rms_error": cand.rms_error, "noise_std": cand.noise_std, "kind": cand.kind,
            "planner_recommended": f"{rec.mechanism} {rec.batching}", "planner_rms_error": rec.rms_error,
            "seconds": time.perf_counter() - t0}


def amplified(eps: float, spec: str) -> dict:
    from corrnoise.planner.amplified import optimize_amplified

    kind, _, p = spec.partition(":")
    p = int(p) if p else None
    res = optimize_amplified(kind, N, BINS, eps, DELTA, bands=p if kind == "banded-toeplitz" else None,
                             buffers=p if kind == "blt" else None)
    row = res.to_dict()
    row.update(method=f"amplified {spec}", verified=bool(res.privacy.extras.get("verified")))
    row["kind"] = row.pop("result_kind")
    row["family"] = spec
    return row


def run(epsilons, kinds, out: str) -> None:
    for eps in epsilons:
        row = baseline(eps)
        _emit(out, {"epsilon": eps, "load": os.getloadavg()[0], **row})
        for spec in kinds:
            row = amplified(eps, spec)
            _emit(out, {"epsilon": eps, "load": os.getloadavg()[0], **row})


def table(path: str) -> None:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    base = {r["epsilon"]: r for r in rows if r["method"] == "bandmf+block-cyclic"}
    print("| epsilon | method | C | rms_error | noise_std | kind | vs best bandmf + block-cyclic | seconds |")
    print("|---:|---|---|---:|---:|---|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["epsilon"], r["method"] != "bandmf+block-cyclic", r["method"])):
        b = base.get(r["epsilon"])
        ratio = f"{100 * (r['rms_error'] / b['rms_error'] - 1):+.1f}%" if b else "-"
        c = r.get("mechanism") or r.get("strategy")
        if "improved" in r and not r["improved"]:
            c += " (start point kept)"
        print(f"| {r['epsilon']:g} | {r['method']} | {c} | {r['rms_error']:.3f} | {r['noise_std']:.3f} | "
              f"{r['kind']} | {ratio} | {r['seconds']:.0f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epsilons", type=float, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--kinds", nargs="*", default=["banded-toeplitz:128"])
    ap.add_argument("--out", default="benchmarks/amplified_runs.jsonl")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--table", metavar="JSONL")
    a = ap.parse_args(argv)
    if a.table:
        table(a.table)
        return
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    run(a.epsilons, a.kinds, a.out)


if __name__ == "__main__":
    main()
