"""One-run audit of real MNIST-1D training runs (issue #28): black-box and white-box lower bounds
beside the run's guarantee, and the time the canaries cost.

    PYTHONPATH=src python benchmarks/bench_audit_run.py [--canaries 1000] [--cases "identity:2;bsr:4:8"]
        [--dataset mnist1d] [--epochs E] [--examples N] [--threads 1] [--out benchmarks/audit_run.jsonl]

Each case (mechanism:epsilon, delta 1e-5, the ``poisson`` pipeline) is
:func:`corrnoise.torch.audit.audit_training_run`: the dataset's default model and
hyperparameters, ``--canaries`` black-box canaries (random N(0, 1) signals with random labels,
score = minus the loss under the final model) and as many white-box canaries (dead input
coordinates, whitened score of the released updates), each in by a fair coin, replacing the
last training examples; Steinke-Nasr-Jagielski one-run bound at 95%. Then the same run without
canaries (same seeds) for the time overhead. One JSON line per case (also appended to --out).

``--overhead R``: instead, R repetitions of each case (with ``--epochs``, e.g. 2) timed with and
without canaries back to back, for a time overhead less exposed to the shared machine's load;
one line per case with every pair and the median ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from corrnoise.torch.audit import audit_training_run

CASES = ["identity:8", "bsr:4:8", "identity:2", "bsr:4:2"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="mnist1d")
    ap.add_argument("--canaries", type=int, default=1000)
    ap.add_argument("--cases", default=";".join(CASES))
    ap.add_argument("--batching", default="poisson")
    ap.add_argument("--epochs", type=float, default=None)
    ap.add_argument("--examples", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--overhead", type=int, default=0)
    args = ap.parse_args()
    if args.overhead:
        return overhead(args)
    for case in args.cases.split(";"):
        mechanism, epsilon = case.rsplit(":", 1)
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        out = audit_training_run(args.dataset, mechanism=mechanism, batching=args.batching, epsilon=float(epsilon),
                                 delta=1e-5, canaries=args.canaries, epochs=args.epochs, examples=args.examples,
                                 baseline=True, threads=args.threads, seed=args.seed)
        run = out["run"]
        line = {"case": case, **run}
        for kind in ("black_box", "white_box"):
            d = out[kind].to_dict()
            line[kind] = {k: d[k] for k in ("kind", "epsilon_lower", "confidence", "method", "canaries", "auc",
                                            "k_plus", "guesses", "correct", "included", "ratio")}
            if "gdp_lower" in d:
                line[kind]["gdp_lower"] = d["gdp_lower"]
        line.update(seconds_total=round(time.perf_counter() - t0, 1), load_before=load0, load_after=os.getloadavg()[0])
        text = json.dumps(line)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(text + "\n")


def overhead(args) -> None:
    """Loop seconds with / without canaries, ``args.overhead`` pairs per case."""
    import statistics

    for case in args.cases.split(";"):
        mechanism, epsilon = case.rsplit(":", 1)
        pairs = []
        for r in range(args.overhead):
            run = audit_training_run(args.dataset, mechanism=mechanism, batching=args.batching,
                                     epsilon=float(epsilon), delta=1e-5, canaries=args.canaries, epochs=args.epochs,
                                     examples=args.examples, baseline=True, threads=args.threads, seed=args.seed + r,
                                     gdp=False)["run"]
            pairs.append((run["seconds_with_canaries"], run["seconds_without_canaries"], os.getloadavg()[0]))
        line = {"case": case, "overhead_pairs": pairs, "steps": run["steps"], "canaries_per_kind": args.canaries,
                "median_ratio": statistics.median(a / b for a, b, _ in pairs),
                "ratio_of_minima": min(a for a, _, _ in pairs) / min(b for _, b, _ in pairs)}
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
