"""``corrnoise plan`` (issue #11): which mechanism and how much noise for a training run.

    corrnoise plan (--dataset-size N --batch-size B --epochs K | --steps n --epochs K)
        --epsilon E --delta D [--max-buffers M] [--only FAMILY,...]
        [--trainable-params P [--dtype float32] [--max-noise-memory 2GB]]
        [--pipeline auto|poisson|cyclic|balls-in-bins] [--plot FILE.png] [--out DIR]
        [--mechanism-file FILE.json] [--json]

Prints every candidate (screening numbers, ``kind`` says guarantee or estimate) and the
recommended one, re-calibrated with the full formal guarantee and saved as a mechanism file
(``--mechanism-file``, default ``plan-recommended.json`` except with ``--json``; with ``--out DIR`` every candidate's
file too, under ``DIR/candidates/``).  With ``--trainable-params`` every candidate reports its noise state
in bytes (``noise_memory_bytes``, :func:`corrnoise.noise_memory.noise_state_bytes`); ``--max-noise-memory``
switches a candidate over it to regenerated noise or excludes it (``excluded`` in the JSON).
``--json``: exactly one JSON object on stdout, no progress. Otherwise progress goes to stderr: a bar
on a terminal, else a line per phase once planning has taken a second.
"""

from __future__ import annotations

import json
import sys

import click

from ..errors import CorrnoiseError
from ..pipelines import PIPELINES
from .report import finite_json


@click.command("plan")
@click.option("--dataset-size", "dataset_size", type=int, default=None, help="Number of training examples N.")
@click.option("--batch-size", "batch_size", type=int, default=None, help="(Expected) batch size B.")
@click.option("--steps", "steps", type=int, default=None, help="Number of steps n (instead of N and B).")
@click.option("--epochs", "epochs", type=float, required=True, metavar="INTEGER",
              help="Epochs K (passes over the data; the planner plans whole epochs).")
@click.option("--epsilon", "epsilon", type=float, required=True, help="Target epsilon.")
@click.option("--delta", "delta", type=float, required=True, help="Target delta, in (0, 1).")
@click.option("--max-buffers", "max_buffers", type=int, default=None,
              help="Memory budget: noise vectors of model size kept between steps (more = infeasible).")
@click.option("--trainable-params", "trainable_params", type=int, default=None,
              help="The model's trainable parameter count: report each candidate's noise state in bytes.")
@click.option("--dtype", "dtype", default=None, help="The dtype of the noise (float32, the default; float64, float16, "
              "bfloat16).")
@click.option("--max-noise-memory", "max_noise_memory", default=None,
              help="Noise-memory budget (2GB, 512MiB, 2e9 bytes): candidates over it are regenerated or excluded.")
@click.option("--only", "only", default=None, help="Comma-separated families: dpsgd,bandmf,blt,dpcgd,toeplitz,dense,tree.")
@click.option("--pipeline", default="auto", show_default=True,
              type=click.Choice(PIPELINES),
              help="Batchings the data pipeline can do (cyclic = shuffle once, fixed order: no amplification).")
@click.option("--plot", "plot", default=None, help="Write a PNG: error vs epsilon of the leading families and the "
              "recommended strategy's coefficients.")
@click.option("--out", "out_dir", default=None, help="Directory for every candidate's mechanism file.")
@click.option("--mechanism-file", "mechanism_file", default=None,
              help="Where to save the recommended mechanism (default plan-recommended.json, or DIR/recommended.json "
                   "with --out).")
