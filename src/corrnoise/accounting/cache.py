"""An on-disk cache of calibrated *guarantees*: a second identical calibration is a file read.

What is cached is only ever a :class:`~corrnoise.accounting.base.PrivacyResult` of kind
``"guarantee"`` that this code produced -- for Monte Carlo (``mc``) one whose fresh-sample
verification passed (Estimate-Verify-Release, seed 000 Thm 2.1) -- under a key naming exactly the
event it was proved for:

* the mechanism's fingerprint (:func:`corrnoise.strategies.mechanism_fingerprint`: SHA-256 of
  its kind, n and every parameter array -- equal fingerprints, same C) and the steps accounted;
* the batching spec, and for unamplified ``none`` the participation schema (``cyclic:k:b``);
* the target (epsilon, delta) (their exact float values), the accounting method that proved it,
  the calibration tolerance and every option that changes the number (``discretization``,
  ``samples`` ...);
* :data:`ACCOUNTANT_VERSION` together with a digest of corrnoise's source code and the versions
  of the libraries it calls (dp_accounting, numpy, scipy): any change to how a guarantee (or the
  C behind a fingerprint) is computed misses every older entry, even if nobody bumps the constant.

Estimates, lower bounds, calibrations with an explicit ``seed`` / ``verify_seed`` (reproducible
experiments) and anything that is not a guarantee are never stored.  An entry is trusted only if
its content digest (SHA-256 over the key and the result) matches, its stored key equals the key
asked for field by field, and the result is self-consistent (kind ``guarantee``, the method and
delta of the key, epsilon <= the target, a finite positive noise, noise_multiplier = noise_std /
||C||_col of this C, ``verified`` for Monte Carlo); otherwise it is ignored and the guarantee is
computed again (and the entry rewritten).  The digest guards against corruption and accidental
edits, not against someone who can write the cache directory and recompute SHA-256: such a person
can also edit the installed code; keep the cache as private as the installation.

Location: ``$CORRNOISE_CACHE`` (a directory), else ``$XDG_CACHE_HOME/corrnoise``, else
``~/.cache/corrnoise``; ``CORRNOISE_CACHE=off`` (or ``0``, ``false``, ``no``, ``none``) disables
it.  Entries are written atomically (a temporary file in the same directory, then
``os.replace``), one JSON file each under ``guarantees/``.  A cache that cannot be read or
written is simply not used.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from .base import PrivacyResult, column_norm, note_proven
from .calibrate import DEFAULT_RTOL, calibrate
from .event import as_event

__all__ = ["ACCOUNTANT_VERSION", "CACHE_ENV", "accountant_version", "cache_dir", "canonical_json", "write_atomically", "cache_key", "cached_calibrate", "cached_guarantee", "lookup",
           "remember", "store"]

#: Bump when the meaning of a cached guarantee changes without a change to the accounting code
#: (the code itself is digested into every key, see :func:`accountant_version`).
ACCOUNTANT_VERSION = 1
CACHE_ENV = "CORRNOISE_CACHE"
FORMAT = "corrnoise-guarantee-cache"
_OFF = ("off", "0", "false", "no", "none", "disabled")
#: Options that never change the number found (how it is computed, not what).
_NEUTRAL_OPTIONS = ("progress", "workers")
#: Options that make a calibration an experiment or not a guarantee: never cached.
_UNCACHEABLE_OPTIONS = ("seed", "verify_seed", "estimate")

_VERSION: str | None = None


def cache_dir() -> Path | None:
    """The cache directory (:data:`CACHE_ENV`, ``$XDG_CACHE_HOME/corrnoise``, ``~/.cache/corrnoise``),
    or None when the cache is off."""
    value = os.environ.get(CACHE_ENV, "").strip()
    if value.lower() in _OFF:
        return None
    if value:
        return Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "corrnoise"


def accountant_version() -> str:
    """:data:`ACCOUNTANT_VERSION`, corrnoise's version, a SHA-256 of every source file of the
    package (the accounting, but also the code that turns a fingerprinted kind and parameters into
    the matrix C that is accounted, and everything they use), and the versions of dp_accounting,
    numpy and scipy: two processes share a cached guarantee only if they would compute it
    identically; any edit to corrnoise invalidates every entry."""
    global _VERSION
    if _VERSION is None:
        from .. import __version__

        h = hashlib.sha256()
        root = Path(__file__).resolve().parent.parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            try:
                h.update(path.read_bytes())
            except OSError:
                h.update(b"?")
        libs = []
        for name in ("dp_accounting", "numpy", "scipy"):
            try:
                from importlib.metadata import version

                libs.append(f"{name}={version(name)}")
            except Exception:  # noqa: BLE001 - not installed / no metadata: name it as such
                libs.append(f"{name}=?")
        _VERSION = f"{ACCOUNTANT_VERSION}:{__version__}:{h.hexdigest()[:32]}:{','.join(libs)}"
    return _VERSION


def canonical_json(obj: Any) -> str:
    """One spelling of a JSON value (sorted keys, no spaces, no NaN): what keys and digests hash."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one, never a
    part (a temporary file in the same directory, fsync, rename); the directory is made private."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def cache_key(event, epsilon: float, delta: float, method: str, rtol: float, options: dict[str, Any]) -> dict | None:
    """The key of a calibration of ``event`` (a MechanismEvent without noise) to (epsilon, delta)
    by ``method`` (already resolved, not ``auto``), or None when it must not be cached (an explicit
    seed, an estimate, an option that is not a JSON scalar)."""
    from ..strategies import mechanism_fingerprint

    opts = {}
    for k, v in sorted(options.items()):
        if k in _NEUTRAL_OPTIONS:
            continue
        if k in _UNCACHEABLE_OPTIONS:
            if v is None or v is False:
                continue
            return None
        if not (v is None or isinstance(v, (bool, int, float, str))) or (isinstance(v, float) and not math.isfinite(v)):
            return None
        opts[k] = v
    bat = event.batching
    participation = getattr(bat, "participation", None)
    return {
        "accountant": accountant_version(),
        "fingerprint": mechanism_fingerprint(event.mechanism),
        "n": int(event.mechanism.n),
        "steps": int(event.steps),
        "batching": bat.spec,
        "participation": None if participation is None else participation.spec,
        "epsilon": float(epsilon).hex(),
        "delta": float(delta).hex(),
        "method": str(method),
        "rtol": float(rtol).hex(),
        "options": opts,
    }


