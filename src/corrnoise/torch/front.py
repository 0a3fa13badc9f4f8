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

import math
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..accounting import PrivacyResult
from ..errors import CorrnoiseError, check_int, check_real
from ..sampling import BallsInBinsSampler, BatchSampler
from ..strategies import Strategy
from .optimizer import balls_in_bins_accounted_steps, plan_private, privacy_spent
from .distributed import DistributedPrivatizer, broadcast_seed
from .privatizer import Privatizer

__all__ = ["DPOptimizer", "DPDataLoader", "make_private", "choose_batching", "BATCHINGS"]

#: ``batching=`` values: ``auto`` lets the mechanism decide (see :func:`choose_batching`).
BATCHINGS = ("auto", "poisson", "block-cyclic", "balls-in-bins", "cyclic")


# ----------------------------------------------------------------------------------------------
# The data loader: sampler batches, micro-batches, padding masks
# ----------------------------------------------------------------------------------------------
class _StepContext:
    """What the loader and the optimizer share: the next step to take (the optimizer's
    ``steps_taken``), the logical step of the micro-batch the user's loop is on, whether more
    micro-batches of it follow, and which entries are padding."""

    def __init__(self) -> None:
        self.next_step = 0
        self.current_step: int | None = None
        self.more_micro_batches = False
        self.size: int | None = None
        self.mask: torch.Tensor | None = None

    def clear_batch(self) -> None:
        self.more_micro_batches = False
        self.size = None
        self.mask = None


class _Collate:
    """The user's collate function, except that an empty batch (Poisson sampling) becomes the
    collation of one item cut to length 0 (every tensor gets a leading dimension 0)."""

    def __init__(self, dataset, collate_fn):
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.template = None

    def __call__(self, items):
        if len(items):
            return self.collate_fn(items)
        if self.template is None:
            self.template = self.collate_fn([self.dataset[0]])
        return _empty_like(self.template)


def _empty_like(value):
    if isinstance(value, torch.Tensor):
        return value[:0]
    if isinstance(value, (list, tuple)):
        return type(value)(_empty_like(v) for v in value)
    if isinstance(value, dict):
        return {k: _empty_like(v) for k, v in value.items()}
    return value


class _PaddedItems:
    """Dataset view in which index N + j is item j again (a padding entry of a fixed-size
    balls-in-bins batch, seed 000 App. I); the optimizer gives it weight 0."""

    def __init__(self, dataset, num_examples: int):
        self.dataset, self.num_examples = dataset, num_examples

    def __len__(self) -> int:
        return 2 * self.num_examples

    def __getitem__(self, index):
        index = int(index)
        return self.dataset[index - self.num_examples if index >= self.num_examples else index]


class _MicroBatches:
    """Batch sampler over steps [start, stop) of a corrnoise sampler, each logical batch cut
    into micro-batches of at most ``size`` entries (an empty batch stays one empty micro-batch).
    With ``world_size > 1`` only this rank's share of each logical batch (:func:`.distributed.local_batch`)."""

    def __init__(self, sampler: BatchSampler, size: int | None, rank: int = 0, world_size: int = 1):
        self.sampler, self.size = sampler, size
        self.rank, self.world_size = rank, world_size
        self.start, self.stop = 0, sampler.steps

    def cuts(self) -> Iterator[tuple[int, list[int], bool]]:
        """(step, indices, last micro-batch of the step) in order."""
        from .distributed import local_batch

        for t in range(self.start, self.stop):
            batch = list(self.sampler.batch(t))
            if self.world_size > 1:
                batch = local_batch(batch, self.rank, self.world_size)
            if self.size is None or len(batch) <= self.size:
                yield t, batch, True
                continue
            for lo in range(0, len(batch), self.size):
                yield t, batch[lo: lo + self.size], lo + self.size >= len(batch)

    def __len__(self) -> int:
        return sum(1 for _ in self.cuts())

    def __iter__(self):
        for _, batch, _ in self.cuts():
            yield batch


