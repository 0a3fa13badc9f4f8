"""The PyTorch front door: ``make_private(module, optimizer, data_loader)`` on the user's own loop.

    module, optimizer, data_loader = make_private(module, optimizer, data_loader, mechanism="auto",
                                                  epsilon=8.0, delta=1e-5, epochs=10, max_grad_norm=1.0)
    for x, y in data_loader:                       # the user's unchanged loop
        loss = criterion(module(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(optimizer.privacy_spent())

or, planned once and reviewed before any privacy is spent (:mod:`corrnoise.runplan`)::

    plan = plan_run(dataset_size=len(dataset), batch_size=64, mechanism="bsr:4", epsilon=8.0, delta=1e-5,
                    epochs=10)
    plan.to_json("plan.json")                      # ... RunPlan.from_json("plan.json") elsewhere
    module, optimizer, data_loader = make_private(module, optimizer, data_loader, plan=plan, max_grad_norm=1.0)

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
  (:mod:`.privatizer`), then runs the wrapped optimizer's update. Once in the loop, before a
  forward, ``if not optimizer.attribution_checked: optimizer.check_attribution(per_example_loss,
  batch)`` checks on that batch that each example's gradient is its own
  (:mod:`.clipping.attribution`; models whose layers see the batch flattened or share an output
  over it, OPT and BART, train only after it).

Every decision about the run (mechanism, batching, sampler, agreement with the accounting,
noise) is :func:`corrnoise.runplan.plan_run`'s -- nothing here repeats a privacy precondition.

The arguments of :func:`make_private`:

``plan``: a :class:`~corrnoise.runplan.RunPlan` to train exactly (its dataset size, batch size
and steps must be the loader's and the length given, else one line naming the field); the
planning keywords below are then left out. Otherwise: ``data_loader``: the user's DataLoader;
its dataset, ``batch_size`` (the expected batch size of the private batches), collate function
and workers are kept, its order is not (the batches come from the sampler the accounting
analyses). ``mechanism``: ``auto`` or a planner family (``dpsgd``, ``bandmf``, ``blt``,
``dpcgd``, ``toeplitz``, ``dense``, ``tree``: the planner's best of it for this run and
``batching``, see :func:`~corrnoise.runplan.plan_mechanism`), a name (``identity``, ``bsr:4``,
``dpcgd:0.9``, ``blt:...``), a mechanism file or a Strategy. Exactly one of ``epsilon``
(calibrate), ``noise_multiplier`` (sigma = noise_std / ||C||_col), ``noise_std``, and
``guarantee`` (a PrivacyResult of kind "guarantee" already calibrated for this mechanism,
batching and number of steps, e.g. the planner's recommendation: its noise is used and
``privacy_spent()`` of the finished run returns it). Exactly one of ``epochs`` and ``steps`` (a
ready sampler may stand for both). ``batching``: one of :data:`corrnoise.pipelines.BATCHINGS`
(``auto``: Poisson for DP-SGD, block-cyclic Poisson for banded C, balls-in-bins for other
non-negative C, cyclic otherwise), or a ready :mod:`corrnoise.sampling` sampler built for the
loader's dataset (its steps, rate and seed are the run's; ``epochs`` / ``steps`` may then be
left out). ``delta``: the run's delta.

``loss_reduction``: how the user's loss reduces over the batch (``mean``, Opacus's convention,
or ``sum``) -- of per-example losses each of its own example, with no other batch-dependent
factor (``loss / len(batch)`` on top of a mean, a token mean over the whole batch): such a factor
moves the others' contributions when one example joins, beyond the clip norm; not checked, except
transformers' built-in token-averaged loss. ``max_physical_batch_size``: cut logical batches
into micro-batches (one noise row per logical step). ``seed`` drives the sampler only; leave it
None (63 bits from the OS) for any real release: amplification by sampling (``poisson``,
``block-cyclic``, ``balls-in-bins``) assumes the adversary does not know which steps used an
example, so the amplified guarantee holds only if the sampler seed is secret. A seed given with an
amplified batching is for experiments and raises a :class:`UserWarning`; the order of ``cyclic``
batches is not secret for the analysis. ``noise_seed`` drives the noise -- leave it None (a
secret seed from the OS) for any real release. ``optimizer.state_dict()`` always holds the
sampler seed (a resumed run reuses it) and, for stateful mechanisms, recent noise rows: keep
checkpoints of the optimizer as private as the data. ``store_noise_seed``: put the noise seed
there too. ``nan_policy``: examples whose gradient is NaN/inf are left out of the update (clip
factor 0); ``"warn"`` (default) warns and takes the step, ``"raise"`` refuses it.

``max_noise_memory`` ("2GB", "512MiB", 2e9 bytes): a budget for the noise state the generator keeps
between steps, for the trainable parameters (count and dtype) the optimizer updates
(:func:`corrnoise.noise_memory.noise_state_bytes`; the whole model's, also when data parallel ranks
hold a shard each). ``mechanism="auto"`` (or a family): the planner chooses within it (regenerated
noise where buffers do not fit); a named mechanism whose state does not fit with ``noise_method``
is refused with one line saying what would fit.

``distributed``: data-parallel training over a torch.distributed process group; ``None``
(default) turns it on for a :class:`~torch.nn.parallel.DistributedDataParallel` module (its
``process_group``) or when a default process group is initialized, ``False`` turns it off (not
allowed for a DDP module). Call make_private on every rank with the same arguments:

* one global sampler: the sampler ``seed`` is broadcast from rank 0 (checked equal when given;
  else rank 0's secret one from the OS; a ready sampler's seed is checked equal on every rank, so
  build it with one seed everywhere), every rank draws the same global batch and the loader
  yields its disjoint share (every ``world_size``-th index). Accounting, steps and the expected
  batch size are those of the global batch; with ``epsilon`` only rank 0 calibrates and
  broadcasts the noise_std. ``mechanism="auto"`` is refused (the planner's randomized screening
  could choose differently on each rank): plan once and pass the plan.
* the clipping engine hooks the inner module (``module.module``) and clips this rank's examples.
  DDP's own all-reduce of *unclipped* gradients is switched off for good
  (``require_backward_grad_sync = False``, what ``no_sync()`` does): it would be wasted work
  (``step()`` overwrites ``.grad``), and ranks with different numbers of micro-batches would
  issue different numbers of collectives. Consequently DDP no longer broadcasts buffers in
  forward after the first one (the engine refuses the layers whose buffers change in training).
  A plain module's parameters and buffers are broadcast from rank 0 once (as DDP does).
* ``step()`` all-reduces (SUM) the clipped sums, then adds the noise row once: each rank
  generates its shard of the row and one all_gather assembles it
  (:class:`.distributed.DistributedPrivatizer`), so every rank adds the same row, equal to the
  single-process row for the same ``noise_seed``; with ``noise_seed=None`` rank 0 draws a
  256-bit secret seed and broadcasts it. Every rank makes the identical update.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..accounting import PrivacyResult
from ..errors import CorrnoiseError, check_int, check_real, user_stacklevel
from ..noise.seeds import seed_commitment
from ..noise_memory import budgeted_noise_method, model_noise_budget
from ..pipelines import AUTO, BATCHINGS
from ..runplan import RunPlan, choose_batching, is_planned, plan_mechanism, plan_run, planned_batching
from ..sampling import BatchSampler
from ..strategies import Strategy
from .distributed import (DistributedPrivatizer, broadcast_module, check_same_run, data_parallel, global_rank0,
                          shared_sampler_seed)
from .dp_optimizer import DPOptimizer
from .loader import DPDataLoader, StepContext, loader_settings
from .privatizer import Privatizer, noise_dtype

__all__ = ["DPOptimizer", "DPDataLoader", "make_private", "choose_batching", "plan_mechanism", "planned_batching",
           "BATCHINGS"]


def make_private(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: DataLoader,
    *,
    max_grad_norm: float,
    plan: RunPlan | None = None,
    delta: float | None = None,
    mechanism: str | Strategy = AUTO,
    epsilon: float | None = None,
    noise_multiplier: float | None = None,
    noise_std: float | None = None,
    guarantee: PrivacyResult | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    batching: str | BatchSampler = AUTO,
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
    max_noise_memory: int | float | str | None = None,
) -> tuple[torch.nn.Module, DPOptimizer, DPDataLoader]:
    """Privatize an existing PyTorch training loop; returns ``(module, optimizer, data_loader)``.

    Trains ``plan`` (a :class:`~corrnoise.runplan.RunPlan`) exactly, or plans the run from the
    planning keywords (``mechanism``, ``batching``, one of ``epsilon`` / ``noise_std`` /
    ``noise_multiplier`` / ``guarantee``, ``epochs`` or ``steps``, ``delta``,
    ``accounting_method`` / ``accounting_options``) with :func:`~corrnoise.runplan.plan_run`.
    Every argument is described in the docstring of :mod:`corrnoise.torch.front`."""
    if not isinstance(module, torch.nn.Module):
        raise CorrnoiseError("module", f"must be a torch.nn.Module, got {type(module).__name__}")
    max_grad_norm = check_real("max_grad_norm", max_grad_norm, low=0.0, low_open=True)
    if noise_seed is not None:
        noise_seed = check_int("noise_seed", noise_seed, minimum=0)
    if max_physical_batch_size is not None:
        max_physical_batch_size = check_int("max_physical_batch_size", max_physical_batch_size, minimum=1)
    _check_method_names(noise_method, accounting_method)
    data = _Loader(*loader_settings(data_loader))
    par = _prepare_parallel(module, distributed, seed, batching)
    trainable = _trainable(module, optimizer)
    budget = model_noise_budget(max_noise_memory, trainable, noise_dtype(trainable) if trainable else None)
    planning = dict(delta=delta, mechanism=mechanism, epsilon=epsilon, noise_multiplier=noise_multiplier,
                    noise_std=noise_std, guarantee=guarantee, epochs=epochs, steps=steps, batching=batching,
                    accounting_method=accounting_method, accounting_options=accounting_options,
                    noise_budget=budget)
    plan = _prepare_plan(plan, planning, data, par)
    if noise_method == "auto":  # a plan made under a noise memory budget says how its noise runs
        noise_method = plan.noise_method
    noise_method = budgeted_noise_method(budget, plan.strategy, noise_method, plan.planner_result)
    sampler = _prepare_sampler(plan, batching, par)
    if par.on:
        described = plan.to_dict()
        # the sampler seed by commitment: a ready sampler keeps its own seed, one drawn from the OS
        # per process unless given (found in review: each rank then cut its share of another global
        # batch, and an example entered one step's sum from two ranks)
        check_same_run({"mechanism": f"{plan.strategy.label} (fingerprint {plan.fingerprint[:16]})",
                        **{k: described[k] for k in _RUN_FIELDS}, "max_grad_norm": max_grad_norm,
                        "loss_reduction": loss_reduction, "noise_method": noise_method,
                        "parameters": [tuple(p.shape) for p in _trainable(module, optimizer)],
                        "seed": f"sampler seed commitment {seed_commitment(sampler.seed)[:16]}"}, par.group)
    engine, privatizer = _prepare_engine(module, optimizer, plan, sampler, par, max_grad_norm=max_grad_norm,
                                         loss_reduction=loss_reduction, noise_seed=noise_seed,
                                         noise_method=noise_method)
    context = StepContext()
    private = _prepare_optimizer(optimizer, engine, privatizer, plan, sampler, context,
                                 store_noise_seed=store_noise_seed, nan_policy=nan_policy)
    private.noise_seed_given = noise_seed is not None
    private.sampler_seed_given = par.seed_given or isinstance(batching, BatchSampler)
    loader = DPDataLoader(data.dataset, sampler, steps_per_epoch=plan.steps_per_epoch, collate_fn=data.collate_fn,
                          max_physical_batch_size=max_physical_batch_size, context=context, rank=par.rank,
                          world_size=par.world_size, **data.keep)
    return module, private, loader


def _check_method_names(noise_method, accounting_method) -> None:
    """The two method keywords checked before anything is planned, each refused under its own name
    (the generator and the accountant name theirs ``method``)."""
    from ..accounting.base import get_method
    from ..noise.generators import NOISE_METHODS

    if noise_method not in NOISE_METHODS:
        raise CorrnoiseError("noise_method", f"must be one of {', '.join(NOISE_METHODS)}, got {noise_method!r}")
    if accounting_method != "auto":
        try:
            get_method(accounting_method)
        except CorrnoiseError as err:
            raise CorrnoiseError("accounting_method", err.message) from None
        except TypeError:
            raise CorrnoiseError("accounting_method", f"must be a method name, got {accounting_method!r}") from None


#: the plan's fields every data-parallel rank must agree on (:func:`.distributed.check_same_run`)
_RUN_FIELDS = ("dataset_size", "batch_size", "steps", "batching", "participation", "sampler", "delta",
               "noise_std", "method", "accounting_method")


def _trainable(module, optimizer) -> list[torch.Tensor]:
    """The tensors whose gradients get noise: the optimizer's that require grad (else the module's)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    return [p for p in module.parameters() if p.requires_grad]


