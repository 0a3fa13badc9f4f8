"""The training job behind ``corrnoise train``: a dataset, a mechanism, a budget -> a trained model.

    result = train("mnist1d", mechanism="auto", epsilon=4.0, delta=1e-5)

The run is the standard PyTorch loop of a user of :func:`corrnoise.torch.make_private`
(the front door): the dataset's model (:mod:`corrnoise.models`), its published or tuned
hyperparameters (:data:`corrnoise.datasets.DATASETS`, overridable), the mechanism and batching
the planner recommends for the pipeline (``auto``) or the ones named, the noise calibrated to a
formal guarantee for (epsilon, delta), and after training the privacy spent, accounted again on
what actually ran (never above the target).

``batching`` is the data pipeline the user has: ``poisson`` (Poisson sampling; block-cyclic
Poisson for banded mechanisms), ``cyclic`` (shuffle once, fixed batches in a fixed order: no
amplification), ``balls-in-bins`` (seed 000: fixed-size batches with amplification), or
``auto`` (any of them: the planner picks).

Seeds: ``seed`` fixes the model initialization and the data order of unamplified (cyclic)
batches; an amplified sampler (Poisson, block-cyclic, balls-in-bins) never takes it -- its
guarantee assumes the adversary does not know which steps used an example -- so its seed is
secret (from the OS) unless ``sampler_seed`` is given (reproducible experiments only;
make_private warns). The noise seed is secret (from the OS) unless ``noise_seed`` is given.
``plan_plot``: a .png path for the planner's picture (error vs epsilon, the chosen C) when the
planner chose. A given ``plan`` decides mechanism, pipeline, length and batch size (given ones
must agree; its dataset size must be the data's), and the budget defaults to its guarantee's
epsilon and delta. ``choice`` lets benchmarks train several seeds on one planner result
(``mechanism`` is then only its label). The result's ``history`` is the test accuracy after
every pass over the data.

``train`` is: plan the run (:func:`corrnoise.runplan.plan_run`, or a given
:class:`~corrnoise.runplan.RunPlan`: ``corrnoise train --plan FILE`` trains exactly the run a
``corrnoise plan --plan-out FILE`` reviewed, without planning again) -> ``make_private`` -> the
loop -> the report (:class:`TrainResult`, whose :meth:`~TrainResult.to_dict` is the ``corrnoise
train`` JSON object).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable

from .errors import CorrnoiseError, check_int, check_real
from .progress import LineProgress
from .pipelines import AUTO, PIPELINES, pipeline_of

if TYPE_CHECKING:
    from .runplan import RunPlan

#: the largest float32: a learning rate above it overflows the models' float32 parameters (found in
#: review: --lr 1e300 ended in an internal error)
_FLOAT32_MAX = 3.4028234663852886e38

__all__ = ["train", "TrainResult", "PIPELINES", "resolve_device", "plot_history", "candidate_choice",
           "check_mechanism", "choose_mechanism"]


def resolve_device(device: str = "auto"):
    """``auto``: CUDA when available, else CPU; otherwise a torch device string (cpu, cuda, cuda:N)."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise CorrnoiseError("device", f"must be auto, cpu, cuda or cuda:N, got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CorrnoiseError("device", "CUDA is not available on this machine; use --device cpu")
    return dev


