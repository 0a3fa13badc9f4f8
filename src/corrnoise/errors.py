"""Input validation shared by every layer.

Every user-facing precondition is checked here and reported as a :class:`CorrnoiseError`
that names the offending parameter, so the command line can print one line and exit
non-zero instead of showing a traceback (docs/cli.md, "Command-line contract").
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import numpy as np


class CorrnoiseError(ValueError):
    """A bad input. ``str(err)`` is one line: ``<parameter>: <what is wrong and how to fix it>``."""

    def __init__(self, param: str, message: str):
        self.param = param
        self.message = message
        super().__init__(f"{param}: {message}")


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` as an int, or raise naming ``name`` if it is not an integer in range."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, (float, np.floating)) and float(value).is_integer():
            value = int(value)
        else:
            raise CorrnoiseError(name, f"must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise CorrnoiseError(name, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise CorrnoiseError(name, f"must be <= {maximum}, got {value}")
    return value


def check_real(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Return ``value`` as a finite float inside the given interval, or raise naming ``name``.
    Text and booleans are not numbers here (``"4"`` for epsilon is a mistake to report, not to
    convert; parsers convert their own fields first)."""
    if isinstance(value, (str, bytes, bool, np.bool_)):
        raise CorrnoiseError(name, f"must be a number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise CorrnoiseError(name, f"must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise CorrnoiseError(name, f"must be finite, got {value!r}")
    lo_bad = low is not None and (x <= low if low_open else x < low)
    hi_bad = high is not None and (x >= high if high_open else x > high)
    if lo_bad or hi_bad:
        lb = "(" if low_open else "["
        hb = ")" if high_open or high is None else "]"
        lo_s = "-inf" if low is None else f"{low:g}"
        hi_s = "inf" if high is None else f"{high:g}"
        raise CorrnoiseError(name, f"must lie in {lb}{lo_s}, {hi_s}{hb}, got {x:g}")
    return x


def check_finite_array(name: str, value: Any, ndim: int | None = None) -> np.ndarray:
    """Return ``value`` as a float64 array with no NaN/inf (and the given number of dimensions)."""
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise CorrnoiseError(name, "must be an array of numbers") from None
    if ndim is not None and arr.ndim != ndim:
        raise CorrnoiseError(name, f"must be {ndim}-dimensional, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise CorrnoiseError(name, "contains NaN or infinite entries")
    return arr


def user_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel, for its caller, of the first frame outside corrnoise and
    torch: a warning names the user's line (also through make_private_run, train, the Opacus
    adapter or torch's optimizer-step wrappers)."""
    inside = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    torch_module = sys.modules.get("torch")  # loaded by whoever trains; this module does not need it
    if getattr(torch_module, "__file__", None):
        inside.append(os.path.dirname(os.path.abspath(torch_module.__file__)) + os.sep)
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(tuple(inside)):
        frame, level = frame.f_back, level + 1
    return level


def first_line(text: str | None) -> str:
    """The first non-empty line of ``text`` (a docstring, an exception's message), or "": what a
    one-line message quotes of a longer one."""
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""


def error_summary(err: BaseException) -> str:
    """``Type: first line`` of an exception, for a one-line message; for an exception that wraps
    the one that failed (dynamo's BackendCompilerFailed keeps it as ``inner_exception``), the
    inner one too -- a compiler's own error says more than "backend='inductor' raised:"."""
    inner = getattr(err, "inner_exception", None)
    if isinstance(inner, BaseException):
        return f"{type(err).__name__} ({error_summary(inner)})"
    text = first_line(str(err))
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
