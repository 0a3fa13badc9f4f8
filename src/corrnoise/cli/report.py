"""Output of every command (layer 7): one JSON object with --json, else a readable table."""

from __future__ import annotations

import json
import math
from typing import Any

import click


def finite_json(value):
    """``value`` with every non-finite float (an epsilon without a bound, say) as None (JSON null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def emit(data: dict[str, Any], as_json: bool, title: str) -> None:
    """Print ``data`` as exactly one JSON object (``as_json``; non-finite numbers as null) or as a
    two-column rich table."""
    if as_json:
        click.echo(json.dumps(finite_json(data), allow_nan=False))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=True)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key, value in data.items():
        if isinstance(value, float):
            value = f"{value:.6g}" if math.isfinite(value) else str(value)
        table.add_row(key, str(value))
    Console().print(table)