def train(
    dataset: str = "digits",
    mechanism: str = AUTO,
    *,
    epsilon: float | None = None,
    delta: float | None = None,
    batching: str = AUTO,
    epochs: float | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    momentum: float | None = None,
    optimizer: str | None = None,
    clip_norm: float | None = None,
    seed: int = 0,
    noise_seed: int | None = None,
    sampler_seed: int | None = None,
    device: str = "auto",
    data_options: dict[str, Any] | None = None,
    max_physical_batch_size: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    plan_plot: str | None = None,
    choice: dict[str, Any] | None = None,
    plan: RunPlan | None = None,
) -> TrainResult:
    """Plan the run, privatize, train, evaluate: the :class:`TrainResult` of ``corrnoise train``.

    ``mechanism``: ``auto`` (the planner's recommendation for the pipeline ``batching``), a
    family (the planner's best of it), or a mechanism name or file; ``plan``: a
    :class:`~corrnoise.runplan.RunPlan` to train exactly; ``choice``: a :func:`choose_mechanism`
    / :func:`candidate_choice` result to train instead of choosing again. Hyperparameters left
    None take the dataset's defaults. Seeds, ``plan_plot`` and the result: the module docstring.
    ``progress(label, done, total)`` hears planning and training; None: progress lines on stderr
    (:class:`~corrnoise.progress.LineProgress`, quiet for the first second), False: silence.
    """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from .datasets import load
    from .models import model_for
    from .torch import front

    start = time.perf_counter()
    s = _settings(dataset, mechanism, batching, epsilon, delta, seed, sampler_seed, device, plan, choice,
                  dict(epochs=epochs, batch_size=batch_size, lr=lr, momentum=momentum, optimizer=optimizer,
                       clip_norm=clip_norm))
    data = load(dataset, **(data_options or {}))
    run = _plan(s, mechanism, plan, choice, len(data.y_train), progress)
    if plan_plot is not None and run.planner_result is not None:
        from .planner.plot import plot_plan

        plot_plan(run.planner_result, plan_plot)
    planned = time.perf_counter()

    torch.manual_seed(s.seed)
    model = model_for(dataset).to(s.device)
    opt = (torch.optim.SGD(model.parameters(), lr=s.lr, momentum=s.momentum) if s.optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=s.lr))
    xtr, ytr, xte, yte = data.tensors()
    # only the order of unamplified cyclic batches may follow the public seed
    sampler_seed = s.seed if s.sampler_seed is None and run.sampler.name == "cyclic" else s.sampler_seed
    model, opt, loader = front.make_private(
        model, opt, DataLoader(TensorDataset(xtr, ytr), batch_size=run.batch_size), plan=run, max_grad_norm=s.clip,
        seed=sampler_seed, noise_seed=noise_seed, max_physical_batch_size=max_physical_batch_size)
    # None: lines on stderr past a second, also while training (a user probe: minutes of silence
    # in train's loop when stderr was not a terminal)
    history, train_loss = _loop(model, opt, loader, xte, yte, s.device,
                                LineProgress() if progress is None else progress)
    trained = time.perf_counter()

    model.eval()
    with torch.no_grad():
        accuracy = (_accuracy(model, xte, yte, s.device), _accuracy(model, xtr, ytr, s.device))
    return _report(dataset, run, opt, s, accuracy, train_loss, history, (start, planned, trained))


@dataclass(frozen=True)
class TrainResult(Mapping):
    """What :func:`train` reports: the run (mechanism label, strategy, batching spec, the
    participation an unamplified epsilon is for, pipeline), its privacy (accounting method, kind,
    target and spent epsilon, delta, noise), its hyperparameters, accuracies, the steps taken with
    examples left out for a non-finite gradient (``nonfinite_steps``, about the data), timings,
    the test accuracy after every pass (``history``) and the planner's candidates. Read-only
    mapping access (``result["epsilon"]``) as before; :meth:`to_dict` is the ``corrnoise train
    --json`` object."""

    dataset: str
    mechanism: str
    strategy: str
    batching: str
    participation: str | None
    pipeline: str | None
    accounting: str
    kind: str
    epsilon_target: float
    epsilon: float
    delta: float
    noise_std: float
    noise_multiplier: float
    steps: int
    batch_size: int
    epochs: float
    lr: float
    clip_norm: float
    test_accuracy: float
    train_accuracy: float
    train_loss: float
    nonfinite_steps: int
    device: str
    seconds_planning: float
    seconds_training: float
    seconds: float
    history: list
    candidates: list

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self.__dataclass_fields__)

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)


