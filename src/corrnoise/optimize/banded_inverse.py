"""``bandinv:P``: the Toeplitz C whose inverse has P bands (the BandInvMF of Kalinin et al. 2025,
cited in seed 003 Sec. 3 and 6, restricted here to Toeplitz C^{-1}), optimized for the RMS or max
loss under single, cyclic or min-sep participation, optionally column-normalized.

C^{-1} = T_q with q = (1, q_1, ..., q_{P-1}) (the loss is scale-free, so q_0 = 1), started from
BISR's q (the first P coefficients of A_pre^{-1/2}) and improved by L-BFGS
(:func:`corrnoise.optimize.common.lbfgs`) on the objective log sens(C, Pi)^2 + log err(B)
(tutorial Problem 4.12), differentiated by torch autograd. The one non-elementary step,
Y = T_q^{-1} W (an IIR filter with the P taps of q, tutorial Alg. 2.1), has a hand-written
adjoint (:class:`_ToeplitzSolve`). Never worse than bisr:P; the returned losses are recomputed
by :func:`corrnoise.losses.loss_report`, never taken from here.

Preconditions on C (the sensitivity formulas below are exact only there):

* single: none (sens^2 = ||C[:, 0]||^2 = sum_t c_t^2 for any signs; colnorm: 1);
* cyclic:K:B: C >= 0 entrywise, so C^T C >= 0 and sens^2 = max over the B patterns of
  ||C 1_pi||^2 (tutorial Lemma 3.15(b)); for the Toeplitz C the first pattern (0, B, 2B, ...) is
  the largest (:func:`corrnoise.sensitivity.toeplitz_precondition_violation`), for C D^{-1}
  (colnorm) all B patterns are evaluated;
* minsep:K:B: C >= 0 and non-increasing (tutorial Lemma 3.16(c), Eq. 3.25); +colnorm is refused
  (C D^{-1} is not Toeplitz and no exact formula is known beyond DP-CGD, seed 003 Lemma 8).

The optimizer keeps C in that class: a step that leaves it is infeasible (f = inf) and the line
search shortens it, so every iterate, and the result, satisfies the precondition (checked once more
on the returned strategy, which falls back to bisr:P otherwise; bisr:P itself is non-negative and
non-increasing, tests/test_bisr.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import signal

from ..errors import CorrnoiseError, check_int
from ..linalg import toeplitz as tp
from ..participation import Cyclic, MinSep, Participation, Single, parse_participation
from ..sensitivity import toeplitz_precondition_violation
from ..workloads import Workload
from .common import blas_threads, check_objective, check_workload, lbfgs

__all__ = ["BandedInverseProblem", "banded_inverse_objective", "optimize_banded_inverse"]


@dataclass(frozen=True)
class BandedInverseProblem:
    """What bandinv:P is optimized for: n steps, participation, ``rms``/``max``, workload, colnorm."""

    n: int
    participation: Participation
    objective: str = "rms"
    workload: Workload | None = None
    colnorm: bool = False

    @classmethod
    def make(cls, n, participation="single", objective="rms", workload=None, colnorm=False) -> BandedInverseProblem:
        n = check_int("n", n, minimum=1)
        schema = parse_participation(participation)
        schema.validate(n)
        wl = check_workload(workload)
        if not isinstance(colnorm, (bool, np.bool_)):
            raise CorrnoiseError("colnorm", f"must be True or False, got {colnorm!r}")
        if colnorm and not wl.is_prefix:
            raise CorrnoiseError("colnorm", "bandinv +colnorm is implemented for the prefix workload only")
        if colnorm and isinstance(schema, MinSep):
            raise CorrnoiseError("colnorm", "bandinv +colnorm has no exact minsep sensitivity (C D^-1 is not "
                                 "Toeplitz); use cyclic:K:B or single")
        return cls(n, schema, check_objective(objective), wl, bool(colnorm))


# ------------------------------------------------------------------------------ T_q^{-1} W
class _ToeplitzSolve(torch.autograd.Function):
    """Y = T_q^{-1} W along axis 0 (lower-triangular Toeplitz solve = IIR filter with taps q).

    Adjoint: from T_q Y = W, dY = T_q^{-1}(dW - dT_q Y), so for a loss with gradient G_Y,
    G_W = U := T_q^{-T} G_Y (the filter run backwards in time) and
    dL/dq_j = -sum_{t, col} U[t, col] Y[t - j, col].
    """

    @staticmethod
    def forward(ctx, q, w):
        qn = q.detach().numpy()
        y = torch.from_numpy(signal.lfilter([1.0], qn, w.detach().numpy(), axis=0))
        ctx.save_for_backward(q, y)
        return y

    @staticmethod
    def backward(ctx, gy):
        q, y = ctx.saved_tensors
        qn, yn = q.numpy(), y.numpy()
        u = signal.lfilter([1.0], qn, gy.numpy()[::-1], axis=0)[::-1]
        n = yn.shape[0]
        gq = np.array([-float(np.sum(u[j:] * yn[: n - j])) for j in range(qn.size)])
        return torch.from_numpy(gq), torch.from_numpy(np.ascontiguousarray(u))


def _shifted_sum(x: torch.Tensor, coefs, shifts) -> torch.Tensor:
    """sum_i coefs_i * S^{shifts_i} x (S = the down-shift, zeros enter at the top)."""
    n = x.shape[0]
    out = torch.zeros_like(x)
    for a, s in zip(coefs, shifts):
        if s < n:
            out = out + a * torch.cat([x.new_zeros(s), x[: n - s]])
    return out


# ------------------------------------------------------------------------------ error
def _row_errors_squared(q: torch.Tensor, c: torch.Tensor, problem: BandedInverseProblem) -> torch.Tensor:
    """||B[t]||^2 for every t, B = A C^{-1} (colnorm: A D C^{-1}, D = diag of C's column norms).

    Plain: B = A T_q is Toeplitz with first column b = a * q (series product), so
    ||B[t]||^2 = sum_{s <= t} b_s^2 (tutorial Eq. 4.11).
    Colnorm, prefix A: B[t, j] = sum_{s=j}^{t} d_s q_{s-j}; with E[j, i] = sum_{r<=i} d_{j+r} q_r
    (d_s = 0 for s >= n), ||B[t]||^2 = sum_{i<P-1} E[t-i, i]^2 + sum_{j <= t-P+1} E[j, P-1]^2.
    """
    n, p = problem.n, q.numel()
    if not problem.colnorm:
        a = torch.from_numpy(problem.workload.coefficients(n))
        b = _shifted_sum(a, [q[j] for j in range(p)], range(p))
        return torch.cumsum(b * b, 0)
    d = torch.sqrt(torch.flip(torch.cumsum(c * c, 0), [0]))  # d_t^2 = sum_{s < n - t} c_s^2
    windows = torch.cat([d, d.new_zeros(p - 1)]).unfold(0, p, 1)[:n]  # [j, r] = d_{j+r}
    e = torch.cumsum(windows * q[None, :], 1)
    rows = torch.cumsum(e[:, p - 1] ** 2, 0)
    rows = torch.cat([rows.new_zeros(p - 1), rows[: n - p + 1]]) if p > 1 else rows
    for i in range(min(p - 1, n)):
        rows = rows + torch.cat([rows.new_zeros(i), e[: n - i, i] ** 2])
    return rows


# ------------------------------------------------------------------------------ sensitivity
def _sensitivity_squared(q: torch.Tensor, c: torch.Tensor, problem: BandedInverseProblem) -> torch.Tensor:
    """sens(C, Pi)^2 under the preconditions of the module docstring (checked by the caller)."""
    schema, n = problem.participation, problem.n
    if isinstance(schema, Single):
        return c.new_ones(()) if problem.colnorm else torch.sum(c * c)
    k, b = schema.max_participations(n), schema.b
    if not problem.colnorm:  # pattern (0, b, ..., (k-1) b): C 1_pi = sum_j S^{jb} c
        v = _shifted_sum(c, [1.0] * k, [j * b for j in range(k)])
        return torch.sum(v * v)
    d = torch.sqrt(torch.flip(torch.cumsum(c * c, 0), [0]))
    steps = torch.arange(n)  # step t belongs to the pattern l = t mod b: W[t, t mod b] = 1 / d_t
    w = c.new_zeros(n, b).index_put((steps, steps % b), 1.0 / d)
    y = _ToeplitzSolve.apply(q, w)
    return torch.max(torch.sum(y * y, 0))


def _feasible(c: np.ndarray, problem: BandedInverseProblem) -> bool:
    if not np.all(np.isfinite(c)) or float(np.max(np.abs(c))) > 1e150:
        return False
    if isinstance(problem.participation, Single):
        return True
    return bool(np.all(c >= 0.0)) and toeplitz_precondition_violation(c, problem.participation) is None


def banded_inverse_objective(x: np.ndarray, problem: BandedInverseProblem) -> tuple[float, np.ndarray]:
    """(log sens^2 + log err, gradient in x) for q = (1, x); (inf, 0) where C leaves the
    precondition class. err = mean_t ||B[t]||^2 (rms) or max_t ||B[t]||^2 (max): rms_loss^2 /
    max_loss^2 of docs/design.md."""
    q = torch.tensor(np.concatenate([[1.0], np.asarray(x, dtype=np.float64)]), requires_grad=True)
    e0 = torch.zeros(problem.n, 1, dtype=torch.float64)
    e0[0, 0] = 1.0
    with np.errstate(all="ignore"):
        c = _ToeplitzSolve.apply(q, e0)[:, 0]
        if not _feasible(c.detach().numpy(), problem):
            return math.inf, np.zeros(len(x))
        rows = _row_errors_squared(q, c, problem)
        err = rows.mean() if problem.objective == "rms" else rows.max()
        f = torch.log(_sensitivity_squared(q, c, problem)) + torch.log(err)
    if not torch.isfinite(f):
        return math.inf, np.zeros(len(x))
    f.backward()
    g = q.grad.numpy()[1:].copy()
    if not np.all(np.isfinite(g)):
        return math.inf, np.zeros(len(x))
    return float(f.detach()), g


def optimize_banded_inverse(n: int, bands: int, participation="single", objective: str = "rms",
                            workload=None, colnorm: bool = False, max_iter: int = 500) -> np.ndarray:
    """q = (1, q_1, ..., q_{P-1}) minimizing the loss of C = T_q^{-1} (or its column-normalized
    version) for ``participation`` / ``objective`` / ``workload``; returns q. The result
    satisfies the module's preconditions.

    Two starts, the better result kept: BISR's q (Kalinin et al. 2025) and the optimum for
    max(2, P // 2) bands padded with zeros (optimized the same way), so P bands are never worse than
    fewer bands even where the precondition class has a boundary the first start gets stuck on.
    """
    problem = BandedInverseProblem.make(n, participation, objective, workload, colnorm)
    bands = check_int("bands", bands, minimum=1)
    if bands > problem.n:
        raise CorrnoiseError("bands", f"must be <= n = {problem.n}, got {bands}")
    with blas_threads(1):  # small tensors: one thread is 5x faster than two on a loaded machine
        return _optimize(problem, bands, max_iter)


def _optimize(problem: BandedInverseProblem, bands: int, max_iter: int) -> np.ndarray:
    q0 = tp.bisr_inverse_coefficients(bands)
    if bands == 1:
        return q0

    def fun(x):
        return banded_inverse_objective(x, problem)

    starts = [q0]
    if bands > 2:
        fewer = _optimize(problem, max(2, bands // 2), max_iter)
        starts.append(np.concatenate([fewer, np.zeros(bands - fewer.size)]))
    best, best_f = None, math.inf
    for start in starts:
        f0 = fun(start[1:].copy())[0]
        if not math.isfinite(f0):
            continue
        x = lbfgs(fun, start[1:].copy(), max_iter=max_iter).x
        q = np.concatenate([[1.0], x])
        f = fun(x)[0]
        if not (f <= f0 and _feasible(tp.series_inverse(q, problem.n), problem)):  # as the strategy computes C
            q, f = start, f0
        if f < best_f:
            best, best_f = q, f
    if best is None:
        raise CorrnoiseError("bands", f"bisr:{bands} is outside the precondition class for {problem.participation.spec}")
    return best
