"""The planner core: which mechanism, which batching and how much noise for one training run.

Setup (:class:`PlanSetup`): ``(dataset_size N, batch_size B, epochs K)`` -- b = N // B steps per
epoch of fixed-size batches, n = K b steps, sampling probability p = B / N -- or
``(steps n, epochs K)`` -- b = ceil(n / K), p = 1 / b (an expected batch of N / b).  Then the
privacy target ``(epsilon, delta)``, an optional memory budget ``max_buffers`` (noise vectors of
model size kept between steps), the families to consider (``only``) and the batchings the data
pipeline can do (``pipeline``):

=================  ============================================  =================================
pipeline           what the data loader can do                    batchings planned
=================  ============================================  =================================
``cyclic``         shuffle once, fixed batches in a fixed order   ``none`` (cyclic:k:b participation)
``poisson``        Poisson sampling (also block-cyclic Poisson)   ``none``, ``poisson``, ``block-cyclic``
``balls-in-bins``  one bin per example and epoch                  ``none``, ``balls-in-bins``
``auto``           all of the above                               all
=================  ============================================  =================================

Candidates (family -> how C is built -> how it is accounted):

- ``dpsgd``: C = I.  ``poisson:P`` (PLD, dp_accounting) and ``none`` (exact Gaussian, cyclic:k:b).
- ``bandmf:BANDS``: ``optimize_banded_toeplitz(n, BANDS, participation=cyclic:k:b)`` for BANDS in
  {2, 4, ..., 64} up to b (seed 002 Sec. 4.2: the best BANDS grows with epsilon and falls with the
  epochs, so a sweep finds it).  ``block-cyclic:BANDS:P`` with P = B BANDS / N (BandMF
  amplification, tutorial Thm 3.21), ``balls-in-bins:b`` (Monte Carlo, seed 000; C >= 0 only) and
  ``none``.
- ``blt:D``: ``optimize_blt(n, buffers=D, participation=cyclic:k:b)`` for D in {1, 2, 4}:
  ``none`` and ``balls-in-bins:b``.
- ``dpcgd:BETA``: BETA in {0.5, 0.7, 0.8, 0.9, 0.95} (seed 003 Sec. 5.1: amplification prefers
  smaller beta than the unamplified optimum, so both ends are swept): ``none`` and
  ``balls-in-bins:b``.
- ``toeplitz`` (n <= 4096: full banded Toeplitz optimization), ``dense`` (n <= 256:
  ``optimize_dense``): ``none`` only.
- ``tree``: the online binary tree for any n (no matrix), decoded plain (``tree``) and by
  streaming least squares (``tree:ls``): ``none`` only (C_tree has 2n - 1 rows: no amplified
  analysis applies).

Every C is optimized for the unamplified cyclic participation and reused under amplification.

Order of work (analytic first, Monte Carlo only where it can still win).  Every design is built
(a design whose optimization fails is dropped with its reason in :attr:`PlanResult.dropped`), then:

1. analytic candidates (DP-SGD PLD, unamplified Gaussian, BandMF block-cyclic PLD) are calibrated
   -- PLD with a 1e-3 discretization while screening: still a pessimistic, formal guarantee;
2. every balls-in-bins (Monte Carlo) candidate gets a deterministic lower bound on its rms_error,
   lower_noise * ||A C^-1||_F / sqrt(n) (:func:`corrnoise.accounting.montecarlo.noise_lower_bound`:
   a hockey-stick lower bound of the Lemma 3.2 pair; every verified guarantee for it has more
   noise); a verified guarantee already in the cache (:mod:`corrnoise.accounting.cache`) makes
   it final at once;
3. branch and bound (:func:`_search_monte_carlo`): a Monte Carlo candidate is considered only
   while its lower bound is below ``(1 - IMPROVEMENT_MARGIN)`` times the best rms_error of a
   formal guarantee so far (an analytic screening or a final one) -- a candidate that cannot beat
   the best by that margin is never screened, let alone verified
   (:data:`~.constants.IMPROVEMENT_MARGIN`).  Those left get a 2^15-sample estimate (``kind:
   "estimate"``, aimed at delta / tau as verification is), the plausible ones (estimate within
   ``SCREEN_NOISE_MARGIN`` of that bar) a 2^20-sample estimate of their verified noise, and the
   best of those estimates, if it beats the bar, the full calibration with fresh-sample
   verification (Estimate-Verify-Release, seed 000 Thm 2.1); the bar moves with every new final
   guarantee;
4. the recommendation (:func:`best_final` with :func:`_preferred`) among the analytic candidates
   and the verified Monte Carlo ones: the preferred analytic one, and any within the screening
   noise of the best, re-calibrated with the default discretization (starting from the screening).

Why the bound is safe for the *choice*: a skipped candidate's verified rms_error would be above its
lower bound (but with the verification's failure probability, <= 1e-3 delta), so above the bar,
so it could not have been recommended by more than the margin.  The *privacy* of what is
recommended never rests on a bound or an estimate: only a final, formal guarantee is recommended,
and only guarantees (verified for Monte Carlo) are cached.  The recommendation is chosen from the
outcomes of up to MAX_FINALIZE verifications (cached ones count), so each verifies
delta_v = delta / (1 + MAX_FINALIZE * 1e-3) and the chosen one is stated at delta
(:func:`corrnoise.accounting.montecarlo.selection_delta`: Thm 2.1 for a selection).

Numbers per candidate (docs/design.md conventions, unit clip norm, prefix workload):
``rms_error = noise_std ||A C^-1||_F / sqrt(n)``, ``max_error = noise_std max_t ||(A C^-1)[t]||``;
``memory_vectors`` = model-size noise vectors the streaming generator keeps between steps
(:func:`corrnoise.noise.make_generator`'s choice: banded b - 1 (the optimized Toeplitz: its nonzero
coefficients less one), BLT d, DP-SGD / DP-CGD / regenerated Toeplitz, dense and the plain tree 0,
``tree:ls`` the bit length of n - 1);
``noise_memory_bytes`` (given ``trainable_params``, and ``dtype``, default float32) = the noise state
in bytes, :func:`corrnoise.noise_memory.noise_state_bytes`; under ``max_noise_memory`` a candidate
over the budget is switched to regenerated noise (``noise_method = "regenerate"``: bandmf, blt and toeplitz for
n <= MAX_REGENERATE_N; same C and noise, no buffers, higher noise_cost) or else excluded, never
calibrated (:mod:`.budget`; :attr:`PlanResult.excluded` / ``regenerated`` list them); ``noise_cost`` = R + A per step, R = model-size
Gaussian draws and A = model-size multiply-adds, each counted as one randn (an upper bound: a
multiply-add is cheaper): DP-SGD 1, banded b, BLT 1 + 2d, DP-CGD 3 (z_t, regenerated z_{t-1}, one
axpy), regenerated C^-1: 2 nnz - 1 per row on average, the tree: ``designs._tree_cost``.
"""

