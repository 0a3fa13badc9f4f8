"""Progress reporting without a user interface: one callback type for long computations.

A :data:`Progress` is called as ``progress(label, done, total)``: ``label`` names the phase
(e.g. ``"verifying"``), ``done`` of ``total`` work items are finished; ``done == 0`` announces the
phase and ``done == total`` ends it.  The core library calls it and never imports a terminal
library; the command line passes a rich progress bar (:class:`corrnoise.cli.progress.RichProgress`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from .errors import CorrnoiseError

__all__ = ["Progress", "null_progress", "resolve_progress", "reporting"]

#: ``progress(label, done, total)``.
Progress = Callable[[str, int, int], None]


def null_progress(label: str, done: int, total: int) -> None:
    """A :data:`Progress` that reports nothing."""


def resolve_progress(progress: Any) -> Progress:
    """A :data:`Progress` from what callers pass: None / False -> :func:`null_progress`, a callable
    as is. (A terminal display belongs to the command line, which passes a callable.)"""
    if progress is None or progress is False:
        return null_progress
    if callable(progress):
        return progress
    raise CorrnoiseError("progress", f"must be a callable(label, done, total), False or None, got {progress!r}")


@contextlib.contextmanager
def reporting(progress: Any) -> Iterator[Progress]:
    """``with reporting(progress) as report:`` -- :func:`resolve_progress`, and on leaving the block
    the reporter's ``close()`` (if it has one: a terminal bar) is called, also on errors."""
    report = resolve_progress(progress)
    try:
        yield report
    finally:
        close = getattr(report, "close", None)
        if close is not None:
            close()
