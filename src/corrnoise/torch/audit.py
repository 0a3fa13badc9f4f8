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

:func:`audit_training_run` audits a *real* run instead (the dataset's default model and
hyperparameters, one run, Steinke-Nasr-Jagielski 2023): black-box canaries are input examples
(random inputs, random labels) scored by their loss under the final model; white-box canaries are
dead input features of :class:`DeadInputModel` (the construction above, for any model). Canaries
replace the last training examples and a canary left out keeps its index with loss weight 0, so
in and out differ in one example's gradient (zero-out adjacency) and every canary is scheduled
by the run's own sampler.
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

__all__ = ["AuditSetup", "CanaryLayout", "DeadInputModel", "SCORES", "audit_many_runs", "audit_one_run",
           "audit_training_run", "black_box_scores", "canary_run", "inject_canaries", "input_canaries",
           "white_box_scores"]

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
        # named here: a batch larger than the data made 0 steps, refused as the mechanism's n (review)
        self.batch_size = check_int("batch_size", self.batch_size, minimum=1, maximum=self.num_examples)
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


# --- one-run audit of a real training run: black-box input canaries and white-box gradient canaries ---------
class DeadInputModel(torch.nn.Module):
    """The audited model ``base`` on the first ``features`` inputs, plus ``slots`` dead input
    features feeding a bias-free linear layer ``head`` (slots -> classes) whose output joins the
    logits: the generalization of the linear audit model's dead weight columns to any model. (For
    an MLP, extra input columns of its first Linear layer would do the same; a layer of their own
    also fits models whose first layer is no Linear, like the MNIST-1D CNN, and leaves the base
    model unchanged.) Real examples and input canaries are 0 there, so no example's gradient reaches
    ``head.weight``: its coordinates are the white-box canaries'. ``head`` is registered first, so
    ``head.weight`` is the optimizer's first parameter (the one :func:`inject_canaries` writes)."""

    def __init__(self, base: torch.nn.Module, features: int, slots: int, classes: int):
        super().__init__()
        self.head = torch.nn.Linear(slots, classes, bias=False)
        torch.nn.init.zeros_(self.head.weight)
        self.base = base
        self.features = int(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x[:, : self.features]) + self.head(x[:, self.features:])


@dataclass
class CanaryLayout:
    """Where the canaries of a one-run audit sit among the ``n`` training indices: the last
    ``black_box + white_box`` indices (they *replace* real examples, so the audited run has the
    planned run's size, batches, steps and noise); black-box first, then white-box. ``coins``:
    the independent fair coins (``black`` / ``white``) drawn before the run."""

    n: int
    black_box: int
    white_box: int
    black_coins: np.ndarray
    white_coins: np.ndarray

    @property
    def black_indices(self) -> np.ndarray:
        start = self.n - self.black_box - self.white_box
        return np.arange(start, start + self.black_box)

    @property
    def white_indices(self) -> np.ndarray:
        return np.arange(self.n - self.white_box, self.n)


def input_canaries(m: int, shape: tuple[int, ...], classes: int, rng: np.random.Generator,
                   scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """m black-box canary examples: inputs drawn i.i.d. N(0, scale^2) per feature (out of the
    data's distribution) and labels drawn uniformly at random -- examples the model can only fit
    by memorizing each one (out-of-distribution inputs with random labels, the kind of input
    canary Steinke, Nasr & Jagielski 2023 use for their black-box audits)."""
    x = (scale * rng.standard_normal((m, *shape))).astype(np.float32)
    return x, rng.integers(0, classes, size=m).astype(np.int64)


def audit_dataset(x: np.ndarray, y: np.ndarray, layout: CanaryLayout, canary_x: np.ndarray, canary_y: np.ndarray,
                  slots: int) -> torch.utils.data.TensorDataset:
    """(inputs with ``slots`` dead features, labels, loss weights, indices) of the audited run.

    The weight is 1 for real examples and included black-box canaries and 0 for canaries left out
    and for white-box canary items (zero-out adjacency: the index stays and is scheduled by the
    sampler, its gradient is 0; a white-box canary's gradient is injected instead)."""
    n, d = x.shape[0], int(np.prod(x.shape[1:]))
    xs = np.zeros((n, d + slots), dtype=np.float32)
    xs[:, :d] = x.reshape(n, d)
    ys = np.asarray(y, dtype=np.int64).copy()
    w = np.ones(n, dtype=np.float32)
    b = layout.black_indices
    xs[b, :d] = canary_x.reshape(len(b), d)
    ys[b] = canary_y
    w[b] = layout.black_coins.astype(np.float32)
    xs[layout.white_indices, :d] = 0.0
    w[layout.white_indices] = 0.0
    return torch.utils.data.TensorDataset(torch.from_numpy(xs), torch.from_numpy(ys), torch.from_numpy(w),
                                          torch.arange(n))


def black_box_scores(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, score: str = "loss") -> np.ndarray:
    """Scores of input canaries under the final model (higher = "in"): ``loss``: minus the
    cross-entropy of the canary's label; ``margin``: its logit minus the largest other logit."""
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(np.ascontiguousarray(x)))
        yt = torch.from_numpy(np.asarray(y, dtype=np.int64))
        if score == "loss":
            out = -torch.nn.functional.cross_entropy(logits, yt, reduction="none")
        elif score == "margin":
            own = logits.gather(1, yt[:, None])[:, 0]
            others = logits.scatter(1, yt[:, None], -math.inf).max(dim=1).values
            out = own - others
        else:
            raise CorrnoiseError("score", f"black-box scores are loss or margin, got {score!r}")
    return out.double().numpy()