def _report(dataset, run, opt, s, accuracy, train_loss, history, times) -> TrainResult:
    """The result of a finished run, its privacy accounted on what ran (never above the target)."""
    target = s.epsilon if s.epsilon is not None else run.guarantee.epsilon
    spent = opt.privacy_spent()
    if spent.kind != "guarantee" or spent.epsilon > target * (1 + 1e-9):
        raise RuntimeError(f"accounted epsilon {spent.epsilon} ({spent.kind}) exceeds the budget {target}")
    start, planned, trained = times
    participation = getattr(opt.batching, "participation", None)  # unamplified: what the epsilon is for
    return TrainResult(
        dataset=dataset, mechanism=run.label, strategy=opt.strategy.label, batching=opt.batching.spec,
        participation=None if participation is None else participation.spec, pipeline=run.pipeline,
        accounting=spent.method, kind=spent.kind, epsilon_target=target,
        epsilon=spent.epsilon, delta=spent.delta, noise_std=opt.noise_std, noise_multiplier=opt.noise_multiplier,
        steps=opt.steps_taken, batch_size=run.batch_size,
        epochs=run.epochs if run.epochs is not None else run.steps / run.steps_per_epoch, lr=s.lr, clip_norm=s.clip,
        test_accuracy=accuracy[0], train_accuracy=accuracy[1], train_loss=train_loss,
        nonfinite_steps=opt.nonfinite_steps, device=str(s.device),
        seconds_planning=planned - start, seconds_training=trained - planned, seconds=time.perf_counter() - start,
        history=history, candidates=list(run.candidates))


@dataclass(frozen=True)
class _Settings:
    """The validated settings of one :func:`train` call (hyperparameters with the dataset's
    defaults, or a given plan's size)."""

    epsilon: float | None
    delta: float | None
    pipeline: str | None
    seed: int
    sampler_seed: int | None
    device: Any
    epochs: float
    batch_size: Any
    lr: float
    clip: float
    momentum: float
    optimizer: str


def _settings(dataset, mechanism, batching, epsilon, delta, seed, sampler_seed, device, plan, choice,
              given: dict[str, Any]) -> _Settings:
    """Check what :func:`train` was given (one line naming the parameter) and fill in defaults."""
    from .datasets import DATASETS

    if dataset not in DATASETS:
        raise CorrnoiseError("dataset", f"must be one of {', '.join(DATASETS)}, got {dataset!r}")
    if batching not in PIPELINES:
        raise CorrnoiseError("batching", f"must be one of {', '.join(PIPELINES)}, got {batching!r}")
    pipeline = batching
    if plan is not None:
        epsilon, delta, pipeline = _plan_settings(plan, mechanism, batching, epsilon, delta, choice, given)
    epsilon = check_real("epsilon", epsilon, low=0.0, low_open=True) if epsilon is not None or plan is None else None
    delta = check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    seed = check_int("seed", seed, minimum=0, maximum=(1 << 62))
    if sampler_seed is not None:
        sampler_seed = check_int("sampler_seed", sampler_seed, minimum=0, maximum=(1 << 62))
    dev = resolve_device(device)
    hp = dict(DATASETS[dataset].defaults)
    hp.update({key: value for key, value in given.items() if value is not None})
    if hp["optimizer"] == "adam":
        if given["momentum"] is not None:
            raise CorrnoiseError("momentum", "applies to sgd only (adam keeps its own moment estimates)")
        if given["lr"] is None and DATASETS[dataset].defaults.get("optimizer") != "adam":
            raise CorrnoiseError("lr", f"give it with optimizer adam: the {dataset} default ({hp['lr']:g}) is tuned "
                                 "for sgd")
    epochs = check_real("epochs", hp["epochs"], low=0.0, low_open=True, high=10000.0)
    lr = check_real("lr", hp["lr"], low=0.0, low_open=True, high=_FLOAT32_MAX)  # the models train in float32
    clip = check_real("clip_norm", hp["clip_norm"], low=0.0, low_open=True)
    momentum = check_real("momentum", hp.get("momentum", 0.0), low=0.0, high=1.0, high_open=True)
    if hp["optimizer"] not in ("sgd", "adam"):
        raise CorrnoiseError("optimizer", f"must be sgd or adam, got {hp['optimizer']!r}")
    return _Settings(epsilon, delta, pipeline, seed, sampler_seed, dev, epochs, hp["batch_size"], lr, clip, momentum,
                     hp["optimizer"])


