"""Amplification-aware optimization of C for balls-in-bins batching (issue #12; seed 000 Sec. 4.2,
App. D, App. G.2).

Every other optimizer in corrnoise minimizes the *unamplified* error and amplification is applied
afterwards.  Here the objective is the amplified one,

    rms(theta) = noise_std(C(theta)) * ||A C(theta)^-1||_F / sqrt(n),                   (OBJ)

where noise_std(C) solves the balls-in-bins calibration equation of seed 000 Algorithm 2,

    delta_hat(noise_std; C, eps, fixed sample) = delta,                                  (CAL)

on a fixed Monte Carlo sample (common random numbers).  (CAL) is solved by bisection, which
autograd cannot see through; its derivative comes from the implicit function theorem (seed 000
App. D): with t = 1 / noise_std and the active adjacency's delta_hat,

    dt/dtheta = -(d delta_hat / d theta) / (d delta_hat / d t),
    d rms/dtheta = (dE/dtheta) / t - (E / t^2) dt/dtheta,      E = ||A C^-1||_F / sqrt(n),  (IFT)

both partial derivatives by torch autograd at the calibrated t.  delta_hat uses the reduced
sampler of :mod:`corrnoise.accounting.montecarlo` (u = L g with L L^T = G = M^T M, M the Lemma 3.2
modes), so the sample g (s x bins standard normals, stratified bins) is fixed and L is
differentiated through the Cholesky factor.  Each optimization step draws its own sample
(:func:`descend`): with one sample for the whole run C over-fits that sample's tail (measured at
n = 2048, eps = 2: 23.7 on the sample, 25.3 on 2^20 fresh samples), with a fresh one per step the
steps are stochastic gradients and the result holds up on new samples (24.5 estimated, 25.1
verified).

Privacy: the Monte Carlo sample used while optimizing is small (App. G.2) and sizes nothing; the
returned C is then calibrated and verified with the full Estimate-Verify-Release of the accounting
layer (:func:`corrnoise.accounting.calibrate`), which alone produces the reported noise.
Lemma 3.2 needs C >= 0 (entrywise): the parameterizations keep it (BLT: alpha > 0, lambda in
(0, 1); Toeplitz: c_0 = 1, c_k = exp(v_k)), and the final strategy is checked again.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import CorrnoiseError, check_int, check_real
from ..progress import resolve_progress

KINDS = ("blt", "banded-toeplitz", "toeplitz")
#: Monte Carlo samples per optimization step (seed 000 App. G.2: a few thousand suffice).
OPT_SAMPLES = 1 << 14
OPT_STEPS = 120
OPT_LR = 0.05
#: largest n: the objective materializes n x n Toeplitz matrices (and autograd keeps a few).
MAX_N = 4096
#: samples of the estimate that chooses between the start point and the optimized C.
SELECT_SAMPLES = 1 << 18


@dataclass
class AmplifiedResult:
    """An amplification-aware strategy with its full (verified) balls-in-bins calibration."""

    strategy: Any
    kind: str
    bins: int
    epsilon: float
    delta: float
    noise_std: float
    noise_multiplier: float
    rms_error: float
    result_kind: str
    samples: int
    seconds: float
    start_estimate: float  # estimated rms_error of the start point (best unamplified solution); not a guarantee
    optimized_estimate: float  # the same estimate for the optimized C
    improved: bool  # whether the optimized C (not the start point) was chosen
    history: list = field(default_factory=list)  # (step, rms on the optimization sample)
    privacy: Any = None

    def to_dict(self) -> dict:
        return {"kind": self.kind, "strategy": self.strategy.label, "n": self.strategy.n, "bins": self.bins,
                "epsilon_target": self.epsilon, "delta": self.delta, "noise_std": self.noise_std,
                "noise_multiplier": self.noise_multiplier, "rms_error": self.rms_error,
                "result_kind": self.result_kind, "samples": self.samples, "seconds": self.seconds,
                "start_rms_estimate": self.start_estimate, "optimized_rms_estimate": self.optimized_estimate,
                "improved": self.improved, "optimization_steps": len(self.history)}


# ---------------------------------------------------------------------------------------------
# The differentiable pieces (torch float64)
# ---------------------------------------------------------------------------------------------
def toeplitz_from_column(c):
    """The lower-triangular Toeplitz matrix with first column c (C[i, j] = c[i - j], i >= j)."""
    import torch

    n = c.shape[0]
    idx = torch.arange(n)
    lag = idx[:, None] - idx[None, :]
    return torch.where(lag >= 0, c[lag.clamp(min=0)], torch.zeros((), dtype=c.dtype))


def prefix_error(c):
    """E = ||A C^-1||_F / sqrt(n) for lower-triangular Toeplitz C with first column c (A the
    all-ones lower triangle): A C^-1 is Toeplitz with first column h = cumsum(C^-1 e_0), and the
    Frobenius norm of a lower-triangular Toeplitz matrix counts h_t (n - t) times."""
    import torch

    n = c.shape[0]
    C = toeplitz_from_column(c)
    e0 = torch.zeros(n, 1, dtype=c.dtype)
    e0[0, 0] = 1.0
    h = torch.cumsum(torch.linalg.solve_triangular(C, e0, upper=False)[:, 0], 0)
    weights = torch.arange(n, 0, -1, dtype=c.dtype)
    return torch.sqrt(torch.sum(weights * h * h) / n)


def modes_gram(c, bins: int):
    """G = M^T M for the Lemma 3.2 modes m_i = sum_j C[:, j bins + i] (C >= 0, so |C| = C)."""
    n = c.shape[0]
    M = toeplitz_from_column(c).reshape(n, n // bins, bins).sum(1)
    G = M.T @ M
    return 0.5 * (G + G.T)


def delta_hat(t, G, g, epsilon: float):
    """(add, remove) Monte Carlo estimates of delta(eps) at noise 1/t on the fixed sample g
    ((Y-add), (Y-remove) of :mod:`corrnoise.accounting.montecarlo`; sample j uses bin j mod b).
    Differentiable in t and G."""
    import torch

    s, b = g.shape
    t = torch.as_tensor(t, dtype=G.dtype)  # a float32 t would silently lose precision
    L = torch.linalg.cholesky(G)
    u = g @ L.T
    diag = torch.diagonal(G)
    ids = torch.arange(s) % b
    A = G - 0.5 * diag[:, None]  # (k, i)
    log_b = math.log(b)
    y_add = torch.logsumexp(t * u + (t * t) * A.T[ids], dim=1) - log_b
    y_rem = log_b - torch.logsumexp(t * u - (t * t) * 0.5 * diag, dim=1)

    def hockey(y):
        return torch.clamp(-torch.expm1(epsilon - y), min=0.0).mean()

    return hockey(y_add), hockey(y_rem)


def _calibrate_t(G, g, epsilon: float, delta: float, guess: float | None, rtol: float = 1e-5) -> float:
    """t = 1 / noise_std solving max(delta_hat_add, delta_hat_rem)(t) = delta on the fixed sample
    (Algorithm 2 on common random numbers: delta_hat grows with t); bisection in log t."""
    import torch

    def excess(t: float) -> float:
        with torch.no_grad():
            a, r = delta_hat(torch.tensor(t, dtype=G.dtype), G, g, epsilon)
        return max(float(a), float(r)) - delta

    if guess is None:  # t of the unamplified noise (sensitivity max ||m_i||), a lower bound on t
        from ..accounting.gaussian import gaussian_mu

        guess = gaussian_mu(epsilon, delta) / math.sqrt(float(torch.max(torch.diagonal(G))))
    lo, hi = guess / 1.25, guess * 1.25
    for _ in range(200):
        if excess(lo) > 0.0:
            lo, hi = lo / 2.0, lo
        elif excess(hi) <= 0.0:
            lo, hi = hi, hi * 2.0
        else:
            break
    else:
        raise CorrnoiseError("epsilon", f"could not bracket the noise for ({epsilon:g}, {delta:g})")
    while hi / lo - 1.0 > rtol:
        mid = math.sqrt(lo * hi)
        if excess(mid) > 0.0:
            hi = mid
        else:
            lo = mid
    return lo  # delta_hat(lo) <= delta: the larger noise end of the bracket


def amplified_rms_and_grad(theta, column: Callable, bins: int, g, epsilon: float, delta: float,
                           guess: float | None = None, rtol: float = 1e-5) -> tuple[float, np.ndarray, float]:
    """(rms, d rms / d theta, t) of (OBJ) on the fixed sample g, the gradient by (IFT)."""
    import torch

    th = torch.as_tensor(theta, dtype=torch.float64).clone().requires_grad_(True)
    c = column(th)
    G = modes_gram(c, bins)
    t_star = _calibrate_t(G.detach(), g, epsilon, delta, guess, rtol)
    t = torch.tensor(t_star, dtype=torch.float64, requires_grad=True)
    d_add, d_rem = delta_hat(t, G, g, epsilon)
    active = d_add if float(d_add.detach()) >= float(d_rem.detach()) else d_rem
    dd_theta, dd_t = torch.autograd.grad(active, (th, t), retain_graph=True)
    E = prefix_error(c)
    (dE,) = torch.autograd.grad(E, th)
    if float(dd_t) <= 0.0:  # no sample is active (the estimate is flat): no amplification signal
        dt = torch.zeros_like(dd_theta)
    else:
        dt = -dd_theta / dd_t
    e_val = float(E.detach())
    rms = e_val / t_star
    grad = dE / t_star - (e_val / t_star ** 2) * dt
    return rms, grad.detach().numpy(), t_star


# ---------------------------------------------------------------------------------------------
# Parameterizations (C >= 0 by construction) and their start points
# ---------------------------------------------------------------------------------------------
def _blt_column(n: int, d: int) -> Callable:
    """theta = (log alpha, logit lambda): c_0 = 1, c_t = sum_i alpha_i lambda_i^(t-1) (tutorial Eq. 2.16)."""
    import torch

    def column(theta):
        alpha = torch.exp(theta[:d])
        lam = torch.sigmoid(theta[d:])
        k = torch.arange(n - 1, dtype=theta.dtype)
        tail = (alpha[None, :] * torch.exp(k[:, None] * torch.log(lam)[None, :])).sum(1)
        return torch.cat([torch.ones(1, dtype=theta.dtype), tail])
    return column


def _toeplitz_column(n: int, bands: int) -> Callable:
    """theta = log c_1..c_{bands-1}: c_0 = 1, c_k = exp(theta_k) for k < bands, 0 beyond."""
    import torch

    def column(theta):
        return torch.cat([torch.ones(1, dtype=theta.dtype), torch.exp(theta),
                          torch.zeros(n - bands, dtype=theta.dtype)])
    return column


def _start(kind: str, n: int, bins: int, bands: int | None, buffers: int | None):
    """(strategy, theta0, column, to_strategy): the best unamplified solution of the family for
    cyclic participation (n / bins epochs, bins steps apart) as the start point."""
    from ..optimize import optimize_banded_toeplitz, optimize_blt
    from ..strategies import BLT, Toeplitz

    part = f"cyclic:{n // bins}:{bins}"
    if kind == "blt":
        strat = optimize_blt(n, buffers=buffers, participation=part)
        d = len(strat.alpha)
        theta0 = np.concatenate([np.log(strat.alpha), np.log(strat.lam) - np.log1p(-strat.lam)])

        def to_strategy(theta):
            theta = np.asarray(theta, dtype=float)
            return BLT(np.exp(theta[:d]), 1.0 / (1.0 + np.exp(-theta[d:])), n)
        return strat, theta0, _blt_column(n, d), to_strategy
    k = n if kind == "toeplitz" else bands
    strat = optimize_banded_toeplitz(n, k, participation=part)
    c = np.asarray(strat.coefficients, dtype=float)[:k]
    c = c / c[0]
    # the unamplified optimum may have (tiny) coefficients <= 0, which Lemma 3.2 cannot account;
    # the start is that optimum with its coefficients floored at 1e-6 (C > 0)
    theta0 = np.log(np.maximum(c[1:], 1e-6))

    def to_strategy_t(theta):
        col = np.concatenate([[1.0], np.exp(np.asarray(theta, dtype=float))])
        return Toeplitz(col, n)
    return to_strategy_t(theta0), theta0, _toeplitz_column(n, k), to_strategy_t


def _estimate_rms(strategy, bins: int, epsilon: float, delta: float, seed: int) -> float:
    """An *estimate* of the amplified rms_error (Algorithm 2 on SELECT_SAMPLES, no verification):
    used only to choose between candidates, never reported as a guarantee."""
    from ..accounting.montecarlo import calibrate_noise_std
    from ..losses import error_summary

    cal = calibrate_noise_std(strategy.matrix(), bins, epsilon, delta, samples=SELECT_SAMPLES, seed=seed)
    return float(cal.noise_std) * float(error_summary(strategy)[0])


def _final(strategy, bins: int, epsilon: float, delta: float, samples: int | None, progress: Any = None):
    """The full balls-in-bins guarantee (Estimate-Verify-Release) and its rms_error."""
    from ..accounting import calibrate, parse_batching
    from ..losses import error_summary

    if not strategy.is_nonnegative():
        raise CorrnoiseError("C", "has a negative entry; Lemma 3.2 (balls-in-bins) needs C >= 0")
    from .constants import FINAL_MC_SAMPLES

    res = calibrate(strategy, parse_batching(f"balls-in-bins:{bins}"), epsilon=epsilon, delta=delta,
                    samples=samples or FINAL_MC_SAMPLES, progress=progress)
    mean, _ = error_summary(strategy)
    return res, float(res.noise_std) * float(mean)


def descend(theta, column: Callable, bins: int, epsilon: float, delta: float, steps: int, samples: int, lr: float,
            seed: int = 0, progress: Callable[[int, float], None] | None = None) -> tuple[np.ndarray, list]:
    """Adam on the (IFT) gradient with a *fresh* sample of ``samples`` per step (chunk k of
    ``seed``): one fixed small sample is over-fitted -- C learns that sample's tail, and its rms
    on a large sample comes out several percent above what the fixed sample promised -- while
    fresh samples make each step an unbiased-in-expectation stochastic gradient.  Returns the
    Polyak average of the second half of the iterates and the per-step (step, sample rms)."""
    import torch

    m = np.zeros_like(theta)
    v = np.zeros_like(theta)
    avg, count, guess, history = np.zeros_like(theta), 0, None, []
    b = bins
    for k in range(steps):
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, k]).generate_state(1)[0]))
        g = torch.randn(max(b, samples - samples % b), b, generator=gen, dtype=torch.float64)
        rms, grad, guess = amplified_rms_and_grad(theta, column, b, g, epsilon, delta, guess)
        history.append((k, rms))
        if progress is not None:
            progress(k, rms)
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
        mh, vh = m / (1 - 0.9 ** (k + 1)), v / (1 - 0.999 ** (k + 1))
        theta = theta - lr * mh / (np.sqrt(vh) + 1e-12)
        if k >= steps // 2:
            avg += theta
            count += 1
    return (avg / count if count else theta), history


def optimize_amplified(kind: str, n: int, bins: int, epsilon: float, delta: float, *, bands: int | None = None,
                       buffers: int | None = None, steps: int = OPT_STEPS, samples: int = OPT_SAMPLES,
                       lr: float = OPT_LR, final_samples: int | None = None, seed: int = 0,
                       progress: Callable[[int, float], None] | None = None,
                       report: Any = None) -> AmplifiedResult:
    """Minimize (OBJ) over ``kind`` in {blt, banded-toeplitz, toeplitz} for balls-in-bins with
    ``bins`` bins over n steps (n / bins epochs), from the family's best unamplified solution, by
    Adam on the (IFT) gradient, each step on its own fixed sample of ``samples`` (seed 000 App. D,
    G.2; :func:`descend`).  The start point and the optimized C are compared by a large-sample
    estimate on common random numbers (:data:`SELECT_SAMPLES`; estimates only choose), and the
    chosen one alone gets the full verified accounting, whose noise is the one reported (so the
    result is never worse than the start, up to the selection estimate's error).

    ``progress(step, sample_rms)`` hears each descent step; ``report`` (a
    :data:`corrnoise.progress.Progress`, True for lines on stderr) hears every phase: the start
    point, the descent (step k of ``steps``), the two selection estimates and the verified
    accounting's own phases (a user probe met minutes of silence in the piped command line)."""
    kind = str(kind).strip().lower()
    if kind not in KINDS:
        raise CorrnoiseError("kind", f"expected one of {', '.join(KINDS)}, got {kind!r}")
    n = check_int("n", n, minimum=2, maximum=MAX_N)
    bins = check_int("bins", bins, minimum=1)
    if n % bins:
        raise CorrnoiseError("bins", f"must divide n = {n} (balls-in-bins runs n / bins whole epochs), got {bins}")
    epsilon = check_real("epsilon", epsilon, low=0.0, low_open=True)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    if kind == "banded-toeplitz":
        bands = check_int("bands", 2 if bands is None else bands, minimum=2, maximum=n)
    steps = check_int("steps", steps, minimum=0)
    samples = check_int("samples", samples, minimum=bins)
    t0 = time.perf_counter()
    tell = resolve_progress(report)
    tell("amplified start (the unamplified optimum)", 0, 1)
    start, theta, column, to_strategy = _start(kind, n, bins, bands, buffers)
    tell("amplified start (the unamplified optimum)", 1, 1)

    def on_step(k: int, rms: float) -> None:
        tell(f"amplified descent: sample rms_error {rms:.6g}", k + 1, steps)
        if progress is not None:
            progress(k, rms)

    theta, history = descend(theta, column, bins, epsilon, delta, steps, samples, lr, seed, on_step)
    optimized = to_strategy(theta)
    estimates = []
    for i, candidate in enumerate((start, optimized)):
        tell("amplified selection (two estimates)", i, 2)
        estimates.append(_estimate_rms(candidate, bins, epsilon, delta, seed))
    tell("amplified selection (two estimates)", 2, 2)
    est_start, est_opt = estimates
    best = optimized if est_opt < est_start else start
    res, rms = _final(best, bins, epsilon, delta, final_samples, tell)
    return AmplifiedResult(best, kind, bins, epsilon, delta, float(res.noise_std), float(res.noise_multiplier),
                           rms, res.kind, int(res.extras.get("samples", final_samples or 0)),
                           time.perf_counter() - t0, est_start, est_opt, best is optimized, history, res)