def _path(directory: Path, key: dict) -> Path:
    return directory / "guarantees" / (hashlib.sha256(canonical_json(key).encode()).hexdigest()[:40] + ".json")


def _digest(key: dict, result: dict) -> str:
    return hashlib.sha256(canonical_json({"key": key, "result": result}).encode()).hexdigest()


def _consistent(result: PrivacyResult, key: dict, event) -> bool:
    """The checks of a cached result against the key it claims (module docstring)."""
    if result.kind != "guarantee" or result.method != key["method"]:
        return False
    if float(result.delta) != float.fromhex(key["delta"]):
        return False
    eps, nu, sigma = float(result.epsilon), float(result.noise_std), float(result.noise_multiplier)
    if not (math.isfinite(eps) and eps <= float.fromhex(key["epsilon"])):
        return False
    if not (math.isfinite(nu) and nu > 0.0 and math.isfinite(sigma) and sigma > 0.0):
        return False
    if not math.isclose(nu / column_norm(event.mechanism), sigma, rel_tol=1e-6):
        return False
    if key["method"] == "mc" and result.extras.get("verified") is not True:
        return False
    return result.extras.get("batching", key["batching"]) == key["batching"]


def lookup(directory: Path, key: dict, event) -> PrivacyResult | None:
    """The cached guarantee for ``key``, or None (missing, unreadable, or failing any check)."""
    try:
        entry = json.loads(_path(directory, key).read_text())
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            return None
        stored_key, stored = entry.get("key"), entry.get("result")
        if stored_key != key or not isinstance(stored, dict) or entry.get("digest") != _digest(stored_key, stored):
            return None
        result = PrivacyResult.from_dict(stored)
        if not _consistent(result, key, event):
            return None
    except Exception:  # noqa: BLE001 - any doubt about an entry: recompute
        return None
    return result