from __future__ import annotations

import contextvars
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ..errors import CorrnoiseError, check_int
from ..noise_memory import format_size
from ..progress import LineProgress, format_seconds, null_progress
from .constants import (BANDS, BETAS, BUFFERS, DPSGD_TIE_MARGIN, ESTIMATE_MC_SAMPLES, FINAL_MC_SAMPLES,
                        IMPROVEMENT_MARGIN,
                        MAX_DENSE_N, MAX_FINALIZE, MAX_NOISE_MULTIPLIER, MAX_TOEPLITZ_N, PIPELINES,
                        SCREEN_DISCRETIZATION, SCREEN_MC_SAMPLES, SCREEN_MC_TAU, SCREEN_NOISE_MARGIN)
from .budget import apply_noise_budget
from .designs import DESIGN_FAILURES, FAMILIES, _batching_spec, _designs, _errors
from .setup import PlanSetup, make_setup
from .store import cached_errors

__all__ = [
    "FAMILIES", "PIPELINES", "PlanSetup", "Candidate", "PlanResult", "plan",
    "SCREEN_DISCRETIZATION", "SCREEN_MC_SAMPLES", "BANDS", "BUFFERS", "BETAS",
]

Progress = Callable[[str, int, int], None]


# ----------------------------------------------------------------------------------------------
@dataclass
class Candidate:
    """One mechanism + batching with its calibrated noise (JSON via :meth:`to_dict`)."""

    family: str
    mechanism: str
    batching: str
    participation: str | None
    strategy_label: str
    memory_vectors: int
    noise_cost: float
    mean_error: float  # ||A C^-1||_F / sqrt(n)  (per unit noise_std)
    max_error_unit: float  # max_t ||(A C^-1)[t]||
    accounting: str | None = None
    kind: str | None = None
    noise_std: float | None = None
    noise_multiplier: float | None = None
    epsilon: float | None = None
    rms_error: float | None = None
    max_error: float | None = None
    feasible: bool = False
    final: bool = False
    seconds: float = 0.0
    note: str | None = None
    mechanism_file: str | None = None
    accounting_details: dict[str, Any] = field(default_factory=dict)
    strategy: Any = field(default=None, repr=False)
    #: the PrivacyResult behind the numbers (a guarantee when ``final``); not in :meth:`to_dict`
    result: Any = field(default=None, repr=False)
    #: PLD candidates: the screening noise (discretization SCREEN_DISCRETIZATION), about where the
    #: final calibration's own coarse search would end (it starts there instead)
    coarse_noise: float | None = field(default=None, repr=False)
    #: balls-in-bins only: a lower bound on the noise any verified guarantee needs, and on rms_error
    lower_noise: float | None = None
    lower_rms: float | None = None
    #: balls-in-bins only: how far the Monte Carlo work went (None, "screened", "estimated", "verified")
    stage: str | None = None
    #: make_generator's method for this candidate's noise: "auto" (the strategy's own recurrence)
    #: or "regenerate" (chosen under a noise-memory budget, :mod:`.budget`)
    noise_method: str = "auto"
    #: noise state in bytes (:func:`corrnoise.noise_memory.noise_state_bytes`), when the setup
    #: gives trainable_params
    noise_memory_bytes: int | None = None
    #: over the noise-memory budget with no regenerated variant: never calibrated
    excluded: bool = field(default=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "family": self.family, "mechanism": self.mechanism, "strategy": self.strategy_label,
            "batching": self.batching, "participation": self.participation, "accounting": self.accounting,
            "kind": self.kind, "noise_std": self.noise_std, "noise_multiplier": self.noise_multiplier,
            "epsilon": self.epsilon, "rms_error": self.rms_error, "max_error": self.max_error,
            "memory_vectors": self.memory_vectors, "noise_cost": self.noise_cost,
            "noise_cost_unit": "model-size Gaussian draws (randn) per step", "feasible": self.feasible,
            "final": self.final, "seconds": round(self.seconds, 4),
        }
        if self.note:
            out["note"] = self.note
        if self.mechanism_file:
            out["mechanism_file"] = self.mechanism_file
        if self.accounting_details:
            out["accounting_details"] = self.accounting_details
        if self.lower_rms is not None:
            out["rms_error_lower_bound"] = self.lower_rms
            out["noise_std_lower_bound"] = self.lower_noise
        if self.noise_memory_bytes is not None:
            out["noise_memory_bytes"] = self.noise_memory_bytes
            out["noise_method"] = self.noise_method
        return out

    @property
    def monte_carlo(self) -> bool:
        """Accounted by balls-in-bins Monte Carlo (a verified guarantee costs ~1/delta samples)."""
        return self.batching.startswith("balls-in-bins")

    @property
    def amplified(self) -> bool:
        return self.batching != "none"

    @property
    def calibrated(self) -> bool:
        return self.noise_std is not None


