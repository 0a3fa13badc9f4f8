"""The ``corrnoise`` command line (layer 7). Contract: docs/cli.md "Command-line contract".

Every command takes ``--json`` (one JSON object on stdout, nothing else there); bad input
exits with status 2 and one line on stderr naming the parameter, never a traceback.
"""

from __future__ import annotations

import json
import os
import sys


import click

from ..errors import CorrnoiseError
from .report import emit as _emit


# Commands defined in other layers, imported only when invoked so that `corrnoise loss` does not
# pay for torch or dp_accounting at start-up: name -> "module:attribute".
LAZY_COMMANDS = {
    "account": "corrnoise.cli.account:account_command",
    "audit": "corrnoise.cli.audit:audit_command",
    "bench": "corrnoise.cli.bench:bench_group",
    "optimize": "corrnoise.cli.optimize:optimize_command",
    "plan": "corrnoise.cli.plan:plan_command",
    "train": "corrnoise.cli.train:train_command",
}


class LazyGroup(click.Group):
    """A click group whose heavier subcommands are imported on first use."""

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(LAZY_COMMANDS))

    def get_command(self, ctx, name):
        if name in LAZY_COMMANDS and name not in self.commands:
            import importlib

            module, attr = LAZY_COMMANDS[name].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), name)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="corrnoise")
def cli() -> None:
    """Differentially private learning with correlated noise (matrix-factorization mechanisms)."""


@cli.command()
@click.argument("strategy")
@click.option("--n", "n", type=int, required=True, help="Number of steps (iterations).")
@click.option("--participation", default="single", show_default=True, help="single | cyclic:K:B | minsep:K:B")
@click.option("--workload", default="prefix", show_default=True, help="prefix | momentum:BETA[:WEIGHT_DECAY]")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def loss(strategy: str, n: int, participation: str, workload: str, as_json: bool) -> None:
    """Sensitivity, mean/max error and normalized RMS/max loss of STRATEGY."""
    from ..losses import loss_report
    from ..participation import parse_participation
    from ..strategies import parse_strategy
    from ..workloads import parse_workload

    if n < 1:
        raise CorrnoiseError("n", f"must be >= 1, got {n}")
    schema = parse_participation(participation)
    wl = parse_workload(workload)
    strat = parse_strategy(strategy, n)
    report = loss_report(strat, schema, wl)
    _emit(report.to_dict(), as_json, f"corrnoise loss {strategy}")


@cli.command()
@click.option("--n", "n", type=int, default=1024, show_default=True, help="Number of steps.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def demo(n: int, as_json: bool) -> None:
    """Compare the built-in mechanisms on n steps (single and 4-epoch cyclic participation)."""
    from ..losses import loss_report
    from ..strategies import parse_strategy

    if n < 16:
        raise CorrnoiseError("n", f"the demo needs n >= 16, got {n}")
    epochs = 4
    cyclic = f"cyclic:{epochs}:{-(-n // epochs)}"
    names = ["identity", "prefix", "toeplitz-sqrt", "toeplitz-sqrt+colnorm", "bsr:16", "dpcgd:0.5", "tree"]
    rows = []
    for name in names:
        strat = parse_strategy(name, n)
        single = loss_report(strat, "single")
        multi = loss_report(strat, cyclic)
        rows.append({"strategy": name, "rms_loss_single": single.rms_loss, "max_loss_single": single.max_loss,
                     "rms_loss_cyclic": multi.rms_loss, "sensitivity_cyclic": multi.sensitivity})
    if as_json:
        click.echo(json.dumps({"n": n, "cyclic": cyclic, "results": rows}))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Prefix-sum losses, n = {n} (single participation and {cyclic})")
    for col in ["strategy", "rms_loss_single", "max_loss_single", "rms_loss_cyclic", "sensitivity_cyclic"]:
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for row in rows:
        table.add_row(row["strategy"], *(f"{row[k]:.4f}" for k in list(row)[1:]))
    Console().print(table)




def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: turns every bad input into one line on stderr."""
    try:
        cli.main(args=argv, prog_name="corrnoise", standalone_mode=False)
    except CorrnoiseError as exc:
        click.echo(f"error: {exc}", err=True)
        return 2
    except click.exceptions.UsageError as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        return 2
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        return 1
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except MemoryError:
        click.echo("error: out of memory: these inputs need an array too large for this machine (a very large n, "
                   "or a noise level far below the sensitivity); reduce them", err=True)
        return 2
    except OSError as exc:  # a path that cannot be read or written (a missing parent, a file in the way)
        where = f"'{exc.filename}'" if getattr(exc, "filename", None) else "file"
        click.echo(f"error: {where}: {exc.strerror or exc}", err=True)
        return 2
    except Exception as exc:  # a bug, not bad input: still one line unless asked for more
        if os.environ.get("CORRNOISE_DEBUG"):
            raise
        click.echo(f"error: internal error ({type(exc).__name__}: {exc}); rerun with CORRNOISE_DEBUG=1 for details", err=True)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
