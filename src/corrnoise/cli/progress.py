"""A rich progress bar as a :data:`corrnoise.progress.Progress` (terminal only).

The command line passes one to long computations as their ``progress``; the core library never
imports rich.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

from ..progress import LineProgress

__all__ = ["RichProgress", "command_progress"]


class RichProgress:
    """``(label, done, total)`` -> a transient bar on stderr, one task per label.

    Phases with a single work item show nothing.  The display starts on the first report and
    stops on :meth:`close` (callable more than once; a later report starts it again)."""

    def __init__(self) -> None:
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}

    def __call__(self, label: str, done: int, total: int) -> None:
        if total <= 1:
            return
        if self._progress is None:
            from rich.console import Console
            from rich.progress import Progress

            self._progress = Progress(console=Console(stderr=True), transient=True)
            self._progress.start()
        task = self._tasks.get(label)
        if task is None:
            task = self._tasks[label] = self._progress.add_task(label, total=total)
        self._progress.update(task, completed=done, total=total)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        self._progress = None
        self._tasks = {}


@contextlib.contextmanager
def command_progress(as_json: bool) -> Iterator[Any]:
    """The reporter a command passes to long work: a rich bar on a terminal, plain lines on stderr
    elsewhere (past a second: piped runs were silent for minutes), None with ``--json`` (stderr
    stays quiet); the bar is closed when the block ends, also on errors."""
    bar = None if as_json else RichProgress() if sys.stderr.isatty() else LineProgress()
    try:
        yield bar
    finally:
        if isinstance(bar, RichProgress):
            bar.close()