@dataclass
class PlanResult:
    """All candidates (screening numbers unless ``final``) and the recommended one (final,
    ``kind == "guarantee"``)."""

    setup: PlanSetup
    candidates: list[Candidate]
    recommended: Candidate
    seconds: float
    #: designs whose optimization failed, with the reason: ``{"candidate": label, "reason": text}``
    dropped: list[dict[str, str]] = field(default_factory=list)
    #: candidates over the noise-memory budget (:func:`.budget.apply_noise_budget`): left out
    #: (``excluded``) or switched to regenerated noise (``regenerated``)
    excluded: list[dict[str, Any]] = field(default_factory=list)
    regenerated: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = {"setup": self.setup.to_dict(), "candidates": [c.to_dict() for c in self.candidates],
               "recommended": self.recommended.to_dict(), "seconds": round(self.seconds, 3)}
        if self.dropped:
            out["dropped"] = list(self.dropped)
        if self.excluded:
            out["excluded"] = list(self.excluded)
        if self.regenerated:
            out["regenerated"] = list(self.regenerated)
        return out


# ----------------------------------------------------------------------------------------------
# Calibration (screening and final)
# ----------------------------------------------------------------------------------------------
_NO_DISCRETIZATION: set[str] = set()
#: the planner's progress reporter while plan() runs (finalize_candidate reports through it)
_REPORT: contextvars.ContextVar[Progress] = contextvars.ContextVar("corrnoise_plan_report", default=null_progress)


def _calibrate(strategy, batching: str, participation: str | None, epsilon: float, delta: float, screen: bool,
               seed: int | None = None, screen_samples: int = SCREEN_MC_SAMPLES, progress: Progress | None = None,
               lower_noise: float | None = None, coarse_start: float | None = None):
    """(PrivacyResult, final?) for ``strategy`` under ``batching``.  Screening: coarse PLD
    discretization where the method takes one, Monte Carlo estimates (:func:`_mc_estimate`);
    final: full analysis (verified Monte Carlo).  Guarantees go through the on-disk cache of
    guarantees (:func:`corrnoise.accounting.cache.cached_calibrate`); estimates never do."""
    from ..accounting import choose_method, parse_batching
    from ..accounting.cache import cached_calibrate

    bat = parse_batching(batching, participation if batching == "none" else None)
    if isinstance(bat, _balls_in_bins_class()):
        if not screen:
            return _mc_final(strategy, bat, epsilon, delta, progress), True
        res = _mc_estimate(strategy, bat, epsilon, delta, seed, screen_samples, lower_noise)
        return res, res.kind == "guarantee"
    method = choose_method(strategy, bat)
    if screen and method not in _NO_DISCRETIZATION:
        try:
            return cached_calibrate(strategy, bat, epsilon=epsilon, delta=delta,
                                    discretization=SCREEN_DISCRETIZATION), False
        except CorrnoiseError as exc:
            if exc.param != "discretization":
                raise
            _NO_DISCRETIZATION.add(method)
    # the screening calibration (a coarser discretization) is where the final one's coarse search
    # would end up, to a fraction of a percent: the fine search starts there
    start = coarse_start if method not in _NO_DISCRETIZATION else None
    return cached_calibrate(strategy, bat, epsilon=epsilon, delta=delta, start=start), True


def _mc_final(strategy, bat, epsilon: float, delta: float, progress):
    """The verified balls-in-bins guarantee (Estimate-Verify-Release, seed 000 Thm 2.1: the
    calibration on FINAL_MC_SAMPLES samples, the verification on a fresh sample, both OS entropy),
    from the cache if it holds one for this event, stored there otherwise."""
    from ..accounting.cache import cached_calibrate

    res = cached_calibrate(strategy, bat, epsilon=epsilon, delta=_verified_delta(delta), samples=FINAL_MC_SAMPLES,
                           progress=progress)
    return _as_selected(res, delta)


def _verified_delta(delta: float) -> float:
    """What each Monte Carlo verification of a plan verifies: the planner verifies up to
    MAX_FINALIZE candidates and releases one chosen from the outcomes, which is (epsilon, delta)-DP
    only if each verified delta_v leaves room for the others' failure probabilities
    (:func:`corrnoise.accounting.montecarlo.selection_delta`)."""
    from ..accounting.montecarlo import selection_delta

    return selection_delta(delta, MAX_FINALIZE)


def _as_selected(res, delta: float):
    """A verified Monte Carlo guarantee at delta_v (:func:`_verified_delta`) restated as what it is
    once the planner chose it: (epsilon, delta)-DP for the selection (``extras["verified_delta"]``
    keeps delta_v and ``extras["selection_verifications"]`` the K of the argument). The restatement
    of a guarantee this process proved is proven too (the selection argument is this function's),
    so the run that trains with it takes it as it is: found on a fresh clone with
    ``CORRNOISE_CACHE=off``, where make_private verified the planner's pick a second time (the
    README's quick start on 50,000 examples, 2 min 37 s on top of the planner's 2 min 46 s)."""
    from ..accounting.base import PrivacyResult, note_proven, was_proven

    if res.kind != "guarantee":  # pragma: no cover - calibrate() only releases guarantees
        return res
    selected = PrivacyResult(res.epsilon, delta, res.noise_std, res.noise_multiplier, res.method,
                             {**res.extras, "verified_delta": res.delta, "selection_verifications": MAX_FINALIZE},
                             res.kind)
    return note_proven(selected) if was_proven(res) else selected


