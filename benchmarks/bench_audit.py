"""White-box many-run audit of small make_private runs (issue #28): lower bound / guarantee per
mechanism and batching at epsilon 2, delta 1e-5, with the GDP estimate beside it and the time.

    PYTHONPATH=src python benchmarks/bench_audit.py [--runs 1600] [--canaries 64] [--cases "identity:cyclic;..."]

Setup: 256 - K digits examples + K canaries (K = --canaries, default 64; 1 = the first version's
one canary per run), batch 64, 2 epochs (8 steps), bias-free linear model, canary = a dead weight
coordinate (so the K canaries of a run are independent trials; under cyclic batching all sit in
the worst-case batch); score = whitened (uses C), threshold chosen on 30% of the trials,
Clopper-Pearson (95%) on the other 70%. One JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from corrnoise.torch.audit import AuditSetup, audit_many_runs

CASES = ["identity:cyclic", "bsr:4:cyclic", "blt:0.4,0.2:0.9,0.5:cyclic", "dpcgd:0.9:cyclic",
         "identity:poisson", "identity:balls-in-bins", "bsr:4:balls-in-bins", "dpcgd:0.9:balls-in-bins"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=1600)
    ap.add_argument("--canaries", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epsilon", type=float, default=2.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--score", default="whitened")
    ap.add_argument("--cases", default=";".join(CASES))
    args = ap.parse_args()
    cases = args.cases.split(";")
    for case in cases:
        mechanism, batching = case.rsplit(":", 1)
        t0 = time.perf_counter()
        setup = AuditSetup.digits(examples=4 * args.batch_size - args.canaries, mechanism=mechanism,
                                  batching=batching, epsilon=args.epsilon, delta=args.delta,
                                  batch_size=args.batch_size, epochs=2, canaries=args.canaries)
        res = audit_many_runs(setup, args.runs, score=args.score, select_fraction=0.3)
        d = res.to_dict()
        print(json.dumps({"mechanism": mechanism, "batching": batching, "runs": args.runs, "canaries": args.canaries,
                          "trials": d["trials"], "score": args.score,
                          "epsilon_guarantee": d["epsilon_guarantee"], "epsilon_lower": d["epsilon_lower"],
                          "ratio": d["epsilon_lower"] / d["epsilon_guarantee"],
                          "gdp_estimate": d["gdp_estimate"]["epsilon_estimate"], "auc": d["auc"],
                          "seconds_runs": d["seconds"], "seconds_total": round(time.perf_counter() - t0, 1),
                          "load": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()