class DPDataLoader(DataLoader):
    """A DataLoader over the batches of a corrnoise sampler (see the module docstring).

    One pass (``for batch in loader``) yields the next epoch of steps (``steps_per_epoch``
    logical batches, fewer at the end of the run), starting at the optimizer's next step, so
    ``for epoch in range(epochs): for batch in loader:`` takes exactly the planned steps and a
    resumed run continues where its checkpoint stopped. Iterating keeps the optimizer informed
    (micro-batch ends, padding masks); it yields exactly what the user's collate function makes
    of the items, nothing added.

    Data parallel (``world_size > 1``): every rank holds the same sampler (same seed), so every
    rank forms the same global -- accounted -- batch and yields only its ``rank``-th share
    (every ``world_size``-th index); the shares partition the batch. A share may be empty.
    """

    def __init__(self, dataset, sampler: BatchSampler, *, steps_per_epoch: int, collate_fn=None,
                 max_physical_batch_size=None, context: _StepContext | None = None, rank: int = 0,
                 world_size: int = 1, **loader_kwargs):
        from torch.utils.data import default_collate

        self.corrnoise_sampler = sampler
        self.steps_per_epoch = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        self.context = context or _StepContext()
        self.max_physical_batch_size = max_physical_batch_size
        self._padded = isinstance(sampler, BallsInBinsSampler) and sampler.batch_size is not None
        items = _PaddedItems(dataset, sampler.num_examples) if self._padded else dataset
        self.world_size = check_int("world_size", world_size, minimum=1)
        self.rank = check_int("rank", rank, minimum=0, maximum=self.world_size - 1)
        self._cutter = _MicroBatches(sampler, max_physical_batch_size, self.rank, self.world_size)
        super().__init__(items, batch_sampler=self._cutter,
                         collate_fn=_Collate(dataset, collate_fn or default_collate), **loader_kwargs)

    def _window(self) -> None:
        start = self.context.next_step
        self._cutter.start = start
        self._cutter.stop = min(start + self.steps_per_epoch, self.corrnoise_sampler.steps)

    def __len__(self) -> int:
        self._window()
        return len(self._cutter)

    def __iter__(self):
        self._window()
        num = self.corrnoise_sampler.num_examples
        cuts = self._cutter.cuts()
        for (t, indices, last), batch in zip(cuts, super().__iter__()):
            if self.context.current_step != t:
                self.context.clear_batch()
                self.context.current_step = t
            self.context.size = len(indices)
            self.context.mask = torch.tensor([0.0 if i >= num else 1.0 for i in indices]) if self._padded else None
            self.context.more_micro_batches = not last
            yield batch