def _plan_settings(plan, mechanism, batching, epsilon, delta, choice, given: dict[str, Any]):
    """(epsilon, delta, pipeline) of a run that trains ``plan``: the plan decides the mechanism,
    the pipeline, the length and the batch size (given ones must agree), the budget defaults to
    its guarantee's epsilon and delta."""
    from .runplan import RunPlan

    if not isinstance(plan, RunPlan):
        raise CorrnoiseError("plan", f"must be a RunPlan (RunPlan.from_json), got {type(plan).__name__}")
    if choice is not None or mechanism != AUTO:
        raise CorrnoiseError("choice" if choice is not None else "mechanism", "is decided by the plan; give the plan "
                             "or a mechanism, not both")
    formed = pipeline_of(plan.sampler.name) if plan.sampler.name is not None else plan.pipeline
    if batching not in (AUTO, plan.pipeline, formed):  # review: a plan of the auto pipeline named its own refused
        raise CorrnoiseError("batching", f"the plan's batches are {plan.sampler.name or plan.batching.spec} "
                             f"(the {formed} pipeline), not {batching}")
    plan.check_fits(batch_size=given["batch_size"],
                    epochs=given["epochs"] if plan.epochs is not None else None)
    if plan.guarantee is None and epsilon is None:
        raise CorrnoiseError("epsilon", "the plan's noise was given, not calibrated to a guarantee: give the budget")
    if delta is not None and delta != plan.delta:  # review: it was taken silently, the plan's delta trained
        raise CorrnoiseError("delta", f"the plan is for delta {plan.delta:g}, not {delta:g}: drop the delta or plan "
                             "again")
    given.update(epochs=plan.epochs if plan.epochs is not None else given["epochs"], batch_size=plan.batch_size)
    return epsilon, plan.delta, plan.pipeline


def _within_budget(plan: RunPlan, epsilon: float | None) -> RunPlan:
    """The plan, its guarantee within the budget ``epsilon`` (None: the guarantee's own), before
    it trains: a plan of a given noise is accounted now and carries its run's guarantee (found in
    review: its epsilon 8.17 over a budget of 1 was found after training, as an internal error).
    Else a one-line refusal naming ``epsilon``."""
    from dataclasses import replace

    from .accounting import account
    from .accounting.base import require_guarantee

    spent = plan.guarantee
    if spent is None:
        spent = require_guarantee(account(plan.event, delta=plan.delta, method=plan.method,
                                          **plan.accounting_options), "training")
    if epsilon is not None and spent.epsilon > epsilon * (1 + 1e-9):
        raise CorrnoiseError("epsilon", f"the plan's noise gives epsilon {spent.epsilon:.4g} ({spent.method}) > the "
                             f"budget {epsilon:g}: give a budget of at least that, or plan more noise")
    return plan if plan.guarantee is not None else replace(plan, guarantee=spent)


def _plan(s: _Settings, mechanism, plan, choice, num_examples: int, progress) -> RunPlan:
    """The run to train: ``plan`` (checked against the data), or the plan of ``choice``, or
    planned now for the pipeline (:func:`corrnoise.runplan.plan_run`)."""
    from .runplan import plan_choice, plan_run

    batch = check_int("batch_size", s.batch_size, minimum=1, maximum=num_examples)
    if plan is not None:
        plan.check_fits(dataset_size=num_examples, batch_size=batch)
        return _within_budget(plan, s.epsilon)
    if choice is not None:
        return plan_choice(choice, dataset_size=num_examples, batch_size=batch, epochs=s.epochs, delta=s.delta,
                           pipeline=s.pipeline)
    return plan_run(dataset_size=num_examples, batch_size=batch, mechanism=mechanism, pipeline=s.pipeline,
                    epsilon=s.epsilon, delta=s.delta, epochs=s.epochs, progress=progress)


