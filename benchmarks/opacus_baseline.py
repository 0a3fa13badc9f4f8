"""Opacus DP-SGD on a corrnoise dataset with that dataset's model and defaults: the peer baseline
that bench_utility.py and bench_fashion_mnist.py train in the same run as ours."""

from __future__ import annotations

import time


def accuracy(model, x, y) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train_opacus(dataset: str, noise_multiplier: float, seed: int, delta: float,
                 data_options: dict | None = None) -> dict:
    """Opacus 1.x DP-SGD: the dataset's model, batch size, epochs, SGD lr / momentum and clip norm,
    Poisson sampling at rate B/N, at the given noise multiplier (ours, calibrated by PLD).  The
    epsilon is Opacus's own PRV-accountant estimate, labelled as such."""
    import torch
    from opacus import PrivacyEngine

    from corrnoise.datasets import load
    from corrnoise.models import model_for

    data = load(dataset, **(data_options or {}))
    xtr, ytr, xte, yte = data.tensors()
    hp = data.defaults
    torch.manual_seed(seed)
    model = model_for(dataset)
    opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=hp["momentum"])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xtr, ytr), batch_size=hp["batch_size"])
    engine = PrivacyEngine(accountant="prv")
    model, opt, loader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                             noise_multiplier=noise_multiplier, max_grad_norm=hp["clip_norm"],
                                             poisson_sampling=True)
    crit = torch.nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    history = []
    for _ in range(hp["epochs"]):
        model.train()
        for x, y in loader:
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
        history.append(accuracy(model, xte, yte))
    seconds = time.perf_counter() - t0
    return {"mechanism": "opacus-dpsgd", "strategy": "identity",
            "batching": f"poisson:{hp['batch_size'] / len(ytr):g}", "accounting": "opacus prv",
            "kind": "estimate (Opacus PRV accountant, not ours)", "epsilon": float(engine.get_epsilon(delta)),
            "noise_multiplier": noise_multiplier, "steps": hp["epochs"] * len(loader), "test_accuracy": history[-1],
            "seconds_training": seconds, "history": history}
