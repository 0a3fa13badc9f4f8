"""White-box gradient canaries on the real training path (issue #28): the torch side of
:mod:`corrnoise.audit`.

An audit run is an ordinary :func:`~corrnoise.torch.make_private` run of a small model (a
bias-free linear classifier on digits, or synthetic data) whose inputs carry ``slots`` extra
features that are 0 for every real example, plus canary *examples*: dataset indices the run's
own sampler schedules exactly as any other example (cyclic, balls-in-bins, block-cyclic,
Poisson). A canary item's input is all zeros, so its own gradient is 0; when its index is in a
sampled batch and it is included, the optimizer's clipped sum gets its fixed gradient
u = max_grad_norm * e_(class, slot) (one dead coordinate of the weight per canary, so canaries
are orthogonal and no real example has gradient there) before the noise is added -- the
documented injection point :func:`inject_canaries` (``DPOptimizer._accumulate``). A canary left
out keeps its (zero-gradient) index: "in" and "out" runs differ in one example's gradient only,
u vs 0 (zero-out adjacency), with the same batches.

The observer sees exactly what the optimizer releases: after each step, ``p.grad`` (the
privatized average gradient) times the expected batch size, G_t = S_t + zeta nu (C^-1 Z)[t].
Along canary i's direction, y_t = <G_t, u_i> / zeta^2 = x_t + nu (C^-1 z)_t with x_t = 1 when the
canary was in batch t, z i.i.d. N(0, 1). Scores:

* ``sum``: sum_t w_t y_t, w = the canary's schedule when it is public (cyclic), else all ones;
* ``whitened`` (uses C): <C y, C w> / ||C w||. C y = C x + nu z has i.i.d. noise, so for a known
  schedule (unamplified) this is the likelihood-ratio test, N(0, nu^2) vs N(||C x||, nu^2): the
  sharpest test there is. Amplified batchings: the schedule is secret (the guarantee assumes
  it), so w is the *expected* schedule, never the realized one;
* ``lda`` (many-run only): a linear discriminant of y learned on the selection runs
  (:func:`corrnoise.audit.many_run_audit_features`): no knowledge of C needed, and it finds
  correlations a broken noise left (a reused noise row).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..audit import AuditResult, many_run_audit, many_run_audit_features, one_run_audit
from ..errors import CorrnoiseError, check_int, check_real
from ..pipelines import BATCHINGS
from ..runplan import parse_mechanism
from ..sampling import CyclicSampler
from ..strategies import Strategy
from .front import make_private

__all__ = ["AuditSetup", "SCORES", "audit_many_runs", "audit_one_run", "canary_run", "inject_canaries"]

SCORES = ("whitened", "sum", "lda")
AUDIT_BATCHINGS = BATCHINGS[1:]  # every batching make_private trains with (the vocabulary, less auto)


@dataclass
class AuditSetup:
    """The audited training setup: data, model size, run length, mechanism, batching, noise.

    ``x`` (N, d) float32 real inputs, ``y`` labels, ``classes``; ``slots`` dead input features
    appended (canary coordinates: ``classes * slots`` of them); ``canaries`` canary indices
    after the N real ones; ``batch_size``, ``epochs`` (steps = epochs * batches per epoch).
    """

    x: np.ndarray
    y: np.ndarray
    classes: int
    mechanism: str | Strategy
    batching: str
    delta: float
    epsilon: float | None = None
    noise_std: float | None = None
    canaries: int = 1
    slots: int = 1
    batch_size: int = 16
    epochs: int = 2
    max_grad_norm: float = 1.0
    lr: float = 0.5
    cyclic_seed: int = 0

    def __post_init__(self):
        self.canaries = check_int("canaries", self.canaries, minimum=1)
        self.slots = check_int("slots", self.slots, minimum=1)
        if self.canaries > self.classes * self.slots:
            self.slots = -(-self.canaries // self.classes)
        if self.batching not in AUDIT_BATCHINGS:
            raise CorrnoiseError("batching", f"must be one of {', '.join(AUDIT_BATCHINGS)}, got {self.batching!r}")
        self.max_grad_norm = check_real("max_grad_norm", self.max_grad_norm, low=0.0, low_open=True)
        self.num_examples = int(self.x.shape[0]) + self.canaries
        self.steps = check_int("epochs", self.epochs, minimum=1) * (self.num_examples // self.batch_size)
        self.strategy = self.mechanism if isinstance(self.mechanism, Strategy) else \
            parse_mechanism(self.mechanism, self.steps)
        self._calibration = None

    @classmethod
    def digits(cls, examples: int = 64, **kw) -> "AuditSetup":
        from ..datasets import digits

        x, y, _, _ = digits()
        return cls(x=x[:examples], y=y[:examples], classes=10, **kw)

    @classmethod
    def mnist1d(cls, examples: int = 64, **kw) -> "AuditSetup":
        from ..datasets import load

        data = load("mnist1d")
        x = np.asarray(data.x_train, dtype=np.float32).reshape(len(data.x_train), -1)
        return cls(x=x[:examples], y=np.asarray(data.y_train[:examples]), classes=10, **kw)

    # ---------------------------------------------------------------------------------------
    def canary_coordinate(self, i: int) -> tuple[int, int]:
        """(class row, input column) of the weight coordinate of canary i."""
        return i % self.classes, self.x.shape[1] + i // self.classes

    def cyclic_sampler(self) -> CyclicSampler:
        return CyclicSampler(self.num_examples, self.batch_size, steps=self.steps, seed=self.cyclic_seed)

    def canary_indices(self) -> list[int]:
        """Dataset index of each canary. Cyclic (the order is public): canary 0 sits in the batch
        whose schedule has the largest ||C x|| (the worst case the guarantee covers); the others
        follow in the order's later slots. Otherwise the last indices (the samplers treat every
        index alike)."""
        if getattr(self, "_positions", None) is not None:
            return list(self._positions)
        self._positions = self._canary_indices()
        return list(self._positions)

    def _canary_indices(self) -> list[int]:
        n_real = self.x.shape[0]
        if self.batching != "cyclic":
            return list(range(n_real, n_real + self.canaries))
        order = self.cyclic_sampler().order
        per = order.shape[0]
        norms = [np.linalg.norm(self.strategy.multiply(self.schedule_of_batch(b))) for b in range(per)]
        ranked = np.argsort(-np.asarray(norms), kind="stable")
        slots = [int(order[b, j]) for b in ranked for j in range(order.shape[1])]  # the worst batch first
        return slots[: self.canaries]

    def worst_case_canaries(self) -> int:
        """How many canaries sit at a worst-case position (the guarantee's): every one under an
        amplified batching (the sampler treats every index alike), under cyclic those in batches
        whose schedule has the largest ||C x||, to a relative 1e-9."""
        if self.batching != "cyclic":
            return self.canaries
        per = self.num_examples // self.batch_size
        norms = np.array([np.linalg.norm(self.strategy.multiply(self.schedule_of_batch(b))) for b in range(per)])
        worst = self.batch_size * int(np.sum(norms >= norms.max() * (1.0 - 1e-9)))
        return min(self.canaries, worst)

    def schedule_of_batch(self, b: int) -> np.ndarray:
        per = self.num_examples // self.batch_size
        return (np.arange(self.steps) % per == b).astype(float)

    def public_schedule(self, index: int) -> np.ndarray:
        """The weights w of the ``sum`` / ``whitened`` scores for the canary at ``index``: its
        schedule when public (cyclic), else the expected schedule (all steps alike)."""
        if self.batching == "cyclic":
            sampler = self.cyclic_sampler()
            return np.array([index in set(sampler.batch(t)) for t in range(self.steps)], dtype=float)
        return np.ones(self.steps)

    def score_weights(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(w, C w / ||C w||) for the canary at ``index``, cached."""
        cache = self.__dict__.setdefault("_weights", {})
        if index not in cache:
            w = self.public_schedule(index)
            cw = self.strategy.multiply(w)
            cache[index] = (w, cw / max(np.linalg.norm(cw), 1e-300))
        return cache[index]

    def dataset(self, canary_at: list[int]) -> torch.utils.data.TensorDataset:
        n_real, d = self.x.shape
        width = d + self.slots
        x = np.zeros((self.num_examples, width), dtype=np.float32)
        y = np.zeros(self.num_examples, dtype=np.int64)
        real = [i for i in range(self.num_examples) if i not in set(canary_at)]
        x[real, :d] = self.x
        y[real] = self.y
        return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def inject_canaries(optimizer, directions: dict[int, torch.Tensor]) -> None:
    """Make dataset index i contribute the fixed clipped gradient ``directions[i]`` (a tensor of
    the first parameter's shape) whenever the run's sampler puts i in a batch: added to the
    optimizer's clipped sum at the end of the step's accumulation, before the noise. The audit's
    injection point, documented here; not a training feature."""
    original = optimizer._accumulate
    sampler = optimizer.sampler

    def _accumulate():
        step, last = optimizer.steps_taken, not optimizer.context.more_micro_batches
        original()
        if last:
            batch = set(sampler.batch(step))
            for index, u in directions.items():
                if index in batch:
                    optimizer._sums[0].add_(u.to(optimizer._sums[0]))

    optimizer._accumulate = _accumulate


def canary_run(setup: AuditSetup, included: list[bool], *, noise_seed: int, sampler_seed: int,
               noise_std: float, patch=None) -> tuple[np.ndarray, Any]:
    """One training run through make_private; returns (y of shape (canaries, steps): the released
    updates along each canary direction, in units of max_grad_norm; the optimizer)."""
    positions = setup.canary_indices()
    data = setup.dataset(positions)
    torch.manual_seed(noise_seed % (2 ** 31))
    model = torch.nn.Linear(data.tensors[0].shape[1], setup.classes, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=setup.lr)
    loader = torch.utils.data.DataLoader(data, batch_size=setup.batch_size)
    batching = setup.cyclic_sampler() if setup.batching == "cyclic" else setup.batching
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fixed sampler seeds: the audit's reproducibility
        model, opt, loader = make_private(
            model, opt, loader, mechanism=setup.strategy, batching=batching, noise_std=noise_std, delta=setup.delta,
            steps=None if setup.batching == "cyclic" else setup.steps, max_grad_norm=setup.max_grad_norm,
            seed=None if setup.batching == "cyclic" else sampler_seed, noise_seed=noise_seed)
    zeta = setup.max_grad_norm
    coords = [setup.canary_coordinate(i) for i in range(setup.canaries)]
    directions = {}
    for i, (index, inc) in enumerate(zip(positions, included)):
        if inc:
            u = torch.zeros_like(model.weight)
            u[coords[i]] = zeta
            directions[index] = u
    inject_canaries(opt, directions)
    if patch is not None:
        patch(opt)
    rows, cols = zip(*coords)
    released = np.zeros((setup.canaries, setup.steps))
    loss_fn = torch.nn.CrossEntropyLoss()
    t = 0
    while t < setup.steps:
        for xb, yb in loader:
            loss_fn(model(xb), yb).backward()
            opt.step()
            g = model.weight.grad.detach() * opt.expected_batch_size
            released[:, t] = g[list(rows), list(cols)].double().numpy() / zeta
            opt.zero_grad()
            t += 1
    return released, opt


class _one_thread:
    """Tiny models train ~10x faster on one torch thread than on a shared pool (measured on 2
    busy cores: 20 ms vs 250 ms a run); restored afterwards."""

    def __enter__(self):
        self.previous = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.previous)


