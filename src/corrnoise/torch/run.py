"""A thin ``(x, y)`` helper over the front door: :func:`make_private_run` and :class:`PrivateRun`.

    run = make_private_run(model, optimizer, loss_fn, train_set, mechanism="bsr:4",
                           epsilon=8.0, delta=1e-5, batch_size=64, epochs=10)
    for x, y in run.data_loader:          # one pass: the whole planned run
        run.step(x, y)
    print(run.privacy_spent().epsilon)

It is the old ``make_private(model, optimizer, loss_fn, dataset)`` call, kept for scripts with
an ``(inputs, targets)`` dataset and a loss function. Everything private is the front door's
(:func:`corrnoise.torch.front.make_private`): the plan and its gate, the sampler and its data
loader, the clipping engine, the noise and the optimizer. ``step(x, y)`` is only the loop body
a user of the front door writes: forward, ``loss_fn``, backward, ``optimizer.step()``,
``optimizer.zero_grad()``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader

from ..accounting import PrivacyResult
from ..errors import CorrnoiseError, check_int
from ..pipelines import BATCHINGS as SAMPLERS
from ..sampling import BatchSampler
from ..strategies import Strategy
from .front import DPDataLoader, DPOptimizer, make_private

__all__ = ["PrivateRun", "make_private_run"]

class PrivateRun:
    """``(module, optimizer, data_loader)`` of the front door with an ``(x, y)`` step.

    ``optimizer`` is the front door's :class:`~corrnoise.torch.front.DPOptimizer`;
    ``data_loader`` its :class:`~corrnoise.torch.front.DPDataLoader`, here yielding every
    remaining planned step in one pass. Privacy attributes (``steps``, ``steps_taken``,
    ``strategy``, ``batching``, ``sampler``, ``noise_std``, ``noise_seed``, ``delta``) are the
    optimizer's.
    """

    def __init__(self, module: torch.nn.Module, optimizer: DPOptimizer, data_loader: DPDataLoader,
                 loss_fn: Callable[[Any, Any], torch.Tensor]):
        self.module, self.optimizer, self.data_loader, self.loss_fn = module, optimizer, data_loader, loss_fn
        self.last_stats: dict[str, Any] = {}

    def step(self, inputs, targets) -> dict[str, Any]:
        """One private step on a batch of :attr:`data_loader`; returns non-private statistics
        (``loss``: the batch's mean loss, ``count``: real examples, ``clipped_fraction``)."""
        loss = self.loss_fn(self.module(inputs), targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        stats = self.optimizer.last_stats
        count = int(stats.get("count", 0))
        self.last_stats = {"loss": float(loss.detach()) if count else math.nan, "count": count,
                           "clipped_fraction": stats.get("clipped", 0) / count if count else 0.0}
        return self.last_stats

    # --- the optimizer's privacy state -------------------------------------------------------------
    def privacy_spent(self, steps: int | None = None, **options: Any) -> PrivacyResult:
        return self.optimizer.privacy_spent(steps, **options)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    steps = property(lambda self: self.optimizer.steps)
    steps_taken = property(lambda self: self.optimizer.steps_taken)
    strategy = property(lambda self: self.optimizer.strategy)
    batching = property(lambda self: self.optimizer.batching)
    sampler = property(lambda self: self.optimizer.sampler)
    noise_std = property(lambda self: self.optimizer.noise_std)
    noise_seed = property(lambda self: self.optimizer.noise_seed)
    delta = property(lambda self: self.optimizer.delta)
    expected_batch_size = property(lambda self: self.optimizer.expected_batch_size)


def make_private_run(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    dataset,
    *,
    delta: float,
    mechanism: str | Strategy = "identity",
    epsilon: float | None = None,
    noise_std: float | None = None,
    noise_multiplier: float | None = None,
    batch_size: int | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    sampler: BatchSampler | str = "auto",
    clip_norm: float = 1.0,
    loss_reduction: str = "mean",
    max_physical_batch_size: int | None = None,
    seed: int | None = None,
    noise_seed: int | None = None,
    store_noise_seed: bool = False,
    accounting_method: str = "auto",
    accounting_options: dict[str, Any] | None = None,
    noise_method: str = "auto",
    num_workers: int = 0,
) -> PrivateRun:
    """The old call, on the front door: ``make_private(module, optimizer, DataLoader(dataset,
    batch_size), max_grad_norm=clip_norm, batching=sampler, ...)`` wrapped in a
    :class:`PrivateRun`. ``sampler``: a ready :mod:`corrnoise.sampling` sampler or one of
    ``auto, poisson, block-cyclic, balls-in-bins, cyclic``. ``loss_fn(model(x), y)`` must reduce
    over the batch as ``loss_reduction`` says (``mean``, as ``F.cross_entropy``, or ``sum``).
    Other arguments as for :func:`corrnoise.torch.make_private`.
    """
    if isinstance(sampler, BatchSampler):
        batch_size = max(1, round(sampler.expected_batch_size))
    elif sampler not in SAMPLERS:
        raise CorrnoiseError("sampler", f"must be a corrnoise.sampling sampler or one of {', '.join(SAMPLERS)}, "
                             f"got {sampler!r}")
    elif batch_size is None:
        raise CorrnoiseError("batch_size", "give the (expected) batch size")
    if not callable(loss_fn):
        raise CorrnoiseError("loss_fn", f"must be callable, got {type(loss_fn).__name__}")
    loader = DataLoader(dataset, batch_size=check_int("batch_size", batch_size, minimum=1), num_workers=num_workers)
    module, private, data_loader = make_private(
        model, optimizer, loader, delta=delta, max_grad_norm=clip_norm, mechanism=mechanism, epsilon=epsilon,
        noise_multiplier=noise_multiplier, noise_std=noise_std, epochs=epochs, steps=steps, batching=sampler,
        loss_reduction=loss_reduction, max_physical_batch_size=max_physical_batch_size, seed=seed,
        noise_seed=noise_seed, store_noise_seed=store_noise_seed, accounting_method=accounting_method,
        accounting_options=accounting_options, noise_method=noise_method)
    data_loader.steps_per_epoch = private.steps  # one pass over the helper's loader: the whole run, as before
    return PrivateRun(module, private, data_loader, loss_fn)
