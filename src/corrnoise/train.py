"""``corrnoise train``: plan, calibrate and run private training on scikit-learn's digits.

The digits data (1797 8x8 images, 10 classes) ship with scikit-learn (``load_digits``): no
download. A fixed stratified 80/20 split (split seed 0); pixels are scaled by the constant
1/16 -- no statistic of the training data is computed outside the private algorithm.

Mechanisms (each with the batching it is analysed under, tutorial Sec. 4.4.3-4.4.4):

``dpsgd``   C = I with Poisson sampling (rate B/N), PLD accounting.
``bandmf``  banded square root ``bsr:b`` (the first b coefficients of A_pre^{1/2}) with
            block-cyclic Poisson sampling in b blocks (tutorial Def. 3.20, Thm 3.21); b in
            {2, 4, 8, 16} chosen by the expected error of the noisy prefix sums.
``blt``     a BLT optimized for the cyclic participation of fixed batches (``optimize_blt``),
            unamplified (exact Gaussian / GDP accounting with sens(C, cyclic)).
``dpcgd``   DP-CGD C^{-1} = I - beta S (seed 003), unamplified cyclic, beta in a grid
            chosen by the RMS loss under the same participation.
``auto``    plans all four and trains the one with the smallest expected RMS error of the
            noisy prefix sums, noise_std * ||A C^{-1}||_F / sqrt(n) (DESIGN.md ``rms_error``;
            the same batch size for all, so the numbers compare).

The noise is calibrated for the target (epsilon, delta); after training the run is accounted
again on the steps actually taken, and the reported epsilon is never above the target.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import click
import numpy as np
import torch

from .errors import CorrnoiseError, check_int, check_real

__all__ = ["MECHANISMS", "Plan", "load_digits_split", "plan", "train_digits", "train_command"]

MECHANISMS = ("dpsgd", "bandmf", "blt", "dpcgd", "auto")
#: Value discretization of the PLD accountant while calibrating (pessimistic, so valid; 10x
#: faster than the 1e-4 default at the cost of ~1e-3 in epsilon).
PLAN_DISCRETIZATION = 1e-3
BANDS = (2, 4, 8, 16)
BETAS = (0.0, 0.3, 0.5, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97)


@dataclass
class Plan:
    """A mechanism, its sampler and accounting, and the calibrated noise."""

    mechanism: str
    strategy: Any
    sampler: Any
    batching: Any
    noise_std: float
    noise_multiplier: float
    epsilon_planned: float
    rms_error: float
    details: dict = field(default_factory=dict)


def load_digits_split(test_fraction: float = 0.2):
    """(x_train, y_train, x_test, y_test) as float32 / int64 tensors; pixels / 16."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_fraction, random_state=0, stratify=y)
    return torch.from_numpy(xtr), torch.from_numpy(ytr), torch.from_numpy(xte), torch.from_numpy(yte)


def _mean_error(strategy) -> float:
    from .losses import error_summary

    return float(error_summary(strategy, None)[0])


def _calibrated(strategy, batching, epsilon, delta, method: str = "auto"):
    """The calibrated accounting of one candidate: its MechanismEvent passes the accounting gate
    (which checks every precondition of the method), then calibrate."""
    from .accounting import MechanismEvent, calibrate, prepare
    from .accounting.base import method_accepts, require_guarantee

    event = MechanismEvent(strategy, batching)
    spec = prepare(event, method)
    # the coarser PLD grid where the method has one (options a method lacks are refused)
    opts = {"discretization": PLAN_DISCRETIZATION} if method_accepts(spec, "discretization") else {}
    return require_guarantee(calibrate(event, epsilon=epsilon, delta=delta, method=method, **opts), "train")