class _Loader(NamedTuple):
    """What make_private keeps of the user's loader (:func:`.loader.loader_settings`)."""

    dataset: Any
    batch_size: int
    keep: dict[str, Any]
    collate_fn: Any


class _Parallel(NamedTuple):
    """Data parallelism of the call: on, process group, module to hook, rank, world size, the
    sampler seed (shared from rank 0) and whether the user gave it."""

    on: bool
    group: Any
    inner: torch.nn.Module
    rank: int
    world_size: int
    seed: int | None
    seed_given: bool


def _prepare_parallel(module, distributed, seed, batching) -> _Parallel:
    on, group, inner = data_parallel(module, distributed)
    rank, world_size = (dist.get_rank(group), dist.get_world_size(group)) if on else (0, 1)
    seed_given = seed is not None and not isinstance(batching, BatchSampler)
    if on:
        seed = shared_sampler_seed(seed, group)
    return _Parallel(on, group, inner, rank, world_size, seed, seed_given)


def _prepare_plan(plan, planning: dict[str, Any], data: _Loader, par: _Parallel) -> RunPlan:
    """The given plan checked against the loader and the keywords, or the plan of the keywords
    (data parallel: rank 0 calibrates -- Monte Carlo calibration draws fresh samples, so ranks
    could disagree -- and broadcasts the noise; the others plan with a placeholder noise_std)."""
    if plan is not None:
        _check_given_plan(plan, planning, len(data.dataset), data.batch_size)
        return plan
    if par.on and is_planned(planning["mechanism"], calibrated=planning["epsilon"] is not None):
        raise CorrnoiseError("mechanism", f"{planning['mechanism']!r} would be planned on every rank (the planner's "
                             "Monte Carlo screening could pick different mechanisms); plan once (corrnoise plan "
                             "--plan-out FILE, or plan_run) and pass the plan")
    if planning["delta"] is None:
        raise CorrnoiseError("delta", "give the run's delta (or a plan)")
    if par.on and par.rank != 0 and planning["epsilon"] is not None:
        planning = {**planning, "epsilon": None, "noise_std": 1.0}
    plan = plan_run(dataset_size=len(data.dataset), batch_size=data.batch_size, **planning)
    if par.on:
        shared = [plan.noise_std, plan.guarantee]
        dist.broadcast_object_list(shared, src=global_rank0(par.group), group=par.group)
        plan = plan.with_noise(*shared)
    return plan


