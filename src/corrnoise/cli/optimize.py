"""``corrnoise optimize KIND --n N ...`` (docs/cli.md).

Optimizes a strategy (:func:`corrnoise.optimize.run.run_optimize`), optionally writes a
mechanism file, and prints a table or one JSON object (``--json``) with ``rms_loss, max_loss,
sensitivity, mean_error, max_error, seconds, file``. Progress goes to stderr: a rich bar on a
terminal, plain lines elsewhere, nothing with ``--json``.
"""

from __future__ import annotations

import contextlib
import sys

import click

from ..errors import CorrnoiseError
from ..optimize.run import run_optimize
from ..progress import LineProgress
from .progress import command_progress
from .report import emit


@contextlib.contextmanager
def _progress_display(as_json: bool, title: str):
    """Yield (fraction_callback, iteration_callback): one rich progress bar on a terminal, plain
    lines on stderr elsewhere (past a second: a user probe met a silent piped optimization), no-ops
    with ``--json``."""
    if as_json:
        yield (lambda fraction, message: None), (lambda iteration, loss: None)
        return
    if not sys.stderr.isatty():
        lines = LineProgress()

        def line_fraction(fraction: float, message: str) -> None:
            lines(f"{title}: {message}", int(round(1000 * min(max(fraction, 0.0), 1.0))), 1000)

        def line_iteration(iteration: int, loss: float) -> None:
            lines(f"{title}: iteration {iteration}, loss {loss:.6g}", iteration, 0)

        yield line_fraction, line_iteration
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  transient=True, console=None) as bar:
        task = bar.add_task(title, total=1.0)

        def on_fraction(fraction: float, message: str) -> None:
            bar.update(task, completed=fraction, description=message)

        def on_iteration(iteration: int, loss: float) -> None:
            bar.update(task, total=None, description=f"{title}: iteration {iteration}, loss {loss:.6g}")

        yield on_fraction, on_iteration


@click.command("optimize")
@click.argument("kind", metavar="KIND")
@click.option("--n", "n", type=int, required=True, help="Number of steps (iterations).")
@click.option("--bands", type=int, default=None, help="Number of bands (banded, banded-toeplitz; bandinv: bands of C^-1).")
@click.option("--buffers", type=int, default=None, help="BLT buffers d (1..10; default: grow while it helps).")
@click.option("--participation", default="single", show_default=True, help="single | cyclic:K:B | minsep:K:B")
@click.option("--objective", default="rms", show_default=True, help="rms | max")
@click.option("--workload", default="prefix", show_default=True, help="prefix | momentum:BETA[:WEIGHT_DECAY]")
@click.option("--colnorm", is_flag=True, help="banded-toeplitz: normalize the columns afterwards; bandinv: optimize the column-normalized C.")
@click.option("--out", "out", default=None, help="Mechanism file to write (.json; dense/banded arrays go to a sibling .npz).")
@click.option("--amplification", default=None,
              help="balls-in-bins: minimize the amplified rms_error (blt, banded-toeplitz, toeplitz; needs "
                   "--participation cyclic:EPOCHS:BINS, --epsilon, --delta).")
@click.option("--epsilon", type=float, default=None, help="Target epsilon (with --amplification).")
@click.option("--delta", type=float, default=None, help="Target delta (with --amplification).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def optimize_command(kind, n, bands, buffers, participation, objective, workload, colnorm, amplification, epsilon,
                     delta, out, as_json):
    """Optimize a KIND strategy (dense, banded, banded-toeplitz, blt, bandinv) and write a mechanism file."""
    if out is not None and not str(out).endswith(".json"):
        raise CorrnoiseError("out", f"mechanism files end in .json, got {out!r}")
    if amplification is not None:
        return _amplified(kind, n, bands, buffers, participation, objective, workload, colnorm, amplification,
                          epsilon, delta, out, as_json)
    for name, value in (("epsilon", epsilon), ("delta", delta)):
        if value is not None:
            raise CorrnoiseError(name, "is only used with --amplification balls-in-bins")
    with _progress_display(as_json, f"optimize {kind}") as callbacks:
        strategy, report, seconds = run_optimize(kind, n, bands, buffers, participation, objective, workload,
                                                 colnorm, progress=callbacks)
    losses = {
        "rms_loss": report.rms_loss,
        "max_loss": report.max_loss,
        "sensitivity": report.sensitivity,
        "sensitivity_exact": report.sensitivity_exact,
        "mean_error": report.mean_error,
        "max_error": report.max_error,
    }
    path = None
    if out is not None:
        from ..strategies import save_mechanism

        designed_for = {"participation": report.participation, "objective": objective.strip().lower(),
                        "workload": report.workload}
        path = str(save_mechanism(strategy, out, designed_for=designed_for, losses=losses))
    data = {
        "kind": kind.strip().lower(),
        "strategy": strategy.label,
        "n": report.n,
        "bands": strategy.bands,
        "participation": report.participation,
        "objective": objective.strip().lower(),
        "workload": report.workload,
        **losses,
        "nonnegative": bool(strategy.is_nonnegative()),  # C >= 0: what the amplified accountants need
        "seconds": seconds,
        "file": path,
    }
    emit(data, as_json, f"corrnoise optimize {kind}")


def _amplified(kind, n, bands, buffers, participation, objective, workload, colnorm, amplification, epsilon, delta,
               out, as_json):
    """``--amplification balls-in-bins``: :func:`corrnoise.planner.amplified.optimize_amplified`."""
    from ..participation import Cyclic, parse_participation
    from ..planner.amplified import optimize_amplified

    if str(amplification).strip().lower() != "balls-in-bins":
        raise CorrnoiseError("amplification", f"only balls-in-bins is supported, got {amplification!r}")
    part = parse_participation(participation)
    if not isinstance(part, Cyclic) or part.k * part.b != n:
        raise CorrnoiseError("participation", f"--amplification balls-in-bins needs cyclic:EPOCHS:BINS with "
                                              f"EPOCHS * BINS = n = {n}, got {participation!r}")
    if epsilon is None or delta is None:
        raise CorrnoiseError("epsilon" if epsilon is None else "delta", "is required with --amplification")
    if objective.strip().lower() != "rms" or workload.strip().lower() != "prefix" or colnorm:
        raise CorrnoiseError("objective", "--amplification optimizes the prefix rms_error only "
                                          "(no --objective max, --workload or --colnorm)")
    with command_progress(as_json) as bar:  # every phase: start point, descent, selection, verification
        res = optimize_amplified(kind, n, part.b, epsilon, delta, bands=bands, buffers=buffers, report=bar)
    path = None
    if out is not None:
        from ..strategies import save_mechanism

        designed_for = {"participation": part.spec, "objective": "rms", "workload": "prefix",
                        "amplification": f"balls-in-bins:{part.b}", "epsilon": epsilon, "delta": delta}
        path = str(save_mechanism(res.strategy, out, designed_for=designed_for,
                                  losses={"rms_error": res.rms_error, "noise_std": res.noise_std}))
    emit({**res.to_dict(), "file": path}, as_json, f"corrnoise optimize {kind} --amplification balls-in-bins")


__all__ = ["optimize_command"]