def white_box_scores(strategy: Strategy, released: np.ndarray, schedules: np.ndarray) -> np.ndarray:
    """The whitened score <C y_i, C w_i> / ||C w_i|| of each white-box canary i (rows of
    ``released``: its coordinate of the released updates / max_grad_norm, one entry a step), w_i
    its public schedule (cyclic) or the expected one (amplified: all ones): the likelihood-ratio
    statistic of the module docstring."""
    cy = strategy.multiply(released.T)   # (steps, m)
    cw = strategy.multiply(schedules.T)
    norms = np.maximum(np.linalg.norm(cw, axis=0), 1e-300)
    return np.sum(cy * cw, axis=0) / norms


def _run_settings(dataset, epochs, batch_size, lr, examples):
    from ..datasets import DATASETS, load

    data = load(dataset)
    hp = dict(DATASETS[dataset].defaults)
    hp.update({k: v for k, v in dict(epochs=epochs, batch_size=batch_size, lr=lr).items() if v is not None})
    x, y = data.x_train, data.y_train
    if examples is not None:
        examples = check_int("examples", examples, minimum=2, maximum=len(y))
        x, y = x[:examples], y[:examples]
    return data, hp, np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.int64)


def _train(model, opt, loader, weighted: bool, observe=None) -> float:
    """The user's loop until the planned steps are taken (weighted: the audit's per-example loss
    weights); ``observe(step)`` after every step. Returns the loop's seconds."""
    start = time.perf_counter()
    ce = torch.nn.CrossEntropyLoss(reduction="none" if weighted else "mean")
    while opt.steps_taken < opt.steps:
        model.train()
        for batch in loader:
            if weighted:
                xb, yb, wb, _ = batch
                loss = (ce(model(xb), yb) * wb).mean()
            else:
                xb, yb = batch
                loss = ce(model(xb), yb)
            loss.backward()
            opt.step()
            if observe is not None:
                observe(opt.steps_taken - 1)
            opt.zero_grad()
    return time.perf_counter() - start


def _accuracy(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).argmax(1).numpy()
    return float(np.mean(pred == np.asarray(y)))


