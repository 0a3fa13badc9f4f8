"""Per-query error, RMS and max loss, and the sensitivity of any strategy (layer 3).

Normalizations (docs/design.md, tutorial Def. 2.3 / 2.23): with B = A C^{-1},
``max_error = max_t ||B[t]||``, ``mean_error = ||B||_F / sqrt(n)``,
``max_loss = sens(C, Pi) * max_error`` and ``rms_loss = sens(C, Pi) * mean_error``
(tutorial Eq. 2.5: loss = error(B) * sens(C)).

Fast paths: Toeplitz C with a Toeplitz workload gives a Toeplitz B whose first column is
b = A-series * C^{-1}-series, so row norms are cumulative sums of b_t^2 and
||B||_F^2 = sum_t (n - t) b_t^2 (tutorial Eq. 4.11), O(n log n); a strategy with closed forms
(``Strategy.closed_form_prefix_errors_squared`` / ``closed_form_sensitivity_squared``: BLT and
DP-CGD, Lemma 2.29, O(d^2)) uses them; everything else streams B row by row.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .errors import CorrnoiseError
from .participation import Cyclic, MinSep, Participation, Single, parse_participation
from .sensitivity import (
    Sensitivity,
    sensitivity_banded,
    sensitivity_dense,
    sensitivity_single,
    sensitivity_from_gram,
    sensitivity_toeplitz_monotone,
    toeplitz_precondition_violation,
)
from .linalg.banded import banded_errors_squared
from .linalg.tree import tree_cyclic_squared, tree_depth, tree_gram, tree_minsep_bound_squared
from .strategies import Banded, ColumnNormalized, OnlineTree, Strategy, Toeplitz, Tree
from .workloads import Workload, prefix

# Strategies without a structured path are materialized; beyond this n that is refused.
MAX_DENSE_N = 8192
#: Min-Sep on the binary tree builds the n x n Gram matrix up to this n, then bounds.
MAX_TREE_GRAM_N = 4096


@dataclass(frozen=True)
class LossReport:
    """The numbers ``corrnoise loss`` prints."""

    strategy: str
    n: int
    participation: str
    workload: str
    rms_loss: float
    max_loss: float
    sensitivity: float
    sensitivity_exact: bool
    sensitivity_method: str
    mean_error: float
    max_error: float

    def to_dict(self) -> dict:
        return asdict(self)


def _toeplitz_b(strategy: Toeplitz, workload: Workload) -> np.ndarray:
    """First column of the Toeplitz B = A C^{-1} (a power-series product)."""
    return workload.apply(strategy.inverse_coefficients)


def _is_plain_toeplitz(strategy: Strategy) -> bool:
    return isinstance(strategy, Toeplitz) and not isinstance(strategy, ColumnNormalized)


def _require_materializable(strategy: Strategy, what: str = "loss") -> None:
    if strategy.n > MAX_DENSE_N:
        raise CorrnoiseError(
            "n", f"{strategy.label} has no structured {what} path; n must be <= {MAX_DENSE_N}, got {strategy.n}"
        )


def decoder_matrix(strategy: Strategy, workload: Workload | None = None) -> np.ndarray:
    """B = A C^{-1} materialized (C^{-1} the tree's decoder: A^{-1} B_tree for ``tree``,
    pinv(C) for ``tree:full``)."""
    workload = workload or prefix()
    _require_materializable(strategy)
    return workload.apply(strategy.noising_matrix())


def streamed_squared_error(strategy: Strategy, workload: Workload | None = None) -> np.ndarray:
    """||B[t, :]||^2 computed row by row, never holding B or C^{-1}.

    Row t of C^{-1} is the strategy's inverse stream applied to the unit vectors e_0, e_1, ...
    (tutorial Alg. 2.1 for banded C: O(n b) memory), and B = A C^{-1} follows from the banded
    inverse of the workload: B[t] = C^{-1}[t] - sum_{j>=1} ainv_j B[t-j] (see workloads.py).
    O(n^2 b) time for a b-banded C.
    """
    workload = workload or prefix()
    n = strategy.n
    taps = np.asarray(workload.inverse_coefficients[1:])
    op = strategy.inverse_stream()
    state = op.init((n,))
    previous: list[np.ndarray] = []  # B[t-1], B[t-2], ...
    unit = np.zeros(n)
    out = np.empty(n)
    for t in range(n):
        unit[t] = 1.0
        row, state = op.step(state, unit)
        unit[t] = 0.0
        for a, prev in zip(taps, previous):
            row = row - a * prev
        out[t] = float(row @ row)
        previous = [row] + previous[: taps.size - 1]
    return out


def per_query_squared_error(strategy: Strategy, workload: Workload | None = None) -> np.ndarray:
    """||B[t, :]||^2 for every step t: the variance of query t's error per unit noise_std.

    Toeplitz: cumulative sums of the Toeplitz B's first column squared; banded (bands < n,
    e.g. column-normalized banded): streamed row by row; otherwise B materialized.
    """
    workload = workload or prefix()
    if _is_plain_toeplitz(strategy):
        return np.cumsum(_toeplitz_b(strategy, workload) ** 2)
    band = band_storage(strategy)
    if band is not None:
        return banded_errors_squared(band, np.asarray(workload.inverse_coefficients))
    return np.sum(decoder_matrix(strategy, workload) ** 2, axis=1)


def band_storage(strategy: Strategy) -> np.ndarray | None:
    """band[t, d] = C[t, t - d] for a square C with fewer than n bands (None otherwise)."""
    if strategy.rows != strategy.n or strategy.bands >= strategy.n:
        return None
    if isinstance(strategy, ColumnNormalized):
        base = band_storage(strategy.base)
        if base is None:
            return None
        n, b = base.shape
        cols = np.arange(n)[:, None] - np.arange(b)[None, :]  # column t - d of each band entry
        return base / strategy.scale[np.clip(cols, 0, None)]
    if isinstance(strategy, Banded):
        return strategy.band
    c = strategy.matrix() if strategy.n <= MAX_DENSE_N else None
    if isinstance(strategy, Toeplitz):
        coeffs = strategy.toeplitz_coefficients[: strategy.bands]
        band = np.broadcast_to(coeffs, (strategy.n, strategy.bands)).copy()
    elif c is not None:
        band = np.stack([np.concatenate([np.zeros(d), np.diagonal(c, -d)]) for d in range(strategy.bands)], axis=1)
    else:
        return None
    for d in range(1, band.shape[1]):
        band[:d, d] = 0.0
    return band


def error_summary(strategy: Strategy, workload: Workload | None = None) -> tuple[float, float]:
    """(mean_error, max_error) = (||B||_F / sqrt(n), max_t ||B[t]||)."""
    workload = workload or prefix()
    n = strategy.n
    closed = strategy.closed_form_prefix_errors_squared() if workload.is_prefix else None
    if closed is not None:  # BLT: Lemma 2.29 (None for defective inverse parameters)
        mean_sq, max_sq = closed
        return math.sqrt(mean_sq), math.sqrt(max_sq)
    if _is_plain_toeplitz(strategy):
        b2 = _toeplitz_b(strategy, workload) ** 2
        weights = np.arange(n, 0, -1, dtype=np.float64)
        return math.sqrt(float(np.dot(weights, b2)) / n), math.sqrt(float(b2.sum()))
    e = per_query_squared_error(strategy, workload)
    return math.sqrt(float(e.mean())), math.sqrt(float(e.max()))


def mechanism_sensitivity(strategy: Strategy, participation: Participation | str | None = None) -> Sensitivity:
    """sens(C, Pi) by the cheapest exact path available (tutorial Sec. 3.3.5).

    Single participation: the max column norm (O(d^2) for BLT, Lemma 2.29(a)). The binary
    tree: :func:`sensitivity_tree`. Cyclic and Min-Sep: bands <= b -> Lemma 3.16(b) (exact, Alg. 3.2 for Min-Sep); Toeplitz with
    non-negative non-increasing coefficients (cyclic: non-negative) -> Eq. 3.25 (exact); otherwise Lemma 3.15 on the
    materialized Gram matrix, exact when C^T C >= 0 on the patterns and an upper bound
    otherwise (``exact=False``).
    """
    schema = parse_participation(participation or "single")
    n = schema.validate(strategy.n)
    if isinstance(schema, Single):
        closed = strategy.closed_form_sensitivity_squared()
        if closed is not None:  # BLT: Lemma 2.29(a) in O(d^2)
            value_sq, method = closed
            return Sensitivity(math.sqrt(value_sq), True, method)
        return sensitivity_single(strategy.column_norms_squared())
    if isinstance(strategy, (OnlineTree, Tree)):  # C_tree: O(n log n) without C
        return sensitivity_tree(n, schema)
    if strategy.bands <= schema.b:
        return sensitivity_banded(strategy.column_norms_squared(), schema, n, strategy.bands)
    if _is_plain_toeplitz(strategy) and toeplitz_precondition_violation(strategy.toeplitz_coefficients, schema) is None:
        return sensitivity_toeplitz_monotone(strategy.toeplitz_coefficients, schema, n)
    _require_materializable(strategy, "sensitivity (for this participation)")
    return sensitivity_dense(strategy.matrix(), schema)


def sensitivity_tree(n: int, participation: Participation | str | None = None) -> Sensitivity:
    """sens(C_tree, Pi) for the binary tree (every decoder shares C_tree), without C.

    C_tree >= 0, so Lemma 3.15(b) is exact: sens^2 = max_pi ||C_tree[:, pi] 1||^2.  Single:
    K + 1 (every leaf is in K + 1 nodes).  Cyclic: ``tree-runs``
    (:func:`corrnoise.linalg.tree.tree_cyclic_squared`), exact, O(n log n).  Min-Sep: the Gram
    matrix (:func:`corrnoise.linalg.tree.tree_gram`) and :func:`sensitivity_from_gram` for
    n <= MAX_TREE_GRAM_N, else ``tree-level-upper-bound``
    (:func:`corrnoise.linalg.tree.tree_minsep_bound_squared`, exact=False).
    """
    schema = parse_participation(participation or "single")
    n = schema.validate(n)
    if isinstance(schema, Single):
        return Sensitivity(math.sqrt(tree_depth(n) + 1.0), True, "max-column-norm")
    if isinstance(schema, Cyclic):
        return Sensitivity(math.sqrt(tree_cyclic_squared(n, schema.k, schema.b)), True, "tree-runs")
    if not isinstance(schema, MinSep):
        raise CorrnoiseError("participation", f"unsupported schema {schema!r}")
    if n <= MAX_TREE_GRAM_N:
        return sensitivity_from_gram(tree_gram(n), schema, n)
    return Sensitivity(math.sqrt(tree_minsep_bound_squared(n, schema.k, schema.b)), False, "tree-level-upper-bound")


def loss_report(
    strategy: Strategy,
    participation: Participation | str | None = None,
    workload: Workload | None = None,
) -> LossReport:
    """Sensitivity, errors and normalized losses of ``strategy`` (docs/cli.md ``corrnoise loss``)."""
    schema = parse_participation(participation or "single")
    workload = workload or prefix()
    sens = mechanism_sensitivity(strategy, schema)
    mean_error, max_error = error_summary(strategy, workload)
    return LossReport(
        strategy=strategy.label,
        n=strategy.n,
        participation=schema.spec,
        workload=workload.spec,
        rms_loss=sens.value * mean_error,
        max_loss=sens.value * max_error,
        sensitivity=sens.value,
        sensitivity_exact=sens.exact,
        sensitivity_method=sens.method,
        mean_error=mean_error,
        max_error=max_error,
    )


__all__ = [
    "LossReport", "decoder_matrix", "error_summary", "loss_report", "mechanism_sensitivity",
    "per_query_squared_error", "sensitivity_tree", "OnlineTree", "Tree",
]
