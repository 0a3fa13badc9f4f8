"""Noise-generation cost: old vs new seed-noise generator, and next to training steps.

    .venv/bin/python benchmarks/bench_noise.py --compare-only [--dim 1e7] [--rounds 15]
    .venv/bin/python benchmarks/bench_noise.py [--dim 1e7] [--steps 8] [--repeats 3]

``--compare-only`` (issue #8/#15) times, in one process and interleaved round by round (so
load from other processes hits all of them alike), one step of DP-SGD, bsr:4, BLT(4) and
DP-CGD with the new counter-based generator and with the old per-chunk torch.Generator loop
(frozen in benchmarks/old_seed_noise.py), next to one ``torch.randn(dim)``; it reports the
minimum and the median over the rounds and the ratios of the minima.

``--steady 'NAME;NAME'`` (issue #13) times the steady state of regenerated banded-inverse noise
(bisr:P, a bandinv mechanism file): every generator is first advanced ``--warm`` steps (>= P, so
each step regenerates all P seed rows), then the mechanisms are timed interleaved round by round
next to DP-SGD; memory is the generator's own account of what it holds beyond the returned
vector (``extra_memory_bytes``) and, measured, the peak RSS of a fresh process that runs the
same steps (``ru_maxrss``), minus DP-SGD's.

Without it, prints a markdown section for benchmarks/RESULTS.md: `corrnoise bench noise` at m = dim
(median of `repeats` runs of the per-step median) and, for scale, the time of
  * forward + backward + SGD step of a ~1e7-parameter MLP at batch 256 (non-private),
  * a per-example-gradient step (torch.func vmap(grad)) + clipping of a ~1e6-parameter MLP
    at batch 256 (what DP training computes every step), with the noise bench at m = 1e6,
  * forward + backward of a small CNN on scikit-learn's digits at batch 256.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from corrnoise.noise.bench import REFERENCE_BLT4, bench_noise, bench_strategy

COMPARE = ("dpsgd", "bsr:4", REFERENCE_BLT4, "dpcgd:0.9")



def interleaved_times(gens: dict, rounds: int) -> dict:
    """Seconds per ``next_flat()`` of each generator, rounds interleaved across generators (so a
    load change hits every mechanism alike)."""
    times = {name: [] for name in gens}
    for _ in range(rounds):
        for name, gen in gens.items():
            t = time.perf_counter()
            out = gen.next_flat()
            times[name].append(time.perf_counter() - t)
            del out
    return times

def old_vs_new(dim: int, rounds: int) -> dict:
    """Per-step seconds (all rounds) of every COMPARE mechanism, old and new, and torch.randn."""
    import sys
    from pathlib import Path

    from corrnoise.noise import make_generator

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from old_seed_noise import make_old_generator

    n = rounds + 70
    gens = {}
    for name in COMPARE:
        strategy, _ = bench_strategy(name, n)
        gens[(name, "old")] = make_old_generator(strategy, dim, seed=1)
        gens[(name, "new")] = make_generator(strategy, dim, seed=1)
    buf = torch.empty(dim)
    times = {key: [] for key in gens}
    times["randn"] = []
    for key, gen in gens.items():  # warm-up: allocations, thread pool, first touch
        gen.next_flat()
    torch.randn(dim, out=buf)
    for _ in range(rounds):
        t = time.perf_counter()
        torch.randn(dim, out=buf)
        times["randn"].append(time.perf_counter() - t)
        for key, gen in gens.items():
            t = time.perf_counter()
            out = gen.next_flat()
            times[key].append(time.perf_counter() - t)
            del out
    return times


def print_compare(dim: int, rounds: int) -> None:
    load0 = os.getloadavg()[0]
    times = old_vs_new(dim, rounds)
    load1 = os.getloadavg()[0]
    lo = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    r = lo["randn"]
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {load0:.1f} at start, {load1:.1f} at end; m = {dim:.0e} float32, {rounds} interleaved rounds\n")
    print(f"one torch.randn({dim:.0e}): min {r * 1e3:.1f} ms, median {med['randn'] * 1e3:.1f} ms\n")
    print("| mechanism | old ms (min / median) | new ms (min / median) | new / old | old / randn | new / randn |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in COMPARE:
        o, n_ = ("old", "new")
        print(f"| {name} | {lo[(name, o)] * 1e3:.1f} / {med[(name, o)] * 1e3:.1f} | "
              f"{lo[(name, n_)] * 1e3:.1f} / {med[(name, n_)] * 1e3:.1f} | {lo[(name, n_)] / lo[(name, o)]:.2f} | "
              f"{lo[(name, o)] / r:.2f} | {lo[(name, n_)] / r:.2f} |")


def steady_state(names: list[str], dim: int, rounds: int, warm: int) -> dict:
    """Per-step seconds of each mechanism (all rounds), after ``warm`` untimed steps each."""
    from corrnoise.noise import make_generator

    n = warm + rounds + 8
    gens = {name: make_generator(bench_strategy(name, n)[0], dim, seed=1) for name in names}
    for gen in gens.values():
        for _ in range(warm):
            gen.next_flat()
    times = interleaved_times(gens, rounds)
    extra = {name: gen.extra_memory_bytes() for name, gen in gens.items()}
    labels = {name: gen.label if hasattr(gen, "label") else name for name, gen in gens.items()}
    return {"times": times, "extra": extra, "kinds": {k: g.kind for k, g in gens.items()}, "labels": labels}


_RSS_CHILD = """
import resource, sys, torch
from corrnoise.noise import make_generator
from corrnoise.noise.bench import bench_strategy
name, dim, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
gen = make_generator(bench_strategy(name, steps + 8)[0], dim, seed=1)
for _ in range(steps):
    out = gen.next_flat()
    del out
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def peak_rss(name: str, dim: int, steps: int) -> int:
    """Peak resident bytes of a fresh process that imports corrnoise and runs ``steps`` steps."""
    import subprocess
    import sys

    env = dict(os.environ)
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, name, str(dim), str(steps)], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def print_steady(names: list[str], dim: int, rounds: int, warm: int, rss_repeats: int = 3) -> None:
    if "dpsgd" not in names:
        names = ["dpsgd", *names]
    load0 = os.getloadavg()[0]
    res = steady_state(names, dim, rounds, warm)
    rss = {name: min(peak_rss(name, dim, warm + 4) for _ in range(rss_repeats)) for name in names}
    load1 = os.getloadavg()[0]
    lo = {k: min(v) for k, v in res["times"].items()}
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {load0:.1f} at start, {load1:.1f} at end; m = {dim:.0e} float32, {warm} warm-up steps, "
          f"{rounds} interleaved rounds; peak RSS: min over {rss_repeats} fresh processes of {warm + 4} steps\n")
    print("| mechanism | generator | ms/step min / median | x DP-SGD (min / median) | extra memory held (accounted) "
          "| beyond DP-SGD | peak RSS beyond DP-SGD (measured) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in names:
        extra = res["extra"][name]
        print(f"| {res['labels'][name]} | {res['kinds'][name]} | {lo[name] * 1e3:.1f} / {med[name] * 1e3:.1f} | "
              f"{lo[name] / lo['dpsgd']:.2f} / {med[name] / med['dpsgd']:.2f} | {extra / 2**20:.3f} MiB | "
              f"{extra - res['extra']['dpsgd']} B | {(rss[name] - rss['dpsgd']) / 2**20:+.2f} MiB |")


def timed(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def mlp(sizes):
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def params_of(model) -> int:
    return sum(p.numel() for p in model.parameters())


def train_step_time(model, x, y) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return timed(step)


def per_example_step_time(model, x, y) -> float:
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss_fn = nn.CrossEntropyLoss()

    def loss_one(p, xi, yi):
        return loss_fn(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_ex = vmap(grad(loss_one), in_dims=(None, 0, 0))

    def step():
        g = per_ex(params, x, y)
        norms = torch.sqrt(sum(v.reshape(v.shape[0], -1).pow(2).sum(1) for v in g.values()))
        scale = (1.0 / norms).clamp(max=1.0)
        summed = {k: (v * scale.view(-1, *[1] * (v.dim() - 1))).sum(0) for k, v in g.items()}
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.sub_(0.01 * summed[k])

    return timed(step, repeats=5)


def digits_cnn_time() -> tuple[float, int]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images[:256], dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target[:256])
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                          nn.Flatten(), nn.Linear(32 * 64, 64), nn.ReLU(), nn.Linear(64, 10))
    return train_step_time(model, x, y), params_of(model)


def noise_table(dim: int, steps: int, repeats: int) -> dict[str, dict]:
    runs = [bench_noise(dim, steps) for _ in range(repeats)]
    out = {}
    for r in runs[0]["results"]:
        name = r["mechanism"]
        secs = [next(x for x in run["results"] if x["mechanism"] == name)["seconds_per_step"] for run in runs]
        out[name] = {"seconds": statistics.median(secs), "extra": r["extra_memory_bytes"], "gen": r.get("generator")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=float, default=1e7)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--compare-only", action="store_true")
    ap.add_argument("--steady", default=None, help="';'-separated mechanisms timed in their steady state")
    ap.add_argument("--warm", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    dim = int(args.dim)
    if args.steady:
        print_steady(args.steady.split(";"), dim, args.rounds, args.warm)
        return
    if args.compare_only:
        print_compare(dim, args.rounds)
        return
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, load average {load:.1f} at start")

    big = noise_table(dim, args.steps, args.repeats)
    small = noise_table(10**6, args.steps, args.repeats)

    model10 = mlp([784, 3000, 2500, 10])
    x = torch.randn(256, 784)
    y = torch.randint(0, 10, (256,))
    t10 = train_step_time(model10, x, y)
    model1 = mlp([784, 1000, 200, 10])
    t1pe = per_example_step_time(model1, x, y)
    tcnn, pcnn = digits_cnn_time()

    iid = big["dpsgd"]["seconds"]
    print(f"\n`corrnoise bench noise --dim {dim:.0e} --steps {args.steps}` (float32, CPU; median over {args.repeats} runs)\n")
    print(f"| mechanism | generator | ms/step at m=1e7 | x DP-SGD noise | extra memory | share of 1e7-param MLP step ({t10 * 1e3:.0f} ms) | ms/step at m=1e6 | share of 1e6 per-example step ({t1pe * 1e3:.0f} ms) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, r in big.items():
        s1 = small[name]["seconds"]
        mem = r["extra"]
        mem_s = f"{mem / 2**20:.2f} MiB" if mem < 2**30 else f"{mem / 2**30:.2f} GiB"
        print(f"| {name} | {r['gen']} | {r['seconds'] * 1e3:.1f} | {r['seconds'] / iid:.2f} | {mem_s} | "
              f"{r['seconds'] / (t10 + r['seconds']):.0%} | {s1 * 1e3:.2f} | {s1 / (t1pe + s1):.0%} |")
    print(f"\nTraining steps, batch 256: MLP {params_of(model10):,} params fwd+bwd+SGD {t10 * 1e3:.0f} ms; "
          f"per-example grads + clipping (vmap) of MLP {params_of(model1):,} params {t1pe * 1e3:.0f} ms; "
          f"digits CNN {pcnn:,} params fwd+bwd+SGD {tcnn * 1e3:.1f} ms.")


if __name__ == "__main__":
    main()
