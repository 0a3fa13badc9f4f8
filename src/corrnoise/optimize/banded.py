"""General (non-Toeplitz) column-normalized banded strategies, optimized without n x n matrices.

Parameterization (seed 002 Sec. 3.1): a parameter matrix P (n x b) with P[j, i] = C~[j + i, j];
C is C~ with every column scaled to unit norm, so ||C||_col = 1 by construction and, for
cyclic / min-sep participation with bands <= b, sens(C, Pi) = sqrt(k) whatever the signs
(tutorial Lemma 3.16(b)). The objective is the per-query error ||B[t]||^2 of B = A C^{-1}
(seed 002 Alg. 3 / Alg. 5, App. D.2), aggregated by a sum (RMS) or a smoothed max.

Computing it in O(n b^2) (instead of Alg. 3's row-by-row O(n^2 b)): the workloads have banded
inverses, so L = C A^{-1} is lower-triangular with bandwidth w = b - 1 + (taps of A^{-1}) - 1, and
B = L^{-1}. Cut L into s x s blocks (s >= w) -- it is then block lower-bidiagonal with diagonal
blocks D_k and sub-diagonal blocks E_k. Block row k of L B = I gives
B_k = D_k^{-1} (I_k - E_k B_{k-1}), and because B is lower-triangular I_k B_{k-1}^T = 0, so the
diagonal blocks of B B^T obey

    G_0 = D_0^{-1} D_0^{-T},    G_k = P_k G_{k-1} P_k^T + D_k^{-1} D_k^{-T},   P_k = D_k^{-1} E_k,

and ||B[t]||^2 = diag(G_k). The D_k^{-1} are one batched triangular solve; only the short
recurrence over n / s blocks is sequential. Gradients come from torch autograd (seed 002 App. C
differentiates its Alg. 3 with JAX the same way).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from ..errors import CorrnoiseError
from ..linalg.banded import gram_recurrence
from ..strategies import Banded
from ..workloads import Workload
from .common import Progress, blas_threads, check_band, check_bands, check_problem, lbfgs, report_progress
from .dense import sqrt_coefficients

#: Smallest block size of the recurrence (fewer sequential steps for small bands).
MIN_BLOCK = 16


class _GramDiagonals(torch.autograd.Function):
    """diag(G_k) for the block recurrence, with a hand-written adjoint: for
    F = sum_k <diag(U_k), G_k>, Lambda_{K-1} = U_{K-1}, Lambda_{k-1} = U_{k-1} + P_k^T Lambda_k P_k,
    dF/dQ_k = Lambda_k and dF/dP_k = 2 Lambda_k P_k G_{k-1}. (Autograd through the loop would
    scatter each block's gradient into a full (K, s, s) buffer: O(K^2 s^2).)"""

    @staticmethod
    def forward(ctx, pk, qk):
        pn, qn = pk.detach().numpy(), qk.detach().numpy()
        g = gram_recurrence(pn, qn)
        ctx.save_for_backward(pk, qk)
        ctx.g = g
        return torch.from_numpy(np.diagonal(g, axis1=1, axis2=2).copy())

    @staticmethod
    def backward(ctx, grad_out):
        pk, _ = ctx.saved_tensors
        pn, g = pk.detach().numpy(), ctx.g
        u = grad_out.detach().numpy()
        K, s, _ = g.shape
        gp = np.zeros_like(g)
        gq = np.empty_like(g)
        lam = np.diag(u[K - 1])
        for k in range(K - 1, 0, -1):
            gq[k] = lam
            gp[k] = 2.0 * (lam @ pn[k] @ g[k - 1])
            lam = pn[k].T @ lam @ pn[k]
            lam[np.diag_indices(s)] += u[k - 1]
        gq[0] = lam
        return torch.from_numpy(gp), torch.from_numpy(gq)


class BandedObjective:
    """Per-query squared errors of the column-normalized banded strategy given by P (n x b)."""

    def __init__(self, n: int, bands: int, workload: Workload):
        self.n, self.b = n, bands
        taps = np.asarray(workload.inverse_coefficients, dtype=np.float64)
        self.taps = taps
        w = min(bands - 1 + taps.size - 1, n - 1)
        s = max(w, MIN_BLOCK, 1)
        s = min(s, n)
        self.s = s
        self.K = -(-n // s)
        self.N = self.K * s
        # entries (row j + i, column j) of L, i = 0..w, inside the n x n matrix
        j, i = np.meshgrid(np.arange(n), np.arange(w + 1), indexing="ij")
        keep = (j + i) < n
        j, i = j[keep], i[keep]
        self.ji = (torch.from_numpy(j), torch.from_numpy(i))
        row = j + i
        kb, kc = row // s, j // s
        diag = kb == kc
        self.idx_diag = tuple(torch.from_numpy(v) for v in (kb[diag], row[diag] % s, j[diag] % s))
        self.idx_off = tuple(torch.from_numpy(v) for v in (kb[~diag], row[~diag] % s, j[~diag] % s))
        self.sel_diag = torch.from_numpy(np.flatnonzero(diag))
        self.sel_off = torch.from_numpy(np.flatnonzero(~diag))
        self.w = w
        pad = torch.zeros(self.K, s, s, dtype=torch.float64)
        for t in range(n, self.N):  # identity rows/columns beyond n (do not touch rows < n)
            pad[t // s, t % s, t % s] = 1.0
        self.pad = pad
        jj, ii = np.meshgrid(np.arange(n), np.arange(bands), indexing="ij")
        self.mask = torch.from_numpy(((jj + ii) < n).astype(np.float64))

    def normalized(self, p: torch.Tensor) -> torch.Tensor:
        """Columns of C~ scaled to unit norm: rows of P (masked to entries inside the matrix)."""
        p = p * self.mask
        return p / torch.linalg.vector_norm(p, dim=1, keepdim=True)

    def per_query(self, p: torch.Tensor) -> torch.Tensor:
        """||B[t]||^2 for t = 0..n-1 (B = A C^{-1}), O(n s^2) work."""
        n, b, w, s, K = self.n, self.b, self.w, self.s, self.K
        q = self.normalized(p)
        # L band: Lb[j, i] = L[j + i, j] = sum_m a_m C[j + i, j + m] = sum_m a_m Q[j + m, i - m]
        qpad = torch.cat([q, q.new_zeros(self.taps.size, b)], dim=0)
        lb = q.new_zeros(n, w + 1)
        for m, a in enumerate(self.taps):
            width = min(b, w + 1 - m)
            if width <= 0 or a == 0.0:
                continue
            lb = lb + torch.nn.functional.pad(a * qpad[m : m + n, :width], (m, w + 1 - m - width))
        vals = lb[self.ji]
        d = self.pad.index_put(self.idx_diag, vals[self.sel_diag])
        e = torch.zeros_like(self.pad).index_put(self.idx_off, vals[self.sel_off])
        eye = torch.eye(s, dtype=torch.float64).expand(K, s, s)
        dinv = torch.linalg.solve_triangular(d, eye, upper=False)
        pk = dinv @ e
        qk = dinv @ dinv.transpose(1, 2)
        return _GramDiagonals.apply(pk, qk).reshape(-1)[:n]

    def band(self, p: np.ndarray) -> np.ndarray:
        """band[t, i] = C[t, t - i] of the normalized strategy (``Banded`` storage)."""
        q = self.normalized(torch.as_tensor(p, dtype=torch.float64)).numpy()
        n, b = q.shape
        band = np.zeros((n, b))
        for i in range(b):
            band[i:, i] = q[: n - i, i]
        return band


def initial_parameters(n: int, bands: int, workload: Workload, schema=None, objective: str = "rms",
                       toeplitz: bool = True) -> np.ndarray:
    """Every column starts from the same coefficients: the optimized banded Toeplitz strategy
    (seed 002 Sec. 3.2, O(n b) per step, so cheap) when ``toeplitz`` and it is available, else
    the banded square root (tutorial Thm 2.13: the first b coefficients of A^{1/2})."""
    c = sqrt_coefficients(workload, bands)
    if toeplitz and bands > 1:
        try:
            from .toeplitz import optimize_banded_toeplitz

            st = optimize_banded_toeplitz(n, bands, participation=schema or "single", objective=objective,
                                          workload=workload)
            ct = np.asarray(getattr(st, "base", st).toeplitz_coefficients, dtype=np.float64)[:bands]
            if ct.shape == (bands,) and np.all(np.isfinite(ct)) and ct[0] > 0:
                c = ct
        except (ImportError, CorrnoiseError, AttributeError, TypeError, ValueError):
            pass  # keep the banded square root
    return np.tile(c, (n, 1))


def optimize_banded(
    n: int,
    bands: int,
    participation="single",
    objective: str = "rms",
    workload=None,
    max_iter: int = 1000,
    rel_tol: float = 1e-9,
    progress: Progress | None = None,
    info: dict | None = None,
    initial: np.ndarray | None = None,
    threads: int | None = 1,
) -> Banded:
    """Optimal column-normalized ``bands``-banded strategy for ``n`` steps (seed 002 Sec. 3.1).

    ``objective='rms'`` minimizes sum_t ||B[t]||^2 (the squared RMS loss up to sens^2 / n);
    ``'max'`` minimizes a log-sum-exp smoothing of max_t ||B[t]||^2 with a decreasing
    temperature (an approximate minimizer; its loss is recomputed exactly by the caller).
    Stops when the relative decrease stays below ``rel_tol`` for 5 iterations or after
    ``max_iter`` L-BFGS iterations. ``info`` receives iterations, evaluations, reason, seconds.
    ``threads``: torch / BLAS threads while optimizing (None keeps the defaults).
    """
    with blas_threads(threads):
        return _optimize_banded(n, bands, participation, objective, workload, max_iter, rel_tol,
                                progress, info, initial)


def _optimize_banded(n, bands, participation, objective, workload, max_iter, rel_tol, progress, info,
                     initial) -> Banded:
    t0 = time.perf_counter()
    n, schema, objective, workload = check_problem(n, participation, objective, workload)
    bands = check_bands(bands, n, schema)
    obj = BandedObjective(n, bands, workload)
    if initial is None:
        report_progress(progress, 0.0, f"banded n={n} b={bands}: banded Toeplitz warm start")
        p0 = initial_parameters(n, bands, workload, schema, objective)
    else:
        p0 = np.asarray(initial, dtype=np.float64)
    if p0.shape != (n, bands):
        raise CorrnoiseError("initial", f"must have shape ({n}, {bands}), got {p0.shape}")
    shape = p0.shape
    counters = {"iterations": 0, "evaluations": 0}

    def fun(x: np.ndarray, tau: float | None):
        if np.any(x.reshape(shape)[:, 0] <= 0.0):  # stay in the component with a positive diagonal
            return math.inf, np.zeros_like(x)
        p = torch.tensor(x.reshape(shape), dtype=torch.float64, requires_grad=True)
        e = obj.per_query(p)
        f = e.sum() if tau is None else tau * torch.logsumexp(e / tau, dim=0)
        if not torch.isfinite(f) or torch.any(e <= 0):
            return math.inf, np.zeros_like(x)
        f.backward()
        grad = p.grad.numpy().reshape(-1)
        if not np.all(np.isfinite(grad)):
            return math.inf, np.zeros_like(x)
        return float(f.detach()), grad.copy()

    def stop(x, f, it):
        counters["iterations"] += 1
        if it % 10 == 0:
            report_progress(progress, it / max_iter, f"banded n={n} b={bands}: iteration {it}")
        return False

    report_progress(progress, 0.0, f"banded n={n} b={bands}")
    with torch.no_grad():
        e0 = obj.per_query(torch.as_tensor(p0))
    if objective == "rms":
        taus = [None]
    else:
        taus = [eta * float(e0.max()) for eta in (1e-2, 1e-3, 1e-4, 1e-5)]
    x = p0.reshape(-1).copy()
    reason = "max_iter"
    for tau in taus:
        res = lbfgs(lambda z, tau=tau: fun(z, tau), x, max_iter=max_iter, rel_tol=rel_tol, stop=stop)
        x = res.x
        counters["evaluations"] += res.evaluations
        reason = res.reason
    band = check_band(obj.band(x.reshape(shape)))
    report_progress(progress, 1.0, f"banded n={n} b={bands}: done")
    if info is not None:
        info.update(counters, reason=reason, seconds=time.perf_counter() - t0)
    return Banded(band)





def sweep_bands(
    n: int,
    bands,
    kind: str = "banded",
    participation="single",
    objective: str = "rms",
    workload=None,
    progress: Progress | None = None,
) -> dict:
    """Optimize one strategy per number of bands and return ``{b: LossReport}`` (losses
    recomputed by :func:`corrnoise.losses.loss_report`), to pick b as in seed 002 Sec. 4.
    ``kind``: ``banded`` (this module) or ``banded-toeplitz`` (column-normalized afterwards)."""
    from ..losses import loss_report

    n, schema, objective, workload = check_problem(n, participation, objective, workload)
    if kind not in ("banded", "banded-toeplitz"):
        raise CorrnoiseError("kind", f"must be banded or banded-toeplitz for a sweep, got {kind!r}")
    try:
        values = sorted({int(b) for b in bands})
    except (TypeError, ValueError):
        raise CorrnoiseError("bands", f"must be a list of integers, got {bands!r}") from None
    if not values:
        raise CorrnoiseError("bands", "must list at least one number of bands")
    for b in values:
        check_bands(b, n, schema)
    out = {}
    for idx, b in enumerate(values):
        report_progress(progress, idx / len(values), f"sweep: {kind} b={b}")
        if kind == "banded":
            strategy = optimize_banded(n, b, schema, objective, workload)
        else:
            from .toeplitz import optimize_banded_toeplitz

            strategy = optimize_banded_toeplitz(n, b, schema, objective, workload, column_normalize=True)
        out[b] = loss_report(strategy, schema, workload)
    report_progress(progress, 1.0, "sweep: done")
    return out

__all__ = ["BandedObjective", "gram_recurrence", "initial_parameters", "optimize_banded", "sweep_bands"]
