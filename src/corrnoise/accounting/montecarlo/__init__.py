"""Balls-in-bins Monte Carlo accounting (method ``mc``; seed 000 Sec. 2-4, App. C, E).

Balls-in-bins batching (seed 000 Def. 3.1): every example lands in one of ``bins`` bins uniformly
at random; step t uses bin ``t mod bins``, for ``epochs = n / bins`` epochs.  For a non-negative
lower-triangular C the correlated noise mechanism C x + Z, Z ~ N(0, nu^2 I), is dominated by
(seed 000 Lemma 3.2, proof in App. C)

    P = (1/b) sum_i N(m_i, nu^2 I),   m_i = sum_{j < E} C[:, j b + i],   Q = N(0, nu^2 I)

-- (P, Q) for the add adjacency and (Q, P) for the remove adjacency.  delta(eps) is the hockey-
stick divergence, an expectation over the privacy loss Y (seed 000 Sec. 2):

    delta(eps) = E_Y[(1 - e^(eps - Y))_+].                                          (Sec. 2)

**Dimension reduction.**  With M = [m_0 .. m_{b-1}] (n x b) and G = M^T M, the privacy loss of a
point x depends on x only through w = M^T x:

    log P/Q(x) = logsumexp_k( w_k / nu^2 - G_kk / (2 nu^2) ) - log b.                (LR)

Under Q, M^T x = nu M^T z ~ N(0, nu^2 G); under the i-th component of P, it is G[:, i] + nu M^T z.
So we sample the b-dimensional vector u = L g (L L^T = G, g ~ N(0, I_b)) instead of n-dimensional
noise, and with t = 1/nu

    add:     Y = logsumexp_k( t u_k + t^2 (G_ki - G_kk/2) ) - log b,   i ~ Uni[b]     (Y-add)
    remove:  Y = log b - logsumexp_k( t u_k - t^2 G_kk / 2 )                          (Y-remove)

Both adjacencies reuse the same u (the two estimates are not independent of each other, which the
union bound of App. E does not need).  Cost per sample: b normals, one b x b triangular product,
b exponentials -- independent of n.

**Stratified bins.**  Instead of drawing i ~ Uni[b] we use every bin equally often (sample j uses
bin j mod b).  The estimator stays unbiased with no larger variance, and App. E's proof of Thm 2.2
goes through unchanged: Bernstein's inequality holds for independent, not identically distributed
terms in [0, 1], and Bhatia-Davis bounds the average variance by the mean.

**Randomness and reproducibility.**  Samples come in chunks; chunk k of stream s is drawn from
``SeedSequence(seed, spawn_key=(s, k))``, so results do not depend on how chunks are scheduled on
threads.  Streams: 0 estimation, 1 verification, 2/3 calibration.  Without an explicit ``seed``
the seed is 128 bits from the OS (:func:`fresh_entropy`), and every verification draws its own
fresh 128 bits, independent of everything that chose the candidate noise (seed 000 Thm 2.1 needs
the verifying sample independent of the candidate; a sample reused across retries would let
"retry until it verifies" select on it).  Results record the seeds used (``seed``,
``verify_seed``), so a run can be reproduced on request.  An explicit ``seed`` is for
reproducible experiments only: its verification stream is derived from it, so retrying other
targets or sample counts with the same seed re-uses one verification sample and voids the stated
failure probability.

Layout: :mod:`.inputs` (defaults, checks, seeds), :mod:`.pair` (Lemma 3.2), :mod:`.sampling`
(reduced pair, losses, chunked sampling), :mod:`.estimates` (delta(eps), eps(delta)),
:mod:`.calibration` (Algorithm 2), :mod:`.release` (Estimate-Verify-Release and
:func:`account_balls_in_bins`), :mod:`.register` (method ``mc``, registered on import).
"""

from __future__ import annotations

# re-exports (public names; the private ones are for the tests)
from . import register as _register_mc  # noqa: F401  (registers method "mc")
from .bounds import NoiseLowerBound, noise_lower_bound
from .calibration import Calibration, _bisect, _keep_bounds, _Kept, _unamplified_noise, calibrate_noise_std
from .estimates import (DeltaEstimate, EpsilonEstimate, _delta_moments, _iid_se, _Moments, _stratified_ids, _tail,
                        _Tail, estimate_delta, estimate_epsilon)
from .inputs import (_CHUNK_ELEMENTS, _PILOT_SAMPLES, _STREAM_CALIBRATE, _STREAM_ESTIMATE, _STREAM_PILOT,
                     _STREAM_VERIFY, _TINY, DEFAULT_CALIBRATION_SAMPLES, DEFAULT_FAILURE_FRACTION, DEFAULT_MARGIN_Z,
                     DEFAULT_PRE_VERIFY_SAMPLES, DEFAULT_SAMPLES, DEFAULT_TAU, fresh_entropy, resolve_seed,
                     verification_seed)
from .pair import DominatingPair, balls_in_bins_modes, dominating_pair
from .release import (MonteCarloResult, Verification, account_balls_in_bins, delta_candidate, failure_probability,
                      release_verified, selection_delta, standing_deltas, verification_calibration, verification_samples,
                      verify_privacy)
from .sampling import (ReducedPair, _chunks, _exp_rows, _hockey, _Losses, _lse_bins, _lse_shift, _map_chunks,
                       _Offsets, reduce_balls_in_bins)

__all__ = [
    "balls_in_bins_modes",
    "DominatingPair",
    "dominating_pair",
    "ReducedPair",
    "reduce_balls_in_bins",
    "DeltaEstimate",
    "EpsilonEstimate",
    "Calibration",
    "Verification",
    "MonteCarloResult",
    "estimate_delta",
    "estimate_epsilon",
    "calibrate_noise_std",
    "verify_privacy",
    "failure_probability",
    "selection_delta",
    "standing_deltas",
    "verification_samples",
    "account_balls_in_bins",
    "DEFAULT_SAMPLES",
    "DEFAULT_CALIBRATION_SAMPLES",
    "DEFAULT_TAU",
    "DEFAULT_PRE_VERIFY_SAMPLES",
    "fresh_entropy",
    "resolve_seed",
    "verification_seed",
    "release_verified",
    "verification_calibration",
    "NoiseLowerBound",
    "noise_lower_bound",
]
