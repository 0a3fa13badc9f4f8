"""The planner's on-disk cache of optimized strategies and their error summaries: a second plan of
the same run re-optimizes nothing (the full Toeplitz and BLT optimizations take seconds each at
n = 2000) and recomputes no ||A C^-1|| (0.9 s for the 50,000 x 500 x 20 epochs designs).

What is stored is a deterministic optimizer output -- a strategy C -- never a privacy number. A
cached C only ever enters the plan as a mechanism whose noise is calibrated for *that* C (every
guarantee is keyed by the C's fingerprint, :mod:`corrnoise.accounting.cache`), so even a wrong C
could cost utility but not privacy. An entry is used only if its content digest matches, its
stored key equals the key asked for (optimizer, arguments, a digest of corrnoise's source and the
numpy and scipy versions) and the strategy rebuilt from
it has the fingerprint recorded with it; otherwise the optimizer runs again and the entry is
rewritten. Error summaries (rms and max error per unit noise, deterministic functions of C) are
keyed by the C's fingerprint and the same code digest. Same directory and switch as the guarantee cache (``$CORRNOISE_CACHE``, ``off``),
under ``designs/``, written atomically.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..accounting.cache import accountant_version, canonical_json, write_atomically

__all__ = ["cached_strategy", "cached_errors", "cached_numbers"]

FORMAT = "corrnoise-design-cache"
def _digest(key: dict, body: dict) -> str:
    return hashlib.sha256(canonical_json({"key": key, "body": body}).encode()).hexdigest()


def _body(strategy) -> dict:
    from ..strategies import ColumnNormalized, mechanism_fingerprint

    base = strategy.base if isinstance(strategy, ColumnNormalized) else strategy
    arrays = {k: np.asarray(v, dtype=np.float64).tolist() for k, v in base.arrays().items()}
    return {"kind": base.kind, "n": int(strategy.n), "column_normalized": isinstance(strategy, ColumnNormalized),
            "params": base.params(), "arrays": arrays, "fingerprint": mechanism_fingerprint(strategy)}


def _rebuild(body: dict):
    from ..strategies import ColumnNormalized, mechanism_fingerprint
    from ..strategies.kinds import kind_class

    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in body["arrays"].items()}
    strategy = kind_class(body["kind"]).from_params(int(body["n"]), body["params"], arrays)
    if body["column_normalized"]:
        strategy = ColumnNormalized(strategy)
    if mechanism_fingerprint(strategy) != body["fingerprint"]:
        return None
    return strategy


def cached_strategy(optimizer: str, args: dict[str, Any], build: Callable[[], Any]):
    """``build()`` (an optimizer run) through the cache: the stored strategy for ``optimizer`` and
    ``args`` (JSON scalars) if an entry passes every check (module docstring), else ``build()``,
    stored. A strategy that cannot be stored is still returned."""
    from ..accounting.cache import cache_dir

    directory = cache_dir()
    if directory is None:
        return build()
    key = {"optimizer": optimizer, "args": args, "code": accountant_version()}
    path = directory / "designs" / (hashlib.sha256(canonical_json(key).encode()).hexdigest()[:40] + ".json")
    try:
        entry = json.loads(path.read_text())
        if (isinstance(entry, dict) and entry.get("format") == FORMAT and entry.get("key") == key
                and entry.get("digest") == _digest(key, entry.get("body"))):
            strategy = _rebuild(entry["body"])
            if strategy is not None:
                return strategy
    except Exception:  # noqa: BLE001 - a missing or doubtful entry: optimize again
        pass
    strategy = build()
    try:
        body = _body(strategy)
        write_atomically(path, canonical_json({"format": FORMAT, "key": key, "body": body, "digest": _digest(key, body)}))
    except Exception:  # noqa: BLE001 - best effort
        pass
    return strategy


def cached_errors(strategy, compute: Callable[[Any], tuple[float, float]]) -> tuple[float, float]:
    """``compute(strategy)`` -- (mean_error, max_error) per unit noise -- through the cache
    (:func:`cached_numbers`)."""
    mean, mx = cached_numbers(strategy, "errors", lambda s: tuple(compute(s)), 2)
    return mean, mx


def cached_numbers(strategy, name: str, compute: Callable[[Any], tuple[float, ...]], count: int
                   ) -> tuple[float, ...]:
    """``compute(strategy)`` -- ``count`` finite positive numbers that are a deterministic function
    of C (its error summary, its noise cost) -- through the cache, keyed by ``name``, the
    strategy's fingerprint and the code digest; a doubtful entry is recomputed."""
    from ..accounting.cache import cache_dir
    from ..strategies import mechanism_fingerprint

    directory = cache_dir()
    if directory is None:
        return tuple(float(v) for v in compute(strategy))
    key = {name + "_of": mechanism_fingerprint(strategy), "code": accountant_version()}
    path = directory / "designs" / (name + "-" + hashlib.sha256(canonical_json(key).encode()).hexdigest()[:40] + ".json")
    try:
        entry = json.loads(path.read_text())
        body = entry.get("body") if isinstance(entry, dict) else None
        if (entry.get("format") == FORMAT and entry.get("key") == key and entry.get("digest") == _digest(key, body)
                and isinstance(body, list) and len(body) == count and all(isinstance(v, float) for v in body)
                and all(np.isfinite(body)) and min(body) > 0.0):
            return tuple(float(v) for v in body)
    except Exception:  # noqa: BLE001 - recompute
        pass
    values = tuple(float(v) for v in compute(strategy))
    try:
        body = list(values)
        write_atomically(path, canonical_json({"format": FORMAT, "key": key, "body": body, "digest": _digest(key, body)}))
    except Exception:  # noqa: BLE001 - best effort
        pass
    return values


