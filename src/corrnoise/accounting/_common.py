"""Numerical plumbing shared by the MMCC (seed 001) and Monte Carlo (seed 000) accountants.

* :func:`as_lower_triangular` -- the mechanism C as a checked dense non-negative lower-triangular
  matrix (both analyses need one: seed 001 Thm 4.3, seed 000 Lemma 3.2);
* :func:`resolve_workers`, :func:`blas_threads`, :func:`map_ordered` -- a thread pool whose
  results come back in input order (so no number depends on the worker count) with BLAS held to
  one thread per worker, reporting to a :data:`corrnoise.progress.Progress`.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, ContextManager, Sequence, TypeVar

import numpy as np

from ..errors import CorrnoiseError, check_int
from ..progress import reporting

__all__ = ["as_lower_triangular", "resolve_workers", "blas_threads", "map_ordered"]

T = TypeVar("T")
R = TypeVar("R")


def as_lower_triangular(strategy: Any, n: int | None = None, *, param: str = "mechanism", method: str = "MMCC",
                        why: str = "", require_nonzero: bool = True) -> tuple[np.ndarray, str]:
    """(C, label): C (n x n, float64) from a Strategy, a strategy name (with ``n``) or an array,
    checked square, finite, lower-triangular and non-negative; otherwise a one-line
    :class:`CorrnoiseError` on ``param`` naming ``method`` (``why``: the reference appended to
    the non-negativity error).  ``require_nonzero`` also refuses C = 0."""
    if isinstance(strategy, str):
        from ..strategies import parse_strategy

        if n is None:
            raise CorrnoiseError("n", "a strategy name needs the number of steps n")
        strategy = parse_strategy(strategy, n)
    if hasattr(strategy, "matrix") and callable(strategy.matrix):
        if n is not None and int(n) != int(strategy.n):
            strategy = strategy.with_n(check_int("n", n, minimum=1))
        label = getattr(strategy, "label", "C")
        rows, steps = getattr(strategy, "rows", None), getattr(strategy, "n", None)
        if rows is not None and steps is not None and rows != steps:
            raise CorrnoiseError(param, f"{label} has {rows} rows for {steps} steps; "
                                 f"{method} needs a square lower-triangular C")
        strategy = strategy.matrix()
    else:
        label = "matrix"
    try:
        cmat = np.asarray(strategy, dtype=np.float64)
    except (TypeError, ValueError):
        raise CorrnoiseError(param, "expected a strategy or a square matrix of numbers, "
                             f"got {type(strategy).__name__}") from None
    if n is not None and cmat.ndim == 2 and cmat.shape[0] != int(n):
        raise CorrnoiseError("n", f"matrix has {cmat.shape[0]} rows but n = {n}")
    if cmat.ndim != 2 or cmat.shape[0] != cmat.shape[1] or cmat.shape[0] == 0:
        raise CorrnoiseError(param, f"{method} needs a square n x n matrix C, got shape {cmat.shape}")
    if not np.all(np.isfinite(cmat)):
        raise CorrnoiseError(param, f"{label} has NaN or infinite entries")
    if np.any(np.triu(cmat, 1) != 0.0):
        raise CorrnoiseError(param, f"{label} is not lower-triangular; {method} needs a lower-triangular C")
    if np.any(cmat < 0.0):
        raise CorrnoiseError(param, f"{label} has negative entries (min {cmat.min():.3g}); {method} needs a "
                             f"non-negative C{why}")
    if require_nonzero and not np.any(cmat > 0.0):
        raise CorrnoiseError(param, f"{label} is zero")
    return cmat, label


def resolve_workers(workers: int | None) -> int:
    """Worker threads: ``workers`` (>= 1) or, by default, one per CPU core (``os.cpu_count()``).

    Results never depend on it: work items are seeded per item and combined in input order."""
    if workers is None:
        return max(1, os.cpu_count() or 1)
    return check_int("workers", workers, minimum=1)


def blas_threads(limit: int | None = 1) -> ContextManager[Any]:
    """Hold BLAS to ``limit`` threads inside the block (None: leave it alone).  BLAS threads spin
    badly next to our own pool on a loaded machine; parallelism comes from the work items."""
    if limit is None:
        return contextlib.nullcontext()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl ships with the scipy / scikit-learn stacks
        return contextlib.nullcontext()
    return threadpool_limits(limits=limit, user_api="blas")


def map_ordered(fn: Callable[[T], R], items: Sequence[T], workers: int = 1, progress: Any = None,
                label: str = "working") -> list[R]:
    """``[fn(item) for item in items]`` on ``workers`` threads, results in input order.

    ``progress`` (a :data:`corrnoise.progress.Progress`, a bool or None) hears ``(label, 0, total)``
    first and ``(label, done, total)`` after each item, in order."""
    total = len(items)
    out: list[R] = []
    with reporting(progress) as report:
        report(label, 0, total)
        if workers > 1 and total > 1:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for res in pool.map(fn, items):
                    out.append(res)
                    report(label, len(out), total)
        else:
            for item in items:
                out.append(fn(item))
                report(label, len(out), total)
    return out
