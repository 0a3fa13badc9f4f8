"""``corrnoise train``: private training on a bundled or local dataset (docs/cli.md)."""

from __future__ import annotations

import json
import sys

import click

from ..pipelines import PIPELINES
from .report import emit, finite_json


def _progress_bar(enabled: bool):
    """A (label, done, total) callback driving one rich progress bar on a terminal, or None."""
    if not enabled:
        return None, None
    from rich.progress import Progress

    bar = Progress(transient=True)
    tasks: dict[str, int] = {}

    def report(label: str, done: int, total: int) -> None:
        key = "training" if label == "training" else "planning"
        if key not in tasks:
            tasks[key] = bar.add_task(key, total=total)
        bar.update(tasks[key], completed=done, total=total, description=label)

    return bar, report


@click.command("train")
@click.option("--dataset", type=click.Choice(["digits", "mnist1d", "fashion-mnist"]), default="digits",
              show_default=True, help="digits (scikit-learn), mnist1d (generated offline), fashion-mnist "
              "(local files: make data).")
@click.option("--mechanism", default="auto", show_default=True,
              help="auto (the planner's choice) | a family: dpsgd, bandmf, blt, dpcgd, toeplitz, dense, tree | "
                   "a mechanism name or file (bsr:4, dpcgd:0.9, plan/recommended.json).")
@click.option("--batching", type=click.Choice(PIPELINES), default="auto",
              show_default=True, help="The data pipeline you have: poisson sampling, cyclic (shuffle once, fixed "
              "batches, no amplification), balls-in-bins, or auto (any).")
@click.option("--epsilon", type=float, default=None,
              help="Target epsilon (the reported one never exceeds it); required unless --plan gives it.")
@click.option("--delta", type=float, default=None, help="Target delta; required unless --plan gives it.")
@click.option("--plan", "plan_file", default=None,
              help="Train exactly this run (a plan file of corrnoise plan --plan-out: mechanism, batching, noise, "
                   "guarantee), without planning again.")
@click.option("--epochs", type=float, default=None, help="Passes over the training data (default: the dataset's).")
@click.option("--batch-size", type=int, default=None, help="(Expected) batch size B (default: the dataset's).")
@click.option("--lr", type=float, default=None, help="Learning rate (default: the dataset's).")
@click.option("--optimizer", type=click.Choice(["sgd", "adam"]), default=None, help="sgd or adam.")
@click.option("--momentum", type=float, default=None, help="SGD momentum (default: the dataset's).")
@click.option("--clip-norm", type=float, default=None, help="Per-example clip norm (default: the dataset's).")
@click.option("--physical-batch-size", type=int, default=None,
              help="Cut each sampled batch into micro-batches of at most this size (memory; same result).")
@click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda | cuda:N")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the model init and of the order of unamplified (cyclic) batches. An amplified sampler "
                   "(poisson, block-cyclic, balls-in-bins) always draws a secret seed from the OS: its guarantee "
                   "assumes nobody knows which steps used an example.")
@click.option("--noise-seed", type=int, default=None,
              help="Fix the noise seed (reproducible experiments only: it lets anyone remove the noise). "
                   "Default: a secret seed from the OS.")
@click.option("--compare", default=None, help="Also train this mechanism (e.g. dpsgd) at the same budget and "
              "pipeline, and report both.")
@click.option("--plot", default=None, help="Write PNG plots: test accuracy per epoch of every run (this path) and, "
              "when the planner chose, its picture (PATH-plan.png).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def train_command(dataset, mechanism, batching, epsilon, delta, plan_file, epochs, batch_size, lr, optimizer, momentum,
                  clip_norm, physical_batch_size, device, seed, noise_seed, compare, plot, as_json):
    """Private training on DATASET with MECHANISM at (EPSILON, DELTA) for your data pipeline."""
    from ..errors import CorrnoiseError, check_int
    from ..training import train

    plan = None
    if plan_file is not None:
        from ..runplan import RunPlan

        if compare is not None:
            raise CorrnoiseError("compare", "trains a second mechanism at a budget; --plan trains exactly one run")
        plan = RunPlan.from_json(plan_file, progress=not as_json)  # review: --json said progress on stderr
    else:
        for name, value in (("epsilon", epsilon), ("delta", delta)):
            if value is None:
                raise CorrnoiseError(name, f"give --{name} (the target), or --plan FILE")
    if plot is not None and not str(plot).lower().endswith(".png"):
        raise CorrnoiseError("plot", f"must be a .png file, got {plot!r}")
    if physical_batch_size is not None:  # named as the option, before the library names it max_physical_batch_size
        check_int("physical_batch_size", physical_batch_size, minimum=1)
    if compare is not None and not compare.strip():
        raise CorrnoiseError("compare", "names a second mechanism to train beside the first; got an empty name")
    if compare is not None:  # a typo found before the first run trains, not after it
        from ..training import check_mechanism

        try:
            check_mechanism(dataset, compare, epsilon=epsilon, delta=delta, batching=batching, epochs=epochs,
                            batch_size=batch_size)
        except CorrnoiseError as err:
            if err.param == "mechanism":
                raise CorrnoiseError("compare", err.message) from None
            raise
    bar, report = _progress_bar(not as_json and sys.stderr.isatty())
    if as_json:  # nothing but the JSON object; otherwise planning writes progress lines on stderr
        report = False
    kwargs = dict(epsilon=epsilon, delta=delta, batching=batching, epochs=epochs, batch_size=batch_size, lr=lr,
                  momentum=momentum, optimizer=optimizer, clip_norm=clip_norm, seed=seed, noise_seed=noise_seed,
                  device=device, max_physical_batch_size=physical_batch_size, progress=report, plan=plan)
    runs = [mechanism] + ([compare] if compare else [])
    results = []
    if bar is not None:
        bar.start()
    try:
        for i, name in enumerate(runs):
            plan_plot = None if plot is None or i else str(plot)[:-4] + "-plan.png"
            try:
                results.append(train(dataset, name, plan_plot=plan_plot, **kwargs).to_dict())
            except CorrnoiseError as err:
                if i and err.param == "mechanism":  # the second run's mechanism is --compare's
                    raise CorrnoiseError("compare", err.message) from None
                raise
    finally:
        if bar is not None:
            bar.stop()
    if plot is not None:
        from ..training import plot_history

        if plan is not None:  # the plan's budget and pipeline
            epsilon, delta, batching = results[0]["epsilon_target"], plan.delta, results[0]["pipeline"]
        plot_history(results, plot, f"{dataset}, epsilon {epsilon:g}, delta {delta:g}, pipeline {batching}")
    if as_json:
        out = results[0] if len(results) == 1 else {"runs": results}
        click.echo(json.dumps(finite_json(out), allow_nan=False))  # a NaN loss is null (review: the result was lost)
        return
    for res in results:
        table = {k: v for k, v in res.items() if k not in ("candidates", "history")}
        emit(table, False, f"corrnoise train --dataset {dataset} --mechanism {res['mechanism']}")
    if len(results) > 1:
        emit({r["mechanism"]: f"test accuracy {r['test_accuracy']:.4f}   epsilon {r['epsilon']:.4g} "
              f"({r['kind']}, {r['accounting']})" for r in results}, False, "comparison at the same budget")

