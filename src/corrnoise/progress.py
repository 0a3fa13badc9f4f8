"""Progress reporting without a user interface: one callback type for long computations.

A :data:`Progress` is called as ``progress(label, done, total)``: ``label`` names the phase
(e.g. ``"verifying"``), ``done`` of ``total`` work items are finished; ``done == 0`` announces the
phase and ``done == total`` ends it.  The core library calls it and never imports a terminal
library; the command line passes a rich progress bar (:class:`corrnoise.cli.progress.RichProgress`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Callable, Iterator, TextIO

from .errors import CorrnoiseError

__all__ = ["Progress", "null_progress", "resolve_progress", "reporting", "LineProgress", "format_seconds"]

#: ``progress(label, done, total)``.
Progress = Callable[[str, int, int], None]


def null_progress(label: str, done: int, total: int) -> None:
    """A :data:`Progress` that reports nothing."""


def resolve_progress(progress: Any) -> Progress:
    """A :data:`Progress` from what callers pass: None / False -> :func:`null_progress`, True -> a
    :class:`LineProgress` on stderr, a callable as is. (A terminal display belongs to the command
    line, which passes a callable.)"""
    if progress is None or progress is False:
        return null_progress
    if progress is True:
        return LineProgress()
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


def format_seconds(seconds: float) -> str:
    """``"0.4 s"``, ``"12 s"``, ``"3 min 05 s"``: a duration for a progress line."""
    if seconds < 10.0:
        return f"{seconds:.1f} s"
    if seconds < 60.0:
        return f"{seconds:.0f} s"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m} min {s:02d} s"


class LineProgress:
    """A :data:`Progress` that writes plain lines (default: to stderr), so a long computation
    says what it is doing also where stderr is not a terminal (a log file, CI, a notebook).

    Nothing is written during the first ``after`` seconds (quick work stays silent). After that
    a line is written when a new phase starts, at most every ``gap`` seconds, and within a phase
    every ``every`` seconds and when a phase that was shown ends. A label ``"phase: detail"``
    reports progress of ``phase`` (its timing is shared; the detail may change from call to
    call). A line carries the time since the first report, the phase's ``done/total`` and, once
    part of a phase is done, the time left at the phase's rate so far (work items of a phase cost
    about the same: Monte Carlo chunks, candidates). A label may carry its own up-front estimate
    (``"verifying ... (~40 s)"``).
    """

    def __init__(self, prefix: str = "corrnoise", stream: TextIO | None = None, after: float = 1.0,
                 every: float = 5.0, gap: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.prefix = prefix
        self.stream = stream
        self.after, self.every, self.gap = float(after), float(every), float(gap)
        self.clock = clock
        self._t0: float | None = None
        self._last = -float("inf")
        self._started: dict[str, float] = {}  # phase -> when it was first reported (until it ends)
        self._shown: set[str] = set()

    def __call__(self, label: str, done: int, total: int) -> None:
        now = self.clock()
        if self._t0 is None:
            self._t0 = now
        phase = label.split(": ", 1)[0]
        started = self._started.setdefault(phase, now)
        if total > 0 and done >= total:
            del self._started[phase]
            if phase in self._shown:
                self._shown.discard(phase)
                self._write(now, f"{phase}: done in {format_seconds(now - started)}")
            return
        if now - self._t0 < self.after:
            return
        new = phase not in self._shown
        if (new and now - self._last >= self.gap) or now - self._last >= self.every:
            self._shown.add(phase)
            self._write(now, self._line(label, done, total, now, started))

    def _line(self, label: str, done: int, total: int, now: float, started: float) -> str:
        text = label
        if total > 1:
            text += f" {done}/{total}"
            elapsed = now - started
            if 0 < done < total and elapsed >= 1.0 and (done >= 5 or done >= 0.02 * total):
                # (not from the first item or two: their time includes starting up)
                text += f", ~{format_seconds(elapsed * (total - done) / done)} left"
        return text

    def _write(self, now: float, text: str) -> None:
        self._last = now
        stream = self.stream if self.stream is not None else sys.stderr
        try:
            stream.write(f"{self.prefix} [{format_seconds(now - (self._t0 or now))}] {text}\n")
            stream.flush()
        except (OSError, ValueError):  # a closed stream never stops the computation
            pass
