"""The planner's pipelines, sweeps and screening settings (one place; the families register
themselves in :mod:`.designs`)."""

from __future__ import annotations

from ..pipelines import PIPELINES, pipeline_spec_heads

_PIPELINE_BATCHINGS = {pipeline: pipeline_spec_heads(pipeline) for pipeline in PIPELINES}
#: PLD value discretization while screening (pessimistic, so still a guarantee; ~10x faster); the
#: final calibration starts from it. (1e-2 would be 4-5x faster again, but its pessimism grows with
#: the compositions: DP-SGD at Fashion-MNIST epsilon 1, 1,172 steps, screened 16% high and lost its
#: tie with bandmf.)
SCREEN_DISCRETIZATION = 1e-3
#: Monte Carlo samples for a screening estimate (seed 000 App. G.2: far fewer than verification).
SCREEN_MC_SAMPLES = 1 << 15
#: Verification keeps delta_hat <= delta / tau (seed 000 Thm 2.1, tau = 1.25 by default), so a
#: screening estimate aims at delta / tau too: it then ranks a Monte Carlo candidate about where
#: its verified noise will land, instead of favouring it by the slack verification needs.
SCREEN_MC_TAU = 1.25
#: Samples of the calibration that precedes the final verification (the accounting default is
#: 2^24).  The guarantee comes from the fresh verification sample alone (its size set by delta,
#: Thm 2.2); fewer calibration samples widen the upper-confidence margin the calibration aims
#: below: at delta 1e-5 2^20 samples cost 2.3-3.5% more noise than no margin, 2^22 0.5-1.3%
#: (benchmarks/RESULTS.md, "Planner: first hour"), for ~4% of the verification's 10^8 samples.
FINAL_MC_SAMPLES = 1 << 22
#: Samples of the estimate that decides which screened Monte Carlo candidate to verify: the
#: final calibration on fewer samples, its confidence margin scaled to the final's (core.
#: _mc_candidate_estimate), so it predicts the verified noise to about a percent either way.
ESTIMATE_MC_SAMPLES = 1 << 20
BANDS = (2, 4, 8, 16, 32, 64)
BUFFERS = (1, 2, 4)
BETAS = (0.5, 0.7, 0.8, 0.9, 0.95)
MAX_TOEPLITZ_N = 4096
#: L-BFGS iterations of the full (bands = n) Toeplitz design: the optimizer's default 2000 runs
#: to ftol 1e-15 and takes 1,200-1,700 iterations at n = 1000-2000 (cyclic, 100 per epoch) for the
#: last 0.03%: rms_loss 11.57269 vs 11.57267 (n = 1000, 2.4 s vs 7.8 s CPU), 20.2124 vs 20.2067
#: (n = 2000, 1.7 s vs 12.4 s); the planner's choices move on 2% margins.
TOEPLITZ_MAX_ITERATIONS = 300
MAX_DENSE_N = 256
#: The online tree's decoders the planner tries (any n: no matrix is materialized).
TREE_DECODINGS = ("plain", "ls")
#: A noise multiplier beyond this counts as "epsilon not reachable" (the accounting search range).
MAX_NOISE_MULTIPLIER = 1e6
#: DP-SGD is recommended unless a correlated candidate's rms_error is at least this fraction
#: lower. rms_error is a proxy (the prefix-sum workload at one clip norm); a gap below 2% is
#: inside what it can resolve, and measured on Fashion-MNIST at epsilon 1 (benchmarks/RESULTS.md)
#: bandmf:2 at 0.17% below DP-SGD trained 1 point worse. DP-SGD is the simpler mechanism:
#: independent noise, exact PLD accounting, no state.
DPSGD_TIE_MARGIN = 0.02
#: Final re-calibrations at most (each may be a verified Monte Carlo run).
MAX_FINALIZE = 4
#: A Monte Carlo (balls-in-bins) candidate is worth sampling only while it can beat the best final
#: guarantee by this fraction: its verification costs ~1/delta samples (10^8 at delta 1e-5), and a
#: smaller gain is inside what rms_error resolves (the reasoning of DPSGD_TIE_MARGIN). Checked
#: first against a deterministic lower bound on its rms_error, then against its estimates.
IMPROVEMENT_MARGIN = DPSGD_TIE_MARGIN

#: A screened (not yet final) candidate whose rms_error is within this fraction of the best final
#: one is finalized too before the choice: 2^15-sample screening estimates move by several percent
#: between runs (MNIST-1D `make run`: bandmf:64 screened at 10.29 in one run, final 10.01 in
#: another), so without it the pick among near-ties is a coin flip.
SCREEN_NOISE_MARGIN = 0.05

#: Noise-memory budget (issue #27 item 5): the families whose buffered noise has a regenerated
#: variant the planner switches to when the buffers do not fit -- the same C and the same noise,
#: ... up to this many steps: the planner's limit for the regenerated full Toeplitz candidate
#: (its C^{-1} is as dense; about n / 2 draws per step on average); past it the candidate is excluded.
MAX_REGENERATE_N = MAX_TOEPLITZ_N
