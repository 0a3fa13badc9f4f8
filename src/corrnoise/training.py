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
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

from .errors import CorrnoiseError, check_int, check_real

__all__ = ["train", "PIPELINES", "resolve_device", "plot_history"]

#: the data pipelines a user may have (``--batching``)
PIPELINES = ("auto", "poisson", "cyclic", "balls-in-bins")


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


def _sampler_batching(batching_spec: str) -> str:
    """The front door's ``batching=`` name for an accounting SPEC (``poisson:P`` -> ``poisson``)."""
    head = batching_spec.split(":", 1)[0]
    return {"none": "cyclic"}.get(head, head)


def train(
    dataset: str = "digits",
    mechanism: str = "auto",
    *,
    epsilon: float,
    delta: float,
    batching: str = "auto",
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
) -> dict[str, Any]:
    """Plan, calibrate, train and evaluate; returns the ``corrnoise train`` JSON object.

    ``mechanism``: ``auto`` (the planner's recommendation for the pipeline), a family
    (``dpsgd``, ``bandmf``, ``blt``, ``dpcgd``: the planner's best of that family), or any
    mechanism name or file (``bsr:4``, ``dpcgd:0.9``, ``plan/recommended.json``: trained with
    ``batching`` as given, ``auto`` letting the front door choose). Hyperparameters left None
    take the dataset's defaults. ``seed`` fixes the model initialization and the data order of
    unamplified (cyclic) batches. An amplified sampler (Poisson, block-cyclic, balls-in-bins)
    never takes ``seed``: its guarantee assumes the adversary does not know which steps used an
    example, so its seed is secret (from the OS) unless ``sampler_seed`` is given (reproducible
    experiments only; make_private warns). The noise seed is secret (from the OS) unless
    ``noise_seed`` is given. ``plan_plot``: a .png
    path for the planner's picture (error vs epsilon, the chosen C) when the planner chose.
    The result's ``history`` is the test accuracy after every pass over the data. ``choice``: a
    :func:`choose_mechanism` result to train instead of choosing again (benchmarks train several
    seeds on one plan; ``mechanism`` is then only its label). ``progress(label, done, total)``
    hears planning and training; None: the planner's own progress lines on stderr, False: silence.
    """
    import torch
    from torch.utils.data import DataLoader

    from .datasets import DATASETS, load
    from .models import model_for
    from .torch.front import make_private
    from .torch.loader import _sampling_for

    start = time.perf_counter()
    if dataset not in DATASETS:
        raise CorrnoiseError("dataset", f"must be one of {', '.join(DATASETS)}, got {dataset!r}")
    if batching not in PIPELINES:
        raise CorrnoiseError("batching", f"must be one of {', '.join(PIPELINES)}, got {batching!r}")
    epsilon = check_real("epsilon", epsilon, low=0.0, low_open=True)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    seed = check_int("seed", seed, minimum=0, maximum=(1 << 62))
    if sampler_seed is not None:
        sampler_seed = check_int("sampler_seed", sampler_seed, minimum=0, maximum=(1 << 62))
    dev = resolve_device(device)
    hp = dict(DATASETS[dataset].defaults)
    for key, value in (("epochs", epochs), ("batch_size", batch_size), ("lr", lr), ("momentum", momentum),
                       ("optimizer", optimizer), ("clip_norm", clip_norm)):
        if value is not None:
            hp[key] = value
    if hp["optimizer"] == "adam":
        if momentum is not None:
            raise CorrnoiseError("momentum", "applies to sgd only (adam keeps its own moment estimates)")
        if lr is None and DATASETS[dataset].defaults.get("optimizer") != "adam":
            raise CorrnoiseError("lr", f"give it with optimizer adam: the {dataset} default ({hp['lr']:g}) is tuned "
                                 "for sgd")
    epochs = check_real("epochs", hp["epochs"], low=0.0, low_open=True, high=10000.0)
    lr = check_real("lr", hp["lr"], low=0.0, low_open=True)
    clip = check_real("clip_norm", hp["clip_norm"], low=0.0, low_open=True)
    momentum = check_real("momentum", hp.get("momentum", 0.0), low=0.0, high=1.0, high_open=True)
    if hp["optimizer"] not in ("sgd", "adam"):
        raise CorrnoiseError("optimizer", f"must be sgd or adam, got {hp['optimizer']!r}")

    data = load(dataset, **(data_options or {}))
    n_ex = len(data.y_train)
    batch = check_int("batch_size", hp["batch_size"], minimum=1, maximum=n_ex)

    if choice is not None and (not isinstance(choice, dict)
                               or not {"mechanism", "batching", "noise", "label"} <= set(choice)):
        raise CorrnoiseError("choice", "must be a choose_mechanism() / candidate_choice() result")
    if choice is None:
        choice = choose_mechanism(mechanism, num_examples=n_ex, batch_size=batch, epochs=epochs, epsilon=epsilon,
                                  delta=delta, pipeline=batching, progress=progress)
    if plan_plot is not None and choice.get("plan") is not None:
        from .planner.plot import plot_plan

        plot_plan(choice["plan"], plan_plot)
    planned = time.perf_counter()

    torch.manual_seed(seed)
    model = model_for(dataset).to(dev)
    params = model.parameters()
    opt = (torch.optim.SGD(params, lr=lr, momentum=momentum) if hp["optimizer"] == "sgd"
           else torch.optim.Adam(params, lr=lr))
    xtr, ytr, xte, yte = data.tensors()
    loader = DataLoader(torch.utils.data.TensorDataset(xtr, ytr), batch_size=batch)
    length = {"steps": choice["steps"]} if "steps" in choice else {"epochs": epochs}
    # the batching make_private will build (resolving "auto" as it does): only the order of
    # unamplified cyclic batches may follow the public seed
    resolved = _sampling_for(choice["batching"], choice["mechanism"], n_ex, batch, length.get("epochs"),
                             length.get("steps"))
    if sampler_seed is None and resolved == "cyclic":
        sampler_seed = seed
    model, opt, loader = make_private(
        model, opt, loader, mechanism=choice["mechanism"], batching=choice["batching"], delta=delta,
        max_grad_norm=clip, seed=sampler_seed, noise_seed=noise_seed, max_physical_batch_size=max_physical_batch_size,
        **length, **choice["noise"])
    criterion = torch.nn.CrossEntropyLoss()
    loss_sum, loss_count, done = 0.0, 0, 0
    history = []
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
            done += 1
            if progress:
                progress("training", opt.steps_taken, opt.steps)
        model.eval()
        with torch.no_grad():
            history.append((opt.steps_taken, _accuracy(model, xte, yte, dev)))
    trained = time.perf_counter()

    spent = opt.privacy_spent()
    if spent.kind != "guarantee" or spent.epsilon > epsilon * (1 + 1e-9):
        raise RuntimeError(f"accounted epsilon {spent.epsilon} ({spent.kind}) exceeds the budget {epsilon}")

    model.eval()
    with torch.no_grad():
        test_acc = _accuracy(model, xte, yte, dev)
        train_acc = _accuracy(model, xtr, ytr, dev)
    return {
        "dataset": dataset,
        "mechanism": choice["label"],
        "strategy": opt.strategy.label,
        "batching": opt.batching.spec,
        "pipeline": batching,
        "accounting": spent.method,
        "kind": spent.kind,
        "epsilon_target": epsilon,
        "epsilon": spent.epsilon,
        "delta": spent.delta,
        "noise_std": opt.noise_std,
        "noise_multiplier": opt.noise_multiplier,
        "steps": opt.steps_taken,
        "batch_size": batch,
        "epochs": epochs,
        "lr": lr,
        "clip_norm": clip,
        "test_accuracy": test_acc,
        "train_accuracy": train_acc,
        "train_loss": loss_sum / loss_count if loss_count else math.nan,
        "device": str(dev),
        "seconds_planning": planned - start,
        "seconds_training": trained - planned,
        "seconds": time.perf_counter() - start,
        "history": history,
        "candidates": choice.get("candidates", []),
    }