@click.option("--plan-out", "plan_out", default=None,
              help="Write the recommended run as a plan file (.json) for corrnoise train --plan FILE.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def plan_command(dataset_size, batch_size, steps, epochs, epsilon, delta, max_buffers, trainable_params, dtype,
                 max_noise_memory, only, pipeline, plot, out_dir, mechanism_file, plan_out, as_json):
    """Recommend a mechanism, batching and calibrated noise for a training run."""
    from ..planner import make_setup, plan

    if plot is not None and not str(plot).lower().endswith(".png"):
        raise CorrnoiseError("plot", f"must be a .png file, got {plot!r}")
    setup = make_setup(epsilon=epsilon, delta=delta, epochs=epochs, dataset_size=dataset_size,
                       batch_size=batch_size, steps=steps, max_buffers=max_buffers, only=only, pipeline=pipeline,
                       trainable_params=trainable_params, dtype=dtype, max_noise_memory=max_noise_memory)
    if plan_out is not None:  # fail before planning, not after it
        from ..runplan import check_plan_out

        check_plan_out(plan_out, setup)
    if mechanism_file is None and out_dir is None and not as_json:  # --json writes only what it is asked to
        mechanism_file = "plan-recommended.json"
    elif mechanism_file is not None:  # fail before planning, not after it
        from ..strategies.io import check_mechanism_path

        check_mechanism_path(mechanism_file, "mechanism_file")
    if as_json:  # exactly one JSON object, nothing else
        result = plan(setup, out_dir=out_dir, mechanism_file=mechanism_file, progress=False)
    elif sys.stdout.isatty():
        result = _with_progress(setup, out_dir, mechanism_file)
    else:  # progress lines on stderr (the planner's default), also when it is not a terminal
        result = plan(setup, out_dir=out_dir, mechanism_file=mechanism_file)
    data = result.to_dict()
    if plan_out is not None:
        from ..runplan import plan_of_recommendation

        data["plan_file"] = str(plan_of_recommendation(result).to_json(plan_out))
    if plot is not None:
        from ..planner.plot import plot_plan

        data["plot"] = str(plot_plan(result, plot))
    if as_json:
        click.echo(json.dumps(finite_json(data), allow_nan=False))
        return
    _table(result, data)


def _with_progress(setup, out_dir, mechanism_file):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from ..planner import plan

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("planning", total=1)

        def progress(label, done, total):
            bar.update(task, description=f"planning: {label}", completed=done, total=total)

        return plan(setup, progress=progress, out_dir=out_dir, mechanism_file=mechanism_file)


def _fmt(x, spec=".4g"):
    return "-" if x is None else format(x, spec)


def _memory(c) -> str:
    """Noise vectors kept between steps, with their bytes when the model size is known."""
    if c.noise_memory_bytes is None:
        return str(c.memory_vectors)
    from ..noise_memory import format_size

    regen = " regen" if c.noise_method == "regenerate" else ""
    return f"{c.memory_vectors} ({format_size(c.noise_memory_bytes)}{regen})"


def _table(result, data) -> None:
    from rich.console import Console
    from rich.table import Table

    s = result.setup
    title = (f"corrnoise plan: n = {s.n} steps, {s.steps_per_epoch} per epoch, {s.participations} epochs, "
             f"p = {s.sampling_probability:.4g}, ({s.epsilon:g}, {s.delta:g})-DP, pipeline {s.pipeline}")
    table = Table(title=title)
    cols = ["mechanism", "batching", "accounting", "kind", "noise_std", "sigma", "rms_error", "max_error",
            "memory", "noise_cost (randn/step)", "feasible", "seconds"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("mechanism", "batching", "accounting", "kind") else "right")
    rec = result.recommended
    for c in result.candidates:
        batching = c.batching if c.batching != "none" else f"none ({c.participation})"
        kind = (c.kind or "-") + (" (final)" if c.final else "")
        rms = _fmt(c.rms_error)
        if not c.calibrated and c.lower_rms is not None:  # ruled out by its lower bound, never sampled
            kind, rms = "not sampled", f">= {c.lower_rms:.4g}"
        row = [c.mechanism, batching, c.accounting or "-", kind,
               _fmt(c.noise_std), _fmt(c.noise_multiplier), rms, _fmt(c.max_error),
               _memory(c), _fmt(c.noise_cost, ".3g"), "yes" if c.feasible else "no", f"{c.seconds:.1f}"]
        table.add_row(*row, style="bold green" if c is rec else None)
    console = Console() if sys.stdout.isatty() else Console(width=170)
    console.print(table)
    console.print(f"recommended: [bold]{rec.mechanism}[/bold] with batching {rec.batching}"
                  f"{' (' + rec.participation + ')' if rec.participation else ''}, noise_std {rec.noise_std:.6g} "
                  f"(sigma {rec.noise_multiplier:.6g}), {rec.accounting} {rec.kind}; rms_error {rec.rms_error:.4g}")
    for d in result.dropped:
        console.print(f"dropped {d['candidate']}: {d['reason']}", markup=False)
    for d in result.regenerated + result.excluded:
        console.print(f"{d['candidate']} ({d['batching']}): {d['reason']}", markup=False)
    if rec.mechanism_file:
        console.print(f"mechanism file: {rec.mechanism_file}")
    if "plan_file" in data:
        console.print(f"plan file: {data['plan_file']} (corrnoise train --plan {data['plan_file']})")
    if "plot" in data:
        console.print(f"plot: {data['plot']}")
    console.print(f"planned in {result.seconds:.1f} s")
