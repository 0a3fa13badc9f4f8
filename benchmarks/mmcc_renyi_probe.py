"""Probe of one candidate for a tighter Poisson analysis of a general C than MMCC: integer-order
Renyi moments (issue #12 research note; a diagnostic, nothing here is a guarantee).

For add/remove adjacency the dominating pair of the Poisson-sampled matrix mechanism is
P = N(0, nu^2 I) and Q = E_b N(C b, nu^2 I), b with i.i.d. Bernoulli(p) entries (seed 001 Sec. 3).
For an integer order alpha >= 2, expanding (dQ/dP)^alpha as a product of alpha independent copies
and integrating y ~ P in closed form (E exp(<u, y>) / nu^2 = exp(||u||^2 / (2 nu^2))) gives

    M_alpha = E_P[(dQ/dP)^alpha] = E_{b^1..b^alpha} exp( sum_{k<l} (b^k)^T C^T C b^l / nu^2 ),

(`renyi_moment_mc` estimates it: alpha - 1 copies sampled, the last integrated exactly,
prod_j (1 - p + p exp((G s)_j / nu^2)) with s the sum of the sampled copies). For C = I it is
Mironov et al.'s sampled Gaussian moment, checked here against dp_accounting. D_alpha(Q || P) =
log(M_alpha) / (alpha - 1), converted to (eps, delta) by dp_accounting's `compute_epsilon`.

Two findings (benchmarks/RESULTS.md, issue #12 section):

* the Monte Carlo *estimate* (one direction only, Q || P) lands far below MMCC at sigma 8. The
  moment is heavy-tailed in the participation counts, so a plain estimate tends to err low; the
  estimate is repeated with the sampled copies drawn at a tilted rate p' = t p and reweighted
  (importance sampling, same expectation): where the tilts agree the estimate is credible (sigma 8),
  where it grows with the tilt it is not (sigma 4);
* a *rigorous lower bound* on the route: keeping only the all-participation term,
  M_alpha >= p^(alpha n) exp(alpha (alpha - 1) ||C 1||^2 / (2 nu^2)), i.e.
  D_alpha >= alpha mu^2 / 2 - alpha n log(1/p) / (alpha - 1) with mu = ||C 1|| / nu the unamplified
  Gaussian mechanism's mu. At sigma 4 this alone puts every integer order's epsilon far above 5x the
  p~ = p lower bound: the Renyi route cannot meet the sigma-4 target, whatever bounds M_alpha.

    PYTHONPATH=src .venv/bin/python benchmarks/mmcc_renyi_probe.py [--samples 6000] [--sigmas 16 8 4]
"""

from __future__ import annotations

import argparse

import numpy as np
from dp_accounting.rdp.rdp_privacy_accountant import _compute_rdp_poisson_subsampled_gaussian, compute_epsilon
from scipy.special import logsumexp

from corrnoise.strategies import parse_strategy

ORDERS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)


def renyi_moment_mc(gram: np.ndarray, p: float, nu: float, alpha: int, samples: int, rng,
                    batch: int = 1000, tilt: float = 1.0) -> float:
    """Monte Carlo estimate of log M_alpha (module docstring) for Gram matrix C^T C: an estimate.

    The alpha - 1 sampled copies are drawn at rate ``tilt * p`` and reweighted by their likelihood
    ratio (p/p')^K ((1-p)/(1-p'))^(n-K), K a copy's participations."""
    n = gram.shape[0]
    pt = tilt * p
    logs = []
    for start in range(0, samples, batch):
        m = min(batch, samples - start)
        b = (rng.random((alpha - 1, m, n)) < pt).astype(float)
        k = b.sum(2)
        weight = (k * np.log(p / pt) + (n - k) * np.log((1 - p) / (1 - pt))).sum(0)
        s = b.sum(0)
        gs = s @ gram
        own = np.einsum("kbi,kbi->b", (b.reshape(-1, n) @ gram).reshape(b.shape), b)
        pairs = (np.einsum("bi,bi->b", s, gs) - own) / (2 * nu**2)  # sum over the sampled pairs k < l
        last = np.log1p(p * np.expm1(gs / nu**2)).sum(1)  # the last copy, integrated exactly
        logs.append(pairs + last + weight)
    v = np.concatenate(logs)
    return float(logsumexp(v) - np.log(v.size))


def all_participation_lower_bound(gram: np.ndarray, p: float, nu: float, alpha: int) -> float:
    """log M_alpha >= alpha n log p + alpha (alpha - 1) 1^T G 1 / (2 nu^2): one term of the sum."""
    n = gram.shape[0]
    return alpha * n * np.log(p) + alpha * (alpha - 1) * float(gram.sum()) / (2 * nu**2)


def _check_identity(rng) -> None:
    """C = I: the estimate must reproduce dp_accounting's sampled-Gaussian RDP (Mironov et al.)."""
    n, p, sigma = 8, 1 / 16, 2.0
    for alpha in (2, 3, 5):
        exact = n * float(_compute_rdp_poisson_subsampled_gaussian(p, sigma, [alpha])[0])
        est = renyi_moment_mc(np.eye(n), p, sigma, alpha, 20000, rng) / (alpha - 1)
        assert abs(est - exact) < 0.05 * exact, (alpha, est, exact)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=6000)
    ap.add_argument("--sigmas", type=float, nargs="+", default=[16.0, 8.0, 4.0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    _check_identity(rng)
    n, p, delta = 512, 1 / 16, 1e-6
    c = parse_strategy("toeplitz-sqrt", n).matrix()
    gram = c.T @ c
    col = float(np.sqrt(np.diag(gram).max()))
    tilts = (1.0, 1.5, 2.0)
    print("| sigma | " + " | ".join(f"eps estimate, tilt {t:g} (best order)" for t in tilts)
          + " | eps floor of the route (rigorous, all-participation term) |")
    print("|---:|" + "---:|" * (len(tilts) + 1))
    for sigma in args.sigmas:
        nu = sigma * col
        cells = []
        for t in tilts:
            est = [renyi_moment_mc(gram, p, nu, a, args.samples, rng, tilt=t) / (a - 1) for a in ORDERS]
            if min(est) < 0:  # a divergence is >= 0: the weights' variance swamped this estimate
                cells.append("unstable")
                continue
            eps, order = compute_epsilon(ORDERS, est, delta)
            cells.append(f"{eps:.2f} ({order})")
        low = [max(0.0, all_participation_lower_bound(gram, p, nu, a) / (a - 1)) for a in ORDERS]
        floor = f"{compute_epsilon(ORDERS, low, delta)[0]:.1f}" if max(low) > 0 else "none (term < 1)"
        print(f"| {sigma:g} | " + " | ".join(cells) + f" | {floor} |", flush=True)


if __name__ == "__main__":
    main()