def store(directory: Path, key: dict, result: PrivacyResult, event) -> bool:
    """Write ``result`` under ``key`` atomically; only a self-consistent guarantee is written.
    Returns whether it was written (a cache that cannot be written is not an error)."""
    if not _consistent(result, key, event):
        return False
    try:
        data = result.to_dict()
        entry = {"format": FORMAT, "key": key, "result": data, "digest": _digest(key, data)}
        write_atomically(_path(directory, key), canonical_json(entry))
    except Exception:  # noqa: BLE001 - best effort: an unwritable cache is no cache
        return False
    return True


def _event_key(event_or_strategy, batching, epsilon, delta, method, rtol, options):
    from .gate import choose_method

    directory = cache_dir()
    event = as_event(event_or_strategy, batching)
    if directory is None or event.noise_std is not None:
        return None, None, event, method
    name = choose_method(event) if method == "auto" else method
    try:
        key = cache_key(event, float(epsilon), float(delta), name, float(rtol), options)
    except (TypeError, ValueError):
        key = None
    return directory, key, event, name


def cached_guarantee(event_or_strategy, batching=None, *, epsilon: float, delta: float, method: str = "auto",
                     rtol: float = DEFAULT_RTOL, **options: Any) -> PrivacyResult | None:
    """The guarantee :func:`cached_calibrate` would read from the cache for these arguments, or
    None (cache off, no entry, or an entry that fails a check); computes nothing."""
    directory, key, event, _ = _event_key(event_or_strategy, batching, epsilon, delta, method, rtol, options)
    if directory is None or key is None:
        return None
    hit = lookup(directory, key, event)
    return None if hit is None else note_proven(hit.with_extras(cached=True))


def remember(result: PrivacyResult, event_or_strategy, batching=None, *, epsilon: float, delta: float,
             method: str = "auto", rtol: float = DEFAULT_RTOL, **options: Any) -> bool:
    """Store a guarantee computed elsewhere under the key :func:`cached_calibrate` would use for
    these arguments (without seeds: any verified guarantee for the event is one); only a
    self-consistent guarantee is stored (:func:`store`). Returns whether it was stored."""
    directory, key, event, _ = _event_key(event_or_strategy, batching, epsilon, delta, method, rtol, options)
    if directory is None or key is None:
        return False
    return store(directory, key, result, event)


def cached_calibrate(event_or_strategy, batching=None, *, epsilon: float, delta: float, method: str = "auto",
                     rtol: float = DEFAULT_RTOL, start: float | None = None, **options: Any) -> PrivacyResult:
    """:func:`~corrnoise.accounting.calibrate.calibrate` through the cache: a stored guarantee for
    exactly this event, target, method and options (module docstring), else the calibration,
    stored if it is a guarantee. A result read from the cache has ``extras["cached"] = True``.
    ``start`` (the coarse search's result, :func:`calibrate`) changes the work, not the result: it
    is not part of the key."""
    directory, key, event, name = _event_key(event_or_strategy, batching, epsilon, delta, method, rtol, options)
    if directory is None:
        return calibrate(event, epsilon=epsilon, delta=delta, method=method, rtol=rtol, start=start, **options)
    if key is not None:
        hit = lookup(directory, key, event)
        if hit is not None:
            return note_proven(hit.with_extras(cached=True))
    result = calibrate(event, epsilon=epsilon, delta=delta, method=name, rtol=rtol, start=start, **options)
    if key is not None:
        store(directory, key, result, event)
    return result
