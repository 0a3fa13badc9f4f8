"""A second amplified guarantee for a non-negative C under Poisson (or block-cyclic) sampling:
Renyi divergence of the participation mixture by joint convexity (issue #12).

MMCC (seed 001) pays, for every pair of rounds, for a delta_1-rare posterior of the adversary
about a participation; at low noise that dominates (toeplitz-sqrt, n = 512, p = 1/16, noise
multiplier 4: MMCC 205 against the p~ = p lower bound 23.6). This analysis pays only for the
*number and placement* of the participations, which is where Poisson sampling amplifies a matrix
mechanism whose columns are strongly correlated:

1. Fix the example's participation pattern b in {0,1}^n (and the other examples' batches, which
   are the same random variable in both worlds). Outputs with and without the example are then
   the Gaussian mechanism C F + Z whose rows differ by C (b o g), g_j the example's clipped
   contributions; its l2 sensitivity is sup_g ||C (b o g)||_F = ||C b||_2 for C >= 0 (triangle
   inequality, attained by equal g_j). Because C is lower-triangular, row i of C F depends only on
   the states up to round i, so tutorial Theorem 1.11 (adaptive vs. non-adaptive Gaussian
   mechanism) makes the adaptive run mu_b-GDP with mu_b = ||C b|| / nu. mu-GDP implies
   D_alpha <= alpha mu^2 / 2 in both directions for every real alpha > 1: by Blackwell's theorem
   (Dong, Roth & Su 2022, Thm 2.10) the pair is a post-processing of N(0, 1) vs N(mu, 1).
2. With the example, the output law is the mixture Q = E_b Q_b over b with i.i.d. Bernoulli(p)
   entries (Poisson sampling, independent of everything else); without it, P = Q_0. The Renyi
   moments int q^alpha p^(1-alpha) and int p^alpha q^(1-alpha) are convex in q (x^alpha and
   x^(1-alpha) are convex for alpha > 1; jointly convex in (q, p), which also averages over the
   other examples' batches), so by Jensen, in both directions,

       exp((alpha - 1) D_alpha) <= E_b exp(alpha (alpha - 1) ||C b||^2 / (2 nu^2))
                                 = E_b exp(t b^T G b),   G = C^T C,  t = alpha (alpha - 1) / (2 nu^2).

   (:func:`mixture_rdp`.)  For block-cyclic sampling b lives on the rounds of the example's
   block (its columns of C), and the worst block is taken.
3. The moment E_b exp(t b^T G b) is a 2^n sum; :func:`quadratic_form_log_mgf_bound` bounds it
   from above in closed form (proof there). The (eps, delta) conversion of the Renyi bounds is
   dp_accounting's ``compute_epsilon`` / ``compute_delta`` (Canonne, Kamath & Steinke 2020,
   Prop. 12), applied to each direction alike.

Every step is an upper bound, so the result is an (eps, delta)-DP guarantee for the same
mechanism and delta as MMCC's; :func:`.driver.mmcc_epsilon` reports the smallest of the three
(MMCC, this, the unamplified Gaussian). The same preconditions as MMCC's: C non-negative and
lower-triangular (checked by the driver), Poisson or block-cyclic sampling.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import minimize_scalar

from ...errors import CorrnoiseError

__all__ = ["bernoulli_subgaussian_variance", "quadratic_form_log_mgf_bound", "mixture_rdp", "mixture_rdp_epsilon",
           "mixture_rdp_delta", "RENYI_ORDERS"]

#: Orders alpha searched by the conversion (dp_accounting uses the Prop. 12 bound from 1.01 up).
RENYI_ORDERS = tuple(float(a) for a in 1.0 + np.geomspace(0.0101, 255.0, 240))

#: Relative and absolute padding of every log-moment bound against float64 rounding.
_ROUNDING = (1e-9, 1e-12)


def bernoulli_subgaussian_variance(p: float) -> float:
    """The optimal sub-Gaussian variance proxy of a centred Bernoulli(p), xi = b - p:
    log E exp(lambda xi) <= s^2 lambda^2 / 2 for every real lambda with
    s^2 = (1 - 2p) / (2 log((1 - p) / p)), and s^2 = 1/4 at p = 1/2 (Kearns & Saul 1998;
    Buldygin & Moskvichova 2013, Thm 2.1). tests/test_mmcc_renyi.py checks it on a grid."""
    if not 0.0 < p < 1.0:
        raise CorrnoiseError("p", f"must be in (0, 1), got {p!r}")
    if abs(p - 0.5) < 1e-12:
        return 0.25
    # log((1 - p) / p) without cancellation: near 1/2 as log1p((1 - 2p) / p); for small p as
    # log1p(-p) - log(p), finite even where (1 - p) / p overflows
    log_odds = math.log1p((1.0 - 2.0 * p) / p) if p >= 0.25 else math.log1p(-p) - math.log(p)
    return (1.0 - 2.0 * p) / (2.0 * log_odds)


def _bernoulli_centred_cgf(p: float, lam: np.ndarray) -> np.ndarray:
    """log E exp(lam (b - p)), b ~ Bernoulli(p), exactly (log-sum-exp form)."""
    return np.logaddexp(math.log1p(-p), math.log(p) + lam) - p * lam


def quadratic_form_log_mgf_bound(gram: np.ndarray, p: float, t: float, *, eigenvalues: np.ndarray | None = None) -> float:
    """An upper bound on log E exp(t b^T G b), b with i.i.d. Bernoulli(p) entries, p in (0, 1]
    (at p = 1 the value itself), G = C^T C positive semi-definite with non-negative entries,
    t >= 0 (``math.inf`` when none applies).

    Proof. Write b = p 1 + xi (xi centred, independent). Then
    b^T G b = p^2 1^T G 1 + 2 p (G 1)^T xi + xi^T G xi, and by Hoelder with 1/r + 1/r' = 1,

        E e^{t b^T G b} <= e^{t p^2 1^T G 1} (E e^{2 r t p (G 1)^T xi})^{1/r} (E e^{r' t xi^T G xi})^{1/r'}.

    The middle factor is a product over coordinates, computed exactly. For the last, with
    tau = r' t and G = C^T C, e^{tau ||C xi||^2} = E_w e^{sqrt(2 tau) w^T C xi} for w ~ N(0, I)
    (Gaussian moment generating function); exchanging the expectations (Tonelli) and bounding each
    coordinate's centred Bernoulli MGF by its sub-Gaussian proxy s^2
    (:func:`bernoulli_subgaussian_variance`),

        E e^{tau xi^T G xi} <= E_w exp(tau s^2 ||C^T w||^2) = prod_k (1 - 2 tau s^2 lambda_k)^{-1/2},

    lambda_k the eigenvalues of C C^T (those of G), finite iff 2 tau s^2 max_k lambda_k < 1. Any
    r > 1 gives a valid bound; r is chosen numerically (a bounded scalar search), and the result is
    padded against float64 rounding.
    """
    if t < 0.0 or not math.isfinite(t):
        raise CorrnoiseError("t", f"must be finite and >= 0, got {t!r}")
    gram = np.asarray(gram, dtype=np.float64)
    if t == 0.0:
        return 0.0
    rel, absolute = _ROUNDING
    if p >= 1.0:  # every round participates: b = 1, no expectation left
        value = t * float(gram.sum())
        return value + abs(value) * rel + absolute
    lam = np.linalg.eigvalsh(gram) if eigenvalues is None else np.asarray(eigenvalues, dtype=np.float64)
    lam = np.clip(lam, 0.0, None)
    lam_max = float(lam.max()) if lam.size else 0.0
    row = gram.sum(axis=1)
    mean_part = t * p * p * float(row.sum())
    s2 = bernoulli_subgaussian_variance(p)
    # r' < r'_max keeps the Gaussian integral finite; r' = r / (r - 1) > 1 needs r'_max > 1
    rp_max = math.inf if lam_max == 0.0 else 1.0 / (2.0 * t * s2 * lam_max)
    if rp_max <= 1.0:
        return math.inf

    def bound(rp: float) -> float:
        r = rp / (rp - 1.0)
        linear = float(_bernoulli_centred_cgf(p, 2.0 * r * t * p * row).sum()) / r
        quad = float(-np.log1p(-2.0 * rp * t * s2 * lam).sum()) / (2.0 * rp)
        return mean_part + linear + quad

    lo = 1.0 + 1e-9
    hi = min(rp_max * (1.0 - 1e-9), 1e6)
    if hi <= lo:
        return math.inf
    # search r' in (lo, hi) through a logistic map of the real line (the bound is smooth in r')
    res = minimize_scalar(lambda z: bound(lo + (hi - lo) / (1.0 + math.exp(-z))), bounds=(-30.0, 30.0),
                          method="bounded", options={"xatol": 1e-6})
    value = min(float(res.fun), bound(lo + (hi - lo) / 2.0))
    if not math.isfinite(value):
        return math.inf
    return value + abs(value) * rel + absolute


def mixture_rdp(columns: np.ndarray, p: float, noise_std: float, orders=RENYI_ORDERS) -> np.ndarray:
    """Upper bounds on the Renyi divergences (both directions) at ``orders`` of the Poisson
    mixture over participations in the given non-negative ``columns`` of C (module docstring,
    steps 1-2): log E_b exp(alpha (alpha - 1) ||C b||^2 / (2 nu^2)) / (alpha - 1)."""
    cols = np.asarray(columns, dtype=np.float64)
    gram = cols.T @ cols
    lam = np.linalg.eigvalsh(gram)
    out = []
    for a in orders:
        t = a * (a - 1.0) / 2.0 / noise_std / noise_std  # no noise_std**2: it under/overflows first
        out.append(quadratic_form_log_mgf_bound(gram, p, t, eigenvalues=lam) / (a - 1.0) if math.isfinite(t)
                   else math.inf)
    return np.asarray(out)


def _block_columns(cmat: np.ndarray, blocks: int) -> list[np.ndarray]:
    """The columns an example can touch: all of them (Poisson), or one block's rounds."""
    return [cmat[:, off::blocks] for off in range(min(blocks, cmat.shape[1]))]


def mixture_rdp_epsilon(cmat: np.ndarray, p: float, noise_std: float, delta: float, *, blocks: int = 1,
                        orders=RENYI_ORDERS) -> tuple[float, float]:
    """(epsilon, best order) of the Renyi mixture bound at ``delta``; the worst block."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    worst, order = 0.0, float("nan")
    for cols in _block_columns(cmat, blocks):
        rdp = mixture_rdp(cols, p, noise_std, orders)
        keep = np.isfinite(rdp)
        if not keep.any():
            return math.inf, float("nan")
        eps, a = compute_epsilon(np.asarray(orders)[keep], rdp[keep], delta)
        if eps >= worst:
            worst, order = float(eps), float(a)
    return worst, order


def mixture_rdp_delta(cmat: np.ndarray, p: float, noise_std: float, epsilon: float, *, blocks: int = 1,
                      orders=RENYI_ORDERS) -> float:
    """delta(epsilon) of the Renyi mixture bound; the worst block."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_delta

    worst = 0.0
    for cols in _block_columns(cmat, blocks):
        rdp = mixture_rdp(cols, p, noise_std, orders)
        keep = np.isfinite(rdp)
        if not keep.any():
            return 1.0
        d, _ = compute_delta(np.asarray(orders)[keep], rdp[keep], epsilon)
        worst = max(worst, float(d))
    return min(worst, 1.0)
