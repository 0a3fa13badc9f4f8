"""``corrnoise bench noise``: seconds per step and extra memory of the noise generators."""

from __future__ import annotations

import click

from ..errors import CorrnoiseError, check_int
from ..noise.bench import DTYPES, DEFAULT_MECHANISMS, bench_noise, bench_strategy
from ..progress import LineProgress


@click.group("bench")
def bench_group() -> None:
    """Benchmarks of training-time costs."""


@bench_group.command("noise")
@click.option("--dim", "dim", type=float, required=True, help="Model dimension m (e.g. 1e7).")
@click.option("--steps", "steps", type=int, default=10, show_default=True, help="Timed steps per mechanism.")
@click.option("--mechanisms", default=";".join(DEFAULT_MECHANISMS), show_default=True,
              help="Mechanism names (docs/cli.md) separated by ';', e.g. 'dpsgd;bsr:4;dpcgd:0.9'.")
@click.option("--device", default="cpu", show_default=True, help="torch device (cpu, cuda, cuda:1, ...).")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def noise_command(dim: float, steps: int, mechanisms: str, device: str, dtype: str, seed: int,
                  threads: int | None, as_json: bool) -> None:
    """Seconds per step and extra memory of correlated-noise generation, per mechanism."""
    import json
    import sys

    import torch

    if not float(dim).is_integer() or dim < 1:
        raise CorrnoiseError("dim", f"must be a positive integer, got {dim:g}")
    steps = check_int("steps", steps, minimum=1)
    if threads is not None:
        torch.set_num_threads(check_int("threads", threads, minimum=1))
    names = [s.strip() for s in mechanisms.split(";") if s.strip()]
    if not names:
        raise CorrnoiseError("mechanisms", "name at least one mechanism")
    for name in names:
        bench_strategy(name, steps + 65)  # validate all names before any work
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise CorrnoiseError("device", f"unknown torch device {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CorrnoiseError("device", "CUDA is not available on this machine; use --device cpu")
    show = not as_json and sys.stderr.isatty()
    if show:
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task("noise", total=len(names))

            def progress(name):
                bar.update(task, description=name, advance=0 if name == names[0] else 1)

            report = bench_noise(int(dim), steps, names, device=device, dtype=getattr(torch, dtype), seed=seed, progress=progress)
    elif not as_json:  # plain lines where stderr is no terminal (the README's run was silent for 15 s)
        lines = LineProgress(prefix="corrnoise bench")
        started: list[str] = []

        def line(name):
            lines(f"noise: {name}", len(started), len(names))
            started.append(name)

        report = bench_noise(int(dim), steps, names, device=device, dtype=getattr(torch, dtype), seed=seed, progress=line)
        lines("noise", len(names), len(names))
    else:
        report = bench_noise(int(dim), steps, names, device=device, dtype=getattr(torch, dtype), seed=seed)
    if as_json:
        click.echo(json.dumps(report, allow_nan=False))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Noise generation, m = {report['dim']}, {report['dtype']} on {report['device']}")
    for col in ("mechanism", "generator", "ms / step", "x DP-SGD", "extra memory (MiB)"):
        table.add_column(col, justify="left" if col in ("mechanism", "generator") else "right")
    for r in report["results"]:
        sps = r.get("seconds_per_step")
        table.add_row(r["mechanism"], r.get("generator", r.get("skipped", "")),
                      "-" if sps is None else f"{1e3 * sps:.2f}",
                      f"{r['relative_to_dpsgd']:.2f}" if "relative_to_dpsgd" in r else "-",
                      f"{r['extra_memory_bytes'] / 2**20:.2f}")
    Console().print(table)
