"""Participation-calibrated L2 sensitivity of a strategy matrix (tutorial Sec. 3.3.4-3.3.5).

Conventions: ``C`` is a ``(rows, n)`` array whose columns are the steps ``0..n-1`` (square and
lower-triangular for most strategies; the binary tree has ``2n - 1`` rows).  Zero-out adjacency,
gradients clipped to norm <= 1.  For a schema ``Pi`` (see :mod:`corrnoise.participation`) and
``M = C^T C`` (Lemma 3.15):

* (a) ``sens(C, Pi)^2 <= max_{pi in Pi} sum_{t, tau in pi} |M[t, tau]|`` for every dimension;
* (b) equality without the absolute values when ``M[t, tau] >= 0`` for all ``t, tau`` on every
  pattern -- the sensitivity is then independent of the model dimension.

Every function returns a :class:`Sensitivity` whose ``value`` is ``sens`` itself (not squared),
``exact`` says whether it is the sensitivity (up to floating-point rounding) or only an upper
bound, and ``method`` names the computation.  The reward-maximization helpers
(:func:`max_reward_min_sep`, :func:`argmax_reward_min_sep`) work in squared units.

Methods:

``max-column-norm``               single participation, ``max_t ||C[:, t]||``
``banded-cyclic`` / ``banded-dp`` Lemma 3.16(b): bands <= b, cross terms vanish (any sign)
``toeplitz-eq-3.25``              Lemma 3.16(c) / Eq. 3.25: lower-triangular Toeplitz, first column
                                  >= 0 and non-increasing (cyclic: >= 0 suffices); O(n k)
``enumeration``                   Lemma 3.15(b) over all patterns, exact
``enumeration-abs-upper-bound``   Lemma 3.15(a) over all patterns (negative entries on a pattern)
``dp-relaxation-upper-bound``     Min-Sep with too many patterns: per-row DP then DP on the
                                  row bounds (see :func:`dp_relaxation_bound`)
``dp-relaxation-tight``           the same bound, certified exact because an allowed pattern
                                  attains it
``tree-runs``, ``tree-level-upper-bound``  the binary tree: ``corrnoise.losses.sensitivity_tree``
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from .errors import CorrnoiseError, check_finite_array, check_int
from .participation import Cyclic, MinSep, Participation, Single, parse_participation

__all__ = [
    "Sensitivity",
    "DEFAULT_MAX_PATTERNS",
    "max_reward_min_sep",
    "argmax_reward_min_sep",
    "sensitivity_single",
    "sensitivity_banded",
    "sensitivity_toeplitz_monotone",
    "toeplitz_precondition_violation",
    "sensitivity_from_gram",
    "dp_relaxation_bound",
    "sensitivity_dense",
    "brute_force_sensitivity",
]

#: Min-Sep schemas with more patterns than this are bounded by the DP relaxation.
DEFAULT_MAX_PATTERNS = 200_000

# Entries of C^T C above -_NEG_RTOL * max diagonal count as non-negative (rounding noise).
_NEG_RTOL = 1e-12
# Relative slack accepted in the monotonicity check of Toeplitz coefficients.
_MONO_RTOL = 1e-12
# Relative slack for "the relaxation bound is attained by an allowed pattern".
_CERT_RTOL = 1e-12
# Elements per temporary block in the vectorized enumeration / relaxation.
_BLOCK_ELEMS = 1 << 22


@dataclass(frozen=True)
class Sensitivity:
    """``value`` = sens(C, Pi) (not squared); ``exact`` False means a valid upper bound only."""

    value: float
    exact: bool
    method: str

    @property
    def squared(self) -> float:
        return self.value * self.value


# ----------------------------------------------------------------------------- helpers


def _schema(schema) -> Participation:
    return parse_participation(schema)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _nonneg_vector(name: str, value, n: int | None = None) -> np.ndarray:
    arr = check_finite_array(name, value, ndim=1)
    if arr.size == 0:
        raise CorrnoiseError(name, "must not be empty")
    if n is not None and arr.size != n:
        raise CorrnoiseError(name, f"must have length n={n}, got {arr.size}")
    if np.any(arr < 0):
        raise CorrnoiseError(name, f"must be non-negative, got minimum {arr.min():g}")
    return arr


def _square_gram(gram, n: int) -> np.ndarray:
    g = check_finite_array("gram", gram, ndim=2)
    if g.shape != (n, n):
        raise CorrnoiseError("gram", f"must have shape ({n}, {n}), got {g.shape}")
    scale = float(np.max(np.abs(g))) if g.size else 0.0
    if not np.allclose(g, g.T, rtol=0.0, atol=1e-10 * max(scale, 1e-300)):
        raise CorrnoiseError("gram", "must be symmetric (gram = C^T C)")
    diag = np.diagonal(g)
    if np.any(diag < -_NEG_RTOL * max(scale, 1e-300)):
        raise CorrnoiseError("gram", "has negative diagonal entries; it is not a Gram matrix C^T C")
    return g


def _neg_tol(g: np.ndarray) -> float:
    d = np.abs(np.diagonal(g))
    return _NEG_RTOL * (float(d.max()) if d.size else 0.0)


def _strategy_matrix(C) -> np.ndarray:
    arr = check_finite_array("strategy", C, ndim=2)
    if arr.shape[1] == 0 or arr.shape[0] == 0:
        raise CorrnoiseError("strategy", f"must be a non-empty (rows x n) matrix, got {arr.shape}")
    return arr


def _suffix_max_layers(r: np.ndarray, b: int, layers: int) -> list[np.ndarray]:
    """Algorithm 3.2 tables: entry ``l`` is ``M[:, l]`` padded with ``b`` zeros (length n + b).

    ``M[t, l]`` = max reward of at most ``l`` picks from steps ``t..n-1`` that are ``>= b``
    apart.  Each layer is ``M[t, l] = max(r_t + M[t+b, l-1], M[t+1, l])`` -- a reversed
    cumulative maximum, vectorized over ``t``.
    """
    n = r.shape[-1]
    table = [np.zeros(n + b)]
    for _ in range(layers):
        prev = table[-1]
        cur = np.zeros(n + b)
        cur[:n] = np.maximum.accumulate((r + prev[b : b + n])[::-1])[::-1]
        table.append(cur)
    return table


def _dp_inputs(r, b, k) -> tuple[np.ndarray, int, int]:
    r = _nonneg_vector("r", r)
    b = check_int("b", b, minimum=1)
    k = check_int("k", k, minimum=1)
    return r, b, k


# ------------------------------------------------------------------ Algorithm 3.2 (DP)


def max_reward_min_sep(r, b: int, k: int) -> float:
    """Eq. 3.24: ``max sum_{t in pi} r_t`` over sets ``pi`` of at most ``k`` steps ``>= b`` apart.

    Algorithm 3.2, ``O(n k)`` time and ``O(n)`` memory; ``r`` must be non-negative.
    """
    r, b, k = _dp_inputs(r, b, k)
    n = r.size
    layers = min(k, _ceil_div(n, b))  # no b-separated subset of [n] is larger
    prev = np.zeros(n + b)
    for _ in range(layers):
        cur = np.zeros(n + b)
        cur[:n] = np.maximum.accumulate((r + prev[b : b + n])[::-1])[::-1]
        prev = cur
    return float(prev[0])


def argmax_reward_min_sep(r, b: int, k: int) -> tuple[float, tuple[int, ...]]:
    """Like :func:`max_reward_min_sep`, also returning a maximizing pattern (sorted steps).

    Ties are broken towards taking the earlier step, so the pattern is never empty.
    ``O(n k)`` time and memory.
    """
    r, b, k = _dp_inputs(r, b, k)
    n = r.size
    layers = min(k, _ceil_div(n, b))
    table = _suffix_max_layers(r, b, layers)
    picks: list[int] = []
    t, l = 0, layers
    while l > 0 and t < n:
        take = r[t] + table[l - 1][t + b]
        skip = table[l][t + 1]
        if take >= skip:
            picks.append(t)
            t += b
            l -= 1
        else:
            t += 1
    return float(table[layers][0]), tuple(picks)


# ------------------------------------------------------------------------ fast paths


def sensitivity_single(col_norms_sq) -> Sensitivity:
    """Single participation: ``sens = max_t ||C[:, t]||`` from the squared column norms."""
    r = _nonneg_vector("col_norms_sq", col_norms_sq)
    return Sensitivity(math.sqrt(float(r.max())), True, "max-column-norm")


def sensitivity_banded(col_norms_sq, schema, n: int, bands: int) -> Sensitivity:
    """Lemma 3.16(b): ``C`` with at most ``bands <= b`` bands (``C[i, j] = 0`` for ``i - j >= bands``).

    Columns of a b-separated pattern then have disjoint supports, so
    ``sens^2 = max_pi sum_{t in pi} ||C[:, t]||^2`` exactly, whatever the signs of ``C``.
    Cyclic: maximum over the ``b`` patterns; Min-Sep: Algorithm 3.2.
    """
    schema = _schema(schema)
    n = schema.validate(n)
    r = _nonneg_vector("col_norms_sq", col_norms_sq, n)
    bands = check_int("bands", bands, minimum=1)
    if isinstance(schema, Single):
        return sensitivity_single(r)
    if not isinstance(schema, (Cyclic, MinSep)):
        raise CorrnoiseError("participation", f"unsupported schema {schema!r}")
    k, b = schema.k, schema.b
    if bands > b:
        raise CorrnoiseError(
            "bands",
            f"{bands} bands exceed the separation b={b} of {schema.spec}, so cross terms do not "
            f"vanish; use at most {b} bands or sensitivity_from_gram/sensitivity_dense",
        )
    if isinstance(schema, Cyclic):
        padded = np.zeros(k * b)
        padded[:n] = r
        best = float(padded.reshape(k, b).sum(axis=0).max())
        return Sensitivity(math.sqrt(best), True, "banded-cyclic")
    return Sensitivity(math.sqrt(max_reward_min_sep(r, b, k)), True, "banded-dp")


def toeplitz_precondition_violation(coeffs, schema) -> str | None:
    """Why pi_0 = (0, b, ..., (k-1) b) may not be the worst pattern for the lower-triangular
    Toeplitz C with first column ``coeffs`` (None: it is, and Lemma 3.15(b) then gives sens^2 =
    ||C 1_{pi_0}||^2 exactly); the one place this precondition lives. Single: never (column 0 is
    longest). Min-Sep: c >= 0 and non-increasing (Lemma 3.16(c)). Cyclic: c >= 0 suffices: then
    C^T C >= 0 (Lemma 3.15(b)) and (C 1_{pi_l})[r] = sum_{j: l + jb < n} c_{r-l-jb} <=
    (C 1_{pi_0})[r - l] entrywise (pi_0 has every j of pi_l; all terms >= 0), so ||C 1_{pi_l}||
    <= ||C 1_{pi_0}||."""
    c, schema = np.asarray(coeffs, dtype=np.float64), _schema(schema)
    if isinstance(schema, Single):
        return None
    tol = _MONO_RTOL * float(np.max(np.abs(c))) if c.size else 0.0
    if np.any(c < -tol):
        return f"needs non-negative Toeplitz coefficients (min {c.min():g})"
    if isinstance(schema, MinSep) and c.size > 1 and np.any(np.diff(c) > tol):
        j = int(np.argmax(np.diff(c) > tol))
        return f"needs non-increasing Toeplitz coefficients under minsep (c[{j + 1}] > c[{j}])"
    return None


def sensitivity_toeplitz_monotone(coeffs, schema, n: int) -> Sensitivity:
    """Eq. 3.25 for lower-triangular Toeplitz ``C`` with first column ``coeffs``:
    ``sens^2 = ||sum_{j<k} C[:, j b]||^2`` in ``O(n k)``, exact under the precondition of
    :func:`toeplitz_precondition_violation` (Min-Sep: non-negative and non-increasing, Lemma
    3.16(c); Cyclic: non-negative), else CorrnoiseError('strategy').
    ``coeffs`` may be shorter than ``n`` (a banded Toeplitz strategy): missing ones are zero.
    For Single, ``sens = ||coeffs||`` (column 0 has the largest norm) for any coefficients.
    """
    schema = _schema(schema)
    n = schema.validate(n)
    c = check_finite_array("strategy", coeffs, ndim=1)
    if c.size == 0:
        raise CorrnoiseError("strategy", "Toeplitz coefficients must not be empty")
    if c.size > n:
        raise CorrnoiseError("strategy", f"has {c.size} Toeplitz coefficients but n={n} steps")
    if isinstance(schema, Single):
        return Sensitivity(float(np.linalg.norm(c)), True, "max-column-norm")
    if not isinstance(schema, (Cyclic, MinSep)):
        raise CorrnoiseError("participation", f"unsupported schema {schema!r}")
    why = toeplitz_precondition_violation(c, schema)
    if why is not None:
        raise CorrnoiseError("strategy", f"Eq. 3.25 {why}; use sensitivity_dense instead")
    full = np.zeros(n)
    full[: c.size] = c
    b = schema.b
    v = np.zeros(n)
    for j in range(schema.max_participations(n)):
        s = j * b
        v[s:] += full[: n - s]
    return Sensitivity(float(np.linalg.norm(v)), True, "toeplitz-eq-3.25")


# ------------------------------------------------------------------ Gram-based paths


def _pattern_blocks(schema: Participation, n: int, width: int):
    """Yield ``(m, width)`` int arrays of patterns, padded with index ``n``."""
    it = schema.patterns(n)
    rows = max(1, _BLOCK_ELEMS // max(1, width * width))
    while True:
        chunk = list(itertools.islice(it, rows))
        if not chunk:
            return
        arr = np.full((len(chunk), width), n, dtype=np.intp)
        for i, p in enumerate(chunk):
            arr[i, : len(p)] = p
        yield arr


def _enumerate_gram(g: np.ndarray, schema: Participation, n: int) -> Sensitivity:
    width = schema.max_participations(n)
    gpad = np.zeros((n + 1, n + 1))
    gpad[:n, :n] = g
    best_abs = 0.0
    min_entry = 0.0
    for idx in _pattern_blocks(schema, n, width):
        sub = gpad[idx[:, :, None], idx[:, None, :]]
        best_abs = max(best_abs, float(np.abs(sub).sum(axis=(1, 2)).max()))
        min_entry = min(min_entry, float(sub.min()))
    exact = min_entry >= -_neg_tol(g)
    method = "enumeration" if exact else "enumeration-abs-upper-bound"
    return Sensitivity(math.sqrt(best_abs), exact, method)


def _separated_zero(g: np.ndarray, b: int) -> bool:
    """True if ``g[t, tau] == 0`` whenever ``|t - tau| >= b`` (a banded strategy)."""
    n = g.shape[0]
    if b >= n:
        return True
    return not np.any(np.triu(g, k=b)) and not np.any(np.tril(g, k=-b))


def _row_bounds(a: np.ndarray, b: int, k: int) -> np.ndarray:
    """``w_t = max_{pi' in MinSep(k, b), t in pi'} sum_{tau in pi'} a[t, tau]`` for every row.

    ``pi' = {t} + left + right`` with ``left`` in ``[0, t-b]``, ``right`` in ``[t+b, n)`` and at
    most ``k - 1`` picks in total; the two sides are Algorithm 3.2 on row ``t`` (prefix and
    suffix), vectorized over blocks of rows.  ``O(n^2 k)`` time, ``O(block * n)`` memory.
    """
    n = a.shape[0]
    w = np.array(np.diagonal(a), dtype=np.float64)
    layers = min(k - 1, _ceil_div(n, b))
    if layers == 0:
        return w
    block = max(1, _BLOCK_ELEMS // (n + b))
    for start in range(0, n, block):
        rows = np.arange(start, min(n, start + block))
        sub = a[rows]
        # suf[l][i]: best <= l picks among columns >= t + b of row t = rows[i]
        # pre[l][i]: best <= l picks among columns <= t - b (suffix DP on reversed columns)
        suf = np.zeros((layers + 1, rows.size))
        pre = np.zeros((layers + 1, rows.size))
        for side, mat, where in (
            (suf, sub, rows + b),
            (pre, sub[:, ::-1], (n - 1) - rows + b),
        ):
            prev = np.zeros((rows.size, n + b))
            inside = where < n
            for l in range(1, layers + 1):
                cur = np.zeros((rows.size, n + b))
                cur[:, :n] = np.maximum.accumulate(
                    (mat + prev[:, b : b + n])[:, ::-1], axis=1
                )[:, ::-1]
                side[l, inside] = cur[inside.nonzero()[0], where[inside]]
                prev = cur
        # extend to k - 1 layers (monotone: extra picks never help beyond the cap)
        total = np.zeros(rows.size)
        for l in range(0, k):
            lp = min(l, layers)
            ls = min(k - 1 - l, layers)
            total = np.maximum(total, pre[lp] + suf[ls])
        w[rows] += total
    return w


def dp_relaxation_bound(gram, schema, n: int) -> Sensitivity:
    """Upper bound on ``sens(C, Pi)`` for Cyclic or Min-Sep ``Pi`` without enumerating patterns.

    With ``a = |gram|`` and ``w_t = max_{pi' b-separated, |pi'| <= k, t in pi'} sum_{tau in pi'}
    a[t, tau]`` (one DP per row), every pattern satisfies
    ``sum_{t, tau in pi} a[t, tau] <= sum_{t in pi} w_t``, so
    ``sens^2 <= max_{pi} sum_{t in pi} w_t`` (Algorithm 3.2 on ``w``; Cyclic is a subset of
    Min-Sep with the same ``k, b``).  Exact for Min-Sep when ``gram[t, tau] = 0`` for
    ``|t - tau| >= b`` (banded ``C``), where ``w_t = gram[t, t]``.  Also exact (method
    ``dp-relaxation-tight``) when an allowed pattern -- the DP's maximizer or the early-and-often
    pattern ``(0, b, ..., (k-1) b)`` -- attains the bound with ``1^T gram[pi, pi] 1``, a lower
    bound on ``sens^2`` for any signs (e.g. Toeplitz with monotone non-negative coefficients).
    """
    schema = _schema(schema)
    n = schema.validate(n)
    g = _square_gram(gram, n)
    if isinstance(schema, Single):
        return Sensitivity(math.sqrt(float(np.abs(np.diagonal(g)).max())), True, "max-column-norm")
    if not isinstance(schema, (Cyclic, MinSep)):
        raise CorrnoiseError("participation", f"unsupported schema {schema!r}")
    k, b = schema.k, schema.b
    w = _row_bounds(np.abs(g), b, k)
    bound_sq, best = argmax_reward_min_sep(w, b, k)
    value = math.sqrt(bound_sq)
    if isinstance(schema, MinSep) and _separated_zero(g, b):
        return Sensitivity(value, True, "dp-relaxation-upper-bound")
    # Certificate: any allowed pattern pi gives sens^2 >= 1^T gram[pi, pi] 1 = ||C[:, pi] 1||^2
    # (all u_t equal).  If one attains the bound, the bound is the sensitivity.
    candidates = [tuple(range(0, min(n, k * b), b))]  # early-and-often, in both schemas
    if isinstance(schema, MinSep) or (best[0] < b and best == tuple(range(best[0], n, b))[:k]):
        candidates.append(best)
    achieved = max(float(g[np.ix_(p, p)].sum()) for p in candidates)
    if achieved >= bound_sq * (1.0 - _CERT_RTOL):
        return Sensitivity(value, True, "dp-relaxation-tight")
    return Sensitivity(value, False, "dp-relaxation-upper-bound")


def sensitivity_from_gram(
    gram, schema, n: int, *, max_patterns: int = DEFAULT_MAX_PATTERNS
) -> Sensitivity:
    """Lemma 3.15 from ``gram = C^T C`` (``n x n``).

    Enumerates the patterns: exact when every entry of ``gram`` on every pattern is ``>= 0``
    (up to rounding), otherwise the absolute-value upper bound (``exact=False``).
    Min-Sep with ``gram[t, tau] = 0`` for all ``|t - tau| >= b`` uses the exact banded DP;
    Min-Sep with more than ``max_patterns`` patterns uses :func:`dp_relaxation_bound`.
    """
    schema = _schema(schema)
    n = schema.validate(n)
    g = _square_gram(gram, n)
    max_patterns = check_int("max_patterns", max_patterns, minimum=0)
    if isinstance(schema, Single):
        return Sensitivity(math.sqrt(float(np.diagonal(g).clip(min=0).max())), True, "max-column-norm")
    if isinstance(schema, MinSep):
        if _separated_zero(g, schema.b):
            diag = np.diagonal(g).clip(min=0)
            return Sensitivity(
                math.sqrt(max_reward_min_sep(diag, schema.b, schema.k)), True, "banded-dp"
            )
        if schema.count(n) > max_patterns:
            return dp_relaxation_bound(g, schema, n)
    elif not isinstance(schema, Cyclic):
        raise CorrnoiseError("participation", f"unsupported schema {schema!r}")
    return _enumerate_gram(g, schema, n)


def _cyclic_dense(C: np.ndarray, schema: Cyclic, n: int) -> Sensitivity:
    """Cyclic from the columns: only the ``Theta(n k)`` needed Gram entries (Fig. 3.10)."""
    k, b = schema.k, schema.b
    idx = np.full((b, k), n, dtype=np.intp)
    for l, p in enumerate(schema.patterns(n)):
        idx[l, : len(p)] = p
    cpad = np.zeros((C.shape[0], n + 1))
    cpad[:, :n] = C
    best_abs = 0.0
    min_entry = 0.0
    diag_max = 0.0
    block = max(1, _BLOCK_ELEMS // max(1, C.shape[0] * k))
    for start in range(0, b, block):
        cols = cpad[:, idx[start : start + block]]  # rows x m x k
        sub = np.einsum("rmi,rmj->mij", cols, cols)
        best_abs = max(best_abs, float(np.abs(sub).sum(axis=(1, 2)).max()))
        min_entry = min(min_entry, float(sub.min()))
        diag_max = max(diag_max, float(np.einsum("mii->mi", sub).max()))
    exact = min_entry >= -_NEG_RTOL * diag_max
    method = "enumeration" if exact else "enumeration-abs-upper-bound"
    return Sensitivity(math.sqrt(best_abs), exact, method)


def sensitivity_dense(C, schema, *, max_patterns: int = DEFAULT_MAX_PATTERNS) -> Sensitivity:
    """Sensitivity of a materialized ``(rows, n)`` strategy ``C`` under ``schema``.

    Single: max column norm.  Cyclic: enumeration over the ``b`` patterns using only the Gram
    entries they need (``O(rows * n * k)``).  Min-Sep: ``C^T C`` then
    :func:`sensitivity_from_gram`.
    """
    schema = _schema(schema)
    C = _strategy_matrix(C)
    n = schema.validate(C.shape[1])
    if isinstance(schema, Single):
        return sensitivity_single(np.einsum("ij,ij->j", C, C))
    if isinstance(schema, Cyclic):
        return _cyclic_dense(C, schema, n)
    gram = C.T @ C
    gram = 0.5 * (gram + gram.T)
    return sensitivity_from_gram(gram, schema, n, max_patterns=max_patterns)


# ------------------------------------------------------------------------ test oracle


def brute_force_sensitivity(C, schema, n: int) -> float:
    """Oracle: ``max_{pi in Pi} ||C[:, pi] @ 1||`` over every enumerated pattern.

    Equals ``sens(C, Pi)`` when ``C^T C >= 0`` on every pattern (Lemma 3.15(b)); a lower bound
    in general.  Deliberately independent of the fast paths (no DP, no Eq. 3.25).
    """
    schema = _schema(schema)
    C = _strategy_matrix(C)
    n = schema.validate(n)
    if C.shape[1] != n:
        raise CorrnoiseError("strategy", f"has {C.shape[1]} columns but n={n}")
    best = 0.0
    for pattern in schema.patterns(n):
        v = C[:, list(pattern)].sum(axis=1)
        best = max(best, float(v @ v))
    return math.sqrt(best)