def _mc_start(lower_noise: float | None) -> tuple[float, float] | None:
    """Where a Monte Carlo calibration of a candidate starts looking: from its lower bound (the
    noise is above it; 1.3x covers the bound's slack measured on the planner's setups)."""
    return None if not lower_noise else (lower_noise, 1.3 * lower_noise)


def _mc_candidate_estimate(strategy, bat, epsilon: float, delta: float, seed: int | None,
                           lower_noise: float | None = None):
    """An estimate of the noise the verified calibration of :func:`_mc_final` will release.

    That calibration (Algorithm 2 on FINAL_MC_SAMPLES samples m_f, aimed at delta / tau) keeps an
    upper-confidence margin z_f se_f below the target, z_f = verification_margin_z (the
    verification's). Here the same calibration runs on ESTIMATE_MC_SAMPLES samples m_e, whose
    standard error is se_f sqrt(m_f / m_e); the margin z_e = z_f sqrt(m_e / m_f) makes z_e se_e =
    z_f se_f, so the estimate aims where the final calibration will, without the bias a full-size
    margin on the smaller sample would add (2-3% noise at delta 1e-5). ``kind="estimate"``: it
    decides what to verify, never what to release."""
    from ..accounting.montecarlo import calibrate_noise_std, reduce_balls_in_bins, verification_samples
    from ..accounting.montecarlo.inputs import DEFAULT_MARGIN_Z, DEFAULT_TAU
    from ..accounting.montecarlo.release import verification_margin_z

    red = reduce_balls_in_bins(strategy.matrix(), bat.bins)
    z_final = verification_margin_z(DEFAULT_MARGIN_Z, FINAL_MC_SAMPLES,
                                   verification_samples(_verified_delta(delta), DEFAULT_TAU))
    z = z_final * math.sqrt(ESTIMATE_MC_SAMPLES / FINAL_MC_SAMPLES)
    cal = calibrate_noise_std(red, bat.bins, epsilon, _verified_delta(delta) / DEFAULT_TAU, ESTIMATE_MC_SAMPLES, seed, z,
                              _reduced=red, start=_mc_start(lower_noise))
    return _estimate_result(cal, red, epsilon, delta)


def _estimate_result(cal, red, epsilon: float, delta: float):
    from ..accounting import PrivacyResult

    extras = {"samples": cal.samples, "screened_at_delta": cal.target_delta, "margin_z": round(cal.margin_z, 4)}
    return PrivacyResult(float(epsilon), float(delta), float(cal.noise_std), float(cal.noise_std / red.column_norm),
                         "mc", extras, kind="estimate")


def _mc_estimate(strategy, bat, epsilon: float, delta: float, seed: int | None, samples: int,
                 lower_noise: float | None = None):
    """A Monte Carlo *estimate* of the balls-in-bins noise (seed 000 Algorithm 2, no verification,
    ``kind="estimate"``), aimed at delta / SCREEN_MC_TAU like the verified calibration, starting
    from the candidate's lower bound. One bin is the exact Gaussian mechanism (a guarantee, from
    the method)."""
    from ..accounting import get_method
    from ..accounting.montecarlo import calibrate_noise_std, reduce_balls_in_bins

    aim = delta / SCREEN_MC_TAU
    if bat.bins == 1:
        return get_method("mc").calibrate(strategy, bat, epsilon, aim, samples=samples, seed=seed, estimate=True)
    red = reduce_balls_in_bins(strategy.matrix(), bat.bins)
    cal = calibrate_noise_std(red, bat.bins, epsilon, aim, samples, seed, _reduced=red, start=_mc_start(lower_noise))
    return _estimate_result(cal, red, epsilon, delta)


def _balls_in_bins_class():
    from ..accounting import BallsInBins

    return BallsInBins


def _apply(cand: Candidate, res, final: bool, seconds: float) -> None:
    cand.result = res
    cand.accounting = res.method
    cand.kind = res.kind
    cand.noise_std = float(res.noise_std)
    cand.noise_multiplier = float(res.noise_multiplier)
    cand.epsilon = float(res.epsilon)
    cand.rms_error = cand.noise_std * cand.mean_error
    cand.max_error = cand.noise_std * cand.max_error_unit
    cand.final = bool(final and res.kind == "guarantee")
    cand.seconds += seconds
    keep = ("verified", "failure_probability", "samples", "std_error_add", "std_error_remove", "gdp_mu",
            "calibration_evaluations", "discretization", "screened_at_delta")
    cand.accounting_details = {k: v for k, v in res.extras.items() if k in keep and _jsonable(v)}


