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

Screening vs final.  Every candidate is first calibrated cheaply: PLD methods with a 1e-3
discretization (still a pessimistic, formal guarantee), Monte Carlo with ``estimate=True`` on
2^15 samples (``kind: "estimate"``: never used to train).  The best feasible candidate by
``rms_error`` is then re-calibrated with the full analysis (default PLD discretization; verified
Monte Carlo -- Estimate-Verify-Release, seed 000 Thm 2.1) and the ranking is checked again, until
the best candidate is a final, formal guarantee.  Only that number is recommended.

Numbers per candidate (docs/design.md conventions, unit clip norm, prefix workload):
``rms_error = noise_std ||A C^-1||_F / sqrt(n)``, ``max_error = noise_std max_t ||(A C^-1)[t]||``;
``memory_vectors`` = model-size noise vectors the streaming generator keeps between steps
(:func:`corrnoise.noise.make_generator`'s choice: banded b - 1, BLT d, DP-SGD / DP-CGD /
regenerated Toeplitz, dense and the plain tree 0, ``tree:ls`` the bit length of n - 1); ``noise_cost`` = R + A per step, R = model-size
Gaussian draws and A = model-size multiply-adds, each counted as one randn (an upper bound: a
multiply-add is cheaper): DP-SGD 1, banded b, BLT 1 + 2d, DP-CGD 3 (z_t, regenerated z_{t-1}, one
axpy), regenerated C^-1: 2 nnz - 1 per row on average, the tree: ``designs._tree_cost``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ..errors import CorrnoiseError, check_int
from .constants import (BANDS, BETAS, BUFFERS, DPSGD_TIE_MARGIN, FAMILIES, FINAL_MC_SAMPLES, MAX_DENSE_N, MAX_FINALIZE,
                        MAX_NOISE_MULTIPLIER, MAX_TOEPLITZ_N, PIPELINES, SCREEN_DISCRETIZATION, SCREEN_MC_SAMPLES,
                        SCREEN_MC_TAU, SCREEN_NOISE_MARGIN)
from .designs import _batching_spec, _designs, _errors
from .setup import PlanSetup, make_setup

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

    def to_dict(self) -> dict[str, Any]:
        out = {
            "family": self.family, "mechanism": self.mechanism, "strategy": self.strategy_label,
            "batching": self.batching, "participation": self.participation, "accounting": self.accounting,
            "kind": self.kind, "noise_std": self.noise_std, "noise_multiplier": self.noise_multiplier,
            "epsilon": self.epsilon, "rms_error": self.rms_error, "max_error": self.max_error,
            "memory_vectors": self.memory_vectors, "noise_cost": self.noise_cost, "feasible": self.feasible,
            "final": self.final, "seconds": round(self.seconds, 4),
        }
        if self.note:
            out["note"] = self.note
        if self.mechanism_file:
            out["mechanism_file"] = self.mechanism_file
        if self.accounting_details:
            out["accounting_details"] = self.accounting_details
        return out

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

    def to_dict(self) -> dict[str, Any]:
        return {"setup": self.setup.to_dict(), "candidates": [c.to_dict() for c in self.candidates],
                "recommended": self.recommended.to_dict(), "seconds": round(self.seconds, 3)}


# ----------------------------------------------------------------------------------------------
# Calibration (screening and final)
# ----------------------------------------------------------------------------------------------
_NO_DISCRETIZATION: set[str] = set()


