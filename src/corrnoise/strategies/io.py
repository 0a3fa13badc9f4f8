"""Mechanism files (docs/mechanism-file.md): a small JSON document + optional sibling .npz.

The JSON holds the format version, kind, n, parameters (floats written with Python's
shortest round-trip repr, so they load bit-for-bit), whether C is column-normalized, what it
was designed for and its losses. Large arrays (dense matrices, bands, long coefficient
vectors) go to ``<stem>.npz`` next to it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorrnoiseError, check_int
from .base import Strategy
from .colnorm import ColumnNormalized
from .kinds import KINDS, kind_class

FORMAT = "corrnoise.mechanism"
VERSION = 1


def check_mechanism_path(path: str | Path, param: str = "out") -> Path:
    """``path`` as a Path if it names a mechanism file (``.json``), else a one-line error naming ``param``."""
    path = Path(path)
    if path.suffix != ".json":
        raise CorrnoiseError(param, f"mechanism files end in .json, got {str(path)!r}")
    return path


def save_mechanism(
    strategy: Strategy,
    path: str | Path,
    designed_for: dict[str, Any] | None = None,
    losses: dict[str, Any] | None = None,
) -> Path:
    """Write ``strategy`` to ``path`` (.json) and, when it has large arrays, ``path.stem + .npz``."""
    path = check_mechanism_path(path)
    base = strategy.base if isinstance(strategy, ColumnNormalized) else strategy
    arrays = base.arrays()
    path.parent.mkdir(parents=True, exist_ok=True)
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
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def mechanism_fingerprint(strategy: Strategy) -> str:
    """SHA-256 of everything that defines the mechanism: equal fingerprints, same C (and same
    noise stream). Labels are not enough (every 1-buffer BLT is ``blt(d=1)``, every dense C
    ``dense``): identity is by content.

    A registered kind (:data:`~corrnoise.strategies.kinds.KINDS`) is defined by its kind, n,
    column normalization, :meth:`~Strategy.params` and :meth:`~Strategy.arrays` (what its
    mechanism file stores and ``from_params`` rebuilds exactly). Any other Strategy -- a subclass
    outside the registry, whose parameters the registry cannot vouch for -- is fingerprinted by
    its class and its materialized C, so two different C can never share a fingerprint."""
    base = strategy.base if isinstance(strategy, ColumnNormalized) else strategy
    h = hashlib.sha256()
    registered = KINDS.get(getattr(base, "kind", None)) is type(base)
    head = {"kind": base.kind, "n": int(strategy.n), "column_normalized": isinstance(strategy, ColumnNormalized),
            "params": base.params()}
    if not registered:
        head["class"] = f"{type(base).__module__}.{type(base).__qualname__}"
    h.update(json.dumps(head, sort_keys=True, default=lambda o: np.asarray(o, dtype=np.float64).tolist()).encode())
    arrays = base.arrays() if registered else {**base.arrays(), "matrix()": base.matrix()}
    for key, value in sorted(arrays.items()):
        h.update(key.encode())
        h.update(np.ascontiguousarray(value, dtype=np.float64).tobytes())
    return h.hexdigest()


def read_json_document(path: str | Path, fmt: str, version: int, param: str, what: str) -> dict[str, Any]:
    """The JSON document at ``path`` if it says it is ``fmt`` of ``version`` (corrnoise's file
    formats: mechanism files, plan files), else one line naming ``param``."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError:
        raise CorrnoiseError(param, f"cannot read {str(path)!r}") from None
    except json.JSONDecodeError as exc:
        raise CorrnoiseError(param, f"{str(path)!r} is not valid JSON ({exc.msg})") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise CorrnoiseError(param, f"{str(path)!r} is not a corrnoise {what}")
    if doc.get("version") != version:
        raise CorrnoiseError(param, f"unsupported {what} version {doc.get('version')!r} (expected {version})")
    return doc


def read_mechanism_document(path: str | Path) -> dict[str, Any]:
    """The JSON document of a mechanism file, validated."""
    return read_json_document(path, FORMAT, VERSION, "mechanism", "mechanism file")


def load_mechanism(path: str | Path, n: int | None = None) -> Strategy:
    """Load a mechanism file; with ``n`` given, resize (n-independent kinds) or take the leading n steps."""
    path = Path(path)
    doc = read_mechanism_document(path)
    arrays: dict[str, np.ndarray] = {}
    if doc.get("arrays"):
        if not isinstance(doc["arrays"], str):
            raise CorrnoiseError("mechanism", f"{str(path)!r}: 'arrays' must be a file name, got {doc['arrays']!r}")
        try:
            with np.load(path.parent / doc["arrays"], allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
        except OSError:
            raise CorrnoiseError("mechanism", f"missing array file {doc['arrays']!r} beside {str(path)!r}") from None
    where = str(path)
    if not isinstance(doc.get("kind"), str):
        raise CorrnoiseError("mechanism", f"{where!r}: 'kind' must be a string, got {doc.get('kind')!r}")
    try:
        steps = check_int("n", doc.get("n"), minimum=1)
    except CorrnoiseError as exc:
        raise CorrnoiseError("mechanism", f"{where!r}: {exc}") from None
    params = doc.get("params", {})
    _check_params(params, where)
    normalized = doc.get("column_normalized", False)
    if not isinstance(normalized, bool):
        raise CorrnoiseError("mechanism", f"{where!r}: 'column_normalized' must be true or false, got {normalized!r}")
    try:
        strategy = kind_class(doc["kind"]).from_params(steps, params, arrays)
    except CorrnoiseError:
        raise
    except KeyError as exc:
        raise CorrnoiseError("mechanism", f"{where!r}: missing entry {exc.args[0]!r} for kind {doc['kind']!r}") from None
    except (TypeError, ValueError, IndexError) as exc:
        raise CorrnoiseError("mechanism", f"{where!r}: malformed parameters for kind {doc['kind']!r} ({exc})") from None
    if n is not None:
        strategy = strategy.with_n(n)
    if normalized:
        strategy = ColumnNormalized(strategy)
    return strategy


#: parameters that count something (an integer, not a float rounded down)
_INTEGER_PARAMS = ("bands",)
#: parameters that name something
_STRING_PARAMS = ("base_kind", "decoding")


def _check_params(params: Any, where: str) -> None:
    """Every parameter of a mechanism file has its type: integers where they count, strings where
    they name, numbers (or lists of numbers) elsewhere -- never a string or a boolean read as a
    number (``"bands": 2.5`` silently becoming 2, ``"column_normalized": "false"`` read as true)."""
    if not isinstance(params, dict):
        raise CorrnoiseError("mechanism", f"{where!r}: 'params' must be an object, got {params!r}")
    for key, value in params.items():
        if key == "base_params":
            _check_params(value, where)
        elif key in _STRING_PARAMS:
            if not isinstance(value, str):
                raise CorrnoiseError("mechanism", f"{where!r}: parameter {key!r} must be a string, got {value!r}")
        elif key in _INTEGER_PARAMS:
            if not isinstance(value, int) or isinstance(value, bool):
                raise CorrnoiseError("mechanism", f"{where!r}: parameter {key!r} must be an integer, got {value!r}")
        elif not _numbers(value):
            raise CorrnoiseError("mechanism", f"{where!r}: parameter {key!r} must be a number or a list of numbers, "
                                 f"got {value!r}")


def _numbers(value: Any) -> bool:
    if isinstance(value, list):
        return all(_numbers(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)
