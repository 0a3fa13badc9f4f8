"""Streaming lower-triangular operators in the (init, step) style.

A streaming operator applies a lower-triangular n x n matrix M to a sequence x_0, x_1, ...
one row at a time: ``state = op.init(shape)``, then ``y_t, state = op.step(state, x_t)``
returns y_t = (M X)[t]. Memory is whatever the state holds (a few rows for banded and BLT
matrices, the whole history for dense and general Toeplitz ones).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

import numpy as np

from ..errors import CorrnoiseError


class StreamingOperator(Protocol):
    def init(self, shape: tuple[int, ...]) -> Any: ...

    def step(self, state: Any, x: np.ndarray) -> tuple[np.ndarray, Any]: ...


def run_stream(op: StreamingOperator, x: np.ndarray) -> np.ndarray:
    """Apply ``op`` to every row of x (shape (n,) or (n, m)) and stack the outputs."""
    x = np.asarray(x, dtype=np.float64)
    state = op.init(x.shape[1:])
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        out[t], state = op.step(state, x[t])
    return out


def _check_step(t: int, n: int) -> None:
    if t >= n:
        raise CorrnoiseError("steps", f"the mechanism has n = {n} steps; step {t} is past its end")


class ToeplitzStream:
    """T_c x (``inverse=False``) or T_c^{-1} y (``inverse=True``) for a Toeplitz c with L taps.

    The inverse is tutorial Alg. 2.1: x_t = (y_t - sum_{j=1}^{L-1} c_j x_{t-j}) / c_0; both keep
    the last L - 1 inputs (multiply) or outputs (inverse): O(L m) memory.
    """

    def __init__(self, c: np.ndarray, n: int, inverse: bool = False):
        c = np.asarray(c, dtype=np.float64)[:n]
        nz = np.flatnonzero(c)
        self.c = c[: int(nz[-1]) + 1] if nz.size else c[:1]
        self.n = n
        self.inverse = inverse

    def init(self, shape):
        return (0, deque(maxlen=max(self.c.size - 1, 1)))

    def step(self, state, x):
        t, hist = state
        _check_step(t, self.n)
        acc = np.zeros_like(np.asarray(x, dtype=np.float64))
        for j, h in enumerate(hist, start=1):
            if j < self.c.size:
                acc = acc + self.c[j] * h
        if self.inverse:
            y = (x - acc) / self.c[0]
            hist.appendleft(y)
        else:
            y = self.c[0] * x + acc
            hist.appendleft(np.asarray(x, dtype=np.float64))
        return y, (t + 1, hist)


class BandedStream:
    """A b-banded lower-triangular matrix stored as band[t, j] = M[t, t - j] (j < b).

    Multiply: y_t = sum_j band[t, j] x_{t-j}; inverse (forward substitution, the non-Toeplitz
    form of Alg. 2.1): x_t = (y_t - sum_{j>=1} band[t, j] x_{t-j}) / band[t, 0].
    """

    def __init__(self, band: np.ndarray, inverse: bool = False):
        self.band = np.asarray(band, dtype=np.float64)
        self.n, self.b = self.band.shape
        self.inverse = inverse

    def init(self, shape):
        return (0, deque(maxlen=max(self.b - 1, 1)))

    def step(self, state, x):
        t, hist = state
        _check_step(t, self.n)
        row = self.band[t]
        acc = np.zeros_like(np.asarray(x, dtype=np.float64))
        for j, h in enumerate(hist, start=1):
            if j < self.b:
                acc = acc + row[j] * h
        if self.inverse:
            y = (x - acc) / row[0]
            hist.appendleft(y)
        else:
            y = row[0] * x + acc
            hist.appendleft(np.asarray(x, dtype=np.float64))
        return y, (t + 1, hist)


class DenseStream:
    """A dense lower-triangular matrix row by row, keeping the full history (O(n m))."""

    def __init__(self, m: np.ndarray, inverse: bool = False):
        self.m = np.asarray(m, dtype=np.float64)
        self.n = self.m.shape[0]
        self.inverse = inverse

    def init(self, shape):
        return (0, [])

    def step(self, state, x):
        t, hist = state
        _check_step(t, self.n)
        x = np.asarray(x, dtype=np.float64)
        acc = np.zeros_like(x)
        if t:
            acc = np.tensordot(self.m[t, :t], np.stack(hist), axes=1)
        if self.inverse:
            y = (x - acc) / self.m[t, t]
            hist.append(y)
        else:
            y = self.m[t, t] * x + acc
            hist.append(x)
        return y, (t + 1, hist)


class ScaledStream:
    """Column scaling around another stream: M D^{-1} (multiply) or D M^{-1} (inverse).

    This is column normalization (tutorial Def. 2.10) at the same time and memory cost as the
    base operator (Remark 2.19): C_norm = C D^{-1}, so C_norm^{-1} z = D (C^{-1} z).
    """

    def __init__(self, base: StreamingOperator, scale: np.ndarray, inverse: bool = False):
        self.base = base
        self.scale = np.asarray(scale, dtype=np.float64)
        self.inverse = inverse

    def init(self, shape):
        return (0, self.base.init(shape))

    def step(self, state, x):
        t, inner = state
        _check_step(t, self.scale.size)
        if self.inverse:
            y, inner = self.base.step(inner, x)
            return self.scale[t] * y, (t + 1, inner)
        y, inner = self.base.step(inner, np.asarray(x, dtype=np.float64) / self.scale[t])
        return y, (t + 1, inner)