def _calibrate(strategy, batching: str, participation: str | None, epsilon: float, delta: float, screen: bool,
               seed: int | None = None, screen_samples: int = SCREEN_MC_SAMPLES):
    """(PrivacyResult, final?) for ``strategy`` under ``batching``.  Screening: coarse PLD
    discretization where the method takes one, Monte Carlo estimates; final: full analysis
    (verified Monte Carlo).  Uses only the public accounting functions."""
    from ..accounting import calibrate, get_method, parse_batching

    bat = parse_batching(batching, participation if batching == "none" else None)
    if isinstance(bat, _balls_in_bins_class()):
        if not screen:
            return calibrate(strategy, bat, epsilon=epsilon, delta=delta, samples=FINAL_MC_SAMPLES), True
        aim = delta / SCREEN_MC_TAU
        try:
            res = calibrate(strategy, bat, epsilon=epsilon, delta=aim, estimate=True, samples=screen_samples, seed=seed)
        except CorrnoiseError as exc:
            if exc.param != "estimate":
                raise
            # calibrate() releases only guarantees; a screening estimate is asked for from the
            # method itself (it is labelled kind="estimate" and never recommended as such)
            res = get_method("mc").calibrate(strategy, bat, epsilon, aim, samples=screen_samples,
                                             seed=seed, estimate=True)
        if res.kind != "guarantee":
            res = res.with_extras(screened_at_delta=aim)
        return res, res.kind == "guarantee"
    from ..accounting import choose_method

    method = choose_method(strategy, bat)
    if screen and method not in _NO_DISCRETIZATION:
        try:
            return calibrate(strategy, bat, epsilon=epsilon, delta=delta,
                             discretization=SCREEN_DISCRETIZATION), False
        except CorrnoiseError as exc:
            if exc.param != "discretization":
                raise
            _NO_DISCRETIZATION.add(method)
    return calibrate(strategy, bat, epsilon=epsilon, delta=delta), True


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
# Strategies per family
# ----------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------------
# plan()
# ----------------------------------------------------------------------------------------------
def plan(setup: PlanSetup | dict | None = None, *, progress: Progress | None = None, out_dir: str | Path | None = None,
         mechanism_file: str | Path | None = None, seed: int | None = None, screen_samples: int = SCREEN_MC_SAMPLES,
         **kwargs: Any) -> PlanResult:
    """Plan a run: every valid candidate with its screened noise, and the recommended one (lowest
    ``rms_error`` among the feasible candidates the pipeline allows, DP-SGD winning a tie within
    ``DPSGD_TIE_MARGIN``) re-calibrated with the full, formal guarantee.

    ``setup``: a :class:`PlanSetup`, a dict of its fields, or its fields as keyword arguments.
    ``progress(label, done, total)`` is called as work completes.  ``out_dir``: save every
    candidate's mechanism file under ``out_dir/candidates/`` and the recommended one as
    ``out_dir/recommended.json``; ``mechanism_file``: where to save the recommended one (a .json
    path).  ``seed`` only fixes the Monte Carlo *screening* samples (the verification of the
    recommended candidate always draws fresh OS entropy); ``screen_samples``: Monte Carlo samples per
    screening estimate.
    """
    t_start = time.perf_counter()
    setup = make_setup(setup, **kwargs)
    screen_samples = check_int("screen_samples", screen_samples, minimum=1)
    if progress is not None and not callable(progress):
        raise CorrnoiseError("progress", "must be a callable (label, done, total)")
    report = progress or (lambda label, done, total: None)
    tasks = _designs(setup)
    if not tasks:
        raise CorrnoiseError("only", f"no family in {','.join(setup.only or FAMILIES)} applies to n = {setup.n} steps "
                             f"(toeplitz needs n <= {MAX_TOEPLITZ_N}, dense n <= {MAX_DENSE_N}, the others n >= 2)")
    total = len(tasks) + 1
    candidates: list[Candidate] = []
    epsilon_errors: list[str] = []
    for i, (label, build) in enumerate(tasks):
        report(label, i, total)
        design = build()
        mean_error, max_error = _errors(design.strategy)
        for spec in design.batchings:
            batching = _batching_spec(spec, setup)
            cand = Candidate(
                family=design.family, mechanism=design.mechanism, batching=batching,
                participation=setup.participation if batching == "none" else None,
                strategy_label=design.strategy.label, memory_vectors=design.memory, noise_cost=design.cost,
                mean_error=mean_error, max_error_unit=max_error, seconds=design.seconds, strategy=design.strategy)
            t0 = time.perf_counter()
            try:
                res, final = _calibrate(design.strategy, batching, cand.participation, setup.epsilon, setup.delta,
                                        screen=True, seed=seed, screen_samples=screen_samples)
            except CorrnoiseError as exc:
                if exc.param != "epsilon":
                    raise
                cand.note = str(exc)
                cand.seconds += time.perf_counter() - t0
                epsilon_errors.append(str(exc))
                candidates.append(cand)
                continue
            _apply(cand, res, final, time.perf_counter() - t0)
            cand.feasible = setup.max_buffers is None or cand.memory_vectors <= setup.max_buffers
            if not cand.feasible:
                cand.note = f"needs {cand.memory_vectors} noise buffers > max_buffers = {setup.max_buffers}"
            if cand.noise_multiplier > MAX_NOISE_MULTIPLIER:
                cand.feasible = False
                cand.note = f"needs noise multiplier {cand.noise_multiplier:.3g} > {MAX_NOISE_MULTIPLIER:g}"
                epsilon_errors.append(f"epsilon: {cand.mechanism} under {cand.batching} {cand.note}")
            candidates.append(cand)
    report("final calibration", len(tasks), total)
    recommended = _finalize(candidates, setup, epsilon_errors)
    report("done", total, total)
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
    return PlanResult(setup, candidates, recommended, time.perf_counter() - t_start)


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
    accepted candidate gets a final guarantee. The planner uses it for the recommendation;
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


def _finalize(candidates: list[Candidate], setup: PlanSetup, epsilon_errors: list[str]) -> Candidate:
    """The recommendation (:func:`_preferred`) with its final guarantee, or a one-line error."""
    best = best_final(candidates, setup, choose=_preferred)
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


def finalize_candidate(cand: Candidate, setup: PlanSetup) -> Candidate:
    """Re-calibrate one screened candidate with the full, formal guarantee (verified Monte Carlo
    where it applies), in place. A failed verification marks it infeasible (never recommended)
    instead of raising. The planner does this for the recommended candidate; benchmarks that
    train the best of every family call it for each."""
    if cand.final or not cand.calibrated:
        return cand
    t0 = time.perf_counter()
    try:
        res, final = _calibrate(cand.strategy, cand.batching, cand.participation, setup.epsilon, setup.delta,
                                screen=False)
    except CorrnoiseError as exc:  # a failed verification
        cand.feasible, cand.note = False, f"final calibration failed: {exc}"
        cand.seconds += time.perf_counter() - t0
        return cand
    _apply(cand, res, final, time.perf_counter() - t0)
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
    losses = {"mean_error": cand.mean_error, "max_error": cand.max_error_unit, "rms_error": cand.rms_error,
              "max_error_at_noise": cand.max_error}
    return save_mechanism(cand.strategy, path, designed_for=designed_for, losses=losses)


def error_curve(cand: Candidate, setup: PlanSetup, epsilons: Iterable[float], seed: int | None = None) -> list[tuple[float, float | None]]:
    """(epsilon, rms_error) of ``cand``'s strategy and batching at other epsilons (screening numbers)."""
    out = []
    for eps in epsilons:
        try:
            res, _ = _calibrate(cand.strategy, cand.batching, cand.participation, float(eps), setup.delta, screen=True,
                                seed=seed)
            out.append((float(eps), float(res.noise_std) * cand.mean_error))
        except CorrnoiseError:
            out.append((float(eps), None))
    return out