def _noise_and_guarantee(setup: AuditSetup, delta: float):
    """(noise_std, the run's guarantee at ``delta``): calibrated once by a make_private call."""
    if setup._calibration is None:
        positions = setup.canary_indices()
        data = setup.dataset(positions)
        model = torch.nn.Linear(data.tensors[0].shape[1], setup.classes, bias=False)
        loader = torch.utils.data.DataLoader(data, batch_size=setup.batch_size)
        batching = setup.cyclic_sampler() if setup.batching == "cyclic" else setup.batching
        kw = {"epsilon": setup.epsilon} if setup.epsilon is not None else {"noise_std": setup.noise_std}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            _, opt, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                                     mechanism=setup.strategy, batching=batching, delta=setup.delta,
                                     steps=None if setup.batching == "cyclic" else setup.steps,
                                     max_grad_norm=setup.max_grad_norm, seed=0, **kw)
        setup._calibration = (opt.noise_std, opt)
    nu, opt = setup._calibration
    return nu, opt.run_guarantee(delta)


def _scores(setup: AuditSetup, y: np.ndarray, index: int, score: str) -> float:
    w, unit = setup.score_weights(index)
    if score == "sum":
        return float(w @ y)
    return float(setup.strategy.multiply(y) @ unit)


def audit_many_runs(setup: AuditSetup, runs: int, *, score: str = "whitened", delta: float | None = None,
                    confidence: float = 0.95, seed: int = 0, patch=None, select_fraction: float = 0.5) -> AuditResult:
    """Many-run white-box audit: ``runs`` make_private runs, each with ``setup.canaries``
    canaries; canary i is included in run r iff r + i is even, so every run holds half of them
    and each canary is in every other run.  Trials are (run, canary) pairs: the canaries' weight
    coordinates are dead (no real gradient reaches them) and the noise is independent across
    coordinates, so with every canary at a worst-case position (:meth:`AuditSetup.worst_case_canaries`;
    refused otherwise) the in-trials are i.i.d. draws of one mechanism's output and the out-trials
    of its neighbour's -- the many-run audit's hypothesis, ``runs * canaries`` times per side/2.
    Scores by ``score`` (:data:`SCORES`); the lower bound of :func:`corrnoise.audit.many_run_audit`
    (or ``..._features`` for ``lda``) at ``delta`` (default the run's), beside the run's guarantee at
    that delta. ``patch(optimizer)``: a test fixture's hook on the noise path (the broken runs of
    the sensitivity tests)."""
    runs = check_int("runs", runs, minimum=6)
    if score not in SCORES:
        raise CorrnoiseError("score", f"must be one of {', '.join(SCORES)}, got {score!r}")
    if setup.worst_case_canaries() < setup.canaries:
        raise CorrnoiseError("canaries", f"at most {setup.worst_case_canaries()} fit the worst-case batches of this "
                             f"cyclic run (trials must be alike); lower canaries or raise batch_size")
    delta = setup.delta if delta is None else check_real("delta", delta, low=0.0, high=1.0, low_open=True,
                                                          high_open=True)
    nu, guarantee = _noise_and_guarantee(setup, delta)
    rng = np.random.default_rng(seed)
    positions = setup.canary_indices()
    feats = {True: [], False: []}
    start = time.perf_counter()
    with _one_thread():
        for r in range(runs):
            included = [(r + i) % 2 == 0 for i in range(setup.canaries)]
            y, _ = canary_run(setup, included, noise_seed=int(rng.integers(2 ** 62)),
                              sampler_seed=int(rng.integers(2 ** 62)), noise_std=nu, patch=patch)
            for i, inc in enumerate(included):
                feats[inc].append((positions[i], y[i]))
    elapsed = time.perf_counter() - start
    method = f"many-run white-box ({score} score, {setup.batching})"
    if score == "lda":
        f_in, f_out = (np.array([f for _, f in feats[side]]) for side in (True, False))
        result = many_run_audit_features(f_in, f_out, delta=delta, confidence=confidence, seed=seed,
                                         select_fraction=select_fraction, method=method)
    else:
        s_in, s_out = (np.array([_scores(setup, f, index, score) for index, f in feats[side]])
                       for side in (True, False))
        result = many_run_audit(s_in, s_out, delta=delta, confidence=confidence, seed=seed,
                                select_fraction=select_fraction, method=method)
    # canaries: scored per run; runs: training runs (the statistics counted runs * canaries trials)
    result = dataclasses.replace(result, canaries=setup.canaries, runs=runs)
    return result.with_extras(trials=runs * setup.canaries, **_about(setup, guarantee, nu, elapsed))