def _plan_one(name: str, num_examples: int, batch_size: int, epochs: float, epsilon: float, delta: float,
              seed: int) -> Plan:
    from .sampling import BlockCyclicPoissonSampler, CyclicSampler, PoissonSampler
    from .strategies import DPCGD, Identity, parse_strategy

    n_ex, b = num_examples, batch_size
    amplified_steps = max(1, int(round(epochs * n_ex / b)))
    if name == "dpsgd":
        sampler = PoissonSampler(n_ex, b / n_ex, amplified_steps, seed=seed)
        strategy = Identity(sampler.steps)
        res = _calibrated(strategy, sampler.batching(), epsilon, delta)
        return Plan(name, strategy, sampler, sampler.batching(), res.noise_std, res.noise_multiplier, res.epsilon,
                    res.noise_std * _mean_error(strategy), {"sampling_probability": sampler.p})
    if name == "bandmf":
        best = None
        for bands in BANDS:
            if bands * b > n_ex or bands > amplified_steps:
                continue
            sampler = BlockCyclicPoissonSampler(n_ex, bands, b * bands / n_ex, amplified_steps, seed=seed)
            strategy = parse_strategy(f"bsr:{bands}", sampler.steps)
            res = _calibrated(strategy, sampler.batching(), epsilon, delta)
            cand = Plan(name, strategy, sampler, sampler.batching(), res.noise_std, res.noise_multiplier,
                        res.epsilon, res.noise_std * _mean_error(strategy),
                        {"bands": bands, "blocks": bands, "sampling_probability": sampler.p})
            if best is None or cand.rms_error < best.rms_error:
                best = cand
        if best is None:
            raise CorrnoiseError("batch_size", f"block-cyclic sampling needs batch_size * 2 <= {n_ex}")
        return best
    # unamplified: fixed batches in a fixed cyclic order
    sampler = CyclicSampler(n_ex, b, steps=max(1, int(round(epochs * (n_ex // b)))), seed=seed)
    n = sampler.steps
    batching = sampler.batching()
    if name == "blt":
        from .optimize.blt import optimize_blt

        strategy = optimize_blt(n, participation=sampler.participation) if n >= 2 else Identity(n)
        details = {"participation": sampler.participation}
    elif name == "dpcgd":
        from .losses import loss_report

        losses = {beta: loss_report(DPCGD(beta, n), sampler.participation).rms_loss for beta in BETAS}
        beta = min(losses, key=losses.get)
        strategy = DPCGD(beta, n)
        details = {"beta": beta, "participation": sampler.participation}
    else:  # pragma: no cover - guarded by the caller
        raise CorrnoiseError("mechanism", f"unknown mechanism {name!r}")
    res = _calibrated(strategy, batching, epsilon, delta)
    return Plan(name, strategy, sampler, batching, res.noise_std, res.noise_multiplier, res.epsilon,
                res.noise_std * _mean_error(strategy), details)


def plan(mechanism: str, num_examples: int, batch_size: int, epochs: float, epsilon: float, delta: float,
         seed: int) -> tuple[Plan, list[dict]]:
    """The plan for ``mechanism`` (``auto``: the smallest expected RMS error of all four) and a
    summary of every candidate considered."""
    names = ["dpsgd", "bandmf", "blt", "dpcgd"] if mechanism == "auto" else [mechanism]
    plans = [_plan_one(name, num_examples, batch_size, epochs, epsilon, delta, seed) for name in names]
    summary = [{"mechanism": p.mechanism, "strategy": p.strategy.label, "noise_std": p.noise_std,
                "rms_error": p.rms_error, "steps": p.sampler.steps} for p in plans]
    return min(plans, key=lambda p: p.rms_error), summary


def _model(hidden: int) -> torch.nn.Module:
    if hidden <= 0:
        return torch.nn.Linear(64, 10)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 10))


def train_digits(
    mechanism: str = "auto",
    *,
    epsilon: float = 8.0,
    delta: float = 1e-5,
    epochs: float = 5,
    batch_size: int = 64,
    seed: int = 0,
    noise_seed: int | None = None,
    lr: float = 0.5,
    momentum: float = 0.9,
    optimizer: str = "sgd",
    clip_norm: float = 1.0,
    hidden: int = 32,
    progress: bool = False,
) -> dict[str, Any]:
    """Plan, calibrate, train and evaluate; returns the ``corrnoise train`` JSON object.

    ``seed`` fixes the data order (sampler) and the model initialization; the noise comes from a
    secret OS seed unless ``noise_seed`` is given (reproducible experiments only: whoever knows
    the noise seed can subtract the noise, so it is never printed).
    """
    from .torch import make_private_run

    start = time.perf_counter()
    if mechanism not in MECHANISMS:
        raise CorrnoiseError("mechanism", f"must be one of {', '.join(MECHANISMS)}, got {mechanism!r}")
    epsilon = check_real("epsilon", epsilon, low=0.0, low_open=True)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    epochs = check_real("epochs", epochs, low=0.0, low_open=True, high=1000.0)
    seed = check_int("seed", seed, minimum=0, maximum=(1 << 62))
    clip_norm = check_real("clip_norm", clip_norm, low=0.0, low_open=True)
    lr = check_real("lr", lr, low=0.0, low_open=True)
    if optimizer not in ("sgd", "adam"):
        raise CorrnoiseError("optimizer", f"must be sgd or adam, got {optimizer!r}")
    xtr, ytr, xte, yte = load_digits_split()
    n_ex = int(xtr.shape[0])
    batch_size = check_int("batch_size", batch_size, minimum=1, maximum=n_ex // 2)

    chosen, candidates = plan(mechanism, n_ex, batch_size, epochs, epsilon, delta, seed)
    planned = time.perf_counter()

    torch.manual_seed(seed)
    model = _model(hidden)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    dataset = torch.utils.data.TensorDataset(xtr, ytr)
    private = make_private_run(model, opt, torch.nn.functional.cross_entropy, dataset, mechanism=chosen.strategy,
                               sampler=chosen.sampler, noise_std=chosen.noise_std, delta=delta, clip_norm=clip_norm,
                               seed=seed, noise_seed=noise_seed)
    loss_sum, loss_count = 0.0, 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only add synchronisation (5-10x slower on a busy machine)
    try:
        with _progress(progress, private.steps, chosen) as advance:
            for x, y in private.data_loader:
                stats = private.step(x, y)
                if stats["count"]:
                    loss_sum += stats["loss"] * stats["count"]
                    loss_count += stats["count"]
                advance()
    finally:
        torch.set_num_threads(threads)
    trained = time.perf_counter()

    # account again on what actually ran (the steps taken, this noise, this batching)
    spent = private.privacy_spent()
    if spent.epsilon > epsilon:  # a finer PLD grid can differ; the calibration grid is the proof
        spent = private.privacy_spent(discretization=PLAN_DISCRETIZATION)
    if spent.epsilon > epsilon * (1 + 1e-12):
        raise RuntimeError(f"accounted epsilon {spent.epsilon} exceeds the budget {epsilon}")

    model.eval()
    with torch.no_grad():
        acc = float((model(xte).argmax(dim=1) == yte).float().mean())
        train_acc = float((model(xtr).argmax(dim=1) == ytr).float().mean())
    out = {
        "dataset": "digits",
        "mechanism": chosen.mechanism,
        "strategy": chosen.strategy.label,
        "test_accuracy": acc,
        "train_accuracy": train_acc,
        "epsilon": float(spent.epsilon),
        "delta": float(delta),
        "target_epsilon": float(epsilon),
        "noise_std": float(chosen.noise_std),
        "noise_multiplier": float(chosen.noise_multiplier),
        "steps": int(private.steps_taken),
        "batching": private.batching.spec,
        "accounting_method": spent.method,
        "expected_batch_size": float(chosen.sampler.expected_batch_size),
        "epochs": float(epochs),
        "clip_norm": clip_norm,
        "optimizer": optimizer,
        "lr": lr,
        "train_loss": loss_sum / loss_count if loss_count else None,
        "rms_error": float(chosen.rms_error),
        "seed": seed,
        "plan_seconds": planned - start,
        "train_seconds": trained - planned,
        "seconds": time.perf_counter() - start,
    }
    out.update({k: v for k, v in chosen.details.items() if k not in out})
    if mechanism == "auto":
        out["candidates"] = candidates
    return out


class _progress:
    """A rich progress bar on a terminal (never with --json); a no-op otherwise."""

    def __init__(self, enabled: bool, total: int, chosen: Plan):
        self.enabled, self.total, self.chosen = enabled, total, chosen
        self.bar = None

    def __enter__(self):
        if not self.enabled:
            return lambda: None
        from rich.progress import Progress

        self.bar = Progress(transient=True)
        self.bar.__enter__()
        task = self.bar.add_task(f"training {self.chosen.strategy.label}", total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False


@click.command("train")
@click.option("--dataset", type=click.Choice(["digits"]), default="digits", show_default=True,
              help="scikit-learn's bundled digits (no download).")
@click.option("--mechanism", default="auto", show_default=True, help="dpsgd | bandmf | blt | dpcgd | auto")
@click.option("--epsilon", type=float, required=True, help="Target epsilon (the reported one never exceeds it).")
@click.option("--delta", type=float, required=True, help="Target delta.")
@click.option("--epochs", type=float, default=5, show_default=True, help="Passes over the training data.")
@click.option("--batch-size", type=int, default=64, show_default=True, help="(Expected) batch size B.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the data order and model init.")
@click.option("--noise-seed", type=int, default=None,
              help="Fix the noise seed (reproducible experiments only: it lets anyone remove the noise). "
                   "Default: a secret seed from the OS.")
@click.option("--lr", type=float, default=0.5, show_default=True, help="Learning rate.")
@click.option("--optimizer", type=click.Choice(["sgd", "adam"]), default="sgd", show_default=True,
              help="sgd (with --momentum) or adam.")
@click.option("--momentum", type=float, default=0.9, show_default=True, help="SGD momentum.")
@click.option("--clip-norm", type=float, default=1.0, show_default=True, help="Per-example clip norm.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def train_command(dataset, mechanism, epsilon, delta, epochs, batch_size, seed, noise_seed, lr, optimizer, momentum,
                  clip_norm, as_json):
    """Private training on DATASET with a correlated-noise MECHANISM at (EPSILON, DELTA)."""
    from .cli.report import emit as _emit

    if mechanism not in MECHANISMS:
        raise CorrnoiseError("mechanism", f"must be one of {', '.join(MECHANISMS)}, got {mechanism!r}")
    result = train_digits(mechanism, epsilon=epsilon, delta=delta, epochs=epochs, batch_size=batch_size, seed=seed,
                          noise_seed=noise_seed, lr=lr, momentum=momentum, optimizer=optimizer, clip_norm=clip_norm,
                          progress=not as_json and sys.stderr.isatty())
    if as_json:
        click.echo(json.dumps(result, allow_nan=False))
        return
    table = {k: v for k, v in result.items() if k != "candidates"}
    _emit(table, False, f"corrnoise train --dataset {dataset} --mechanism {mechanism}")
    if "candidates" in result:
        _emit({c["mechanism"]: f"{c['strategy']}  noise_std={c['noise_std']:.4g}  rms_error={c['rms_error']:.4g}"
               for c in result["candidates"]}, False, "auto: candidates (smallest rms_error trained)")