def _loop(model, opt, loader, xte, yte, dev, progress) -> tuple[list, float]:
    """The user's loop on the private loader until the planned steps are taken: (test accuracy
    after every pass, mean training loss)."""
    import torch

    criterion = torch.nn.CrossEntropyLoss()
    loss_sum, loss_count, history = 0.0, 0, []
    while opt.steps_taken < opt.steps:
        model.train()
        for x, y in loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            loss = criterion(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if len(y):
                loss_sum += float(loss.detach()) * len(y)
                loss_count += len(y)
            if progress:
                progress("training", opt.steps_taken, opt.steps)
        model.eval()
        with torch.no_grad():
            history.append((opt.steps_taken, _accuracy(model, xte, yte, dev)))
    return history, loss_sum / loss_count if loss_count else math.nan


def _accuracy(model, x, y, dev, chunk: int = 4096) -> float:
    correct = 0
    for i in range(0, len(y), chunk):
        out = model(x[i:i + chunk].to(dev))
        correct += int((out.argmax(dim=1).cpu() == y[i:i + chunk]).sum())
    return correct / max(len(y), 1)


def candidate_choice(candidate, planned) -> dict[str, Any]:
    """What to train for one of the planner's candidates: :func:`corrnoise.runplan.candidate_choice`."""
    from .runplan import candidate_choice as choice_of

    return choice_of(candidate, planned)


def check_mechanism(dataset: str, mechanism: str, *, epsilon: float, delta: float, batching: str = AUTO,
                    epochs: float | None = None, batch_size: int | None = None,
                    data_options: dict[str, Any] | None = None) -> None:
    """One line naming ``mechanism`` where :func:`train` could not build it for this run, said
    before any run trains: a name (``bsr:4``, ``blt:...``) is parsed for the run's own steps and
    its batching formed for the pipeline, by :func:`choose_mechanism` with :func:`train`'s
    settings. ``corrnoise train --compare`` checks its second run with it (a typo in a family's
    parameter, ``bsr:abc`` or ``dpcgd:2``, was found only after the first run had trained).
    ``auto`` and the planner's families pass (the planner builds them); loads the dataset for
    its size."""
    from .datasets import load
    from .runplan import choose_mechanism as choose, is_planned

    if is_planned(mechanism, calibrated=True):
        return
    s = _settings(dataset, mechanism, batching, epsilon, delta, 0, None, "cpu", None, None,
                  dict(epochs=epochs, batch_size=batch_size, lr=None, momentum=None, optimizer=None, clip_norm=None))
    n = len(load(dataset, **(data_options or {})).y_train)
    choose(mechanism, num_examples=n, batch_size=check_int("batch_size", s.batch_size, minimum=1, maximum=n),
           epochs=s.epochs, epsilon=s.epsilon, delta=s.delta, pipeline=s.pipeline)


def choose_mechanism(mechanism: str, **kwargs: Any) -> dict[str, Any]:
    """What to train for a pipeline: :func:`corrnoise.runplan.choose_mechanism`."""
    from .runplan import choose_mechanism as choose

    return choose(mechanism, **kwargs)


def plot_history(results: list[dict[str, Any]], path: str, title: str) -> str:
    """One PNG: test accuracy after every epoch of each run (``train`` results), labelled with the
    mechanism, its batching and the privacy it reports."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for res in results:
        steps, acc = zip(*res["history"]) if res["history"] else ((), ())
        ax.plot(steps, acc, marker="o", label=f"{res['mechanism']} / {res['batching'].split(':')[0]}: "
                f"{res['test_accuracy']:.3f} (eps {res['epsilon']:.3g}, {res['accounting']})")
    ax.set_xlabel("step")
    ax.set_ylabel("test accuracy")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return str(out)