def _check_given_plan(plan, planning: dict[str, Any], dataset_size: int, batch_size: int) -> None:
    """A plan decides the run: refuse planning keywords beside it, and a loader or length that
    is not the plan's (one line naming the field)."""
    if not isinstance(plan, RunPlan):
        raise CorrnoiseError("plan", f"must be a RunPlan (corrnoise.runplan.plan_run or RunPlan.from_json), got "
                             f"{type(plan).__name__}")
    given = [k for k in ("mechanism", "batching") if isinstance(planning[k], str) and planning[k] != AUTO]
    given += [k for k in ("epsilon", "noise_multiplier", "noise_std", "guarantee", "accounting_options")
              if planning[k] is not None]
    given += ["accounting_method"] if planning["accounting_method"] != "auto" else []
    if given:
        raise CorrnoiseError(given[0], "is decided by the plan; pass the plan or the planning keywords, not both")
    if planning["delta"] is not None and planning["delta"] != plan.delta:
        raise CorrnoiseError("delta", f"the plan is for delta {plan.delta:g}, not {planning['delta']:g}")
    plan.check_fits(dataset_size=dataset_size, batch_size=batch_size, steps=planning["steps"],
                    epochs=planning["epochs"])
    plan.check_guarantee()
    ready = planning["batching"]
    if isinstance(ready, BatchSampler) and (plan.sampler.name is not None
                                            or ready.describe() != plan.sampler.description):
        raise CorrnoiseError("batching", "this sampler is not the one the plan was made for")
    plan.check_parts(ready if isinstance(ready, BatchSampler) else plan.sampler.build(0))


