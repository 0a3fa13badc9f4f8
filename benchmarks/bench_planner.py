"""Planner wall time and choice for the setups of "the first hour of a real user" (issue: fast auto).

Each case runs in a fresh interpreter (imports included, as a user sees it) and prints one JSON
line: the case, seconds, the recommended mechanism / batching / rms_error / noise_std, the load.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_planner.py readme adapter makerun cli50k
    PYTHONPATH=/path/to/old/src .venv/bin/python benchmarks/bench_planner.py readme   # another version

Cases:
  readme   make_private(mechanism="auto") on 2,048 x 20 features, batch 256, 10 epochs, (4, 1e-5)
  adapter  PrivacyEngine.make_private_with_epsilon on scikit-learn digits (1,437 train), batch 143,
           5 epochs (50 steps), mechanism auto, (8, 1e-5)
  makerun  the planning of `make run`: plan(20,000, batch 400, 10 epochs, (4, 1e-5)), pipeline auto
           (batch 200 before 2026-11-25 22:00 UTC)
  cli50k   `corrnoise plan --dataset-size 50000 --batch-size 500 --epochs 20 --epsilon 2 --delta 1e-5`
           (a subprocess; stdout is not a terminal)

The on-disk cache of verified guarantees (``$CORRNOISE_CACHE``) is whatever the environment says:
set ``CORRNOISE_CACHE=off`` for cold numbers, or a fresh directory twice for cold then warm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _rec(rec) -> dict:
    return {"mechanism": rec.mechanism, "batching": rec.batching, "rms_error": rec.rms_error,
            "noise_std": rec.noise_std, "accounting": rec.accounting, "kind": rec.kind}


def case_readme() -> dict:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from corrnoise.torch import make_private

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2048, 20, generator=g), torch.randint(0, 2, (2048,), generator=g)
    model = torch.nn.Linear(20, 2)
    loader = DataLoader(TensorDataset(x, y), batch_size=256)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    t0 = time.perf_counter()
    _, private, _ = make_private(model, opt, loader, mechanism="auto", epsilon=4.0, delta=1e-5, epochs=10,
                                 max_grad_norm=1.0)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "mechanism": getattr(private.strategy, "label", str(private.strategy)),
            "batching": str(private.batching), "noise_std": float(private.noise_std)}


def case_adapter() -> dict:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from corrnoise.datasets import digits
    from corrnoise.models import mlp
    from corrnoise.torch.opacus_adapter import PrivacyEngine

    x_train, y_train, _, _ = digits()
    data = TensorDataset(torch.as_tensor(x_train, dtype=torch.float32), torch.as_tensor(y_train))
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    t0 = time.perf_counter()
    _, private, _ = PrivacyEngine().make_private_with_epsilon(
        module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=143), target_epsilon=8.0,
        target_delta=1e-5, epochs=5, max_grad_norm=1.0)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "steps": private.steps,
            "mechanism": getattr(private.strategy, "label", str(private.strategy)),
            "batching": str(private.batching), "noise_std": float(private.noise_std)}


def case_makerun() -> dict:
    from corrnoise.planner import plan

    t0 = time.perf_counter()
    res = plan(dataset_size=20000, batch_size=400, epochs=10, epsilon=4.0, delta=1e-5)
    return {"seconds": time.perf_counter() - t0, **_rec(res.recommended)}


def case_cli50k() -> dict:
    cmd = [sys.executable, "-m", "corrnoise.cli", "plan", "--dataset-size", "50000", "--batch-size", "500",
           "--epochs", "20", "--epsilon", "2", "--delta", "1e-5", "--json", "--mechanism-file",
           os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench-plan-{os.getpid()}.json")]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if out.returncode:
        return {"seconds": seconds, "error": out.stderr.strip().splitlines()[-1:]}
    rec = json.loads(out.stdout)["recommended"]
    return {"seconds": seconds, **{k: rec.get(k) for k in ("mechanism", "batching", "rms_error", "noise_std",
                                                             "accounting", "kind")}}


CASES = {"readme": case_readme, "adapter": case_adapter, "makerun": case_makerun, "cli50k": case_cli50k}


def main(argv: list[str]) -> None:
    names = argv or list(CASES)
    if len(names) > 1 or os.environ.get("_BENCH_PLANNER_CHILD") != "1":
        for name in names:  # one fresh interpreter per case
            env = dict(os.environ, _BENCH_PLANNER_CHILD="1")
            t0 = time.perf_counter()
            load = _load()
            out = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, env=env)
            line = out.stdout.strip().splitlines()[-1:] if out.stdout.strip() else []
            rec = json.loads(line[0]) if line else {"case": name, "error": out.stderr.strip().splitlines()[-1:]}
            rec.update(process_seconds=round(time.perf_counter() - t0, 1), load_before=load, load_after=_load())
            print(json.dumps(rec), flush=True)
        return
    name = names[0]
    try:
        rec = CASES[name]()
    except Exception as exc:  # noqa: BLE001 - a benchmark reports what broke
        rec = {"error": f"{type(exc).__name__}: {exc}"}
    rec["case"] = name
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
