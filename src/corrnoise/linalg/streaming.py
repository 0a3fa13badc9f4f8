"""Streaming lower-triangular operators in the (init, step) style.

A streaming operator applies a lower-triangular n x n matrix M to a sequence x_0, x_1, ...
one row at a time: ``state = op.init(shape)``, then ``y_t, state = op.step(state, x_t)``
returns y_t = (M X)[t]. Memory is whatever the state holds (a few rows for banded and BLT
matrices, the whole history for dense and general Toeplitz ones).

:class:`NoiseStream` is the description a strategy gives of how its training-time noise
(C^{-1} Z)[t] is produced step by step (``Strategy.noise_stream()``): the torch generators of
:mod:`corrnoise.noise.generators` are built from it, and :meth:`NoiseStream.operator` builds the
numpy (init, step) operator of the same recurrence with the same parameters, so the choice of
recurrence is made once, by the strategy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Protocol

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
            hist.appendleft(np.array(x, dtype=np.float64))  # a copy: callers may reuse x (losses.py does)
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
            hist.appendleft(np.array(x, dtype=np.float64))  # a copy: callers may reuse x (losses.py does)
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


NOISE_KINDS = ("iid", "banded", "blt", "dpcgd", "regenerate", "tree")


@dataclass(frozen=True, eq=False)
class NoiseStream:
    """How (C^{-1} Z)[t] is produced, one step at a time: a ``kind`` and its parameters.

    * ``iid`` -- C = I: Z[t]; no state.
    * ``banded`` -- ``coefficients``: the first column (c_0..c_{b-1}) of a banded Toeplitz C, or
      an (n, b) array band[t, j] = C[t, t - j]; forward substitution over the last b - 1 outputs.
    * ``blt`` -- ``alpha``, ``lam``: C = BLT(alpha, lam) by Alg. 2.2 with d buffers.
    * ``dpcgd`` -- ``beta``: C^{-1} = I - beta S, i.e. Z[t] - beta Z[t-1].
    * ``regenerate`` -- ``inverse_toeplitz`` (first column of a Toeplitz C^{-1}) or ``noising``
      (C^{-1} materialized, shape (n, rows)): sum_tau C^{-1}[t, tau] Z[tau].
    * ``tree`` -- ``weights`` (a_l per level), ``slots``: the online binary tree, Z indexed by
      tree node (postorder); step t is :func:`corrnoise.linalg.tree.online_tree_step`. All
      a_l = 1 (plain decoding): u_v = Z[v], regenerated, no buffers; otherwise ``slots`` node
      estimates are kept (one per level).

    ``row_scale`` (column normalization, tutorial Def. 2.10 / Remark 2.19) multiplies row t by
    ``row_scale[t]`` after the base recurrence. Build one with the class methods below.
    """

    kind: str
    params: Mapping[str, Any] = field(default_factory=dict)
    row_scale: np.ndarray | None = None

    def __post_init__(self):
        if self.kind not in NOISE_KINDS:
            raise CorrnoiseError("strategy", f"unknown noise stream kind {self.kind!r}; one of {', '.join(NOISE_KINDS)}")

    @classmethod
    def iid(cls) -> "NoiseStream":
        return cls("iid")

    @classmethod
    def banded(cls, coefficients: np.ndarray) -> "NoiseStream":
        return cls("banded", {"coefficients": np.asarray(coefficients, dtype=np.float64)})

    @classmethod
    def blt(cls, alpha: np.ndarray, lam: np.ndarray) -> "NoiseStream":
        return cls("blt", {"alpha": alpha, "lam": lam})

    @classmethod
    def dpcgd(cls, beta: float) -> "NoiseStream":
        return cls("dpcgd", {"beta": float(beta)})

    @classmethod
    def regenerate(cls, *, inverse_toeplitz: np.ndarray | None = None,
                   noising: np.ndarray | None = None) -> "NoiseStream":
        if (inverse_toeplitz is None) == (noising is None):
            raise CorrnoiseError("strategy", "give exactly one of inverse_toeplitz and noising")
        if inverse_toeplitz is not None:
            return cls("regenerate", {"inverse_toeplitz": inverse_toeplitz})
        return cls("regenerate", {"noising": noising})

    @classmethod
    def tree(cls, weights: np.ndarray, slots: int) -> "NoiseStream":
        return cls("tree", {"weights": np.asarray(weights, dtype=np.float64), "slots": int(slots)})

    @property
    def regenerates_tree_nodes(self) -> bool:
        """A ``tree`` stream whose node estimates are the nodes' own noise (every a_l = 1)."""
        return self.kind == "tree" and bool(np.all(self.params["weights"] == 1.0))

    def scaled(self, row_scale: np.ndarray) -> "NoiseStream":
        """The same stream with row t multiplied by ``row_scale[t]`` (one level of scaling)."""
        if self.row_scale is not None:
            raise CorrnoiseError("strategy", "the noise stream is already row-scaled")
        return replace(self, row_scale=np.asarray(row_scale, dtype=np.float64))

    def buffer_rows(self) -> int:
        """How many model-sized rows of state the recurrence keeps (b - 1, d, tree slots, or 0)."""
        if self.kind == "banded":
            c = self.params["coefficients"]
            if c.ndim == 1:  # trailing zeros are trimmed, as by the operators
                nz = np.flatnonzero(c)
                return max(int(nz[-1]) if nz.size else 0, 0)
            return max(int(c.shape[-1]) - 1, 0)
        if self.kind == "blt":
            return int(np.asarray(self.params["alpha"]).size)
        if self.kind == "tree" and not self.regenerates_tree_nodes:
            return int(self.params["slots"])
        return 0

    def operator(self, n: int) -> StreamingOperator:
        """The numpy (init, step) operator z -> (C^{-1} z)[t] of this recurrence for n steps.

        The reference twin of the torch generator built from the same stream (tests and
        :func:`run_stream`); the rows of z play the part of Z. A ``tree`` stream's rows of Z are
        tree nodes, not steps: its operator (:class:`corrnoise.linalg.tree.TreeNoiseOperator`)
        takes the rows of the nodes that end at step t, and
        :func:`corrnoise.linalg.tree.run_tree_stream` feeds them.
        """
        p = self.params
        if self.kind == "tree":
            from .tree import TreeNoiseOperator

            if self.row_scale is not None:
                raise CorrnoiseError("strategy", "a row-scaled tree stream has no numpy operator here")
            return TreeNoiseOperator(n, p["weights"])
        if self.kind == "iid":
            op: StreamingOperator = ToeplitzStream(np.ones(1), n)
        elif self.kind == "banded":
            c = p["coefficients"]
            op = ToeplitzStream(c, n, inverse=True) if c.ndim == 1 else BandedStream(c[:n], inverse=True)
        elif self.kind == "blt":
            from .blt import BLTStream

            op = BLTStream(p["alpha"], p["lam"], n, inverse=True)
        elif self.kind == "dpcgd":
            op = ToeplitzStream(np.array([1.0, -p["beta"]]), n)
        elif "inverse_toeplitz" in p:
            op = ToeplitzStream(p["inverse_toeplitz"], n)
        else:
            noising = np.asarray(p["noising"], dtype=np.float64)
            if noising.shape != (n, n) or np.any(np.triu(noising, 1)):
                raise CorrnoiseError(
                    "strategy", f"C^-1 of shape {noising.shape} is not lower-triangular n x n: row t needs "
                    "rows of Z after t, so it has no streaming form here (the generator regenerates them)")
            op = DenseStream(noising)
        if self.row_scale is not None:
            op = ScaledStream(op, self.row_scale, inverse=True)
        return op
