"""The PyTorch front door: ``make_private(module, optimizer, data_loader)`` on the user's own loop.

    module, optimizer, data_loader = make_private(module, optimizer, data_loader, mechanism="auto",
                                                  epsilon=8.0, delta=1e-5, epochs=10, max_grad_norm=1.0)
    for x, y in data_loader:                       # the user's unchanged loop
        loss = criterion(module(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(optimizer.privacy_spent())

What each piece does (tutorial Alg. 3.1):

* the **data loader** yields the batches of a corrnoise sampler (Poisson, block-cyclic Poisson,
  balls-in-bins, cyclic) built from the user's loader's dataset, expected batch size, collate
  function and workers, so the batches are the ones the accounting analyses. With
  ``max_physical_batch_size`` it cuts each sampled (logical) batch into micro-batches and tells
  the optimizer where a logical batch ends (gradient accumulation with one noise row per logical
  step, as Opacus's BatchMemoryManager). Padding entries of fixed-size balls-in-bins batches
  (seed 000 App. I) are real items whose contribution the optimizer masks to zero.
* the **module** is the user's, with the hooks of the clipping engine
  (:mod:`corrnoise.torch.clipping`) that capture what each layer needs for per-example clipping;
  any forward signature works (the engine never calls the model itself).
* the **optimizer** is a :class:`torch.optim.Optimizer` (schedulers, ``state_dict`` and
  ``param_groups`` work) that wraps the user's: ``step()`` takes the engine's clipped sum, adds
  max_grad_norm * noise_std * (C^-1 Z)[t] and divides by the expected batch size
  (:mod:`.privatizer`), then runs the wrapped optimizer's update.

Every check that sampler, mechanism and accounting agree is the one gate of
:func:`corrnoise.torch.optimizer.plan_private` -- nothing here repeats a privacy precondition.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..accounting import PrivacyResult
from ..errors import CorrnoiseError, check_int, check_real, user_stacklevel
from ..pipelines import batching_name, pipeline_of
from ..sampling import BatchSampler
from ..strategies import Strategy
from .distributed import (DistributedPrivatizer, _broadcast_module, _data_parallel, _global_rank0,
                          _shared_sampler_seed)
from .dp_optimizer import DPOptimizer, _matching_guarantee
from .loader import (BATCHINGS, DPDataLoader, _loader_settings, _sampling_for, _StepContext, _steps_per_epoch,
                     choose_batching)
from .optimizer import check_run_size, plan_private
from .privatizer import Privatizer

__all__ = ["DPOptimizer", "DPDataLoader", "make_private", "choose_batching", "plan_mechanism", "BATCHINGS"]


# ----------------------------------------------------------------------------------------------
# make_private
# ----------------------------------------------------------------------------------------------
def make_private(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: DataLoader,
    *,
    delta: float,
    max_grad_norm: float,
    mechanism: str | Strategy = "auto",
    epsilon: float | None = None,
    noise_multiplier: float | None = None,
    noise_std: float | None = None,
    guarantee: PrivacyResult | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    batching: str | BatchSampler = "auto",
    loss_reduction: str = "mean",
    max_physical_batch_size: int | None = None,
    seed: int | None = None,
    noise_seed: int | None = None,
    store_noise_seed: bool = False,
    nan_policy: str = "warn",
    accounting_method: str = "auto",
    accounting_options: dict[str, Any] | None = None,
    noise_method: str = "auto",
    distributed: bool | None = None,
) -> tuple[torch.nn.Module, DPOptimizer, DPDataLoader]:
    """Privatize an existing PyTorch training loop; returns ``(module, optimizer, data_loader)``.

    ``data_loader``: the user's DataLoader; its dataset, ``batch_size`` (the expected batch
    size of the private batches), collate function and workers are kept, its order is not (the
    batches come from the sampler the accounting analyses). ``mechanism``: ``auto`` or a planner
    family (``dpsgd``, ``bandmf``, ``blt``, ``dpcgd``, ``toeplitz``, ``dense``, ``tree``: the
    planner's best of it for this run and ``batching``, see :func:`plan_mechanism`), a name
    (``identity``, ``bsr:4``, ``dpcgd:0.9``, ``blt:...``), a mechanism file or a Strategy.
    Exactly one of ``epsilon`` (calibrate), ``noise_multiplier`` (sigma = noise_std /
    ||C||_col), ``noise_std``, and ``guarantee`` (a PrivacyResult of kind "guarantee" already
    calibrated for this mechanism, batching and number of steps, e.g. the planner's
    recommendation: its noise is used and ``privacy_spent()`` of the finished run returns it).
    Exactly one of ``epochs`` and ``steps`` (a ready sampler may stand for both). ``batching``: one of
    ``auto, poisson, block-cyclic, balls-in-bins, cyclic`` (``auto``: Poisson for DP-SGD,
    block-cyclic Poisson for banded C, balls-in-bins for other non-negative C, cyclic otherwise),
    or a ready :mod:`corrnoise.sampling` sampler built for the loader's dataset (its steps, rate
    and seed are the run's; ``epochs`` / ``steps`` may then be left out).
    ``loss_reduction``: how the user's loss reduces over the batch (``mean``, Opacus's
    convention, or ``sum``). ``max_physical_batch_size``: cut logical batches into micro-batches
    (one noise row per logical step). ``seed`` drives the sampler only; leave it None (63 bits
    from the OS) for any real release: amplification by sampling (``poisson``, ``block-cyclic``,
    ``balls-in-bins``) assumes the adversary does not know which steps used an example, so the
    amplified guarantee holds only if the sampler seed is secret. A seed given with an amplified
    batching is for experiments and raises a :class:`UserWarning`; the order of ``cyclic``
    batches is not secret for the analysis. ``noise_seed`` drives the noise -- leave it None (a
    secret seed from the OS) for any real release. ``optimizer.state_dict()`` always holds the
    sampler seed (a resumed run reuses it) and, for stateful mechanisms, recent noise rows: keep
    checkpoints of the optimizer as private as the data. ``store_noise_seed``: put the noise
    seed there too. ``nan_policy``: examples whose gradient is NaN/inf are left out of the update
    (clip factor 0); ``"warn"`` (default) warns and takes the step, ``"raise"`` refuses it.

    ``distributed``: data-parallel training over a torch.distributed process group; ``None``
    (default) turns it on for a :class:`~torch.nn.parallel.DistributedDataParallel` module (its
    ``process_group``) or when a default process group is initialized, ``False`` turns it off
    (not allowed for a DDP module). Call make_private on every rank with the same arguments:

    * one global sampler: the sampler ``seed`` is broadcast from rank 0 (checked equal when
      given; else rank 0's secret one from the OS), every rank draws the same global batch and
      the loader yields its disjoint share (every ``world_size``-th index). Accounting, steps and
      the expected batch size are those of the global batch; with ``epsilon`` only rank 0
      calibrates and broadcasts the noise_std.
    * the clipping engine hooks the inner module (``module.module``) and clips this rank's
      examples. DDP's own all-reduce of *unclipped* gradients is switched off for good
      (``require_backward_grad_sync = False``, what ``no_sync()`` does): it would be wasted work
      (``step()`` overwrites ``.grad``), and ranks with different numbers of micro-batches would
      issue different numbers of collectives. Consequently DDP no longer broadcasts buffers in
      forward after the first one (the engine refuses the layers whose buffers change in training).
      A plain module's parameters and buffers are broadcast from rank 0 once (as DDP does).
    * ``step()`` all-reduces (SUM) the clipped sums, then adds the noise row once: each rank
      generates its shard of the row and one all_gather assembles it
      (:class:`.distributed.DistributedPrivatizer`), so every rank adds the same row, equal to
      the single-process row for the same ``noise_seed``; with ``noise_seed=None`` rank 0 draws
      a 256-bit secret seed and broadcasts it. Every rank makes the identical update.
    """
    from .clipping import ClippingEngine

    if not isinstance(module, torch.nn.Module):
        raise CorrnoiseError("module", f"must be a torch.nn.Module, got {type(module).__name__}")
    max_grad_norm = check_real("max_grad_norm", max_grad_norm, low=0.0, low_open=True)
    if epochs is not None and steps is not None:
        raise CorrnoiseError("steps", "give exactly one of epochs and steps (the run's length)")
    if epochs is not None:
        if isinstance(epochs, (str, bool)):
            raise CorrnoiseError("epochs", f"must be a number, got {epochs!r}")
        epochs = check_real("epochs", epochs, low=0.0, low_open=True)
    if steps is not None:
        steps = check_int("steps", steps, minimum=1)
    if noise_seed is not None:
        noise_seed = check_int("noise_seed", noise_seed, minimum=0)
    if not isinstance(batching, BatchSampler) and batching not in BATCHINGS:
        raise CorrnoiseError("batching", f"must be one of {', '.join(BATCHINGS)} or a corrnoise.sampling sampler, "
                             f"got {batching!r}")
    if max_physical_batch_size is not None:
        max_physical_batch_size = check_int("max_physical_batch_size", max_physical_batch_size, minimum=1)
    dataset, batch_size, keep, collate_fn = _loader_settings(data_loader)
    if not isinstance(batching, BatchSampler):  # a ready sampler stands for its own size
        check_run_size(len(dataset), batch_size, epochs, steps)
    on, group, inner = _data_parallel(module, distributed)
    rank, world_size = (dist.get_rank(group), dist.get_world_size(group)) if on else (0, 1)
    seed_given = seed is not None and not isinstance(batching, BatchSampler)
    if on:
        seed = _shared_sampler_seed(seed, group)
    loader_epochs = epochs
    if isinstance(mechanism, str) and _is_planned(mechanism):
        if on:  # the planner's screening is randomized: ranks could choose different mechanisms
            raise CorrnoiseError("mechanism", f"{mechanism!r} would be planned on every rank (the planner's Monte "
                                 "Carlo screening could pick different mechanisms); plan once (corrnoise plan --out "
                                 "DIR) and pass the mechanism file with its batching and epsilon")
        if guarantee is not None or epsilon is None:
            raise CorrnoiseError("mechanism", f"{mechanism!r} is chosen by the planner for a target: give epsilon "
                                 "(or name a mechanism to use a given noise)")
        if isinstance(batching, BatchSampler):
            raise CorrnoiseError("mechanism", f"{mechanism!r} is chosen with its batching: pass batching as a name")
        mechanism, batching, steps, guarantee, _ = plan_mechanism(
            mechanism, batching, num_examples=len(dataset), batch_size=batch_size, epochs=epochs, steps=steps,
            epsilon=epsilon, delta=delta)
        epsilon, epochs = None, None
    if guarantee is not None:
        if any(v is not None for v in (epsilon, noise_std, noise_multiplier)):
            raise CorrnoiseError("guarantee", "give a guarantee or one of epsilon, noise_std, noise_multiplier, not both")
        if not isinstance(guarantee, PrivacyResult) or guarantee.kind != "guarantee":
            raise CorrnoiseError("guarantee", "must be a PrivacyResult of kind 'guarantee' (estimates and lower "
                                 "bounds never calibrate training noise)")
        noise_std = guarantee.noise_std
    # distributed with epsilon: rank 0 calibrates (Monte Carlo calibration draws fresh samples, so
    # ranks could disagree) and broadcasts; the others plan with a placeholder noise_std
    deferred = on and rank != 0 and epsilon is not None
    strategy, sampler, agreement, nu, calibration = plan_private(
        dataset, mechanism=mechanism, delta=delta, epsilon=None if deferred else epsilon,
        noise_std=1.0 if deferred else noise_std, noise_multiplier=noise_multiplier, batch_size=batch_size,
        epochs=epochs, steps=steps,
        sampler=_sampling_for(batching, mechanism, len(dataset), batch_size, epochs, steps), seed=seed,
        accounting_method=accounting_method, accounting_options=accounting_options)
    if seed_given and sampler.amplified:
        warnings.warn(f"a given seed fixes the {sampler.accounting.split(':', 1)[0]} sampler: its amplified privacy "
                      "guarantee assumes the sampler seed is secret (leave seed=None, drawn from the OS, for any "
                      "real release; a given seed is for experiments)", UserWarning, stacklevel=user_stacklevel())
    if on:
        shared = [nu, calibration]
        dist.broadcast_object_list(shared, src=_global_rank0(group), group=group)
        nu, calibration = shared
    if guarantee is not None:
        calibration = _matching_guarantee(guarantee, agreement, delta)
    optimized = None  # clip and noise only what the optimizer updates (as Opacus does)
    if isinstance(optimizer, torch.optim.Optimizer):
        chosen = [p for group in optimizer.param_groups for p in group["params"]]
        owned = {id(p) for p in inner.parameters()}
        if all(id(p) in owned for p in chosen if p.requires_grad):
            optimized = chosen  # else DPOptimizer refuses the foreign tensor, naming the optimizer
    engine = ClippingEngine(inner, loss_reduction=loss_reduction, max_grad_norm=max_grad_norm, parameters=optimized)
    params = list(engine.parameters)
    if on:
        if inner is module:
            _broadcast_module(module, group)  # replicas start equal, as DDP's constructor ensures
        privatizer = DistributedPrivatizer.for_parameters(
            strategy, params, noise_std=nu, clip_norm=max_grad_norm, expected_batch_size=sampler.expected_batch_size,
            seed=noise_seed, method=noise_method, group=group)
    else:
        privatizer = Privatizer.for_parameters(strategy, params, noise_std=nu, clip_norm=max_grad_norm,
                                               expected_batch_size=sampler.expected_batch_size, seed=noise_seed,
                                               method=noise_method)
    context = _StepContext()
    try:
        private = DPOptimizer(optimizer, engine=engine, privatizer=privatizer, strategy=strategy,
                              batching=agreement.batching, delta=delta, steps=agreement.steps,
                              accounting_method=accounting_method, accounting_options=accounting_options,
                              sampler=sampler, context=context, store_noise_seed=store_noise_seed,
                              calibration=calibration, nan_policy=nan_policy)
    except Exception:
        engine.detach()  # a refused call leaves the user's module without hooks
        raise
    private.noise_seed_given = noise_seed is not None
    private.sampler_seed_given = seed_given or isinstance(batching, BatchSampler)
    loader = DPDataLoader(dataset, sampler,
                          steps_per_epoch=_steps_per_epoch(sampler, loader_epochs, len(dataset), batch_size),
                          collate_fn=collate_fn, max_physical_batch_size=max_physical_batch_size, context=context,
                          rank=rank, world_size=world_size, **keep)
    return module, private, loader


def _is_planned(mechanism: str) -> bool:
    from ..planner import FAMILIES

    return mechanism == "auto" or mechanism in FAMILIES


def plan_mechanism(mechanism: str, batching: str, *, num_examples: int, batch_size: int, epochs, steps,
                   epsilon: float, delta: float, progress=None):
    """``mechanism="auto"`` (or a family): the planner's recommendation (:mod:`corrnoise.planner`)
    for this run and the pipeline ``batching`` describes -> (strategy, batching name, steps, the
    guarantee its noise was calibrated to, the :class:`~corrnoise.planner.PlanResult`). One
    planner, no second set of rules."""
    from ..planner import plan

    per_epoch = max(1, num_examples // batch_size)
    if steps is not None:
        steps = check_int("steps", steps, minimum=1)
        if steps % per_epoch:
            raise CorrnoiseError("steps", f"the planner plans whole epochs of {per_epoch} steps (N // B); give epochs "
                                 f"or a multiple of {per_epoch} steps, got {steps}")
        epochs = steps // per_epoch
    if epochs is None or not float(epochs).is_integer():
        raise CorrnoiseError("epochs", f"the planner plans whole epochs, got {epochs!r}")
    result = plan(dataset_size=num_examples, batch_size=batch_size, epochs=int(epochs), epsilon=epsilon, delta=delta,
                  pipeline=pipeline_of(batching), only=None if mechanism == "auto" else (mechanism,),
                  progress=progress)
    rec = result.recommended
    return rec.strategy, planned_batching(rec.batching), result.setup.n, rec.result, result


def planned_batching(spec: str) -> str:
    """The front door's batching name for a planner batching spec (``poisson:P`` -> ``poisson``,
    ``none`` (unamplified, the pipeline's participation) -> ``cyclic``)."""
    return batching_name(spec)