def _accuracy(model, x, y, dev, chunk: int = 4096) -> float:
    correct = 0
    for i in range(0, len(y), chunk):
        out = model(x[i:i + chunk].to(dev))
        correct += int((out.argmax(dim=1).cpu() == y[i:i + chunk]).sum())
    return correct / max(len(y), 1)


def candidate_choice(candidate, planned) -> dict[str, Any]:
    """What to train for one of the planner's candidates (given its final guarantee, see
    :func:`corrnoise.planner.finalize_candidate`): the :func:`choose_mechanism` dict."""
    from .torch.front import planned_batching

    if not candidate.final:
        raise CorrnoiseError("candidate", f"{candidate.mechanism} under {candidate.batching} has no final guarantee")
    return {"mechanism": candidate.strategy, "batching": planned_batching(candidate.batching),
            "label": candidate.mechanism, "noise": {"guarantee": candidate.result}, "steps": planned.setup.n,
            "plan": planned, "candidates": [c.to_dict() for c in planned.candidates]}


def choose_mechanism(mechanism: str, *, num_examples: int, batch_size: int, epochs: float, epsilon: float,
                     delta: float, pipeline: str, progress=None) -> dict[str, Any]:
    """What to train: ``{"mechanism", "batching", "steps" | "epochs", "noise", "label", "candidates"}``.

    ``auto`` and the planner's families go to the front door's planner step
    (:func:`corrnoise.torch.front.plan_mechanism`), which returns the mechanism, its batching for
    the pipeline and the guarantee its noise was calibrated to (verified where it is Monte Carlo);
    an explicit name is trained as named and calibrated by the front door for ``epsilon``.
    """
    from .torch.front import _is_planned, plan_mechanism

    if _is_planned(mechanism):
        planned = plan_mechanism(mechanism, pipeline, num_examples=num_examples, batch_size=batch_size, epochs=epochs,
                                 steps=None, epsilon=epsilon, delta=delta, progress=progress)[-1]
        return candidate_choice(planned.recommended, planned)
    from .planner import FAMILIES as PLANNED
    from .strategies import parse_strategy

    try:
        parse_strategy(mechanism, max(1, round(epochs * num_examples / batch_size)))
    except CorrnoiseError as exc:
        raise CorrnoiseError("mechanism", f"{exc.message}; or a family: auto, {', '.join(PLANNED)}") from None
    batching = pipeline
    if pipeline == "poisson":  # Poisson sampling: every step for DP-SGD, within blocks for a banded C
        from .torch.front import choose_batching

        probe = parse_strategy(mechanism, max(1, round(epochs * num_examples / batch_size)))
        batching = choose_batching(probe, num_examples, batch_size)
        if batching not in ("poisson", "block-cyclic"):
            batching = "poisson"  # any other C: Poisson with the accounting that suits it (MMCC)
    return {"mechanism": mechanism, "batching": batching, "label": mechanism, "noise": {"epsilon": epsilon},
            "epochs": epochs}


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
