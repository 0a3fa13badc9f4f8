"""BLT strategy optimization (tutorial Sec. 4.3.2, closed forms of Sec. 2.10 / Lemma 2.29).

Parameters: C = BLT(alpha, lam) with alpha_i > 0 and lam_i in (0, 1) (tutorial Eq. 2.16,
parameterization phi = (alpha, lambda) of Fig. 4.4a, left, which the tutorial recommends).
The objective of Problem 4.12 is evaluated in torch float64 and differentiated by autograd:

* inverse parameters (Lemma 2.16): with alpha > 0 the inverse decays mu_k are the real roots of
  the secular equation f(w) = 1 + sum_i alpha_i / (w - lam_i), one in each gap between sorted
  decays and one below the smallest (they interlace). They are found by bisection in numpy and
  then passed through one Newton step in torch, whose derivative at a root is exactly the
  implicit-function derivative -(df/dtheta) / f'(mu); alpha_hat_k = 1 / f'(mu_k).
  Everything is carried in complement form (q = 1 - lam, omega = 1 - mu), so decays within
  1e-12 of 1 keep their relative precision.
* single participation, prefix workload: O(d^2) closed forms (Lemma 2.29 in the corrected
  beta / e form of :mod:`corrnoise.linalg.blt`): ||C||_col^2, max_t ||B[t]||^2 and ||B||_F^2 / n;
* cyclic / min-sep: Toeplitz materialization (tutorial Eq. 4.12): c_t in O(n d), then
  sens^2 = ||sum_{j<k} S^{jb} c||^2 (Eq. 3.25, valid because alpha >= 0 and sum alpha <= 1 make c
  non-negative and non-increasing); the error keeps its closed form;
* other Toeplitz workloads: the decoder's first column A-series * C^{-1}-series by FFT (O(n log n)).

Constraints (tutorial Sec. 4.3.2): the optimizer works in coordinates whose image is exactly the
feasible set -- lam = sigmoid(v), alpha = exp(u) (multi-participation: alpha = exp(u) / (1 +
sum exp(u)), so sum alpha < 1) -- and adds the tutorial's log barrier
h = -sum_i (log lam_i + log(1 - lam_i) + log alpha_i) (plus -log(1 - sum alpha) for multiple
participations) with a small weight, which keeps the iterates away from the boundary where the
gradients vanish. The number of buffers d grows from 1 while the loss improves by more than
0.5 % (d <= 10) when ``buffers`` is None. Losses of the returned mechanism should be (and in the
CLI are) recomputed with :func:`corrnoise.losses.loss_report`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from scipy import optimize as sopt

from ..errors import CorrnoiseError, check_int
from ..linalg import blt as bltmath
from ..participation import Participation, Single, parse_participation
from ..strategies import BLT
from ..workloads import Workload
from .common import blas_threads, check_objective, check_progress, check_workload

__all__ = ["optimize_blt", "blt_objective", "initial_blt", "MAX_BUFFERS"]

MAX_BUFFERS = 10
#: grow d while the loss improves by more than this fraction (issue #3).
AUTO_BUFFER_GAIN = 0.005
_BARRIER_WEIGHT = 1e-9
_DT = torch.float64


# ------------------------------------------------------------------ torch special functions
_PHI2_TAYLOR = [1.0 / math.factorial(j + 2) for j in range(16)]


def _phi2(z: torch.Tensor) -> torch.Tensor:
    """phi2(z) = (expm1(z) - z) / z^2, by its Taylor series for |z| < 0.5 (smooth at 0)."""
    small = z.abs() < 0.5
    zs = torch.where(small, z, torch.zeros_like(z))
    series = torch.zeros_like(z)
    for coef in reversed(_PHI2_TAYLOR):
        series = series * zs + coef
    zd = torch.where(small, torch.ones_like(z), z)
    return torch.where(small, series, (torch.expm1(zd) - zd) / (zd * zd))


@dataclass
class _Decay:
    """A set of decays w in complement form (om = 1 - w, accurate near w = 1).

    ``x`` = log|w| (log1p(-om) for w > 0, log(-w) for w < 0); ``pos`` marks w > 0 and
    ``all_pos`` (decided on the values, piecewise constant) selects the branch-free fast path.
    """

    w: torch.Tensor
    om: torch.Tensor
    pos: torch.Tensor
    x: torch.Tensor
    all_pos: bool

    @staticmethod
    def make(om: torch.Tensor) -> "_Decay":
        w = 1.0 - om
        pos = (w > 0).detach()
        if bool(pos.all()):
            return _Decay(w, om, pos, torch.log1p(-om), True)
        x = torch.where(
            pos,
            torch.log1p(-torch.where(pos, om, torch.full_like(om, 0.5))),
            torch.log(torch.where(pos, torch.full_like(w, 0.5), -w)),
        )
        return _Decay(w, om, pos, x, False)

    def with_pairs(self) -> "_Decay":
        """This set followed by its d^2 pairwise products (flattened), as one set."""
        p = self.pairs()
        return _Decay(torch.cat([self.w, p.w.reshape(-1)]), torch.cat([self.om, p.om.reshape(-1)]),
                      torch.cat([self.pos, p.pos.reshape(-1)]), torch.cat([self.x, p.x.reshape(-1)]),
                      self.all_pos and p.all_pos)

    def pairs(self) -> "_Decay":
        """The products w_k w_l (1 - w_k w_l = om_k + om_l - om_k om_l, accurate near 1)."""
        om = self.om[:, None] + self.om[None, :] - self.om[:, None] * self.om[None, :]
        w = self.w[:, None] * self.w[None, :]
        x = self.x[:, None] + self.x[None, :]
        if self.all_pos:
            return _Decay(w, om, torch.ones_like(w, dtype=torch.bool), x, True)
        return _Decay(w, om, (w > 0).detach(), x, False)


def _gamma(n: int, d: _Decay) -> torch.Tensor:
    """gamma_n(w) = sum_{t<n} w^t = -expm1(n log w) / (1 - w) (tutorial Lemma 2.29).

    For w > 0 both expm1(n log w) and 1 - w (carried as om) are accurate, so this form has no
    cancellation even for w within 1e-12 of 1; for w < 0, 1 - w >= 1 and the plain formula
    (1 - w^n) / (1 - w) is accurate.
    """
    if n == 0:
        return torch.zeros_like(d.w)
    if d.all_pos:
        return -torch.expm1(float(n) * d.x) / d.om
    pos_val = -torch.expm1(float(n) * d.x) / torch.where(d.pos, d.om, torch.ones_like(d.om))
    wn = torch.where(d.pos, torch.full_like(d.w, -0.5), d.w)
    neg_val = (1.0 - torch.pow(wn, float(n))) / (1.0 - wn)
    return torch.where(d.pos, pos_val, neg_val)


def _gsum(n: int, d: _Decay) -> torch.Tensor:
    """G_n(w) = sum_{s<n} (n - 1 - s) w^s = (n - gamma_n(w)) / (1 - w).

    For w > 0, with x = log w: expm1(nx) - n expm1(x) = x^2 (n^2 phi2(nx) - n phi2(x)) and
    expm1(x) = -(1 - w), so G_n = x^2 (n^2 phi2(n x) - n phi2(x)) / (1 - w)^2 -- no
    cancellation near w = 1 (phi2 by its Taylor series for small arguments).
    """
    nf = float(n)
    p2 = _phi2(torch.cat([nf * d.x, d.x])).reshape(2, -1)  # one batched series evaluation
    if d.all_pos:
        return d.x * d.x * (nf * nf * p2[0] - nf * p2[1]) / (d.om * d.om)
    om = torch.where(d.pos, d.om, torch.ones_like(d.om))
    pos_val = d.x * d.x * (nf * nf * p2[0] - nf * p2[1]) / (om * om)
    wn = torch.where(d.pos, torch.full_like(d.w, -0.5), d.w)
    gam = (1.0 - torch.pow(wn, nf)) / (1.0 - wn)
    neg_val = (nf - gam) / (1.0 - wn)
    return torch.where(d.pos, pos_val, neg_val)


# ------------------------------------------------------------------ inverse parameters
def _eigen_guess(alpha: np.ndarray, q: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """1 - eig(Lam - 1 alpha^T), sorted (Lemma 2.16); bracket midpoints if LAPACK fails."""
    try:
        mat = np.diag(1.0 - q) - np.outer(np.ones(q.size), alpha)
        return np.sort(1.0 - np.linalg.eigvals(mat).real)
    except np.linalg.LinAlgError:
        return 0.5 * (lo + hi)


def _secular_roots_complement(alpha: np.ndarray, q: np.ndarray, guess: np.ndarray | None = None) -> np.ndarray:
    """omega_k = 1 - mu_k for the d real roots mu of f(w) = 1 + sum_i alpha_i / (w - lam_i).

    In omega = 1 - w: g(om) = 1 + sum_i alpha_i / (q_i - om) with q = 1 - lam. For alpha > 0
    and distinct q the roots interlace: one in each gap (q_(i), q_(i+1)) of the sorted q and
    one in (q_max, q_max + sum alpha]; on each bracket g increases from -inf to a value >= 0.
    Start from ``guess`` (the roots at a nearby point) where it lies in the brackets, else
    from the eigenvalues of Lam - 1 alpha^T (Lemma 2.16); then safeguarded Newton (bisection
    whenever a step leaves the bracket) in the accurate omega coordinates.
    """
    qs = np.sort(q)
    lo = qs.copy()
    hi = np.append(qs[1:], qs[-1] + float(np.sum(alpha)) + 1.0)
    with np.errstate(all="ignore"):
        if guess is not None and guess.shape == q.shape and np.all((guess > lo) & (guess < hi)):
            est = guess
        else:
            est = _eigen_guess(alpha, q, lo, hi)
        om = np.where((est > lo) & (est < hi), est, 0.5 * (lo + hi))
        for _ in range(100):
            diff = q[None, :] - om[:, None]
            g = 1.0 + np.sum(alpha[None, :] / diff, axis=1)
            dg = np.sum(alpha[None, :] / diff**2, axis=1)
            neg = g < 0.0
            lo = np.where(neg, om, lo)
            hi = np.where(neg, hi, om)
            step = om - g / dg
            inside = (step >= lo) & (step <= hi) & np.isfinite(step)
            new = np.where(inside, step, 0.5 * (lo + hi))
            done = np.abs(new - om) <= 1e-13 * np.abs(om)  # quadratic: one more step is exact
            om = new
            if np.all(done | (hi <= np.nextafter(lo, np.inf))):
                break
    return om


def _inverse_torch(alpha: torch.Tensor, q: torch.Tensor, cache: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha_hat, omega = 1 - lam_hat) of C^{-1} with the implicit-function gradient.

    ``cache`` keeps the last roots as the starting guess for the next (nearby) evaluation.
    """
    guess = None if cache is None else cache.get("om")
    roots = _secular_roots_complement(alpha.detach().numpy(), q.detach().numpy(), guess)
    if cache is not None:
        cache["om"] = roots
    om0 = torch.as_tensor(roots, dtype=_DT)
    diff = q[None, :] - om0[:, None]  # (q_i - om_k) = (mu_k - lam_i)
    g = 1.0 + (alpha[None, :] / diff).sum(dim=1)
    dg = (alpha[None, :] / diff**2).sum(dim=1)  # d g / d om
    om = om0 - (g - g.detach()) / dg.detach()  # value om0, derivative -(dg/dtheta) / g'
    diff = q[None, :] - om[:, None]
    fprime = -(alpha[None, :] / diff**2).sum(dim=1)  # f'(mu) = d/dw [sum alpha/(w - lam)]
    return 1.0 / fprime, om