def audit_one_run(setup: AuditSetup, *, score: str = "whitened", delta: float | None = None,
                  confidence: float = 0.95, seed: int = 0, patch=None) -> AuditResult:
    """One-run white-box audit: ``setup.canaries`` canaries, each included by an independent
    fair coin (seeded), in one make_private run; :func:`corrnoise.audit.one_run_audit`."""
    if score not in ("whitened", "sum"):
        raise CorrnoiseError("score", f"the one-run audit scores by whitened or sum, got {score!r}")
    delta = setup.delta if delta is None else check_real("delta", delta, low=0.0, high=1.0, low_open=True,
                                                          high_open=True)
    nu, guarantee = _noise_and_guarantee(setup, delta)
    rng = np.random.default_rng(seed)
    coins = rng.random(setup.canaries) < 0.5
    start = time.perf_counter()
    with _one_thread():
        y, _ = canary_run(setup, list(coins), noise_seed=int(rng.integers(2 ** 62)),
                          sampler_seed=int(rng.integers(2 ** 62)), noise_std=nu, patch=patch)
    elapsed = time.perf_counter() - start
    positions = setup.canary_indices()
    scores = np.array([_scores(setup, y[i], positions[i], score) for i in range(setup.canaries)])
    result = one_run_audit(scores, coins, delta=delta, confidence=confidence, runs=1,
                           method=f"one-run white-box ({score} score, {setup.batching})")
    return result.with_extras(**_about(setup, guarantee, nu, elapsed))


def _about(setup: AuditSetup, guarantee, nu: float, elapsed: float) -> dict[str, Any]:
    eps_g = float(guarantee.epsilon)
    return {"epsilon_guarantee": eps_g, "guarantee_kind": guarantee.kind, "guarantee_method": guarantee.method,
            "mechanism": setup.strategy.label, "batching": setup.batching, "steps": setup.steps,
            "noise_std": float(nu), "examples": int(setup.x.shape[0]), "batch_size": setup.batch_size,
            "epochs": setup.epochs, "seconds": round(elapsed, 3)}
