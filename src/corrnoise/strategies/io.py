"""Mechanism files (DESIGN.md "Mechanism files"): a small JSON document + optional sibling .npz.

The JSON holds the format version, kind, n, parameters (floats written with Python's
shortest round-trip repr, so they load bit-for-bit), whether C is column-normalized, what it
was designed for and its losses. Large arrays (dense matrices, bands, long coefficient
vectors) go to ``<stem>.npz`` next to it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorrnoiseError
from .base import Strategy
from .colnorm import ColumnNormalized
from .kinds import kind_class

FORMAT = "corrnoise.mechanism"
VERSION = 1


def save_mechanism(
    strategy: Strategy,
    path: str | Path,
    designed_for: dict[str, Any] | None = None,
    losses: dict[str, Any] | None = None,
) -> Path:
    """Write ``strategy`` to ``path`` (.json) and, when it has large arrays, ``path.stem + .npz``."""
    path = Path(path)
    if path.suffix != ".json":
        raise CorrnoiseError("out", f"mechanism files end in .json, got {str(path)!r}")
    base = strategy.base if isinstance(strategy, ColumnNormalized) else strategy
    arrays = base.arrays()
    npz_name = None
    if arrays:
        npz_name = path.with_suffix(".npz").name
        np.savez(path.with_suffix(".npz"), **arrays)
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "kind": base.kind,
        "label": strategy.label,
        "n": strategy.n,
        "column_normalized": isinstance(strategy, ColumnNormalized),
        "params": base.params(),
        "arrays": npz_name,
        "designed_for": designed_for or {},
        "losses": losses or {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def read_mechanism_document(path: str | Path) -> dict[str, Any]:
    """The JSON document of a mechanism file, validated."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError:
        raise CorrnoiseError("mechanism", f"cannot read {str(path)!r}") from None
    except json.JSONDecodeError as exc:
        raise CorrnoiseError("mechanism", f"{str(path)!r} is not valid JSON ({exc.msg})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorrnoiseError("mechanism", f"{str(path)!r} is not a corrnoise mechanism file")
    if doc.get("version") != VERSION:
        raise CorrnoiseError("mechanism", f"unsupported mechanism file version {doc.get('version')!r} (expected {VERSION})")
    return doc


def load_mechanism(path: str | Path, n: int | None = None) -> Strategy:
    """Load a mechanism file; with ``n`` given, resize (n-independent kinds) or take the leading n steps."""
    path = Path(path)
    doc = read_mechanism_document(path)
    arrays: dict[str, np.ndarray] = {}
    if doc.get("arrays"):
        try:
            with np.load(path.parent / doc["arrays"], allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
        except OSError:
            raise CorrnoiseError("mechanism", f"missing array file {doc['arrays']!r} beside {str(path)!r}") from None
    strategy = kind_class(doc["kind"]).from_params(int(doc["n"]), doc.get("params", {}), arrays)
    if n is not None:
        strategy = strategy.with_n(n)
    if doc.get("column_normalized"):
        strategy = ColumnNormalized(strategy)
    return strategy