# ------------------------------------------------------------------------ objective
def _blt_coefficients_torch(alpha, q, n):
    """c_0 = 1, c_t = sum_i alpha_i lam_i^(t-1) (Eq. 2.16), in O(n d)."""
    t = torch.arange(n - 1, dtype=_DT)
    powers = torch.exp(t[:, None] * torch.log1p(-q)[None, :])
    return torch.cat([torch.ones(1, dtype=_DT), powers @ alpha])


def _sensitivity_squared(alpha, q, n, schema: Participation) -> torch.Tensor:
    if isinstance(schema, Single):
        lam = _Decay.make(q).pairs()
        return 1.0 + alpha @ _gamma(n - 1, lam) @ alpha
    c = _blt_coefficients_torch(alpha, q, n)
    k, b = schema.max_participations(n), schema.b
    blocks = -(-n // b)
    cp = torch.cat([c, torch.zeros(blocks * b - n, dtype=_DT)]).reshape(blocks, b)
    cs = torch.cumsum(cp, dim=0)  # v[q b + r] = sum_{j <= min(q, k-1)} c[(q - j) b + r]
    if k < blocks:
        cs = torch.cat([cs[:k], cs[k:] - cs[:-k]])
    v = cs.reshape(-1)[:n]
    return v @ v


def _error_closed_form(alpha, q, a_hat, om, n, objective):
    """max_t ||B[t]||^2 or ||B||_F^2 / n for B = A_pre C^{-1} (Lemma 2.29, beta/e form)."""
    beta = 1.0 / (1.0 + (alpha / q).sum())
    e = -a_hat / om
    mu = _Decay.make(om)
    both = mu.with_pairs()  # the d decays and their d^2 products, evaluated in one batch
    d = om.numel()
    nf = float(n)
    g = _gamma(n, both)
    if objective == "max":
        return nf * beta * beta + 2.0 * beta * (e * g[:d]).sum() + e @ g[d:].reshape(d, d) @ e
    h = _gsum(n, both) + g
    h1, h2 = h[:d], h[d:].reshape(d, d)
    total = beta * beta * nf * (nf + 1.0) / 2.0 + 2.0 * beta * (e * h1).sum() + e @ h2 @ e
    return total / nf


def _error_materialized(a_hat, om, n, objective, workload: Workload):
    """err for any Toeplitz workload: b = A-series * C^{-1}-series (FFT), then Eq. 4.11."""
    t = torch.arange(n - 1, dtype=_DT)
    mu = 1.0 - om
    powers = torch.pow(mu[None, :], t[:, None])
    cinv = torch.cat([torch.ones(1, dtype=_DT), powers @ a_hat])
    a = torch.as_tensor(workload.coefficients(n), dtype=_DT)
    size = 1 << (2 * n - 1).bit_length()
    b = torch.fft.irfft(torch.fft.rfft(cinv, size) * torch.fft.rfft(a, size), size)[:n]
    if objective == "max":
        return b @ b
    w = (n - torch.arange(n, dtype=_DT)) / n
    return (w * b) @ b


def _unpack(x: torch.Tensor, d: int, multi: bool):
    u, v = x[:d], x[d:]
    if multi:
        m = torch.clamp(u.max().detach(), min=0.0)
        eu = torch.exp(u - m)
        alpha = eu / (torch.exp(-m) + eu.sum())
    else:
        alpha = torch.exp(u)
    lam = torch.sigmoid(v)
    q = torch.sigmoid(-v)
    return alpha, lam, q


def _pack(alpha: np.ndarray, lam: np.ndarray, multi: bool) -> np.ndarray:
    alpha = np.maximum(np.asarray(alpha, dtype=np.float64), 1e-300)
    lam = np.clip(np.asarray(lam, dtype=np.float64), 1e-300, 1.0 - 1e-16)
    if multi:
        rest = 1.0 - alpha.sum()
        if rest <= 0:
            alpha = alpha * (0.999 / alpha.sum())
            rest = 1.0 - alpha.sum()
        u = np.log(alpha / rest)
    else:
        u = np.log(alpha)
    v = np.log(lam) - np.log1p(-lam)
    return np.concatenate([u, v])


@dataclass(frozen=True)
class _Problem:
    n: int
    schema: Participation
    objective: str
    workload: Workload

    @property
    def multi(self) -> bool:
        return not isinstance(self.schema, Single)


def _objective_torch(x: torch.Tensor, d: int, prob: _Problem, barrier: float, cache: dict | None = None):
    alpha, lam, q = _unpack(x, d, prob.multi)
    a_hat, om = _inverse_torch(alpha, q, cache)
    sens2 = _sensitivity_squared(alpha, q, prob.n, prob.schema)
    if prob.workload.is_prefix:
        err = _error_closed_form(alpha, q, a_hat, om, prob.n, prob.objective)
    else:
        err = _error_materialized(a_hat, om, prob.n, prob.objective, prob.workload)
    f = torch.log(sens2) + torch.log(err)
    h = -(torch.log(lam) + torch.log(q) + torch.log(alpha)).sum()
    if prob.multi:
        h = h - torch.log1p(-alpha.sum())
    return f + barrier * h, f


def blt_objective(alpha, lam, n: int, participation="single", objective: str = "rms", workload=None) -> float:
    """The normalized loss sens(C, Pi) * err(B)^(1/2) that the optimizer minimizes (torch path).

    Exposed for testing against :func:`corrnoise.losses.loss_report`.
    """
    alpha, lam = bltmath.validate_blt(alpha, lam)
    prob = _Problem(check_int("n", n, minimum=2), parse_participation(participation),
                    check_objective(objective), check_workload(workload))
    prob.schema.validate(prob.n)
    x = torch.as_tensor(_pack(alpha, lam, prob.multi), dtype=_DT)
    _, f = _objective_torch(x, alpha.size, prob, 0.0)
    return math.exp(0.5 * float(f))


def initial_blt(n: int, d: int, multi: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A d-buffer BLT approximating the A^{1/2} coefficients c_t ~ 1/sqrt(pi t) (Thm 2.5).

    1/sqrt(pi t) = (1/pi) int s^{1/2} e^{-s t} d(log s): a d-point rule on a log grid of rates
    s in [1/n, 1] gives lam_i = e^{-s_i}, alpha_i = lam_i s_i^{1/2} Delta / pi (Delta the log
    spacing). With multiple participations the scales are shrunk so that sum alpha < 1.
    """
    if d == 1:
        s = np.array([4.0 / n ** 0.5]) if n > 1 else np.array([1.0])
        delta = 1.0
    else:
        ls = np.linspace(math.log(1.0 / n), math.log(2.0), d)
        s = np.exp(ls)
        delta = ls[1] - ls[0]
    lam = np.exp(-s)
    alpha = lam * np.sqrt(s) * delta / math.pi
    if d == 1:
        alpha = np.array([0.5])
    if multi and alpha.sum() >= 0.95:
        alpha = alpha * (0.95 / alpha.sum())
    return alpha, lam


# Objective value returned for infeasible / overflowing points (|lam_hat| > 1 makes the error
# grow like lam_hat^(2n)): large but finite, so the L-BFGS line search backtracks instead of
# aborting on inf/nan.
_INFEASIBLE = 1e6


def _optimize_fixed_d(prob: _Problem, x0: np.ndarray, d: int, max_iterations: int, callback) -> tuple[np.ndarray, float]:
    cache: dict = {}

    def fun(xn):
        x = torch.tensor(xn, dtype=_DT, requires_grad=True)
        try:
            total, _ = _objective_torch(x, d, prob, _BARRIER_WEIGHT, cache)
            if not torch.isfinite(total):
                return _INFEASIBLE, np.zeros_like(xn)
            (g,) = torch.autograd.grad(total, x)
        except (ValueError, RuntimeError, FloatingPointError, np.linalg.LinAlgError):
            return _INFEASIBLE, np.zeros_like(xn)
        g = g.numpy()
        if not np.all(np.isfinite(g)):
            return _INFEASIBLE, np.zeros_like(xn)
        return float(total.detach()), g

    f0 = fun(x0)[0]
    if not f0 < _INFEASIBLE:
        return x0, math.inf
    res = sopt.minimize(
        fun, x0, jac=True, method="L-BFGS-B", callback=callback,
        options={"maxiter": max_iterations, "maxcor": 20, "ftol": 1e-11, "gtol": 1e-8, "maxls": 40},
    )
    if np.all(np.isfinite(res.x)) and res.fun < _INFEASIBLE and res.fun <= f0:
        return res.x, float(res.fun)
    return x0, f0


def _grow(alpha: np.ndarray, lam: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Warm start for d + 1 buffers: the d-buffer optimum plus a slow, tiny extra buffer.

    The new decay sits between the slowest one and 1 - 1/n (the scale on which a length-n
    mechanism can still use it); its scale is small, so the loss starts where d left it.
    """
    top = float(np.max(lam))
    q_new = math.sqrt((1.0 - top) * (1.0 / n)) if (1.0 - top) > 1.0 / n else 0.5 * (1.0 - top)
    lam_new = 1.0 - q_new
    alpha_new = 0.05 * float(np.min(alpha))
    return np.append(alpha, alpha_new), np.append(lam, lam_new)


def optimize_blt(
    n: int,
    buffers: int | None = None,
    participation="single",
    objective: str = "rms",
    workload=None,
    progress: Callable[[int, float], None] | None = None,
    *,
    max_iterations: int = 500,
) -> BLT:
    """Optimize a BLT(alpha, lambda) strategy for n steps (tutorial Problem 4.12, Sec. 4.3.2).

    ``buffers`` = d in 1..10, or None to grow d from 1 while the loss improves by > 0.5 %.
    ``progress(iteration, loss)`` is called after every L-BFGS iteration (over all d).
    Always returns a valid BLT with alpha > 0 and lam in (0, 1) (sum alpha < 1 with multiple
    participations, so Eq. 3.25 applies), or raises CorrnoiseError.
    """
    n = check_int("n", n, minimum=2)
    if buffers is not None:
        buffers = check_int("buffers", buffers, minimum=1, maximum=MAX_BUFFERS)
    schema = parse_participation(participation)
    schema.validate(n)
    prob = _Problem(n, schema, check_objective(objective), check_workload(workload))
    check_progress(progress)
    max_iterations = check_int("max_iterations", max_iterations, minimum=1)

    top = buffers if buffers is not None else MAX_BUFFERS
    best: tuple[float, np.ndarray, int] | None = None  # over all d (or d = buffers)
    with blas_threads(1):  # small tensors: one intra-op thread (1.3 s vs 8.8 s wall at n = 2000, d <= 4)
        path = _blt_path(prob, top, max_iterations, progress)
        for d, loss, x, prev_loss in path:
            if loss is None:  # no valid parameters for this d
                if buffers is None and prev_loss is not None:
                    break
                continue
            if buffers is None or d == buffers:
                if best is None or loss < best[0]:
                    best = (loss, x, d)
            if buffers is None and prev_loss is not None and not loss < prev_loss * (1.0 - AUTO_BUFFER_GAIN):
                break
        path.close()
    if best is None:
        raise CorrnoiseError(
            "buffers", "BLT optimization did not produce valid parameters; try another number of buffers"
        )
    _, x, d = best
    alpha, lam = _finalize(x, d, prob)[1:]
    return BLT(alpha, lam, n)


def optimize_blt_each(n: int, buffers, participation="single", objective: str = "rms", workload=None, *,
                      max_iterations: int = 500) -> dict[int, BLT]:
    """``{d: optimize_blt(n, buffers=d, ...)}`` for every d in ``buffers``, from one run of the
    d = 1, 2, ... path (each d warm-starts from the previous one, so optimize_blt(buffers=4) computes
    the d = 1..3 optima on its way: the results are the same BLTs, without recomputing them).
    A d without valid parameters is missing from the result."""
    wanted = sorted({check_int("buffers", d, minimum=1, maximum=MAX_BUFFERS) for d in buffers})
    if not wanted:
        raise CorrnoiseError("buffers", "name at least one number of buffers")
    n = check_int("n", n, minimum=2)
    schema = parse_participation(participation)
    schema.validate(n)
    prob = _Problem(n, schema, check_objective(objective), check_workload(workload))
    max_iterations = check_int("max_iterations", max_iterations, minimum=1)
    out: dict[int, BLT] = {}
    with blas_threads(1):  # small tensors: one intra-op thread (see optimize_blt)
        for d, loss, x, _ in _blt_path(prob, wanted[-1], max_iterations, None):
            if loss is not None and d in wanted:
                alpha, lam = _finalize(x, d, prob)[1:]
                out[d] = BLT(alpha, lam, n)
    return out


def _blt_path(prob: "_Problem", top: int, max_iterations: int, progress):
    """Yield (d, loss, x, loss of the previous d or None) for d = 1..top: each d optimized from the
    cold start and from the previous d's optimum grown by one buffer (:func:`_grow`), the better
    valid one kept; a d without valid parameters yields loss = x = None (the next starts cold)."""
    counter = {"it": 0}

    def callback(intermediate_result):
        counter["it"] += 1
        if progress is not None:
            progress(counter["it"], math.exp(0.5 * float(intermediate_result.fun)))

    prev: tuple[float, np.ndarray, np.ndarray] | None = None  # best of the previous d
    for d in range(1, top + 1):
        starts = [initial_blt(prob.n, d, prob.multi)]
        if prev is not None:
            starts.append(_grow(prev[1], prev[2], prob.n))
        found: tuple[float, np.ndarray, np.ndarray, np.ndarray] | None = None
        for a0, l0 in starts:
            x, _ = _optimize_fixed_d(prob, _pack(a0, l0, prob.multi), d, max_iterations, callback)
            candidate = _finalize(x, d, prob)
            if candidate is not None and (found is None or candidate[0] < found[0]):
                found = (candidate[0], x, candidate[1], candidate[2])
        if found is None:
            yield d, None, None, (None if prev is None else prev[0])
            prev = None  # the next d starts cold
            continue
        loss, x, alpha, lam = found
        yield d, loss, x, (None if prev is None else prev[0])
        prev = (loss, alpha, lam)


def _finalize(x: np.ndarray, d: int, prob: _Problem):
    """(loss, alpha, lam) if the parameters are a valid BLT for this problem, else None."""
    with torch.no_grad():
        alpha, lam, q = _unpack(torch.as_tensor(x, dtype=_DT), d, prob.multi)
    alpha, lam = alpha.numpy().copy(), lam.numpy().copy()
    if not (np.all(np.isfinite(alpha)) and np.all(np.isfinite(lam))):
        return None
    if not (np.all(alpha > 0.0) and np.all(lam > 0.0) and np.all(lam < 1.0)):
        return None
    if prob.multi and not bltmath.blt_is_nonnegative_monotone(alpha, lam):
        return None
    try:
        loss = blt_objective(alpha, lam, prob.n, prob.schema, prob.objective, prob.workload)
    except (CorrnoiseError, ValueError, RuntimeError):
        return None
    if not math.isfinite(loss):
        return None
    return loss, alpha, lam