def _jsonable(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


# ----------------------------------------------------------------------------------------------
# plan()
# ----------------------------------------------------------------------------------------------
def _reporter(progress: Any) -> Progress:
    """``progress`` for plan(): None -> lines on stderr (:class:`corrnoise.progress.LineProgress`,
    silent for the first second), False -> nothing, a callable as is."""
    if progress is None:
        return LineProgress("corrnoise plan")
    if progress is False:
        return null_progress
    if not callable(progress):
        raise CorrnoiseError("progress", "must be a callable (label, done, total), False or None")
    return progress


def plan(setup: PlanSetup | dict | None = None, *, progress: Progress | None = None, out_dir: str | Path | None = None,
         mechanism_file: str | Path | None = None, seed: int | None = None, screen_samples: int = SCREEN_MC_SAMPLES,
         **kwargs: Any) -> PlanResult:
    """Plan a run: every valid candidate with its screened noise (or, for a Monte Carlo candidate
    that cannot win, its lower bound), and the recommended one (lowest ``rms_error`` among the
    feasible candidates the pipeline allows, DP-SGD winning a tie within ``DPSGD_TIE_MARGIN``)
    with the full, formal guarantee.  The order of work is in the module docstring: analytic
    candidates first, Monte Carlo only where it can still win.

    ``setup``: a :class:`PlanSetup`, a dict of its fields, or its fields as keyword arguments.
    ``progress(label, done, total)`` is called as work completes; by default (None) a line on
    stderr says what is being done and about how long it will take, once the plan has run a
    second (also when stderr is not a terminal); ``False`` is silent.  ``out_dir``: save every
    candidate's mechanism file under ``out_dir/candidates/`` and the recommended one as
    ``out_dir/recommended.json``; ``mechanism_file``: where to save the recommended one (a .json
    path).  ``seed`` only fixes the Monte Carlo *screening* samples (the verification of the
    recommended candidate always draws fresh OS entropy); ``screen_samples``: Monte Carlo samples per
    screening estimate.  Verified guarantees are cached on disk (``$CORRNOISE_CACHE``, see
    :mod:`corrnoise.accounting.cache`; ``CORRNOISE_CACHE=off`` disables it).
    """
    t_start = time.perf_counter()
    setup = make_setup(setup, **kwargs)
    screen_samples = check_int("screen_samples", screen_samples, minimum=1)
    report = _reporter(progress)
    token = _REPORT.set(report)
    try:
        candidates, dropped, epsilon_errors, memory = _build_candidates(setup, report, seed, screen_samples)
        recommended = _finalize(candidates, setup, epsilon_errors, report, seed, screen_samples)
        report("done", 1, 1)
    finally:
        _REPORT.reset(token)
        close = getattr(report, "close", None)
        if close is not None:
            close()
    if out_dir is not None:
        out = Path(out_dir)
        for cand in candidates:
            if cand.calibrated:
                name = f"{cand.mechanism}__{cand.batching.split(':')[0]}".replace(":", "-")
                cand.mechanism_file = str(_save(cand, setup, out / "candidates" / f"{name}.json"))
        if mechanism_file is None:
            mechanism_file = out / "recommended.json"
    if mechanism_file is not None:
        recommended.mechanism_file = str(_save(recommended, setup, Path(mechanism_file)))
    candidates.sort(key=_rank_key)
    return PlanResult(setup, candidates, recommended, time.perf_counter() - t_start, dropped, memory["excluded"],
                      memory["regenerated"])


def _build_candidates(setup: PlanSetup, report: Progress, seed: int | None, screen_samples: int
                      ) -> tuple[list[Candidate], list[dict[str, str]], list[str], dict[str, list]]:
    """Every design built (a failed one dropped with its reason), its noise memory checked against
    the budget (:func:`.budget.apply_noise_budget`: regenerated or excluded), every analytic
    candidate left screened (a formal guarantee, cached), every Monte Carlo candidate's lower bound."""
    tasks = _designs(setup)
    if not tasks:
        raise CorrnoiseError("only", f"no family in {','.join(setup.only or FAMILIES)} applies to n = {setup.n} steps "
                             f"(toeplitz needs n <= {MAX_TOEPLITZ_N}, dense n <= {MAX_DENSE_N}, the others n >= 2)")
    candidates: list[Candidate] = []
    dropped: list[dict[str, str]] = []
    epsilon_errors: list[str] = []
    for i, (label, build) in enumerate(tasks):
        report(f"optimizing candidates: {label}", i, len(tasks))
        t0 = time.perf_counter()
        try:
            design = build()
            mean_error, max_error = cached_errors(design.strategy, _errors)
        except DESIGN_FAILURES as exc:  # one failed design must not sink the plan
            dropped.append({"candidate": label, "reason": _one_line(exc),
                            "seconds": f"{time.perf_counter() - t0:.2f}"})
            continue
        for spec in design.batchings:
            batching = _batching_spec(spec, setup)
            candidates.append(Candidate(
                family=design.family, mechanism=design.mechanism, batching=batching,
                participation=setup.participation if batching == "none" else None,
                strategy_label=design.strategy.label, memory_vectors=design.memory, noise_cost=design.cost,
                mean_error=mean_error, max_error_unit=max_error, seconds=design.seconds, strategy=design.strategy))
    report("optimizing candidates", len(tasks), len(tasks))
    if not candidates:
        why = "; ".join(f"{d['candidate']}: {d['reason']}" for d in dropped[:3])
        raise CorrnoiseError("only", f"every candidate design failed ({why})")
    memory = apply_noise_budget(candidates, setup)
    if all(c.excluded for c in candidates):
        raise CorrnoiseError("max_noise_memory", f"no candidate's noise state fits in {format_size(setup.max_noise_memory)} "
                             f"({candidates[0].note.removeprefix('excluded: ')}); raise it or add dpsgd or dpcgd "
                             "(no buffers) to only")
    analytic = [c for c in candidates if not c.monte_carlo and not c.excluded]
    for j, cand in enumerate(analytic):
        report(f"analytic accounting: {cand.mechanism} {cand.batching}", j, len(analytic))
        _screen(cand, setup, seed, screen_samples, epsilon_errors)
    report("analytic accounting", len(analytic), len(analytic))
    mc = [c for c in candidates if c.monte_carlo and not c.excluded]
    for j, cand in enumerate(mc):
        report(f"Monte Carlo lower bounds: {cand.mechanism}", j, len(mc))
        _lower_bound(cand, setup)
    report("Monte Carlo lower bounds", len(mc), len(mc))
    return candidates, dropped, epsilon_errors, memory


def _one_line(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, CorrnoiseError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def _screen(cand: Candidate, setup: PlanSetup, seed: int | None, screen_samples: int,
            epsilon_errors: list[str]) -> None:
    """The screening calibration of one candidate (a guarantee for analytic methods, an estimate
    for Monte Carlo), in place; an unreachable epsilon is a note, not an error."""
    t0 = time.perf_counter()
    try:
        res, final = _calibrate(cand.strategy, cand.batching, cand.participation, setup.epsilon, setup.delta,
                                screen=True, seed=seed, screen_samples=screen_samples, lower_noise=cand.lower_noise)
    except CorrnoiseError as exc:
        if exc.param != "epsilon":
            raise
        cand.note = str(exc)
        cand.feasible = False
        cand.seconds += time.perf_counter() - t0
        epsilon_errors.append(str(exc))
        return
    _apply(cand, res, final, time.perf_counter() - t0)
    if not final and not cand.monte_carlo:  # a coarse PLD screening
        cand.coarse_noise = cand.noise_std
    _check_feasible(cand, setup, epsilon_errors)


def _check_feasible(cand: Candidate, setup: PlanSetup, epsilon_errors: list[str]) -> None:
    cand.feasible = setup.max_buffers is None or cand.memory_vectors <= setup.max_buffers
    if not cand.feasible:
        cand.note = f"needs {cand.memory_vectors} noise buffers > max_buffers = {setup.max_buffers}"
    if cand.noise_multiplier is not None and cand.noise_multiplier > MAX_NOISE_MULTIPLIER:
        cand.feasible = False
        cand.note = f"needs noise multiplier {cand.noise_multiplier:.3g} > {MAX_NOISE_MULTIPLIER:g}"
        epsilon_errors.append(f"epsilon: {cand.mechanism} under {cand.batching} {cand.note}")


def _lower_bound(cand: Candidate, setup: PlanSetup) -> None:
    """A Monte Carlo candidate's deterministic lower bounds on noise and rms_error
    (:func:`corrnoise.accounting.montecarlo.noise_lower_bound`), its memory feasibility, and
    whether delta can be verified at all (Thm 2.2's sample count)."""
    from ..accounting.montecarlo.release import check_verification_cost

    t0 = time.perf_counter()
    cand.feasible = setup.max_buffers is None or cand.memory_vectors <= setup.max_buffers
    if not cand.feasible:
        cand.note = f"needs {cand.memory_vectors} noise buffers > max_buffers = {setup.max_buffers}"
    try:
        check_verification_cost(setup.delta)
    except CorrnoiseError as exc:
        cand.feasible, cand.note = False, str(exc)
    cand.lower_noise = _noise_lower_bound(cand, setup.epsilon, setup.delta)
    cand.lower_rms = cand.lower_noise * cand.mean_error
    cand.seconds += time.perf_counter() - t0


def _noise_lower_bound(cand: Candidate, epsilon: float, delta: float) -> float:
    """:func:`corrnoise.accounting.montecarlo.noise_lower_bound` of a balls-in-bins candidate."""
    from ..accounting import parse_batching
    from ..accounting.montecarlo import noise_lower_bound

    bins = parse_batching(cand.batching).bins
    C = cand.strategy.matrix()
    n = C.shape[0]
    # the Lemma 3.2 modes m_i = sum_j C[:, j b + i] (C >= 0 here: balls-in-bins is offered only to
    # non-negative C, so |C| = C and the copy of balls_in_bins_modes' np.abs is skipped)
    modes = C.reshape(n, n // bins, bins).sum(axis=1)
    return float(noise_lower_bound(C, bins, epsilon, delta, modes=modes).noise_std)


def _rank_key(c: Candidate):
    return (not c.feasible, c.rms_error if c.rms_error is not None else math.inf)


def _preferred(pool: list[Candidate]) -> Candidate:
    """The candidate to recommend from ``pool``: the lowest rms_error, except that DP-SGD wins
    when the best correlated candidate is less than ``DPSGD_TIE_MARGIN`` below it."""
    best = min(pool, key=_rank_key)
    if best.family == "dpsgd":
        return best
    dpsgd = [c for c in pool if c.family == "dpsgd"]
    if dpsgd:
        base = min(dpsgd, key=_rank_key)
        if best.rms_error > base.rms_error * (1.0 - DPSGD_TIE_MARGIN):
            return base
    return best


def best_final(candidates: list[Candidate], setup: PlanSetup, keep: Callable[[Candidate], bool] = lambda c: True,
               choose: Callable[[list[Candidate]], Candidate] | None = None) -> Candidate | None:
    """The best candidate among those ``keep`` accepts, with its final guarantee: the best screened
    one (``choose``, default the lowest rms_error) is re-calibrated with the full guarantee until
    the best is final (finalizing can raise a candidate's rms_error or rule it out) and no screened
    candidate lies within ``SCREEN_NOISE_MARGIN`` of it (at most ``MAX_FINALIZE`` re-calibrations;
    then the best final one). None when no
    accepted candidate gets a final guarantee. The planner uses it for the analytic candidates;
    benchmarks that train the best of every family call it per family."""
    choose = choose or (lambda pool: min(pool, key=_rank_key))
    for _ in range(MAX_FINALIZE + 1):
        pool = [c for c in candidates if keep(c) and c.feasible and c.calibrated]
        if not pool:
            return None
        best = choose(pool)
        if best.final:
            rivals = [c for c in pool if not c.final and c.rms_error <= best.rms_error * (1.0 + SCREEN_NOISE_MARGIN)]
            if not rivals:
                return best
            best = min(rivals, key=_rank_key)  # within the screening noise: finalize it before choosing
        finalize_candidate(best, setup)
    pool = [c for c in candidates if keep(c) and c.feasible and c.calibrated and c.final]
    return choose(pool) if pool else None


def _finalize(candidates: list[Candidate], setup: PlanSetup, epsilon_errors: list[str], report: Progress,
              seed: int | None, screen_samples: int) -> Candidate:
    """The recommendation (:func:`_preferred` among final guarantees) or a one-line error: the
    analytic candidates finalized first, then the Monte Carlo search (module docstring)."""
    _search_monte_carlo(candidates, setup, report, seed, screen_samples, epsilon_errors)
    # the analytic candidates last: finalize the preferred one (and its rivals within the screening
    # noise) among them and the verified Monte Carlo ones -- an unverified Monte Carlo estimate
    # never enters (the search decided what is worth verifying)
    best = best_final(candidates, setup, keep=lambda c: not c.monte_carlo or c.final, choose=_preferred)
    if best is not None:
        return best
    if not any(c.calibrated for c in candidates) or all(
            c.noise_multiplier is None or c.noise_multiplier > MAX_NOISE_MULTIPLIER for c in candidates):
        why = epsilon_errors[0] if epsilon_errors else "no candidate could be calibrated"
        raise CorrnoiseError("epsilon", f"no candidate reaches epsilon = {setup.epsilon:g} at delta = {setup.delta:g} "
                             f"({why.split(': ', 1)[-1]})")
    if setup.max_buffers is not None and not any(c.feasible for c in candidates):
        raise CorrnoiseError("max_buffers", f"no candidate fits in {setup.max_buffers} noise buffers; raise it")
    raise CorrnoiseError("epsilon", f"no candidate got a final guarantee for epsilon = {setup.epsilon:g}")


def _bar(candidates: list[Candidate]) -> float:
    """What a Monte Carlo candidate's rms_error must be below to be worth its verification:
    (1 - IMPROVEMENT_MARGIN) times the best rms_error of a formal guarantee -- final, or an
    analytic screening (PLD at a coarser discretization is pessimistic: at least the final
    number, so the bar is never lower than with final ones) -- inf while there is none."""
    held = [c.rms_error for c in candidates if c.feasible and c.calibrated and c.kind == "guarantee"]
    return (1.0 - IMPROVEMENT_MARGIN) * min(held) if held else math.inf


def _cached_final(cand: Candidate, setup: PlanSetup) -> bool:
    """Make ``cand`` final from a verified guarantee in the cache, if one is there (no sampling)."""
    from ..accounting import parse_batching
    from ..accounting.cache import cached_guarantee

    t0 = time.perf_counter()
    res = cached_guarantee(cand.strategy, parse_batching(cand.batching), epsilon=setup.epsilon,
                           delta=_verified_delta(setup.delta), samples=FINAL_MC_SAMPLES)
    if res is None:
        return False
    res = _as_selected(res, setup.delta)
    _apply(cand, res, True, time.perf_counter() - t0)
    cand.stage = "verified"
    return True


def _search_monte_carlo(candidates: list[Candidate], setup: PlanSetup, report: Progress, seed: int | None,
                        screen_samples: int, epsilon_errors: list[str]) -> None:
    """Branch and bound over the Monte Carlo candidates (module docstring, step 3), in place.

    A candidate is *open* while feasible, not final and its lower bound is below :func:`_bar`.
    Open candidates are screened (2^15-sample estimate); the plausible ones (screened below
    bar * (1 + SCREEN_NOISE_MARGIN): screening noise) are estimated on ESTIMATE_MC_SAMPLES, most
    promising first -- once one is below the bar, the others only if their lower bound can beat
    it by IMPROVEMENT_MARGIN -- and the lowest estimate below the bar is finalized (verified; a
    failed verification rules it out).  Repeats with the new bar, at most MAX_FINALIZE
    verifications."""
    mc = sorted((c for c in candidates if c.monte_carlo and c.lower_rms is not None), key=lambda c: c.lower_rms)
    # a cached verified guarantee is one of the verifications the choice is made from (Thm 2.1 for a
    # selection, :func:`_verified_delta`): together with the fresh ones, at most MAX_FINALIZE
    verifications = 0
    for cand in mc:
        if cand.feasible and verifications < MAX_FINALIZE and _cached_final(cand, setup):
            verifications += 1
    while verifications < MAX_FINALIZE:
        bar = _bar(candidates)
        open_ = [c for c in mc if c.feasible and not c.final and c.lower_rms < bar]
        if not open_:
            break
        todo = [c for c in open_ if c.stage is None]
        for j, cand in enumerate(todo):
            report(f"Monte Carlo screening: {cand.mechanism} {cand.batching}", j, len(todo))
            _screen(cand, setup, seed, screen_samples, epsilon_errors)
            cand.stage = "screened" if cand.calibrated and not cand.final else cand.stage
        open_ = [c for c in open_ if c.feasible and c.calibrated and not c.final]
        # estimate the plausible ones, most promising first; once an estimate beats the bar, only
        # those whose lower bound can still beat that estimate by the margin are estimated too
        # (verifications cost 10^8 samples: verify the best estimate once, not the first)
        plausible = sorted((c for c in open_ if c.stage == "screened"
                            and c.rms_error < bar * (1.0 + SCREEN_NOISE_MARGIN)), key=_rank_key)
        for j, cand in enumerate(plausible):
            best = min((c for c in open_ if c.stage == "estimated" and c.feasible and c.rms_error < bar),
                       key=_rank_key, default=None)
            if best is not None and cand.lower_rms >= (1.0 - IMPROVEMENT_MARGIN) * best.rms_error:
                continue
            report(f"Monte Carlo estimates ({ESTIMATE_MC_SAMPLES:.1e} samples): {cand.mechanism}", j, len(plausible))
            _estimate(cand, setup, seed)
        best = min((c for c in open_ if c.stage == "estimated" and c.feasible and c.rms_error < bar), key=_rank_key,
                   default=None)
        if best is None:
            break
        finalize_candidate(best, setup)
        verifications += 1
    bar = _bar(candidates)
    for cand in mc:
        if cand.final or not cand.feasible:
            continue
        if cand.stage is None:
            cand.note = (f"not sampled: rms_error >= {cand.lower_rms:.4g} (lower bound) cannot beat the best final "
                         f"guarantee by {IMPROVEMENT_MARGIN:.0%}")
        elif cand.note is None:
            cand.note = "estimate only: not expected to beat the best final guarantee by " \
                        f"{IMPROVEMENT_MARGIN:.0%} (bar {bar:.4g})"


def _estimate(cand: Candidate, setup: PlanSetup, seed: int | None) -> None:
    """A screened Monte Carlo candidate's estimate of its verified noise
    (:func:`_mc_candidate_estimate`), in place: the choice of which candidate to verify rests on
    it; it is an estimate, never a guarantee."""
    from ..accounting import parse_batching

    t0 = time.perf_counter()
    try:
        res = _mc_candidate_estimate(cand.strategy, parse_batching(cand.batching), setup.epsilon, setup.delta, seed,
                                     cand.lower_noise)
    except CorrnoiseError as exc:
        if exc.param != "epsilon":
            raise
        cand.feasible, cand.note = False, str(exc)
        return
    _apply(cand, res, False, time.perf_counter() - t0)
    cand.stage = "estimated"
    cand.accounting_details["estimate_samples"] = ESTIMATE_MC_SAMPLES


def _verify_eta(cand: Candidate, setup: PlanSetup) -> str:
    """' (N samples, ~T)': what a verified calibration of ``cand`` will sample (the calibration
    sample and the verification sample of Thm 2.2) and, from this process's last Monte Carlo pass
    over as many bins, about how long that takes ('' for the time when there was none)."""
    from ..accounting import parse_batching
    from ..accounting.montecarlo import verification_samples
    from ..accounting.montecarlo.sampling import seconds_per_sample

    total = verification_samples(setup.delta) + FINAL_MC_SAMPLES
    rate = seconds_per_sample(parse_batching(cand.batching).bins)
    eta = f", ~{format_seconds(rate * total)}" if rate else ""
    return f" ({total:.2g} samples{eta})"


def finalize_candidate(cand: Candidate, setup: PlanSetup) -> Candidate:
    """Re-calibrate one screened candidate with the full, formal guarantee (verified Monte Carlo
    where it applies), in place. A failed verification marks it infeasible (never recommended)
    instead of raising. The planner does this for the recommended candidate; benchmarks that
    train the best of every family call it for each."""
    if cand.final or not cand.calibrated:
        return cand
    report = _REPORT.get()
    # the candidate inside the phase (LineProgress's phase ends at ": "): with it after the colon every
    # finalization was one phase, so a later candidate's line was not written and the last line named
    # a candidate that lost (a user probe: "final guarantee: bandmf:16 ..." before bandmf:8 trained)
    what = f"final guarantee of {cand.mechanism} {cand.batching}"
    if cand.monte_carlo:
        what = f"verifying {cand.mechanism} + {cand.batching}{_verify_eta(cand, setup)}"
    report(what, 0, 1)

    def relay(label: str, done: int, total: int) -> None:  # each Monte Carlo pass its own phase
        report(f"{what}, {label}", done, total)

    t0 = time.perf_counter()
    try:
        res, final = _calibrate(cand.strategy, cand.batching, cand.participation, setup.epsilon, setup.delta,
                                screen=False, progress=relay if report is not null_progress else None,
                                coarse_start=cand.coarse_noise)
    except CorrnoiseError as exc:  # a failed verification
        cand.feasible, cand.note = False, f"final calibration failed: {exc}"
        cand.seconds += time.perf_counter() - t0
        return cand
    finally:
        report(what, 1, 1)
    _apply(cand, res, final, time.perf_counter() - t0)
    if cand.monte_carlo and cand.final:
        cand.stage = "verified"
    if res.kind != "guarantee":  # pragma: no cover - calibrate() only releases guarantees
        cand.feasible, cand.note = False, "final calibration gave no guarantee"
    return cand


def _save(cand: Candidate, setup: PlanSetup, path: Path) -> Path:
    from ..strategies import save_mechanism

    designed_for = {
        "participation": setup.participation, "objective": "rms", "workload": "prefix",
        "batching": cand.batching, "epsilon": setup.epsilon, "delta": setup.delta,
        "noise_std": cand.noise_std, "noise_multiplier": cand.noise_multiplier, "accounting": cand.accounting,
        "kind": cand.kind, "planned_by": "corrnoise plan",
    }
    if cand.noise_memory_bytes is not None:  # planned for a model size: how its noise fits the budget
        designed_for.update(noise_method=cand.noise_method, noise_memory_bytes=cand.noise_memory_bytes,
                            trainable_params=setup.trainable_params, dtype=setup.noise_dtype)
    losses = {"mean_error": cand.mean_error, "max_error": cand.max_error_unit, "rms_error": cand.rms_error,
              "max_error_at_noise": cand.max_error}
    return save_mechanism(cand.strategy, path, designed_for=designed_for, losses=losses)


def error_curve(cand: Candidate, setup: PlanSetup, epsilons: Iterable[float], seed: int | None = None) -> list[tuple[float, float | None]]:
    """(epsilon, rms_error) of ``cand``'s strategy and batching at other epsilons (screening numbers)."""
    out = []
    for eps in epsilons:
        try:
            lower = _noise_lower_bound(cand, float(eps), setup.delta) if cand.monte_carlo else None
            res, _ = _calibrate(cand.strategy, cand.batching, cand.participation, float(eps), setup.delta, screen=True,
                                seed=seed, lower_noise=lower)
            out.append((float(eps), float(res.noise_std) * cand.mean_error))
        except CorrnoiseError:
            out.append((float(eps), None))
    return out