# ----------------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------------
class DPOptimizer(torch.optim.Optimizer):
    """A :class:`torch.optim.Optimizer` that privatizes the wrapped optimizer's steps.

    It shares ``param_groups`` and ``state`` with the wrapped optimizer (so LR schedulers and
    checkpoints see one optimizer). ``step()``: the engine's clipped per-example sum over every
    micro-batch since the last step, + max_grad_norm * noise_std * (C^-1 Z)[t], / expected batch
    size, into ``.grad``; then the wrapped optimizer's update. Attributes: ``original`` (the
    wrapped optimizer), ``strategy``, ``batching``, ``delta``, ``steps`` (planned),
    ``steps_taken``, ``noise_std``, ``noise_multiplier``, ``expected_batch_size``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, engine, privatizer: Privatizer, strategy: Strategy,
                 batching: Any, delta: float, steps: int, accounting_method: str = "auto",
                 accounting_options: dict[str, Any] | None = None, sampler: BatchSampler | None = None,
                 context: _StepContext | None = None, store_noise_seed: bool = False,
                 calibration: PrivacyResult | None = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise CorrnoiseError("optimizer", f"must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DPOptimizer):
            raise CorrnoiseError("optimizer", "is already private (make_private was called on it before)")
        # Optimizer.__init__ appends the very dicts of ``param_groups``: the groups are shared.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.state = optimizer.state
        self.original = optimizer
        self.engine = engine
        self.params = list(engine.parameters)
        ids = {id(p) for p in self.params}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in ids:
                    raise CorrnoiseError("optimizer", "optimizes a tensor that is not a trainable parameter of the "
                                         "module; its gradient would not be privatized")
        self.privatizer = privatizer
        self.strategy = strategy
        self.batching = batching
        self.delta = delta
        self.steps = steps
        self.accounting_method = accounting_method
        self.accounting_options = dict(accounting_options or {})
        self.sampler = sampler
        self.context = context or _StepContext()
        self.store_noise_seed = bool(store_noise_seed)
        self.calibration = calibration
        self.steps_taken = 0
        self.last_stats: dict[str, Any] = {}
        self._sums: list[torch.Tensor] | None = None
        self._count = 0
        self._clipped = 0

    # --- torch.optim surface ------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "original", None) is None:  # Optimizer.__init__ registering the shared groups
            return super().add_param_group(param_group)
        raise CorrnoiseError("param_group", "cannot add parameters to a private optimizer: the noise and the "
                             "clipping cover the parameters given to make_private; add the group before it")

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Opacus's BatchMemoryManager hook: refused, since several sampled batches in one noise
        row are outside the accounted sampling; cut batches with ``max_physical_batch_size``."""
        if do_skip:
            raise CorrnoiseError("signal_skip_step", "virtual steps (Opacus's BatchMemoryManager) are not supported: "
                                 "pass max_physical_batch_size to make_private (one noise row per sampled batch)")

    @property
    def noise_std(self) -> float:
        return self.privatizer.noise_std

    @property
    def max_grad_norm(self) -> float:
        return self.privatizer.clip_norm

    @property
    def expected_batch_size(self) -> float:
        return self.privatizer.expected_batch_size

    @property
    def noise_multiplier(self) -> float:
        from ..accounting import column_norm

        return self.noise_std / column_norm(self.strategy)

    @property
    def noise_seed(self) -> int:
        """The secret noise seed: whoever knows it can remove the noise. Needed to resume from a
        checkpoint saved without it."""
        return self.privatizer.generator.seed

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` and any captured forward/backward the next step would otherwise use."""
        self.original.zero_grad(set_to_none=set_to_none)
        self.engine.clear()

    def _check_step(self) -> None:
        current = self.context.current_step
        if current is not None and current != self.steps_taken:
            raise CorrnoiseError(
                "data_loader", f"the batch in hand was sampled for step {current} but this is step "
                f"{self.steps_taken}: take one optimizer step per batch of the private data loader (a batch "
                "used at another step is outside the accounted sampling schema)")
        if self.steps_taken >= self.steps:
            raise CorrnoiseError(
                "steps", f"all {self.steps} planned steps are done; the privacy guarantee covers no more "
                "(plan more steps with make_private)")
        if self.privatizer.step != self.steps_taken:
            raise CorrnoiseError(
                "steps", f"the noise generator is at row {self.privatizer.step} but this is step {self.steps_taken}; "
                "step t must add row t (a row used twice is reused noise)")

    def _accumulate(self) -> None:
        """Add the clipped per-example sum of the micro-batch just back-propagated to the step's sum."""
        size = self.context.size
        if size is None:
            raise CorrnoiseError("data_loader", "step() without a batch from the private data loader: iterate the "
                                 "loader make_private returned (its batches are the accounted ones)")
        if size == 0:  # an empty (Poisson) batch: its clipped sum is 0, whatever backward captured
            sums = [torch.zeros(p.shape, dtype=torch.promote_types(torch.float32, p.dtype), device=p.device)
                    for p in self.params]
            norms = torch.zeros(0)
        else:
            sums, norms = self.engine.clipped_sum(size, weights=self.context.mask)
        self.engine.clear()
        if self._sums is None:
            self._sums = list(sums)
        else:
            for acc, s in zip(self._sums, sums):
                acc.add_(s)
        real = self.context.mask.sum() if self.context.mask is not None else size
        self._count += int(real)
        self._clipped += int((norms > self.max_grad_norm).sum()) if norms.numel() else 0
        self.context.size = None
        self.context.mask = None

    def step(self, closure=None):
        """One private step, or -- mid logical batch (``max_physical_batch_size``) -- the clipped sum
        of this micro-batch kept for the step that ends the logical batch."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_step()
        self._accumulate()
        if self.context.more_micro_batches:
            return loss
        with torch.no_grad():
            noisy = self.privatizer.privatize(self._sums)
            for p, g in zip(self.params, noisy):
                p.grad = g.to(dtype=p.dtype)
            self.original.step()
        count, clipped = self._count, self._clipped
        if isinstance(self.privatizer, DistributedPrivatizer):  # statistics of the global batch
            count, clipped = self.privatizer.all_reduce_counts(count, clipped)
        self.last_stats = {"count": count, "clipped": clipped}
        self._sums, self._count, self._clipped = None, 0, 0
        self.context.clear_batch()
        self.context.current_step = None
        self.steps_taken += 1
        self.context.next_step = self.steps_taken
        return loss

    # --- privacy -----------------------------------------------------------------------------
    def privacy_spent(self, steps: int | None = None, **options: Any) -> PrivacyResult:
        """(epsilon, delta) of the steps taken so far (or ``steps``) by the accounting that
        calibrated the noise (a guarantee). Zero steps: epsilon 0."""
        k = self.steps_taken if steps is None else check_int("steps", steps, minimum=0, maximum=self.steps)
        if self.calibration is not None and not options and _accounted_steps(self.batching, k) == self.steps:
            # the run the noise was calibrated for: its guarantee (a Monte Carlo one was verified on
            # a fresh sample; accounting it again would draw new samples and a slightly other epsilon)
            return self.calibration.with_extras(steps=int(k), accounted_steps=int(self.steps))
        return privacy_spent(self.strategy, self.batching, noise_std=self.noise_std, delta=self.delta, steps=k,
                             planned_steps=self.steps, method=self.accounting_method,
                             **{**self.accounting_options, **options})

    # --- checkpoints -----------------------------------------------------------------------------
    def _sampler_state(self) -> dict[str, Any] | None:
        return None if self.sampler is None else {"seed": int(self.sampler.seed), **self.sampler.describe()}

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, the noise stream's position and the sampler's identity.
        The noise seed is left out unless ``store_noise_seed`` was asked for (then the
        checkpoint is as secret as the seed: whoever reads it can remove the noise)."""
        noise = self.privatizer.state_dict()
        if not self.store_noise_seed:
            noise = {**noise, "generator": {k: v for k, v in noise["generator"].items() if k != "seed"}}
        return {"corrnoise": 1, "original": self.original.state_dict(), "noise": noise,
                "steps_taken": self.steps_taken, "sampler": self._sampler_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: same sampler (seed and description), same noise seed
        (stored in the checkpoint, or passed again to make_private as ``noise_seed``)."""
        if not isinstance(state, dict) or state.get("corrnoise") != 1:
            raise CorrnoiseError("state", "not a checkpoint of a corrnoise DPOptimizer")
        mine, saved = self._sampler_state(), state.get("sampler")
        if mine != saved:
            diff = sorted(k for k in set(saved or {}) | set(mine or {}) if (saved or {}).get(k) != (mine or {}).get(k))
            raise CorrnoiseError("sampler", f"this run's sampler differs from the checkpoint's in {', '.join(diff)}; "
                                 "rebuild it with the checkpoint's seed (state['sampler']['seed'])")
        noise = dict(state["noise"])
        generator = dict(noise["generator"])
        if "seed" not in generator:
            if not getattr(self, "noise_seed_given", True):
                # a fresh secret seed would continue the run with other noise rows than C^-1 Z's
                raise CorrnoiseError("noise_seed", "the checkpoint does not store the noise seed; pass the original "
                                     "run's (its optimizer.noise_seed) to make_private to resume")
            generator["seed"] = self.privatizer.generator.seed
        elif generator["seed"] != self.privatizer.generator.seed:
            raise CorrnoiseError("noise_seed", "differs from the checkpoint's: pass the checkpoint's noise seed to "
                                 "make_private (a fresh seed would restart the noise stream mid-run)")
        noise["generator"] = generator
        steps_taken = check_int("steps_taken", state["steps_taken"], minimum=0, maximum=self.steps)
        self.original.load_state_dict(state["original"])
        self.privatizer.load_state_dict(noise)
        self.steps_taken = steps_taken
        self.context.next_step = steps_taken
        self.context.current_step = None


def _matching_guarantee(guarantee: PrivacyResult, agreement, delta: float) -> PrivacyResult:
    """``guarantee`` if it is the accounting of exactly this run (mechanism, steps, batching,
    delta), else a one-line error naming what differs."""
    event = agreement.event
    mine = {"mechanism": event.mechanism.label, "n": int(event.mechanism.n), "batching": agreement.batching.spec}
    for key, value in mine.items():
        theirs = guarantee.extras.get(key)
        if theirs != value:
            raise CorrnoiseError("guarantee", f"was computed for {key} = {theirs!r}, this run has {value!r}")
    if guarantee.delta > delta:
        raise CorrnoiseError("guarantee", f"has delta {guarantee.delta:g} > the run's delta {delta:g}")
    return guarantee


def _accounted_steps(batching, steps: int) -> int:
    """The steps :func:`corrnoise.torch.optimizer.privacy_spent` analyses after ``steps`` steps."""
    from ..accounting import BallsInBins

    if isinstance(batching, BallsInBins):
        return balls_in_bins_accounted_steps(steps, batching.bins)
    return steps


# ----------------------------------------------------------------------------------------------
# make_private
# ----------------------------------------------------------------------------------------------
def _loader_settings(data_loader) -> tuple[Any, int, dict[str, Any], Any]:
    """(dataset, batch size, DataLoader keyword arguments to keep, collate_fn) of the user's loader."""
    if not isinstance(data_loader, DataLoader):
        raise CorrnoiseError("data_loader", f"must be a torch DataLoader, got {type(data_loader).__name__}")
    dataset = data_loader.dataset
    try:
        len(dataset)
    except TypeError:
        raise CorrnoiseError("data_loader", "needs a map-style dataset with a length (sampling needs indices)") from None
    batch_size = data_loader.batch_size
    if batch_size is None:
        sampler = data_loader.batch_sampler
        batch_size = getattr(sampler, "batch_size", None)
    if batch_size is None:
        raise CorrnoiseError("data_loader", "has no batch_size to take as the expected batch size; build it with "
                             "DataLoader(dataset, batch_size=B)")
    keep = {k: getattr(data_loader, k) for k in ("num_workers", "pin_memory", "timeout", "worker_init_fn",
                                                  "multiprocessing_context", "generator", "persistent_workers")}
    keep = {k: v for k, v in keep.items() if v is not None}
    if not keep.get("num_workers"):
        keep.pop("persistent_workers", None)
    if keep.get("num_workers") and getattr(data_loader, "prefetch_factor", None) is not None:
        keep["prefetch_factor"] = data_loader.prefetch_factor
    return dataset, int(batch_size), keep, data_loader.collate_fn


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
    accounting_method: str = "auto",
    accounting_options: dict[str, Any] | None = None,
    noise_method: str = "auto",
    distributed: bool | None = None,
) -> tuple[torch.nn.Module, DPOptimizer, DPDataLoader]:
    """Privatize an existing PyTorch training loop; returns ``(module, optimizer, data_loader)``.

    ``data_loader``: the user's DataLoader; its dataset, ``batch_size`` (the expected batch
    size of the private batches), collate function and workers are kept, its order is not (the
    batches come from the sampler the accounting analyses). ``mechanism``: ``auto``, a name
    (``identity``, ``bsr:4``, ``dpcgd:0.9``, ``blt:...``), a mechanism file or a Strategy.
    Exactly one of ``epsilon`` (calibrate), ``noise_multiplier`` (sigma = noise_std /
    ||C||_col), ``noise_std``, and ``guarantee`` (a PrivacyResult of kind "guarantee" already
    calibrated for this mechanism, batching and number of steps, e.g. the planner's
    recommendation: its noise is used and ``privacy_spent()`` of the finished run returns it). Exactly one of ``epochs`` and ``steps``. ``batching``: one of
    ``auto, poisson, block-cyclic, balls-in-bins, cyclic`` (``auto``: Poisson for DP-SGD,
    block-cyclic Poisson for banded C, balls-in-bins for other non-negative C, cyclic otherwise),
    or a ready :mod:`corrnoise.sampling` sampler built for the loader's dataset (its steps, rate
    and seed are the run's; ``epochs`` / ``steps`` may then be left out).
    ``loss_reduction``: how the user's loss reduces over the batch (``mean``, Opacus's
    convention, or ``sum``). ``max_physical_batch_size``: cut logical batches into micro-batches
    (one noise row per logical step). ``seed`` drives the sampler only; ``noise_seed`` the
    noise -- leave it None (a secret seed from the OS) for any real release.
    ``store_noise_seed``: put the seed into ``optimizer.state_dict()`` (a documented risk).

    ``distributed``: data-parallel training over a torch.distributed process group; ``None``
    (default) turns it on for a :class:`~torch.nn.parallel.DistributedDataParallel` module (its
    ``process_group``) or when a default process group is initialized, ``False`` turns it off
    (not allowed for a DDP module). Call make_private on every rank with the same arguments:

    * one global sampler: the sampler ``seed`` is broadcast from rank 0 (checked equal when
      given), every rank draws the same global batch and the loader yields its disjoint share
      (every ``world_size``-th index). Accounting, steps and the expected batch size are those of
      the global batch; with ``epsilon`` only rank 0 calibrates and broadcasts the noise_std.
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
    if not isinstance(batching, BatchSampler) and batching not in BATCHINGS:
        raise CorrnoiseError("batching", f"must be one of {', '.join(BATCHINGS)} or a corrnoise.sampling sampler, "
                             f"got {batching!r}")
    if max_physical_batch_size is not None:
        max_physical_batch_size = check_int("max_physical_batch_size", max_physical_batch_size, minimum=1)
    dataset, batch_size, keep, collate_fn = _loader_settings(data_loader)
    on, group, inner = _data_parallel(module, distributed)
    rank, world_size = (dist.get_rank(group), dist.get_world_size(group)) if on else (0, 1)
    if on:
        seed = _shared_sampler_seed(seed, group)
    if mechanism == "auto":
        mechanism = choose_mechanism(len(dataset), batch_size, epochs=epochs, steps=steps, epsilon=epsilon,
                                     delta=delta)
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
    if on:
        shared = [nu, calibration]
        dist.broadcast_object_list(shared, src=_global_rank0(group), group=group)
        nu, calibration = shared
    if guarantee is not None:
        calibration = _matching_guarantee(guarantee, agreement, delta)
    engine = ClippingEngine(inner, loss_reduction=loss_reduction, max_grad_norm=max_grad_norm)
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
                              calibration=calibration)
    except Exception:
        engine.detach()  # a refused call leaves the user's module without hooks
        raise
    private.noise_seed_given = noise_seed is not None
    loader = DPDataLoader(dataset, sampler, steps_per_epoch=_steps_per_epoch(sampler, epochs, len(dataset), batch_size),
                          collate_fn=collate_fn, max_physical_batch_size=max_physical_batch_size, context=context,
                          rank=rank, world_size=world_size, **keep)
    return module, private, loader


# ----------------------------------------------------------------------------------------------
# Data parallel (torch.distributed)
# ----------------------------------------------------------------------------------------------
def _data_parallel(module: torch.nn.Module, distributed: bool | None):
    """(on, process group, module to hook) for ``distributed`` (see :func:`make_private`)."""
    from torch.nn.parallel import DistributedDataParallel

    is_ddp = isinstance(module, DistributedDataParallel)
    initialized = dist.is_available() and dist.is_initialized()
    if distributed is None:
        distributed = is_ddp or initialized
    if not distributed:
        if is_ddp:
            raise CorrnoiseError("distributed", "is False but the module is DistributedDataParallel: DDP averages "
                                 "the ranks' gradients, so each rank's sampler, noise and accounting would not be "
                                 "what is released; pass the inner module (module.module) instead")
        return False, None, module
    if not initialized:
        raise CorrnoiseError("distributed", "torch.distributed is not initialized (call init_process_group first)")
    if not is_ddp:
        return True, None, module
    if getattr(module, "_delay_all_reduce_all_params", False) or getattr(module, "_delay_all_reduce_params", None):
        raise CorrnoiseError("module", "DistributedDataParallel with delayed all-reduce parameters all-reduces "
                             "unclipped gradients even under no_sync(); build DDP without them")
    # every step overwrites .grad with the privatized sum: DDP's all-reduce of unclipped gradients
    # is wasted work, and ranks with different numbers of micro-batches would issue different
    # numbers of collectives. no_sync() does exactly this, for good here.
    module.require_backward_grad_sync = False
    return True, getattr(module, "process_group", None), module.module


def _global_rank0(group) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def _shared_sampler_seed(seed: int | None, group) -> int:
    """The sampler seed of rank 0 on every rank (``seed`` checked equal where given, else drawn
    on rank 0): one global sampler, so every rank forms the same, accounted, batches."""
    from ..sampling import _SEED_MAX

    value = broadcast_seed(seed, group)
    return value if seed is not None else value & _SEED_MAX


@torch.no_grad()
def _broadcast_module(module: torch.nn.Module, group) -> None:
    """Rank 0's parameters and buffers on every rank."""
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=_global_rank0(group), group=group)


def _steps_per_epoch(sampler: BatchSampler, epochs, num_examples: int, batch_size: int) -> int:
    """Logical batches per pass over the private loader: the run's steps / epochs when epochs
    were given, else a natural epoch (balls-in-bins: its bins; otherwise N / B)."""
    if epochs is not None:
        return max(1, math.ceil(sampler.steps / float(epochs) - 1e-9))
    if isinstance(sampler, BallsInBinsSampler):
        return sampler.bins
    return max(1, round(num_examples / batch_size))


def choose_batching(strategy: Strategy, num_examples: int, batch_size: int) -> str:
    """``batching="auto"``: the amplified batching whose analysis suits C (issue #10 item 3).

    DP-SGD (one band): Poisson sampling (PLD). A banded C whose bands fit as blocks
    (bands * batch_size <= N): block-cyclic Poisson (tutorial Thm 3.21). Any other
    non-negative C (BLT, DP-CGD, Toeplitz, dense): balls-in-bins with the verified Monte
    Carlo guarantee (seed 000). Otherwise fixed batches in cyclic order, unamplified.
    """
    bands = min(int(strategy.bands), strategy.n)
    if bands <= 1:
        return "poisson"
    if bands * batch_size <= num_examples and bands < strategy.n:
        return "block-cyclic"
    if strategy.rows == strategy.n and strategy.is_nonnegative():
        return "balls-in-bins"
    return "cyclic"


def _sampling_for(batching: str, mechanism, num_examples: int, batch_size: int, epochs, steps) -> str:
    """The sampler name of :func:`corrnoise.torch.optimizer.make_sampler` for ``batching``."""
    if batching != "auto":
        return batching
    from ..strategies import parse_strategy

    if isinstance(mechanism, Strategy):
        probe = mechanism
    else:
        n = steps if steps is not None else max(1, int(round(
            check_real("epochs", epochs if epochs is not None else math.nan, low=0.0, low_open=True)
            * num_examples / batch_size)))
        probe = parse_strategy(mechanism, n)
    return choose_batching(probe, num_examples, batch_size)


def choose_mechanism(num_examples: int, batch_size: int, *, epochs, steps, epsilon, delta) -> str:
    """``mechanism="auto"`` until the planner (issue #11) lands: DP-SGD."""
    return "identity"
