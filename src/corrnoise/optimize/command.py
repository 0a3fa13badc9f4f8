"""``corrnoise optimize KIND --n N ...`` (DESIGN.md "Command-line contract").

Optimizes a strategy, recomputes its losses with :func:`corrnoise.losses.loss_report` (never the
optimizer's own number), optionally writes a mechanism file, and prints a table or one JSON
object (``--json``) with ``rms_loss, max_loss, sensitivity, mean_error, max_error, seconds, file``.
Progress is shown with rich only on a terminal and never with ``--json``.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time

import click

from ..errors import CorrnoiseError, check_int
from ..report import emit

KINDS = ("dense", "banded", "banded-toeplitz", "blt")


def validate_strategy(strategy) -> None:
    """Refuse an invalid mechanism (not lower-triangular, non-positive diagonal, non-finite)."""
    import numpy as np

    from ..strategies import Banded, ColumnNormalized, Dense
    from .common import check_band, check_strategy_matrix

    base = strategy.base if isinstance(strategy, ColumnNormalized) else strategy
    if isinstance(base, Dense):
        check_strategy_matrix(base.matrix())
    elif isinstance(base, Banded):
        check_band(base.band)
    else:
        coef = base.toeplitz_coefficients
        if coef is None:
            raise CorrnoiseError("strategy", f"unexpected optimizer result {type(base).__name__}")
        coef = np.asarray(coef, dtype=np.float64)
        if not np.all(np.isfinite(coef)) or coef.size == 0 or coef[0] <= 0.0:
            raise CorrnoiseError("strategy", "optimizer produced invalid Toeplitz coefficients")
    if isinstance(strategy, ColumnNormalized):
        norms = np.sqrt(base.column_norms_squared())
        if not np.all(np.isfinite(norms)) or np.any(norms <= 0.0):
            raise CorrnoiseError("strategy", "optimizer produced a zero or non-finite column")


@contextlib.contextmanager
def _progress_display(enabled: bool, title: str):
    """Yield (fraction_callback, iteration_callback) driving one rich progress bar, or no-ops."""
    if not enabled:
        yield (lambda fraction, message: None), (lambda iteration, loss: None)
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


def run_optimize(kind: str, n: int, bands=None, buffers=None, participation: str = "single",
                 objective: str = "rms", workload: str = "prefix", colnorm: bool = False,
                 progress=None):
    """Optimize and return ``(strategy, LossReport, seconds)``; ``progress`` is the pair of
    callbacks of :func:`_progress_display` (or None)."""
    from ..losses import loss_report
    from ..participation import parse_participation
    from .common import check_bands, check_objective, check_workload

    if not isinstance(kind, str) or kind.strip().lower() not in KINDS:
        raise CorrnoiseError("kind", f"must be one of {', '.join(KINDS)}, got {kind!r}")
    kind = kind.strip().lower()
    n = check_int("n", n, minimum=1)
    schema = parse_participation(participation)
    schema.validate(n)
    objective = check_objective(objective)
    wl = check_workload(workload)
    on_fraction, on_iteration = progress or (None, None)
    if kind in ("banded", "banded-toeplitz"):
        if bands is None:
            raise CorrnoiseError("bands", f"is required for {kind} (e.g. --bands 32)")
        bands = check_int("bands", bands, minimum=1)
        if bands > n:
            raise CorrnoiseError("bands", f"must be <= n = {n}, got {bands}")
        if kind == "banded":
            bands = check_bands(bands, n, schema)
    elif bands is not None:
        raise CorrnoiseError("bands", f"does not apply to {kind}" + (
            "; min-sep dense strategies are banded by the separation b" if kind == "dense" else ""))
    if buffers is not None:
        if kind != "blt":
            raise CorrnoiseError("buffers", f"only applies to blt, not {kind}")
        buffers = check_int("buffers", buffers, minimum=1, maximum=10)
    if colnorm and kind != "banded-toeplitz":
        raise CorrnoiseError("colnorm", f"only applies to banded-toeplitz ({kind} strategies are already column-normalized or need not be)")

    t0 = time.perf_counter()
    if kind == "dense":
        from .dense import optimize_dense

        strategy = optimize_dense(n, schema, objective, wl, progress=on_fraction)
    elif kind == "banded":
        from .banded import optimize_banded

        strategy = optimize_banded(n, bands, schema, objective, wl, progress=on_fraction)
    elif kind == "banded-toeplitz":
        from .toeplitz import optimize_banded_toeplitz

        strategy = optimize_banded_toeplitz(n, bands, participation=schema, objective=objective, workload=wl,
                                            column_normalize=bool(colnorm), progress=on_iteration)
    else:
        from .blt import optimize_blt

        strategy = optimize_blt(n, buffers=buffers, participation=schema, objective=objective, workload=wl,
                                progress=on_iteration)
    seconds = time.perf_counter() - t0
    validate_strategy(strategy)
    report = loss_report(strategy, schema, wl)
    for name in ("rms_loss", "max_loss", "sensitivity"):
        if not math.isfinite(getattr(report, name)):
            raise CorrnoiseError("strategy", f"the optimized strategy has a non-finite {name}")
    return strategy, report, seconds


@click.command("optimize")
@click.argument("kind", metavar="KIND")
@click.option("--n", "n", type=int, required=True, help="Number of steps (iterations).")
@click.option("--bands", type=int, default=None, help="Number of bands (banded, banded-toeplitz).")
@click.option("--buffers", type=int, default=None, help="BLT buffers d (1..10; default: grow while it helps).")
@click.option("--participation", default="single", show_default=True, help="single | cyclic:K:B | minsep:K:B")
@click.option("--objective", default="rms", show_default=True, help="rms | max")
@click.option("--workload", default="prefix", show_default=True, help="prefix | momentum:BETA[:WEIGHT_DECAY]")
@click.option("--colnorm", is_flag=True, help="banded-toeplitz: normalize the columns afterwards.")
@click.option("--out", "out", default=None, help="Mechanism file to write (.json; dense/banded arrays go to a sibling .npz).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def optimize_command(kind, n, bands, buffers, participation, objective, workload, colnorm, out, as_json):
    """Optimize a KIND strategy (dense, banded, banded-toeplitz, blt) and write a mechanism file."""
    if out is not None and not str(out).endswith(".json"):
        raise CorrnoiseError("out", f"mechanism files end in .json, got {out!r}")
    show = (not as_json) and sys.stderr.isatty()
    with _progress_display(show, f"optimize {kind}") as callbacks:
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
        "seconds": seconds,
        "file": path,
    }
    emit(data, as_json, f"corrnoise optimize {kind}")


__all__ = ["KINDS", "optimize_command", "run_optimize", "validate_strategy"]