def _prepare_sampler(plan: RunPlan, batching, par: _Parallel) -> BatchSampler:
    """The run's sampler: a ready one as given (its own seed), else the plan's with the (shared)
    seed -- secret from the OS unless given, which warns for an amplified batching."""
    if isinstance(batching, BatchSampler):
        return batching
    sampler = plan.sampler.build(par.seed)
    if par.seed_given and sampler.amplified:
        warnings.warn(f"a given seed fixes the {sampler.accounting.split(':', 1)[0]} sampler: its amplified privacy "
                      "guarantee assumes the sampler seed is secret (leave seed=None, drawn from the OS, for any "
                      "real release; a given seed is for experiments)", UserWarning, stacklevel=user_stacklevel())
    return sampler


def _warn_unoptimized(module: torch.nn.Module, chosen) -> None:
    """Trainable parameters of ``module`` outside the optimizer given to make_private are neither
    clipped nor noised: backward leaves their raw gradients in ``.grad``, and a second optimizer
    (or any update from them) trains them on the data while ``privacy_spent`` reports the run's
    epsilon. One warning, naming the first few; not refused (the gradients are harmless if nothing
    reads them)."""
    ids = {id(p) for p in chosen}
    names = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in ids]
    if names:
        shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
        warnings.warn(f"{len(names)} trainable parameter(s) of the module are not in the optimizer given to "
                      f"make_private ({shown}): they get no clipping and no noise (backward leaves their raw "
                      "gradients in .grad, and the privacy spent does not cover anything trained on them); freeze "
                      "them (requires_grad_(False)) or add them to the optimizer", UserWarning,
                      stacklevel=user_stacklevel())


