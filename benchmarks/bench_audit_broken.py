"""Sensitivity of the white-box many-run audit at the run's own delta (issue #28): each broken
noise path of tests/test_audit.py (BROKEN: fixtures that patch the noise path) audited with
``--runs`` runs x 64 worst-case canaries (192 digits examples, batch 64, 2 epochs = 8 steps),
calibrated to (--epsilon, 1e-5); the 95% lower bound against the claimed epsilon.

    PYTHONPATH=src:tests python benchmarks/bench_audit_broken.py [--runs 1000] [--epsilon 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import test_audit  # the fixtures live with the tests (not code a user can reach)

from corrnoise.torch.audit import AuditSetup, audit_many_runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--epsilon", type=float, default=2.0)
    args = ap.parse_args()
    for name, (mechanism, patch, score) in test_audit.BROKEN.items():
        t0 = time.perf_counter()
        setup = AuditSetup.digits(examples=192, mechanism=mechanism, batching="cyclic", epsilon=args.epsilon,
                                  delta=1e-5, batch_size=64, epochs=2, canaries=64)
        res = audit_many_runs(setup, args.runs, score=score, patch=patch, select_fraction=0.3)
        claimed = res.extras["epsilon_guarantee"]
        print(json.dumps({"broken": name, "score": score, "runs": args.runs, "trials": res.extras["trials"],
                          "epsilon_claimed": claimed, "epsilon_lower": res.epsilon_lower,
                          "flagged": res.epsilon_lower > claimed, "seconds": round(time.perf_counter() - t0, 1),
                          "load": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()