def audit_training_run(dataset: str = "mnist1d", *, mechanism: str = "identity", batching: str = "poisson",
                       epsilon: float | None = None, delta: float | None = None, plan=None, canaries: int = 1000,
                       black_box: bool = True, white_box: bool = True, examples: int | None = None,
                       epochs: float | None = None, batch_size: int | None = None, lr: float | None = None,
                       confidence: float = 0.95, seed: int = 0, black_box_score: str = "loss",
                       baseline: bool = False, patch=None, threads: int | None = None,
                       audit_delta: float | None = None, gdp: bool = True) -> dict[str, Any]:
    """One-run audit (Steinke, Nasr & Jagielski 2023) of a real training run: the dataset's
    default model and hyperparameters (:data:`corrnoise.datasets.DATASETS`, as ``corrnoise train``
    builds them; ``epochs`` / ``batch_size`` / ``lr`` / ``examples`` override), the run planned by
    :func:`corrnoise.runplan.plan_run` for (``mechanism``, the pipeline ``batching``, ``epsilon``,
    ``delta``) or the given ``plan`` (a :class:`~corrnoise.runplan.RunPlan`, trained exactly).

    ``canaries`` black-box canaries (:func:`input_canaries`, scored by ``black_box_score`` under
    the final model) and/or ``canaries`` white-box canaries (dead coordinates of
    :class:`DeadInputModel`'s head, scored from the released updates by
    :func:`white_box_scores`), each included by an independent fair coin; they replace the last
    training examples (:class:`CanaryLayout`) and are scheduled by the run's own sampler. Each
    kind gets its own :func:`corrnoise.audit.one_run_audit` at ``confidence`` (kind
    ``lower_bound``), compared with the run's guarantee, both at ``audit_delta`` (default: the
    run's ``delta``: 1e-5, or the plan's). ``baseline``: also train the same run (same seeds,
    data, model) without canaries and report both loop times. ``patch(optimizer)``: a test
    fixture's hook on the noise path. ``gdp``: also the GDP refinement (``extras["gdp_lower"]``:
    a lower bound on mu, :func:`corrnoise.audit.one_run_mu_lower`).

    Returns {"black_box": AuditResult, "white_box": AuditResult (those asked for), "run": facts}.
    """
    from ..models import model_for

    if not (black_box or white_box):
        raise CorrnoiseError("canaries", "ask for black-box or white-box canaries (or both)")
    m = check_int("canaries", canaries, minimum=2)
    data, hp, x, y = _run_settings(dataset, epochs, batch_size, lr, examples)
    n, classes = len(y), data.num_classes
    m_b, m_w = (m if black_box else 0), (m if white_box else 0)
    if m_b + m_w > n // 2:
        raise CorrnoiseError("canaries", f"{m_b + m_w} canaries would replace more than half of the {n} examples")
    run, delta = _audited_plan(plan, n, hp, mechanism, batching, epsilon, delta)
    rng = np.random.default_rng(check_int("seed", seed, minimum=0))
    layout = CanaryLayout(n, m_b, m_w, rng.random(m_b) < 0.5, rng.random(m_w) < 0.5)
    canary_x, canary_y = input_canaries(m_b, x.shape[1:], classes, rng)
    slots = max(1, -(-m_w // classes))
    seeds = tuple(int(rng.integers(2 ** 62)) for _ in range(3))  # noise, sampler, model initialization
    zeta = float(hp["clip_norm"])
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(check_int("threads", threads, minimum=1))
    try:
        torch.manual_seed(seeds[2])
        model = DeadInputModel(model_for(dataset), int(np.prod(x.shape[1:])), slots, classes)
        model, opt, loader = _private(model, audit_dataset(x, y, layout, canary_x, canary_y, slots), run, hp, seeds)
        released, observe = _white_box_canaries(model, opt, layout, classes, zeta)
        if patch is not None:
            patch(opt)
        seconds = _train(model, opt, loader, True, observe)
        if audit_delta is not None:
            delta = check_real("audit_delta", audit_delta, low=0.0, high=1.0, low_open=True, high_open=True)
        facts = _run_facts(dataset, run, opt, hp, delta, seconds, m)
        facts["test_accuracy_with_canaries"] = _accuracy(model, _with_dead(data.x_test, slots), data.y_test)
        about = {k: facts[k] for k in ("epsilon_guarantee", "guarantee_kind", "mechanism", "batching", "steps",
                                       "noise_std", "examples", "dataset")}
        kind = opt.batching.spec.split(":")[0]
        out: dict[str, Any] = {}
        if m_b:
            scores = black_box_scores(model, _with_dead(canary_x, slots), canary_y, black_box_score)
            res = one_run_audit(scores, layout.black_coins, delta=delta, confidence=confidence, gdp=gdp,
                                method=f"one-run black-box (input canaries, {black_box_score} score, {kind})")
            out["black_box"] = res.with_extras(**about, ratio=res.epsilon_lower / about["epsilon_guarantee"])
        if m_w:
            scores = white_box_scores(opt.strategy, released, _schedules(opt, layout.white_indices))
            res = one_run_audit(scores, layout.white_coins, delta=delta, confidence=confidence, gdp=gdp,
                                method=f"one-run white-box (gradient canaries in dead inputs, whitened score, {kind})")
            out["white_box"] = res.with_extras(**about, ratio=res.epsilon_lower / about["epsilon_guarantee"])
        if baseline:
            facts.update(_baseline(dataset, data, x, y, run, hp, seeds, seconds))
    finally:
        torch.set_num_threads(previous)
    out["run"] = facts
    return out


def _audited_plan(plan, n: int, hp: dict, mechanism, batching, epsilon, delta):
    """(the RunPlan of the audited run, its delta): ``plan`` checked against the data's size, or
    planned as ``corrnoise train`` plans it (:func:`corrnoise.runplan.plan_run`, the pipeline)."""
    from ..runplan import RunPlan, plan_run

    if plan is not None:
        if not isinstance(plan, RunPlan):
            raise CorrnoiseError("plan", f"must be a RunPlan (RunPlan.from_json), got {type(plan).__name__}")
        plan.check_fits(dataset_size=n)
        return plan, plan.delta
    delta = 1e-5 if delta is None else delta
    return plan_run(dataset_size=n, batch_size=check_int("batch_size", hp["batch_size"], minimum=1, maximum=n),
                    mechanism=mechanism, pipeline=batching, epsilon=epsilon, delta=delta, epochs=hp["epochs"],
                    progress=False), delta


def _private(model, dataset, run, hp: dict, seeds: tuple[int, int, int]):
    """make_private(plan=run) with the dataset's optimizer settings and the audit's fixed seeds."""
    opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=hp.get("momentum", 0.0))
    loader = torch.utils.data.DataLoader(dataset, batch_size=run.batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fixed sampler seed: the audit's reproducibility
        return make_private(model, opt, loader, plan=run, max_grad_norm=float(hp["clip_norm"]), seed=seeds[1],
                            noise_seed=seeds[0])


def _white_box_canaries(model: DeadInputModel, opt, layout: CanaryLayout, classes: int, zeta: float):
    """Inject the included white-box canaries (coordinate (i mod classes, i div classes) of the
    head, norm ``zeta``) and return (the released-update array to fill, the per-step observer)."""
    if opt.params[0] is not model.head.weight:
        raise RuntimeError("the dead-input head is not the optimizer's first parameter")
    m_w = layout.white_box
    rows = [i % classes for i in range(m_w)]
    cols = [i // classes for i in range(m_w)]
    directions = {}
    for i, index in enumerate(layout.white_indices):
        if layout.white_coins[i]:
            u = torch.zeros_like(model.head.weight)
            u[rows[i], cols[i]] = zeta
            directions[int(index)] = u
    inject_canaries(opt, directions)
    released = np.zeros((m_w, opt.steps))

    def observe(t: int) -> None:
        if m_w:  # what the optimizer released at step t, in units of zeta
            g = model.head.weight.grad.detach() * opt.expected_batch_size
            released[:, t] = g[rows, cols].double().numpy() / zeta

    return released, observe


def _run_facts(dataset, run, opt, hp: dict, delta: float, seconds: float, m: int) -> dict[str, Any]:
    guarantee = opt.run_guarantee(delta)
    return {"dataset": dataset, "examples": run.dataset_size, "mechanism": run.label, "strategy": opt.strategy.label,
            "batching": opt.batching.spec, "steps": int(opt.steps), "batch_size": run.batch_size,
            "epochs": round(opt.steps / run.steps_per_epoch, 6), "lr": hp["lr"], "clip_norm": float(hp["clip_norm"]),
            "noise_std": float(opt.noise_std), "epsilon_guarantee": float(guarantee.epsilon),
            "guarantee_kind": guarantee.kind, "guarantee_method": guarantee.method, "delta": float(delta),
            "seconds_with_canaries": round(seconds, 2), "canaries_per_kind": m,
            "torch_threads": torch.get_num_threads()}


def _baseline(dataset, data, x, y, run, hp, seeds, seconds: float) -> dict[str, Any]:
    """The same run without canaries (same seeds, the real data, the plain model): its loop time,
    the overhead ratio and its test accuracy."""
    from ..models import model_for

    torch.manual_seed(seeds[2])
    plain, opt, loader = _private(model_for(dataset), torch.utils.data.TensorDataset(
        torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)), run, hp, seeds)
    base = _train(plain, opt, loader, False)
    return {"seconds_without_canaries": round(base, 2), "time_overhead": round(seconds / base, 3),
            "test_accuracy_without_canaries": _accuracy(plain, data.x_test, data.y_test)}


def _with_dead(x: np.ndarray, slots: int) -> np.ndarray:
    """Inputs flattened with ``slots`` zero (dead) features appended."""
    flat = np.asarray(x, dtype=np.float32).reshape(len(x), -1)
    return np.concatenate([flat, np.zeros((len(x), slots), dtype=np.float32)], axis=1)


def _schedules(opt, indices: np.ndarray) -> np.ndarray:
    """(len(indices), steps) weights of the whitened score: the realized schedule when the
    batching is unamplified (cyclic: the order is public), else all ones (the expected schedule;
    the amplified guarantee assumes the realized one secret)."""
    out = np.ones((len(indices), opt.steps))
    if opt.batching.spec.split(":")[0] in ("cyclic", "none"):
        where = {int(j): k for k, j in enumerate(indices)}
        out[:] = 0.0
        for t in range(opt.steps):
            for j in opt.sampler.batch(t):
                k = where.get(int(j))
                if k is not None:
                    out[k, t] = 1.0
    return out