def _prepare_engine(module, optimizer, plan: RunPlan, sampler: BatchSampler, par: _Parallel, *, max_grad_norm,
                    loss_reduction, noise_seed, noise_method):
    """The clipping engine on the (inner) module -- clipping and noising only what the optimizer
    updates, as Opacus does, with a warning naming the trainable parameters left out
    (:func:`_warn_unoptimized`) -- and the privatizer of the plan's mechanism and noise."""
    from .clipping import ClippingEngine

    optimized = None
    if isinstance(optimizer, torch.optim.Optimizer):
        chosen = [p for group in optimizer.param_groups for p in group["params"]]
        owned = {id(p) for p in par.inner.parameters()}
        if all(id(p) in owned for p in chosen if p.requires_grad):
            optimized = chosen  # else DPOptimizer refuses the foreign tensor, naming the optimizer
            _warn_unoptimized(par.inner, chosen)
    engine = ClippingEngine(par.inner, loss_reduction=loss_reduction, max_grad_norm=max_grad_norm,
                            parameters=optimized)
    noise = dict(noise_std=plan.noise_std, clip_norm=max_grad_norm, expected_batch_size=sampler.expected_batch_size,
                 seed=noise_seed, method=noise_method)
    if not par.on:
        return engine, Privatizer.for_parameters(plan.strategy, list(engine.parameters), **noise)
    if par.inner is module:
        broadcast_module(module, par.group)  # replicas start equal, as DDP's constructor ensures
    return engine, DistributedPrivatizer.for_parameters(plan.strategy, list(engine.parameters), group=par.group,
                                                        **noise)


def _prepare_optimizer(optimizer, engine, privatizer, plan: RunPlan, sampler: BatchSampler, context: StepContext, *,
                       store_noise_seed: bool, nan_policy: str) -> DPOptimizer:
    """The private optimizer of the plan (a refused call leaves the user's module without hooks)."""
    try:
        private = DPOptimizer(optimizer, engine=engine, privatizer=privatizer, strategy=plan.strategy,
                              batching=plan.batching, delta=plan.delta, steps=plan.steps,
                              accounting_method=plan.accounting_method,
                              accounting_options=plan.accounting_options or None, sampler=sampler, context=context,
                              store_noise_seed=store_noise_seed, calibration=plan.guarantee, nan_policy=nan_policy)
    except Exception:
        engine.detach()
        raise
    private.plan = plan
    return private
